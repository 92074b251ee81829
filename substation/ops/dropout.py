"""Kind ``dropout`` (EW): inverted dropout with a counter-based mask (Philox4x32-10 keyed by the call's
seed, one stream per dropout site, counter from the element's index over ``attrs["rng_dims"]``), so
backward regenerates the forward's mask and nothing is stored. Its gradient is the same kind applied
to ``dy``."""
from __future__ import annotations

import numpy as np
import torch

from .kind import OpKind, align, elementwise_flop, register

__all__ = ["DROPOUT", "dropout_constants", "dropout_keep_mask"]


def dropout_constants(p: float) -> tuple[int, float]:
    """(threshold, scale) of inverted dropout with probability ``p`` on 16 random bits: an element is
    kept when its bits are >= threshold = round(p * 2^16) (so p is rounded to a multiple of 2^-16)
    and then scaled by 2^16 / (2^16 - threshold), the inverse of the exact keep probability."""
    threshold = min(int(round(p * 65536.0)), 65535)
    return threshold, 65536.0 / (65536 - threshold)


def dropout_keep_mask(seed: int, stream: int, index, p: float):
    """Which elements the generated dropout keeps (CPU and CUDA builds alike), computed with numpy:
    element ``e`` draws 16 bits, half ``e % 2`` of word ``(e // 2) % 4`` of the Philox4x32-10 block at
    counter ``e // 8`` (stream ``stream``, key ``seed``), and is kept when they are >= the threshold
    of :func:`dropout_constants`.

    Args:
        seed: the 64-bit seed of the call; stream: the dropout site's stream id
            (:data:`substation.ir.graph.DROPOUT_SITES`); index: integer array of element indices (row-major
            over the site's ``rng_dims``, e.g. ``((b * H + h) * J + j) * K + k``); p: the probability.

    Returns:
        a bool array shaped like ``index``.
    """
    idx = np.asarray(index, dtype=np.uint64)
    m32 = np.uint64(0xFFFFFFFF)
    counter = idx >> np.uint64(3)
    c0, c1 = counter & m32, counter >> np.uint64(32)
    c2 = np.full_like(idx, np.uint64(stream & 0xFFFFFFFF))
    c3 = np.zeros_like(idx)
    k0, k1 = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    for _ in range(10):
        p0 = np.uint64(0xD2511F53) * c0
        p1 = np.uint64(0xCD9E8D57) * c2
        n0 = (p1 >> np.uint64(32)) ^ c1 ^ np.uint64(k0)
        n2 = (p0 >> np.uint64(32)) ^ c3 ^ np.uint64(k1)
        c0, c1, c2, c3 = n0, p1 & m32, n2, p0 & m32
        k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
    word = np.choose(((idx >> np.uint64(1)) & np.uint64(3)).astype(np.int64), [c0, c1, c2, c3])
    bits = (word >> (np.uint64(16) * (idx & np.uint64(1)))) & np.uint64(0xFFFF)
    return bits >= np.uint64(dropout_constants(p)[0])


def _dropout_vjp(d, op, ins, outs, dy, y_acc):
    x, a = ins["x"]
    d.g.op(f"{op.label}_grad", "dropout", "EW", {"x": f"{dy}[{y_acc}]"},
           {"y": d.grad_target(x, a, op.label)}, **op.attrs)


def _dropout_row(k, attrs):
    threshold, scale = dropout_constants(attrs["p"])

    def dropped(e):
        bits = e.random_bits(attrs["stream"], attrs["rng_dims"])
        return f"training ? {k.fn('dropout', e['x'], bits, f'{threshold}u', k.lit(scale))} : {e['x']}"
    k.map(dropped)


def _dropout_reference(ins, outs, attrs):
    """Eval mode (``attrs["training"]`` false or absent): the identity. Training: the generated code's
    mask for ``attrs["seed"]`` (:func:`dropout_keep_mask`), kept elements scaled."""
    x, lx = ins["x"]
    y = align(x, lx, outs["y"])
    if not attrs.get("training"):
        return {"y": y}
    dims = attrs["rng_dims"]
    sizes = dict(zip(lx, x.shape))
    shape = [sizes[c] for c in dims]
    keep = dropout_keep_mask(attrs["seed"], attrs["stream"], np.arange(int(np.prod(shape))).reshape(shape), attrs["p"])
    keep = align(torch.from_numpy(keep).to(y.device), dims, outs["y"])
    return {"y": torch.where(keep, y * dropout_constants(attrs["p"])[1], torch.zeros((), dtype=y.dtype))}


DROPOUT = register(OpKind("dropout", "EW", flop=elementwise_flop(1), reference=_dropout_reference, vjp=_dropout_vjp,
                          row=_dropout_row, letter="D"))
