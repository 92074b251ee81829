"""Contractions of the generated CUDA code: one cuBLAS call each.

The mapping onto a row-major GEMM is :func:`substation.ir.operands.plan_contraction`'s (the one the
CPU build uses); ``sscuda::gemm`` turns it into cuBLAS's column-major call by swapping the operands.
By batch letters (those in all three operands):

* none: ``cublasGemmEx``;
* letters whose strides nest in all three operands (merged by :func:`merge_batch` into one group):
  ``cublasGemmStridedBatchedEx``;
* several groups (attention's B and H in the default layouts, where Q, K and V interleave in QKV):
  one ``cublasGemmBatchedEx`` over pointer arrays, B * H matrices in one call. One kernel at the
  start of ``substation_run`` (``sscuda::fill_batches``) writes the arrays of every such contraction
  of the graph into the workspace.
"""
from __future__ import annotations

import sympy

from ...ir.graph import LayerGraph, Operator
from ...ir.operands import LayoutError, c_expr, dim_symbol, plan_contraction, resolve_operand
from ...ops.contraction import EPILOGUE_BIAS, factors

__all__ = ["MAX_BATCH_GROUPS", "merge_batch", "ContractionCalls"]

#: Batch groups a pointer-array GEMM may have (``sscuda::kMaxBatchGroups``).
MAX_BATCH_GROUPS = 4


def merge_batch(plan) -> list[tuple[list[str], object, object, object, object]]:
    """Merge adjacent batch letters of a :func:`~substation.ir.operands.plan_contraction` plan whose
    strides nest in all three operands: groups of (letters, size, stride in A, B, C), outermost first
    (K and J are the same size)."""
    groups = []
    for x, sa, sb, sc in plan.batch:
        if groups:
            letters, size, ga, gb, gc = groups[-1]
            n = dim_symbol(x)
            ok = all(sympy.simplify((g - s * n).subs(sympy.Symbol("K"), sympy.Symbol("J"))) == 0
                     for g, s in ((ga, sa), (gb, sb), (gc, sc)))
            if ok:
                groups[-1] = (letters + [x], size * n, sa, sb, sc)
                continue
        groups.append(([x], dim_symbol(x), sa, sb, sc))
    return groups


class ContractionCalls:
    """The cuBLAS calls of one graph's contractions (see the module docstring), and the pointer
    arrays of those whose batch letters form several groups."""

    def __init__(self, graph: LayerGraph):
        self.graph = graph
        self.describe: list[str] = []   # batch_desc statements, one per pointer-array GEMM
        self.counts: list[str] = []     # the matrices of each pointer-array GEMM (C expressions)

    def call(self, op: Operator) -> str:
        """The statement of ``substation_run`` that computes contraction ``op`` (one cuBLAS call).

        Raises:
            LayoutError: the operand layouts need an explicit transpose, or the batch letters form
                more than MAX_BATCH_GROUPS groups.
        """
        ops = {conn: resolve_operand(self.graph, t, a) for conn, (t, a) in self.graph.operands(op).items()}
        out = ops.pop("y")
        if EPILOGUE_BIAS in ops:
            raise ValueError(f"contraction {op.label}: CUDA builds place no bias in a GEMM epilogue")
        a, b = factors(ops)
        plan = plan_contraction(a, b, out, op.label)
        alpha = op.attrs.get("alpha", 1.0)
        ptr = {w: f"{o.name} + ({c_expr(o.base) if o.base != 0 else '0'})"
               for w, o in (("a", plan.a), ("b", plan.b), ("c", plan.c))}
        head = (f"{str(plan.trans_a).lower()}, {str(plan.trans_b).lower()}, {c_expr(plan.m)}, {c_expr(plan.n)}, "
                f"{c_expr(plan.k)}, {alpha!r}")
        groups = merge_batch(plan)
        if len(groups) <= 1:
            count, sa, sb, sc = ("1", "0", "0", "0") if not groups else (c_expr(s) for s in groups[0][1:])
            return (f"SS_CHECK(sscuda::gemm<store_t>({head}, {ptr['a']}, {c_expr(plan.lda)}, {sa}, "
                    f"{ptr['b']}, {c_expr(plan.ldb)}, {sb}, {ptr['c']}, {c_expr(plan.ldc)}, {sc}, {count}, stream_));")
        if len(groups) > MAX_BATCH_GROUPS:
            raise LayoutError(f"{op.label}: the batch letters form {len(groups)} groups of strides, more than the "
                              f"{MAX_BATCH_GROUPS} a batched GEMM of the CUDA target takes")
        i = len(self.describe)

        def array(k):
            return "{" + ", ".join(c_expr(g[k]) for g in groups) + "}"
        self.describe.append(f"{{ const int64_t n_[] = {array(1)}, sa_[] = {array(2)}, sb_[] = {array(3)}, "
                             f"sc_[] = {array(4)};  // {op.label}: batch {' x '.join(''.join(g[0]) for g in groups)}\n"
                             f"  sscuda::batch_desc(batch_.d[{i}], batch_next_, {ptr['a']}, {ptr['b']}, {ptr['c']}, "
                             f"{len(groups)}, n_, sa_, sb_, sc_); }}")
        self.counts.append(" * ".join(f"({c_expr(g[1])})" for g in groups))
        return (f"SS_CHECK(sscuda::gemm_batched<store_t>({head}, batch_.d[{i}], {c_expr(plan.lda)}, "
                f"{c_expr(plan.ldb)}, {c_expr(plan.ldc)}, stream_));")

    def pointer_bytes(self) -> str:
        """C expression (of B, J, K) of the workspace bytes of the pointer arrays: three arrays of
        pointers per pointer-array GEMM; "0" when there is none."""
        if not self.counts:
            return "0"
        return f"(int64_t)sizeof(void*) * 3 * ({' + '.join(self.counts)})"

    def setup(self) -> list[str]:
        """Statements of ``substation_run`` before the first contraction: describe every pointer-array
        GEMM (its arrays taken from ``batch_next_``, the workspace region of :meth:`pointer_bytes`)
        and write all arrays with one kernel. Empty when there is none."""
        if not self.describe:
            return []
        lines = [f"sscuda::BatchTable<store_t, {len(self.describe)}> batch_;"]
        for d in self.describe:
            lines += d.split("\n")
        return lines + ["SS_CHECK(sscuda::fill_batches(batch_, stream_));"]
