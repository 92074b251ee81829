"""The operator-kind record every pass queries instead of switching on kind names (TVM's registered op
attributes and tinygrad's ``Ops`` are the models).

A kind declares, once, in its own module of :mod:`substation.ops`: its operator class (TC / SN / EW),
its reduction, its flop rule, its vector-Jacobian rule, its float64 reference semantics and its
row-kernel member body, written once against :class:`substation.backends.rowkernel.RowEmitter` for every
target, with per-target overrides only where a target really differs.

Operands of the rules are what the graphs hold: ``inputs`` / ``outputs`` map a connector (``x``,
``y``, ``dy``, ...) to a ``(tensor, access)`` pair whose access string names a dimension letter per
tensor dimension (a digit indexes a static stack dimension, e.g. ``QKV[BJ0HP]``).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ..config import TARGETS
from ..ir.graph import access_letters

__all__ = ["AUTOCAST_RULES", "OpKind", "KINDS", "register", "op_kind", "operand_access", "elements", "elementwise_flop",
           "align", "reduce_to", "op_space"]

#: Every registered kind by name (filled by the modules of :mod:`substation.ops`).
KINDS: dict[str, "OpKind"] = {}
#: How a kind's output dtype follows in a mixed-precision graph (:attr:`OpKind.autocast`); the names of
#: PyTorch's autocast op lists (``torch/csrc/autograd/autocast_mode.h``).
AUTOCAST_RULES = ("lower_precision_fp", "fp32", "promote")


@dataclasses.dataclass(frozen=True)
class OpKind:
    """One operator kind.

    Attributes:
        name: the kind's name as the graphs store it.
        op_class: ``TC`` (tensor contraction), ``SN`` (statistical normalization) or ``EW``
            (element-wise), the paper's classes.
        flop: ``(attrs, inputs, outputs, size) -> flop`` with ``size(letter)`` a dimension size
            (an int or a sympy symbol); docs/analysis.md lists the per-element counts.
        reference: float64 semantics, ``(inputs, output_letters, attrs) -> outputs``: ``inputs`` maps a
            connector to ``(tensor, letters)`` (one tensor dimension per letter), ``output_letters``
            maps each output connector to its letters, the result maps it to a tensor in that order.
        vjp: the vector-Jacobian rule ``(differentiator, op, inputs, outputs, dy, y_access)``, which adds
            the gradient operators to the backward graph; None for kinds only backward graphs or the
            layout pass create.
        row: the row-kernel member body ``(kernel, attrs)`` against
            :class:`substation.backends.rowkernel.RowEmitter`, shared by every target; None for contractions
            (BLAS / cuBLAS), required for every other kind.
        overrides: target name (``cpu``, ``cuda``) -> a body replacing ``row`` on that target.
        reduction: ``row`` (over the normalized axis ``attrs["axis"]``), ``column`` (over the row
            letters, into the output's letters) or None.
        letter: the kind's letters in fused-kernel names (the paper's style: B bias, D dropout, ...).
        statistics: connectors holding per-row normalization statistics (layer norm's mean and rstd,
            RMSNorm's rstd), kept in a wider type: double on the CPU, the compute type in CUDA.
        autocast: the dtype of the kind's outputs in a mixed-precision graph (one of
            :data:`AUTOCAST_RULES`, the names of PyTorch's autocast op lists): ``lower_precision_fp``
            (inputs cast to the low dtype, outputs in it: contractions), ``fp32`` (outputs float32:
            normalizations) or ``promote`` (the widest input dtype: element-wise kinds).
    """

    name: str
    op_class: str
    flop: Callable
    reference: Callable
    vjp: Callable | None = None
    row: Callable | None = None
    overrides: dict = dataclasses.field(default_factory=dict, hash=False)
    reduction: str | None = None
    letter: str | None = None
    statistics: tuple[str, ...] = ()
    autocast: str = "promote"

    def __post_init__(self):
        if self.autocast not in AUTOCAST_RULES:
            raise ValueError(f"kind {self.name}: autocast must be one of {', '.join(AUTOCAST_RULES)}, "
                             f"got {self.autocast!r}")
        if self.op_class not in ("TC", "SN", "EW"):
            raise ValueError(f"kind {self.name}: op_class must be TC, SN or EW, got {self.op_class!r}")
        if self.reduction not in (None, "row", "column"):
            raise ValueError(f"kind {self.name}: reduction must be row, column or None, got {self.reduction!r}")
        if (self.op_class == "TC") != (self.row is None):
            raise ValueError(f"kind {self.name}: {'a TC kind has no' if self.row else 'an EW or SN kind needs a'} "
                             "row-kernel body (row)")
        if set(self.overrides) - set(TARGETS) or (self.overrides and self.row is None):
            raise ValueError(f"kind {self.name}: overrides must map targets ({', '.join(TARGETS)}) of a kind "
                             f"with a row body to bodies, got {sorted(self.overrides)}")

    def row_emitter(self, target: str) -> Callable:
        """The member body for ``target``: its override there, else :attr:`row`.

        Raises:
            ValueError: the kind has no row-kernel body (a contraction).
        """
        if self.row is None:
            raise ValueError(f"kind {self.name} ({self.op_class}) has no row-kernel body")
        return self.overrides.get(target, self.row)


def register(kind: OpKind) -> OpKind:
    """Add ``kind`` to :data:`KINDS` and return it.

    Raises:
        ValueError: a kind of that name is registered already.
    """
    if kind.name in KINDS:
        raise ValueError(f"operator kind {kind.name!r} is registered twice")
    KINDS[kind.name] = kind
    return kind


def op_kind(name: str) -> OpKind:
    """The registered kind ``name``.

    Raises:
        ValueError: no such kind (the message lists the known ones).
    """
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown operator kind {name!r} (known: {', '.join(sorted(KINDS))})") from None


def operand_access(value) -> str:
    """An access string from ``"BJI"``, ``("X", "BJI")`` or ``["X", "BJI"]``.

    Raises:
        TypeError: anything else.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[1], str):
        return value[1]
    raise TypeError(f"an operand must be an access string or a (tensor, access) pair, got {value!r}")


