"""Kinds ``activation`` (EW, ``y = f(x)`` for ``attrs["function"]`` in gelu, gelu_tanh, relu) and
``activation_grad`` (EW, ``dx = dy * f'(x)``). Flop per element: f counts 5 / 9 / 1 (a transcendental
function, erf / exp / tanh, counts one), f' 11 / 19 / 2 (docs/analysis.md)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .kind import OpKind, align, elements, register

#: Arithmetic operations per element of each function and of its gradient.
ACTIVATION_FLOP = {"gelu": 5, "gelu_tanh": 9, "relu": 1}
ACTIVATION_GRAD_FLOP = {"gelu": 11, "gelu_tanh": 19, "relu": 2}


def _flop_from(table: dict, name: str):
    def flop(attrs, inputs, outputs, size):
        fn = attrs.get("function")
        if fn not in table:
            raise ValueError(f"{name}: unknown activation function {fn!r} (known: {', '.join(table)})")
        return table[fn] * elements(outputs["y"], size)
    return flop


def apply_activation(function: str, x: torch.Tensor) -> torch.Tensor:
    """``function`` (gelu, gelu_tanh, relu) of ``x``, elementwise, in ``x``'s dtype (the reference of the
    ``activation`` kind and of a contraction's activation epilogue)."""
    if function == "relu":
        return torch.relu(x)
    return F.gelu(x, approximate="tanh" if function == "gelu_tanh" else "none")


def _activation_reference(ins, outs, attrs):
    x, lx = ins["x"]
    return {"y": apply_activation(attrs["function"], align(x, lx, outs["y"]))}


def _activation_grad_reference(ins, outs, attrs):
    (dy, ldy), (x, lx) = ins["dy"], ins["x"]
    x = align(x, lx, outs["y"]).detach().requires_grad_()
    with torch.enable_grad():
        (grad,) = torch.autograd.grad(apply_activation(attrs["function"], x).sum(), x)
    return {"y": align(dy, ldy, outs["y"]) * grad}


def _activation_vjp(d, op, ins, outs, dy, y_acc):
    x, a = ins["x"]
    d.g.op(f"{op.label}_grad", "activation_grad", "EW", {"dy": f"{dy}[{y_acc}]", "x": d.use(x, a)},
           {"y": d.grad_target(x, a, op.label)}, **op.attrs)


def _activation_row(k, attrs):
    k.map(lambda e: k.fn(attrs["function"], e["x"]))


def _activation_grad_row(k, attrs):
    k.map(lambda e: f"{e['dy']} * {k.fn(attrs['function'] + '_grad', e['x'])}")


ACTIVATION = register(OpKind("activation", "EW", flop=_flop_from(ACTIVATION_FLOP, "activation"),
                             reference=_activation_reference, vjp=_activation_vjp, row=_activation_row,
                             letter="A"))
ACTIVATION_GRAD = register(OpKind("activation_grad", "EW", flop=_flop_from(ACTIVATION_GRAD_FLOP, "activation_grad"),
                                  reference=_activation_grad_reference, row=_activation_grad_row,
                                  letter="A"))
