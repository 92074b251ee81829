"""Kind ``mask`` (EW): ``y = x + m`` with the additive key mask m; with ``attrs["causal"]`` also -inf
where the last letter's index exceeds the second-to-last's (key k > query j)."""
from __future__ import annotations

import torch

from ..ir.graph import access_letters
from .kind import OpKind, align, elementwise_flop, register


def _mask_vjp(d, op, ins, outs, dy, y_acc):
    d.pass_through(ins["x"][0], dy)


def _mask_row(k, attrs):
    def masked(e):
        expr = f"{e['x']} + {e['m']}"
        if attrs.get("causal"):
            query, key = access_letters(k.access("y"))[-2:]
            expr = f"({e.index(key)} > {e.index(query)}) ? {k.neg_inf()} : ({expr})"
        return expr
    k.map(masked)


def _mask_reference(ins, outs, attrs):
    (x, lx), (m, lm) = ins["x"], ins["m"]
    target = outs["y"]
    y = align(x, lx, target) + align(m, lm, target)
    if attrs.get("causal"):
        j, k = y.shape[-2], y.shape[-1]
        y = y.masked_fill(torch.ones(j, k, dtype=torch.bool, device=y.device).triu(1), float("-inf"))
    return {"y": y}


MASK = register(OpKind("mask", "EW", flop=elementwise_flop(1), reference=_mask_reference, vjp=_mask_vjp,
                       row=_mask_row, letter="M"))
