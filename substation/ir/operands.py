"""Operands of an operator resolved against their tensors' layouts, and the mapping of a contraction
onto one (batched) GEMM call: what the layout pass checks and both code generators emit.

An operand's access string names a dimension letter per tensor dimension (a digit indexes a static
stack dimension, e.g. ``QKV[BJ0HP]``); its strides come from the SDFG array's layout
(:func:`~substation.ir.graph.layout_strides`), in elements, symbolic in B, J, K and numeric in the
static sizes H, P, I, U (``T`` is the Q/K/V stack of 3).
"""
from __future__ import annotations

import dataclasses

import sympy

from .graph import LayerGraph, access_letters, layout_strides

__all__ = ["LayoutError", "Operand", "BiasPlan", "ContractionPlan", "STACK_LETTER", "c_expr", "dim_symbol", "dim_size",
           "gemm_groups", "linear_index", "plan_bias", "plan_contraction", "resolve_operand", "split_stack_params",
           "stride_order"]


class LayoutError(ValueError):
    """The layouts of a contraction's operands do not map to one (batched) GEMM call."""


def c_expr(expr) -> str:
    """A sympy expression (or int) as C source."""
    return sympy.ccode(sympy.sympify(expr))


def dim_symbol(dim: str):
    """The size of dimension letter ``dim`` as a sympy symbol (the Q/K/V stack ``T``: 3)."""
    return 3 if dim == "T" else sympy.Symbol(dim)


@dataclasses.dataclass
class Operand:
    """One operand of an operator, resolved against its tensor's strides (in elements)."""

    name: str        # C++ pointer variable
    access: str
    strides: dict    # loop letter -> symbolic element stride
    base: object     # symbolic element offset from the fixed (digit) indices

    def offset(self, letters=None, index=None) -> str:
        """The C expression of the element offset ``base + sum(i_<c> * stride_c)`` over ``letters``
        (default: all of the operand's letters); ``index(c)`` names the index variable of letter c
        (default ``i_<c>``)."""
        index = index or (lambda c: f"i_{c}")
        terms = [] if self.base == 0 else [c_expr(self.base)]
        for c, s in self.strides.items():
            if letters is None or c in letters:
                terms.append(index(c) if s == 1 else f"{index(c)} * ({c_expr(s)})")
        return " + ".join(terms) or "0"


def resolve_operand(graph: LayerGraph, tensor: str, access: str) -> Operand:
    """``tensor[access]`` of ``graph`` as an :class:`Operand` (strides from the tensor's layout).

    Raises:
        KeyError: ``graph`` has no tensor ``tensor``.
    """
    info = graph.tensors[tensor]
    strides = layout_strides(info.dims, info.layout, dim_symbol)
    res, base = {}, sympy.Integer(0)
    for c, s in zip(access, strides):
        if c.isdigit():
            base += int(c) * s
        else:
            res[c] = s
    return Operand(tensor, access, res, base)


def dim_size(letter: str) -> str:
    """The C expression of a dimension's size: its letter (a variable or constant of the generated
    code), ``3`` for the Q/K/V stack ``T``."""
    return "3" if letter == "T" else letter


def linear_index(letters, index_of) -> str:
    """The row-major linear index over ``letters`` (outermost first) as a C expression: Horner's form
    ``((i0) * S1 + i1) * S2 + i2 ...`` with ``index_of(letter)`` as each letter's index expression."""
    res = ""
    for c in letters:
        res = f"({res}) * {dim_size(c)} + {index_of(c)}" if res else index_of(c)
    return res or "0"


def stride_order(strides: dict, letters) -> list[str]:
    """``letters`` sorted outermost first by ``strides`` (letter -> symbolic element stride, e.g.
    :attr:`Operand.strides`; a letter without one counts as innermost; ties keep the given order),
    strides evaluated at generic sizes."""
    def key(c):
        return 0 if c not in strides else -_generic_stride(strides[c])
    return sorted(letters, key=key)


def _generic_stride(expr) -> float:
    """A stride evaluated at generic sizes (for ordering only)."""
    sub = {sympy.Symbol(d): v for d, v in zip("BJKHPIU", (7, 11, 11, 13, 17, 19, 23))}
    return float(sympy.sympify(expr).subs(sub))


