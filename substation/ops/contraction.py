"""Kind ``contraction`` (TC): ``y = alpha * einsum(a, b)`` over the operands' letters (letters missing
from ``y`` are summed). Backends map it to BLAS / cuBLAS GEMMs (``plan_contraction``), so it has no
row-kernel emitters. Flop: 2 per point of the iteration space."""
from __future__ import annotations

import torch

from ..ir.graph import access_letters
from .kind import OpKind, operand_access, register


def _contraction_flop(attrs, inputs, outputs, size):
    letters: list[str] = []
    for v in (*inputs.values(), *outputs.values()):
        letters += [c for c in access_letters(operand_access(v)) if c not in letters]
    n = 2
    for c in letters:
        n = n * size(c)
    return n


def _contraction_reference(ins, outs, attrs):
    (a, la), (b, lb) = ins.values()
    return {"y": attrs.get("alpha", 1.0) * torch.einsum(f"{la},{lb}->{outs['y']}", a, b)}


def _contraction_vjp(d, op, ins, outs, dy, y_acc):
    alpha = op.attrs.get("alpha", 1.0)
    (c1, (t1, a1)), (c2, (t2, a2)) = ins.items()
    for (c, (t, a)), (_, (ot, oa)) in (((c1, (t1, a1)), (c2, (t2, a2))), ((c2, (t2, a2)), (c1, (t1, a1)))):
        target = d.grad_target(t, a, op.label)
        if target is None:
            continue
        operands = {"dy": f"{dy}[{y_acc}]", c2 if c == c1 else c1: d.use(ot, oa)}
        d.g.op(f"{op.label}_d{c}", "contraction", "TC", operands, {"y": target}, alpha=alpha)


CONTRACTION = register(OpKind("contraction", "TC", flop=_contraction_flop, reference=_contraction_reference,
                              vjp=_contraction_vjp))
