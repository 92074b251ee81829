"""Kind ``cast`` (EW): a copy into another dtype (``y`` is stored in its own dtype, rounded to nearest
even for bfloat16), inserted by the mixed-precision pass (:mod:`substation.passes.precision`) where a
contraction reads a float32 tensor and where a float32 gradient flows into a bfloat16 tensor's.

Casts carry no letter, so fused kernels keep the paper's names (a BDRLN that also writes the bfloat16
copy of its output for the next GEMM is still BDRLN)."""
from __future__ import annotations

from .kind import OpKind, align, elementwise_flop, register

__all__ = ["CAST"]


def _cast_vjp(d, op, ins, outs, dy, y_acc):
    x, _ = ins["x"]
    d.pass_through(x, dy)


def _cast_row(k, attrs):
    k.map(lambda e: e["x"])


def _cast_reference(ins, outs, attrs):
    x, lx = ins["x"]
    return {"y": align(x, lx, outs["y"])}


CAST = register(OpKind("cast", "EW", flop=elementwise_flop(0), reference=_cast_reference, vjp=_cast_vjp,
                       row=_cast_row, letter=""))
