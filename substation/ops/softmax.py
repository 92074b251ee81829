"""Kinds ``softmax`` (SN, over ``attrs["axis"]``: max, subtract, exp, sum, scale; a row whose entries
are all -inf gives zeros) and ``softmax_grad`` (SN, ``dx = y * (dy - sum_axis(y * dy))``)."""
from __future__ import annotations

import torch

from .kind import OpKind, align, elementwise_flop, register


def _softmax_reference(ins, outs, attrs):
    x, lx = ins["x"]
    x = align(x, lx, outs["y"])
    dim = outs["y"].index(attrs["axis"])
    dead = x.amax(dim, keepdim=True) == float("-inf")
    return {"y": torch.softmax(x.masked_fill(dead, 0.0), dim).masked_fill(dead, 0.0)}


def _softmax_grad_reference(ins, outs, attrs):
    target = outs["y"]
    dy, pr = (align(t, lt, target) for t, lt in (ins["dy"], ins["probs"]))
    dim = target.index(attrs["axis"])
    return {"y": pr * (dy - (dy * pr).sum(dim, keepdim=True))}


def _softmax_vjp(d, op, ins, outs, dy, y_acc):
    x, a = ins["x"]
    y, _ = outs["y"]
    d.g.op(f"{op.label}_grad", "softmax_grad", "SN", {"dy": f"{dy}[{y_acc}]", "probs": d.use(y, y_acc)},
           {"y": d.grad_target(x, a, op.label)}, **op.attrs)


def _recomputed_exponentials(k, mx):
    """(row sum of exp(x - mx), element -> exp(x - mx)): the exponentials computed again where used."""
    s = k.accumulator("s", "sum")
    with k.sweep() as e:
        e.reduce(s, k.fn("exp_", f"{e['x']} - {mx}"))
    return s, lambda e: k.fn("exp_", f"{e['x']} - {mx}")


def _softmax_row(k, attrs, exponentials=_recomputed_exponentials):
    mx = k.accumulator("mx", "max")
    with k.sweep() as e:
        e.reduce(mx, e["x"])
    # Every key masked (max -inf): exp gives 0 everywhere and the probabilities are 0, without a
    # branch, so the normalizing sweep merges with what follows.
    k.row(f"if ({mx} == {k.neg_inf()}) {mx} = 0;")
    s, exp_of = exponentials(k, mx)
    inv = k.let_row("inv", f"{s} == 0 ? {k.lit(0)} : {k.lit(1)} / {s}")  # a NaN sum stays NaN
    with k.sweep() as e:
        e.store("y", f"{exp_of(e)} * {inv}")


def _buffered_exponentials(k, mx):
    """CPU: each exponential computed once into the output's row buffer (an exp costs more than the
    buffer's traffic), by the vector routine ``ss::exp_shifted_row`` for a contiguous float row."""
    buf = k.output_buffer("y")
    row = k.row_start("x") if k.T == "float" else None
    if row:
        return k.let_row("s", f"ss::exp_shifted_row({row}, &{buf}[0], {k.row_length}, {mx})"), lambda e: f"{buf}[n_]"
    s = k.accumulator("s", "sum")
    with k.sweep() as e:
        ex = e.let("e_", k.fn("exp_", f"{e['x']} - {mx}"))
        e.stmt(f"{buf}[n_] = {ex};")
        e.reduce(s, ex)
    return s, lambda e: f"{buf}[n_]"


def _softmax_cpu(k, attrs):
    _softmax_row(k, attrs, _buffered_exponentials)


def _softmax_grad_row(k, attrs):
    dot = k.accumulator("dot", "sum")
    with k.sweep() as e:
        e.reduce(dot, f"{e['dy']} * {e['probs']}")
    with k.sweep() as e:
        e.store("y", f"{e['probs']} * ({e['dy']} - {dot})")


SOFTMAX = register(OpKind("softmax", "SN", flop=elementwise_flop(5, 1), reference=_softmax_reference,
                          vjp=_softmax_vjp, row=_softmax_row, overrides={"cpu": _softmax_cpu}, reduction="row",
                          letter="S"))
SOFTMAX_GRAD = register(OpKind("softmax_grad", "SN", flop=elementwise_flop(4), reference=_softmax_grad_reference,
                               row=_softmax_grad_row, reduction="row", letter="S"))