# -- contractions ----------------------------------------------------------------------------------
@dataclasses.dataclass
class ContractionPlan:
    """How one einsum maps to GEMM calls ``C[m, n] = alpha * A[m, k] B[k, n]`` (row-major C).

    Sizes and leading dimensions are symbolic; ``batch`` lists (letter, stride in A, B, C) for the
    loops around the call (a stride of 0: that operand is the same for every index of the letter);
    ``m_letters`` and ``n_letters`` are C's row and column letters, outermost first.
    """

    a: Operand
    b: Operand
    c: Operand
    trans_a: bool
    trans_b: bool
    m: object
    n: object
    k: object
    lda: object
    ldb: object
    ldc: object
    batch: list
    m_letters: tuple = ()
    n_letters: tuple = ()


def _group(op: Operand, letters: list[str], what: str, ref_order=None):
    """Merge ``letters`` of one operand into a single (size, stride) if they are dense and ordered."""
    if not letters:
        raise LayoutError(f"{what}: empty index group")
    order = stride_order(op.strides, letters)
    if ref_order is not None and order != ref_order:
        raise LayoutError(f"{what}: index order {''.join(order)} differs from {''.join(ref_order)}")
    for outer, inner in zip(order, order[1:]):
        # K renames J in self-attention: compare strides with K = J.
        gap = (op.strides[outer] - op.strides[inner] * dim_symbol(inner)).subs(sympy.Symbol("K"), sympy.Symbol("J"))
        if sympy.simplify(gap) != 0:
            raise LayoutError(f"{what}: dimensions {outer}{inner} of {op.name} are not adjacent in memory")
    size = sympy.Integer(1)
    for c in order:
        size *= dim_symbol(c)
    return order, size, op.strides[order[-1]]


def _transposition(op: Operand, row_stride, col_stride, label: str) -> tuple[bool, object]:
    """(transposed, leading dimension) of a GEMM operand whose matrix has ``row_stride`` and
    ``col_stride``: row-major when its columns are contiguous, transposed when its rows are.

    Raises:
        LayoutError: neither is contiguous.
    """
    if col_stride == 1:
        return False, row_stride
    if row_stride == 1:
        return True, col_stride
    raise LayoutError(f"{label}: operand {op.name} has no unit-stride GEMM dimension")


#: The stack letter a GEMM may loop over when it is a row or column letter that does not fit the matrix
#: (the Q/K/V stack of a T-major QKV written by the QKV GEMM: one call per T, A shared).
STACK_LETTER = "T"


def split_stack_params(graph: LayerGraph) -> tuple[str, ...]:
    """The parameters a forward-only CPU library takes in parts, one pointer per index of the stack
    letter T (``in_proj_weight`` [T, H, P, I] as the Q, K and V weights [H, P, I], wherever each lives):
    parameters stored T-outermost whose every reader is a contraction (one GEMM per T). A drop-in layer
    of a model with separate Q, K, V projections then runs inference without concatenating its weights
    on every call. Empty for graphs that save tensors for backward, backward graphs and CUDA builds.
    """
    if graph.config.target != "cpu" or not graph.forward_only:
        return ()
    readers: dict[str, set[str]] = {}
    for op in graph.operators():
        for t, _ in graph.inputs_of(op).values():
            readers.setdefault(t, set()).add(op.kind)
    return tuple(t.name for t in graph.tensors.values()
                 if t.role == "param" and t.layout[:1] == STACK_LETTER and readers.get(t.name) == {"contraction"})


def gemm_groups(c_access: str, a_access: str, b_access: str, loop_stack: bool = False):
    """(batch, m, n, k) letters of ``C[c_access] = A[a_access] x B[b_access]`` in C's (k: A's) order;
    with ``loop_stack``, :data:`STACK_LETTER` leaves the row or column group for the batch (None when
    it is in neither with another letter). Digits (fixed indices) are skipped."""
    la, lb, lc = set(access_letters(a_access)), set(access_letters(b_access)), set(access_letters(c_access))
    batch = [x for x in access_letters(c_access) if x in la and x in lb]
    m = [x for x in access_letters(c_access) if x in la and x not in lb]
    n = [x for x in access_letters(c_access) if x in lb and x not in la]
    k = [x for x in access_letters(a_access) if x in lb and x not in lc]
    if loop_stack:
        group = m if STACK_LETTER in m else n
        if STACK_LETTER not in group or len(group) < 2:
            return None
        group.remove(STACK_LETTER)
        batch = [x for x in access_letters(c_access) if x in batch or x == STACK_LETTER]
    return batch, m, n, k


