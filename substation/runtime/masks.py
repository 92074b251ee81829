"""Attention masks at the PyTorch boundary: checking a caller's mask (shape, dtype, device, values) and
turning it into the additive key mask [B, K] the compiled code reads.

Dimension letters: B batch, H heads, J query positions, K key positions.
"""
from __future__ import annotations

import torch

from ..config import EncoderConfig

__all__ = ["MASK_DTYPES", "cast_additive_mask", "check_mask", "check_mask_dtype", "check_mask_values",
           "heads_differ", "key_mask", "mask_differs", "queries_differ"]

#: The dtypes an attention mask may have: bool and integer masks mark keys (1 / True), floating ones add.
MASK_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
               torch.bfloat16, torch.float32, torch.float64)


def _differs_along(mask: torch.Tensor, dim: int) -> bool:
    """Whether ``mask`` holds different values along ``dim`` (a NaN counts as different): its maximum
    and minimum along ``dim`` disagree somewhere. Two reductions, no [B, H, J, K] temporary (a
    comparison with the first row took 3x the time on Hugging Face's [B, 1, J, K] masks); a bool mask
    is read as uint8, the same bytes (PyTorch's reductions of bool along a dimension took 8x longer:
    174 against 22 us on a [32, 1, 128, 128] mask, 2 threads)."""
    if mask.shape[dim] == 1 or mask.stride(dim) == 0 or mask.numel() == 0:
        return False
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    return not bool((mask.amax(dim) == mask.amin(dim)).all())


def queries_differ(mask: torch.Tensor) -> bool:
    """Whether a ``[B, H, J, K]`` mask's rows differ between queries j (reads the data)."""
    return _differs_along(mask, 2)


def heads_differ(mask: torch.Tensor) -> bool:
    """Whether a ``[B, H, J, K]`` mask differs between heads h (reads the data)."""
    return _differs_along(mask, 1)


def mask_differs(mask: torch.Tensor) -> str | None:
    """What a ``[B, H, J, K]`` mask differs between, ``"heads"`` or ``"queries"``, or None when it is a key
    mask (every head and query row equal; reads the data)."""
    for differs, what in ((heads_differ, "heads"), (queries_differ, "queries")):
        if differs(mask):
            return what
    return None


def check_mask_values(mask: torch.Tensor) -> None:
    """Refuse a float (additive) mask holding NaN or +inf, and an integer mask holding other values than
    0 and 1 (reads the data).

    Raises:
        ValueError: NaN or +inf in a float ``mask`` (every score it touches would be NaN); an integer
            value other than 0 or 1 (an additive mask stored as integers would be read as keys to attend).
    """
    if not mask.numel() or mask.dtype == torch.bool:
        return
    if mask.is_floating_point():
        if not bool(mask.max() < float("inf")):  # NaN if any: max propagates it
            raise ValueError("the float (additive) attention mask holds NaN or +inf; masked keys take -inf or a "
                             "large negative value, attended keys 0")
        return
    low, high = (int(v) for v in torch.aminmax(mask))
    if low < 0 or high > 1:
        raise ValueError(f"the integer attention mask holds values from {low} to {high}; integer and bool masks "
                         f"hold 1 (attend) and 0 (masked) only; pass an additive mask (0 = attend, -inf or a "
                         f"large negative value = masked) as a float tensor")


