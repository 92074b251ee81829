"""Kind ``transpose`` (EW): a copy into another layout, inserted by the layout pass."""
from __future__ import annotations

from .kind import OpKind, align, elementwise_flop, register


def _transpose_cpu(k, m, attrs):  # a copy into another layout (inserted by the layout pass)
    k.ew(m, "v_x")


def _transpose_cuda(k, m, attrs):  # a copy into another layout (inserted by the layout pass)
    k.ew(m, "{x}")


def _transpose_reference(ins, outs, attrs):
    x, lx = ins["x"]
    return {"y": align(x, lx, outs["y"])}


TRANSPOSE = register(OpKind("transpose", "EW", flop=elementwise_flop(0), reference=_transpose_reference,
                            cpu=_transpose_cpu, cuda=_transpose_cuda, letter="T"))
