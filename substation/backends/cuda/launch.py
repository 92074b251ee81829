"""Shared-memory planning of the generated CUDA row kernels: how much dynamic shared memory a
row kernel's launches need (the host side of ``sscuda::row_cfg`` in ``csrc/substation_cuda.cuh``),
what a block may have on each architecture, and the error for rows that do not fit."""
from __future__ import annotations

import dataclasses
import re

__all__ = ["SHARED_MEMORY_PER_BLOCK", "WARP_LANES", "WARP_ROWS", "RED_SLOTS", "RowTooLongError", "RowLaunchPlan",
           "shared_memory_limit", "check_fits"]

#: Dynamic shared memory one block may have (cudaDevAttrMaxSharedMemoryPerBlockOptin), bytes, by the
#: major and minor digits of ``cuda_arch``; other architectures get the smallest, 101376 B.
SHARED_MEMORY_PER_BLOCK = {"80": 166912, "87": 166912, "90": 232448, "100": 232448, "103": 232448}
_SMEM_FLOOR = 101376
#: Constants of the launcher (substation_cuda.cuh): lanes per warp, rows per warp-mode block, slots
#: of a block-mode reduction.
WARP_LANES, WARP_ROWS, RED_SLOTS = 32, 4, 32


class RowTooLongError(ValueError):
    """A row kernel's rows need more shared memory than a block can have on the target GPU."""


def shared_memory_limit(arch: str) -> int:
    """Bytes of dynamic shared memory a block may use on ``arch`` (e.g. ``"sm_90"`` -> 232448).

    Raises:
        ValueError: a malformed ``arch``.
    """
    m = re.fullmatch(r"sm_(\d{2,3})[a-z]?", arch)
    if not m:
        raise ValueError(f"cuda_arch: must look like sm_90 or sm_90a, got {arch!r}")
    return SHARED_MEMORY_PER_BLOCK.get(m.group(1), _SMEM_FLOOR)


@dataclasses.dataclass(frozen=True)
class RowLaunchPlan:
    """The shared memory of one generated row kernel at the config's sizes (J = K = max_seq_len).

    Attributes:
        kernel: the kernel's name (``k3_MSD``); members: its operators' labels.
        row_elements: elements per row (the inner letters' sizes multiplied).
        buffers: row-long shared arrays per row (intermediate tensors and column accumulators).
        reduces: whether it reduces rows (block mode then uses 32 shared slots).
        shared_bytes: the largest dynamic shared memory of its instantiations (scalar and vector,
            warp or block mode), bytes; 0 for a kernel with neither buffers nor reductions.
    """

    kernel: str
    members: tuple[str, ...]
    row_elements: int
    buffers: int
    reduces: bool
    shared_bytes: int


def check_fits(config, plan: RowLaunchPlan) -> None:
    """Refuse a row kernel whose launches need more shared memory than a block has on the config's
    ``cuda_arch``.

    Raises:
        RowTooLongError: naming the kernel, its members, the row length, the bytes and the limit.
    """
    limit = shared_memory_limit(config.cuda_arch)
    if plan.shared_bytes > limit:
        raise RowTooLongError(
            f"{plan.kernel} ({', '.join(plan.members)}): a row of {plan.row_elements} elements with "
            f"{plan.buffers} row buffer(s) needs {plan.shared_bytes} B of shared memory per block, more than "
            f"the {limit} B a block can have on {config.cuda_arch} (config {config.name}: I={config.hidden_size}, "
            f"U={config.ffn_size}, L={config.max_seq_len}); the CUDA target does not support rows this long")