def plan_contraction(a: Operand, b: Operand, c: Operand, label: str, loop_stack: bool = False) -> ContractionPlan:
    """Map ``c = einsum(a, b)`` onto a GEMM, swapping or transposing operands as the strides require;
    where that fails (or always, with ``loop_stack``: an operand given in parts, see
    :func:`split_stack_params`) and the stack letter T is a row or column letter, onto one GEMM per T
    (:data:`STACK_LETTER`).

    Raises:
        LayoutError: the operands' layouts need an explicit transpose first; ``loop_stack`` where T is
            no row or column letter.
    """
    la, lb, lc = set(a.strides), set(b.strides), set(c.strides)
    batch, m, n, k = gemm_groups(c.access, a.access, b.access)
    stray = (la | lb | lc) - set(batch) - set(m) - set(n) - set(k)
    if stray:
        raise LayoutError(f"{label}: indices {''.join(sorted(stray))} appear in only one operand")
    looped = gemm_groups(c.access, a.access, b.access, loop_stack=True)
    if loop_stack and looped is None:
        raise LayoutError(f"{label}: an operand in parts along {STACK_LETTER} needs {STACK_LETTER} as a row or "
                          f"column letter with another")
    first = None
    for groups in ([] if loop_stack else [(batch, m, n, k)]) + ([looped] if looped else []):
        try:
            return _plan(a, b, c, label, *groups)
        except LayoutError as e:  # the first attempt's reason is the one to report
            first = first or e
    raise first


def _plan(a: Operand, b: Operand, c: Operand, label: str, batch, m, n, k) -> ContractionPlan:
    mo, msize, cm = _group(c, m, f"{label} (C rows)")
    _, _, am = _group(a, m, f"{label} (A rows)", mo)
    no, nsize, cn = _group(c, n, f"{label} (C cols)")
    _, _, bn = _group(b, n, f"{label} (B cols)", no)
    ko, ksize, ak = _group(a, k, f"{label} (A inner)")
    _, _, bk = _group(b, k, f"{label} (B inner)", ko)
    if cn != 1:
        if cm != 1:
            raise LayoutError(f"{label}: output {c.name} has no unit-stride GEMM dimension")
        # C^T = B^T A^T: swap the roles of A and B.
        a, b, am, ak, bk, bn, cm, cn, msize, nsize = b, a, bn, bk, ak, am, cn, cm, nsize, msize
        mo, no = no, mo
    trans_a, lda = _transposition(a, am, ak, label)
    trans_b, ldb = _transposition(b, bk, bn, label)
    batch_info = [(x, a.strides.get(x, 0), b.strides.get(x, 0), c.strides[x]) for x in stride_order(c.strides, batch)]
    return ContractionPlan(a, b, c, trans_a, trans_b, msize, nsize, ksize, lda, ldb, cm,
                           batch_info, tuple(mo), tuple(no))


@dataclasses.dataclass
class BiasPlan:
    """Element strides of a contraction's epilogue bias along C's rows, C's columns and each batch
    letter of the plan (0: broadcast along it)."""

    operand: Operand
    m: object
    n: object
    batch: list


def plan_bias(plan: ContractionPlan, bias: Operand, label: str) -> BiasPlan:
    """How the epilogue ``bias`` of ``plan``'s contraction broadcasts: along C's row group and column
    group it has either none of the letters (stride 0) or all of them, dense in C's order (the
    innermost one's stride); along a batch letter, its stride there or 0.

    Raises:
        LayoutError: a bias letter C lacks, or part of a row or column group, or one not dense.
    """
    stray = set(bias.strides) - set(plan.m_letters) - set(plan.n_letters) - {x for x, *_ in plan.batch}
    if stray:
        raise LayoutError(f"{label}: bias {bias.name} has letters {''.join(sorted(stray))} the output lacks")

    def along(letters, what):
        have = [x for x in letters if x in bias.strides]
        if not have:
            return 0
        if len(have) != len(letters):
            raise LayoutError(f"{label}: bias {bias.name} has only {''.join(have)} of the {what} {''.join(letters)}")
        return _group(bias, list(letters), f"{label} (bias {what})", list(letters))[2]

    return BiasPlan(bias, along(plan.m_letters, "rows"), along(plan.n_letters, "columns"),
                    [bias.strides.get(x, 0) for x, *_ in plan.batch])