def key_mask(mask: torch.Tensor | None, attend_marks_true: bool, batch: int, seq: int,
             dtype: torch.dtype) -> torch.Tensor | None:
    """The additive key mask ``[B, K]`` of ``dtype`` (0 = attend, -inf or the given value = masked) that
    the compiled code reads, from a mask whose shape :func:`check_mask` accepted.

    A bool or integer mask marks keys to attend (``attend_marks_true``, Hugging Face) or padding
    (PyTorch's ``key_padding_mask``); a float mask is additive, its finite values clamped to the range
    of ``dtype`` (float32's minimum, Hugging Face's mask value, stays finite in bfloat16, so a row
    masked with it everywhere still attends uniformly, as in PyTorch). A 4-D ``[B, H, J, K]`` mask must be
    the same for every head h and query j; it is reduced to its first row (checked here, on the data:
    this runs inside the custom operator, so it is no data-dependent branch for ``torch.compile``).

    Raises:
        ValueError: a ``[B, H, J, K]`` mask that differs between heads or queries; a float mask holding
        NaN or +inf (every score it touches would be NaN).
    """
    if mask is None:
        return None
    check_mask_values(mask)
    if mask.dim() == 4:
        what = mask_differs(mask)
        if what is not None:
            raise ValueError(f"attention_mask [B, H, J, K] differs between {what}; Substation's layer takes "
                             f"key masks only (and mask: causal in the config); a Hugging Face drop-in "
                             f"falls back to its own forward for such masks in eager mode, not under "
                             f"torch.compile")
        mask = mask[:, 0, 0, :]
    mask = mask.expand(batch, seq)
    if mask.dtype == torch.bool or not mask.is_floating_point():
        attend = mask.bool() if attend_marks_true else ~mask.bool()
        return torch.zeros(batch, seq, dtype=dtype, device=mask.device).masked_fill_(~attend, float("-inf"))
    return cast_additive_mask(mask, dtype).contiguous().resolve_neg()


def cast_additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float (additive) mask in the float ``dtype``, its finite values clamped to that dtype's range
    (float32's minimum, Hugging Face's mask value, stays finite in bfloat16), -inf kept."""
    if mask.dtype != dtype and torch.finfo(dtype).max < torch.finfo(mask.dtype).max:
        low = torch.finfo(dtype)
        mask = torch.where(mask.isinf(), mask, mask.clamp(low.min, low.max))
    return mask.to(dtype)


def check_mask_dtype(mask: torch.Tensor, what: str) -> None:
    """Refuse a mask whose dtype is not in :data:`MASK_DTYPES`.

    Raises:
        TypeError: another dtype (uint16 and wider unsigned integers, float8, complex), named with ``what``.
    """
    if mask.dtype not in MASK_DTYPES:
        raise TypeError(f"{what} has dtype {mask.dtype}; give a bool or integer mask (uint8, int8 to int64; 1 or "
                        f"True = attend) or a floating additive one (float16, bfloat16, float32, float64; 0 = "
                        f"attend, -inf = masked)")


def check_mask(mask: torch.Tensor, batch: int, seq: int, device: torch.device, config: EncoderConfig,
               what: str, padding_only: bool = False) -> None:
    """Check a mask's shape, dtype and device (no data is read, so this traces without a graph break).

    Accepted shapes: ``[B, K]`` and 4-D ``[B, H, J, K]`` (B, H and J may also be 1, broadcast; the
    operator reduces a 4-D mask to its key mask after checking that its heads and rows agree). With
    ``padding_only`` (PyTorch's ``key_padding_mask``): a bool ``[B, K]`` mask only (B may be 1).

    Raises:
        ValueError: a layer compiled with ``mask: none``, the wrong device type, the wrong shape.
        TypeError: not a tensor, or a dtype not in :data:`MASK_DTYPES`.
    """
    if config.mask == "none":
        raise ValueError("this layer was compiled with mask: none; compile with mask: padding to pass a mask")
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{what} must be None or a tensor, got {type(mask).__name__}")
    if mask.device.type != device.type:
        raise ValueError(f"the mask must be on the {'CPU' if device.type == 'cpu' else device.type.upper()} "
                         f"like hidden_states, got device {mask.device}")
    shape = tuple(mask.shape)
    if padding_only:
        if mask.dtype != torch.bool:
            raise TypeError(f"{what} must be a bool tensor [B, K] (True = padding), got {mask.dtype}")
        if len(shape) != 2 or shape[0] not in (1, batch) or shape[1] != seq:
            raise ValueError(f"{what} must have shape [B, K] = [{batch}, {seq}] (or [1, K]), got {shape}")
        return
    check_mask_dtype(mask, what)
    heads = config.num_heads
    ok = (len(shape) == 2 and shape[0] in (1, batch) and shape[1] == seq) or \
         (len(shape) == 4 and shape[0] in (1, batch) and shape[1] in (1, heads) and shape[2] in (1, seq)
          and shape[3] == seq)
    if not ok:
        raise ValueError(f"{what} must have shape [B, K] = [{batch}, {seq}], [B, 1, 1, K], [B, 1, J, K] or "
                         f"[B, H, J, K] with H = {heads}; got {shape}")
