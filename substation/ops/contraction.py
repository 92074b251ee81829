"""Kind ``contraction`` (TC): ``y = f(alpha * einsum(a, b) (+ bias))`` over the operands' letters (letters
missing from ``y`` are summed). Backends map it to BLAS / cuBLAS GEMMs (``plan_contraction``), so it has
no row-kernel emitters. Flop: 2 per point of the iteration space, plus 1 per output element with a bias
and the activation's count per output element with an activation.

The optional input ``bias`` (its letters a subset of ``y``'s, broadcast over the rest) and the optional
attribute ``activation`` (f: a function of :mod:`substation.ops.activation`, else the identity) are a
GEMM epilogue: :func:`substation.passes.epilogue.fuse_epilogues` moves a ``bias`` and an ``activation``
operator there, after autodiff, for back ends whose GEMM library applies them while the accumulators
are in registers."""
from __future__ import annotations

import torch

from ..ir.graph import access_letters
from .activation import ACTIVATION_FLOP, apply_activation
from .kind import OpKind, align, elements, operand_access, register

__all__ = ["CONTRACTION", "EPILOGUE_BIAS", "factors"]

#: The input connector of a contraction's epilogue bias.
EPILOGUE_BIAS = "bias"


def factors(operands: dict) -> tuple:
    """The two factors of a contraction's ``operands`` (connector -> operand, the output ``y`` and any
    ``bias`` left out), in connector order.

    Raises:
        ValueError: not exactly two factors.
    """
    rest = [v for c, v in operands.items() if c not in ("y", EPILOGUE_BIAS)]
    if len(rest) != 2:
        raise ValueError(f"a contraction has two factors besides y and {EPILOGUE_BIAS}, got {sorted(operands)}")
    return tuple(rest)


def _contraction_flop(attrs, inputs, outputs, size):
    letters: list[str] = []
    for v in (*factors(inputs), *outputs.values()):
        letters += [c for c in access_letters(operand_access(v)) if c not in letters]
    n = 2
    for c in letters:
        n = n * size(c)
    epilogue = (1 if EPILOGUE_BIAS in inputs else 0) + ACTIVATION_FLOP.get(attrs.get("activation"), 0)
    return n + epilogue * elements(outputs["y"], size)


def _contraction_reference(ins, outs, attrs):
    (a, la), (b, lb) = factors(ins)
    y = attrs.get("alpha", 1.0) * torch.einsum(f"{la},{lb}->{outs['y']}", a, b)
    if EPILOGUE_BIAS in ins:
        bias, lbias = ins[EPILOGUE_BIAS]
        y = y + align(bias, lbias, outs["y"])
    if "activation" in attrs:
        y = apply_activation(attrs["activation"], y)
    return {"y": y}


def _contraction_vjp(d, op, ins, outs, dy, y_acc):
    if EPILOGUE_BIAS in ins or "activation" in op.attrs:
        raise ValueError(f"contraction {op.label}: an epilogue is placed after autodiff, not differentiated")
    alpha = op.attrs.get("alpha", 1.0)
    (c1, (t1, a1)), (c2, (t2, a2)) = ins.items()
    for (c, (t, a)), (_, (ot, oa)) in (((c1, (t1, a1)), (c2, (t2, a2))), ((c2, (t2, a2)), (c1, (t1, a1)))):
        target = d.grad_target(t, a, op.label)
        if target is None:
            continue
        operands = {"dy": f"{dy}[{y_acc}]", c2 if c == c1 else c1: d.use(ot, oa)}
        d.g.op(f"{op.label}_d{c}", "contraction", "TC", operands, {"y": target}, alpha=alpha)


CONTRACTION = register(OpKind("contraction", "TC", flop=_contraction_flop, reference=_contraction_reference,
                              vjp=_contraction_vjp, autocast="lower_precision_fp"))
