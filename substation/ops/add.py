"""Kind ``add`` (EW): the sum of its inputs (residual connections; gradient accumulation)."""
from __future__ import annotations

from .kind import OpKind, align, elements, register


def _add_vjp(d, op, ins, outs, dy, y_acc):
    for t, _ in ins.values():
        d.pass_through(t, dy)


def _add_row(k, attrs):
    k.map(lambda e: " + ".join(e[c] for c in sorted(k.member["inputs"])))


def _add_flop(attrs, inputs, outputs, size):
    if "y" not in outputs:
        raise ValueError("an add operator needs an output 'y'")
    return (len(inputs) - 1) * elements(outputs["y"], size)


def _add_reference(ins, outs, attrs):
    parts = [align(t, lt, outs["y"]) for _, (t, lt) in sorted(ins.items())]
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return {"y": total}


ADD = register(OpKind("add", "EW", flop=_add_flop, reference=_add_reference, vjp=_add_vjp, row=_add_row,
                      letter="R"))
