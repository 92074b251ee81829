"""Shared-memory planning of the generated CUDA row kernels: how much dynamic shared memory a
row kernel's launches need (the host side of ``sscuda::row_cfg`` in ``csrc/substation_cuda.cuh``),
what a block may have on each architecture, and the error for rows that do not fit."""
from __future__ import annotations

import dataclasses
import re

__all__ = ["SHARED_MEMORY_PER_BLOCK", "WARP_LANES", "WARP_ROWS", "RED_SLOTS", "MAX_BLOCK", "RowTooLongError",
           "RowLaunchPlan", "row_lanes", "row_region", "row_shared_elements", "shared_memory_limit", "check_fits"]

#: Dynamic shared memory one block may have (cudaDevAttrMaxSharedMemoryPerBlockOptin), bytes, by the
#: major and minor digits of ``cuda_arch``; other architectures get the smallest, 101376 B.
SHARED_MEMORY_PER_BLOCK = {"80": 166912, "87": 166912, "90": 232448, "100": 232448, "103": 232448}
_SMEM_FLOOR = 101376
#: Constants of the launcher (substation_cuda.cuh): lanes per warp, warps per warp-mode block, slots
#: of a block-mode reduction, threads of a block-mode block at most.
WARP_LANES, WARP_ROWS, RED_SLOTS, MAX_BLOCK = 32, 4, 32, 512


def row_lanes(nvec: int) -> int:
    """Threads per row in warp mode (``sscuda::row_lanes``): the smallest power of two >= ``nvec``
    (the row's vectors), at most a warp; a warp then holds ``WARP_LANES // row_lanes(nvec)`` rows."""
    lanes = 1
    while lanes < WARP_LANES and lanes < nvec:
        lanes *= 2
    return lanes


def row_region(elems: int, lanes: int) -> int:
    """Shared elements of one row group (``sscuda::row_region``): its ``elems`` buffer elements,
    padded in warp mode so that the groups of one warp start ``lanes`` banks apart."""
    if elems == 0 or lanes >= WARP_LANES:
        return elems
    return elems + (lanes - elems) % WARP_LANES


def row_shared_elements(nn: int, v: int, slots: int, reduces: bool) -> int:
    """Dynamic shared memory of one launch (``sscuda::row_cfg``), in compute-type elements: a row of
    ``nn`` elements in vectors of ``v``, ``slots`` row buffers, the 32 reduction slots if it reduces.
    Warp mode (at most 2 warps of vectors) holds ``WARP_ROWS * WARP_LANES / row_lanes`` rows."""
    nvec = nn // v
    if nvec <= 2 * WARP_LANES:
        lanes = row_lanes(nvec)
        rows = WARP_ROWS * WARP_LANES // lanes
    else:
        lanes, rows = min(-(-nvec // WARP_LANES) * WARP_LANES, MAX_BLOCK), 1
    return (RED_SLOTS if reduces else 0) + rows * row_region(slots * nn, lanes)


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
