"""Kind ``mask`` (EW): ``y = x + m`` with the additive key mask m; with ``attrs["causal"]`` also -inf
where the last letter's index exceeds the second-to-last's (key k > query j)."""
from __future__ import annotations

import torch

from ..ir.graph import access_letters
from .kind import OpKind, align, elementwise_flop, register


def _mask_vjp(d, op, ins, outs, dy, y_acc):
    d.pass_through(ins["x"][0], dy)


def _mask_cpu(k, m, attrs):
    expr = "v_x + v_m"
    if attrs.get("causal"):
        letters = access_letters(m["outputs"]["y"][1])
        expr = f"(i_{letters[-1]} > i_{letters[-2]}) ? ({k.T})(-INFINITY) : ({expr})"
    k.ew(m, expr)


def _mask_cuda(k, m, attrs):
    expr = "{x} + {m}"
    if attrs.get("causal"):
        letters = access_letters(m["outputs"]["y"][1])
        expr = f"({k.lane_of(letters[-1])} > {k.lane_of(letters[-2])}) ? (comp_t)(-INFINITY) : ({expr})"
    k.ew(m, expr)


def _mask_reference(ins, outs, attrs):
    (x, lx), (m, lm) = ins["x"], ins["m"]
    target = outs["y"]
    y = align(x, lx, target) + align(m, lm, target)
    if attrs.get("causal"):
        j, k = y.shape[-2], y.shape[-1]
        y = y.masked_fill(torch.ones(j, k, dtype=torch.bool, device=y.device).triu(1), float("-inf"))
    return {"y": y}


MASK = register(OpKind("mask", "EW", flop=elementwise_flop(1), reference=_mask_reference, vjp=_mask_vjp,
                       cpu=_mask_cpu, cuda=_mask_cuda, letter="M"))
