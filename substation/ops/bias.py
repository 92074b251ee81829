"""Kinds ``bias`` (EW, ``y = x + b``, b broadcast over the letters it lacks) and ``bias_grad`` (SN, a
column reduction: ``db = sum of dy over the broadcast letters``)."""
from __future__ import annotations

from .kind import OpKind, align, elementwise_flop, reduce_to, register


def _bias_vjp(d, op, ins, outs, dy, y_acc):
    x, _ = ins["x"]
    b, b_acc = ins["b"]
    d.pass_through(x, dy)
    d.g.op(f"{op.label}_grad", "bias_grad", "SN", {"dy": f"{dy}[{y_acc}]"},
           {"y": d.grad_target(b, b_acc, op.label)})


def _bias_row(k, attrs):
    k.map(lambda e: f"{e['x']} + {e['b']}")


def _bias_grad_row(k, attrs):
    with k.sweep() as e:
        e.add_to_column("y", e["dy"])


def _bias_reference(ins, outs, attrs):
    (x, lx), (b, lb) = ins["x"], ins["b"]
    return {"y": align(x, lx, outs["y"]) + align(b, lb, outs["y"])}


def _bias_grad_reference(ins, outs, attrs):
    dy, ly = ins["dy"]
    return {"y": reduce_to(dy, ly, outs["y"])}


BIAS = register(OpKind("bias", "EW", flop=elementwise_flop(1), reference=_bias_reference, vjp=_bias_vjp,
                       row=_bias_row, letter="B"))
BIAS_GRAD = register(OpKind("bias_grad", "SN", flop=elementwise_flop(1, main="dy"), reference=_bias_grad_reference,
                            row=_bias_grad_row, reduction="column", letter="B"))