def elements(value, size: Callable[[str], object]):
    """Elements one operand touches: the product of its letters' sizes (digits count 1)."""
    n = 1
    for c in access_letters(operand_access(value)):
        n = n * size(c)
    return n


def elementwise_flop(per_element: int, per_row: int = 0, main: str = "y") -> Callable:
    """A flop rule: ``per_element`` per element of the operand ``main`` (an output, or the input ``dy``
    of a column reduction) plus ``per_row`` per row of ``attrs["axis"]``.

    The rule raises ValueError when the operator lacks ``main`` or its axis is not a letter of it.
    """
    def flop(attrs, inputs, outputs, size):
        side = outputs if main in outputs else inputs
        if main not in side:
            raise ValueError(f"the operator needs the operand {main!r}")
        access = operand_access(side[main])
        n = per_element * elements(access, size)
        if per_row:
            axis = attrs.get("axis")
            if axis not in access:
                raise ValueError(f"axis {axis!r} is not a letter of the access {access!r}")
            rows = 1
            for c in access_letters(access):
                if c != axis:
                    rows = rows * size(c)
            n = n + per_row * rows
        return n
    return flop


def align(tensor: torch.Tensor, letters: str, target: str) -> torch.Tensor:
    """``tensor`` (one dimension per letter of ``letters``) permuted and unsqueezed so that it broadcasts
    against a tensor with letters ``target``; letters of ``tensor`` missing from ``target`` are an error.

    Raises:
        ValueError: a letter of ``letters`` not in ``target``.
    """
    extra = set(letters) - set(target)
    if extra:
        raise ValueError(f"letters {''.join(sorted(extra))} of {letters!r} are not in {target!r}")
    order = sorted(range(len(letters)), key=lambda i: target.index(letters[i]))
    t = tensor.permute(*order) if order else tensor
    have = "".join(letters[i] for i in order)
    shape = [t.shape[have.index(c)] if c in have else 1 for c in target]
    return t.reshape(shape)


def reduce_to(tensor: torch.Tensor, letters: str, target: str) -> torch.Tensor:
    """Sum ``tensor`` (letters ``letters``) over the letters not in ``target`` and order it as ``target``."""
    return torch.einsum(f"{letters}->{target}", tensor)


def op_space(kind: str, inputs: dict, outputs: dict, attrs: dict) -> tuple[frozenset, frozenset | None]:
    """(F, N) of an EW or SN operator of kind ``kind``: its full iteration letters and the inner
    letters its reduction fixes (the axis of a row reduction, the kept letters of a column reduction;
    None when any split works, as for element-wise operators).

    Raises:
        ValueError: an unknown kind.
    """
    reduction = op_kind(kind).reduction
    if reduction == "column":
        full = max((frozenset(access_letters(a)) for _, a in inputs.values()), key=len)
        kept = frozenset(access_letters(next(iter(outputs.values()))[1]))
        return full, kept
    full = max((frozenset(access_letters(a)) for _, a in list(inputs.values()) + list(outputs.values())), key=len)
    if reduction == "row":
        return full, frozenset(attrs["axis"])
    return full, None
