"""Kind ``transpose`` (EW): a copy into another layout, inserted by the layout pass."""
from __future__ import annotations

from .kind import OpKind, align, elementwise_flop, register


def _transpose_row(k, attrs):
    k.map(lambda e: e["x"])


def _transpose_reference(ins, outs, attrs):
    x, lx = ins["x"]
    return {"y": align(x, lx, outs["y"])}


TRANSPOSE = register(OpKind("transpose", "EW", flop=elementwise_flop(0), reference=_transpose_reference,
                            row=_transpose_row, letter="T"))
