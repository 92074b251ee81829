"""Operator kinds, each declared once in a module of its own (see :mod:`substation.ops.kind`): the graph
builder, autodiff, fusion, analysis, the reference interpreter and both code generators query
:func:`op_kind` instead of switching on kind names.

Kinds: contraction, attention (TC); bias, add, mask, dropout, activation, activation_grad, transpose, cast (EW);
softmax, softmax_grad, layer_norm, layer_norm_grad, layer_norm_param_grad, rms_norm, rms_norm_grad,
rms_norm_param_grad, bias_grad (SN).
"""
from . import (activation, add, attention, bias, cast, contraction, dropout, layer_norm, mask,  # noqa: F401 (register)
               rms_norm, softmax, transpose)
from .kind import KINDS, OpKind, op_kind, op_space

__all__ = ["KINDS", "OpKind", "op_kind", "op_space"]
