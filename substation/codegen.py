"""C++ code generation for the CPU: one translation unit per :class:`~substation.graph.LayerGraph`.

Each operator becomes one loop nest (EW), one row or column reduction kernel (SN) or one BLAS
GEMM call, possibly in a batch loop (TC). Operand offsets come from the tensors' strides, so any
layout the graph carries is honoured; a contraction whose layouts do not map to a (batched) GEMM
is rejected with :class:`LayoutError`. H, P, I and U are compile-time constants; B, J and K are
runtime arguments, so one build serves every batch size and sequence length.

The generated library exports::

    int64_t substation_workspace_bytes(const int64_t* sizes);          // sizes = {B, J, K}
    int     substation_run(void* const* args, const int64_t* sizes, void* workspace,
                           uint64_t seed, int32_t training);
    const char* substation_signature();                                 // argument names, comma-separated

``args`` holds one pointer per non-temporary tensor in :attr:`LayerGraph.tensors` order.
"""
from __future__ import annotations

import dataclasses
import math

import sympy

from .graph import STATIC_DIMENSIONS, LayerGraph, Operator, layout_strides

__all__ = ["LayoutError", "generate_cpu", "ContractionPlan", "plan_contraction"]

_CTYPES = {"float32": "float", "float64": "double"}


class LayoutError(ValueError):
    """The layouts of a contraction's operands do not map to one (batched) GEMM call."""


def _cxx(expr) -> str:
    return sympy.ccode(sympy.sympify(expr))


def _symbol(dim: str):
    return 3 if dim == "T" else sympy.Symbol(dim)


@dataclasses.dataclass
class _Operand:
    """One operand of an operator, resolved against its tensor's strides."""

    name: str        # C++ pointer variable
    access: str
    strides: dict    # loop letter -> symbolic element stride
    base: object     # symbolic element offset from the fixed (digit) indices

    def offset(self, letters=None) -> str:
        terms = [] if self.base == 0 else [_cxx(self.base)]
        for c, s in self.strides.items():
            if letters is None or c in letters:
                terms.append(f"i_{c}" if s == 1 else f"i_{c} * ({_cxx(s)})")
        return " + ".join(terms) or "0"


def _resolve(graph: LayerGraph, tensor: str, access: str) -> _Operand:
    info = graph.tensors[tensor]
    strides = layout_strides(info.dims, info.layout, _symbol)
    res, base = {}, sympy.Integer(0)
    for c, s in zip(access, strides):
        if c.isdigit():
            base += int(c) * s
        else:
            res[c] = s
    return _Operand(tensor, access, res, base)


def _size(letter: str) -> str:
    return "3" if letter == "T" else letter


def _order(op: _Operand, letters) -> list[str]:
    """Letters sorted outermost first by ``op``'s strides (ties keep the given order)."""
    def key(c):
        s = op.strides.get(c)
        return 0 if s is None else -_numeric(s)
    return sorted(letters, key=key)


def _numeric(expr) -> float:
    """A stride evaluated at generic sizes (for ordering only)."""
    sub = {sympy.Symbol(d): v for d, v in zip("BJKHPIU", (7, 11, 11, 13, 17, 19, 23))}
    return float(sympy.sympify(expr).subs(sub))


# -- contractions ----------------------------------------------------------------------------------
@dataclasses.dataclass
class ContractionPlan:
    """How one einsum maps to GEMM calls ``C[m, n] = alpha * A[m, k] B[k, n]`` (row-major C).

    Sizes and leading dimensions are symbolic; ``batch`` lists (letter, stride in A, B, C) for the
    loops around the call.
    """

    a: _Operand
    b: _Operand
    c: _Operand
    trans_a: bool
    trans_b: bool
    m: object
    n: object
    k: object
    lda: object
    ldb: object
    ldc: object
    batch: list


def _group(op: _Operand, letters: list[str], what: str, ref_order=None):
    """Merge ``letters`` of one operand into a single (size, stride) if they are dense and ordered."""
    if not letters:
        raise LayoutError(f"{what}: empty index group")
    order = _order(op, letters)
    if ref_order is not None and order != ref_order:
        raise LayoutError(f"{what}: index order {''.join(order)} differs from {''.join(ref_order)}")
    for outer, inner in zip(order, order[1:]):
        # K renames J in self-attention: compare strides with K = J.
        gap = (op.strides[outer] - op.strides[inner] * _symbol(inner)).subs(sympy.Symbol("K"), sympy.Symbol("J"))
        if sympy.simplify(gap) != 0:
            raise LayoutError(f"{what}: dimensions {outer}{inner} of {op.name} are not adjacent in memory")
    size = sympy.Integer(1)
    for c in order:
        size *= _symbol(c)
    return order, size, op.strides[order[-1]]


def plan_contraction(a: _Operand, b: _Operand, c: _Operand, label: str) -> ContractionPlan:
    """Map ``c = einsum(a, b)`` onto a GEMM, swapping or transposing operands as the strides require.

    Raises:
        LayoutError: the operands' layouts need an explicit transpose first.
    """
    la, lb, lc = set(a.strides), set(b.strides), set(c.strides)
    batch = [x for x in c.access if x in la and x in lb and not x.isdigit()]
    m = [x for x in c.access if x in la and x not in lb and not x.isdigit()]
    n = [x for x in c.access if x in lb and x not in la and not x.isdigit()]
    k = [x for x in a.access if x in lb and x not in lc and not x.isdigit()]
    stray = (la | lb | lc) - set(batch) - set(m) - set(n) - set(k)
    if stray:
        raise LayoutError(f"{label}: indices {''.join(sorted(stray))} appear in only one operand")
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
    if ak == 1:
        trans_a, lda = False, am
    elif am == 1:
        trans_a, lda = True, ak
    else:
        raise LayoutError(f"{label}: operand {a.name} has no unit-stride GEMM dimension")
    if bn == 1:
        trans_b, ldb = False, bk
    elif bk == 1:
        trans_b, ldb = True, bn
    else:
        raise LayoutError(f"{label}: operand {b.name} has no unit-stride GEMM dimension")
    batch_info = [(x, a.strides[x], b.strides[x], c.strides[x]) for x in _order(c, batch)]
    return ContractionPlan(a, b, c, trans_a, trans_b, msize, nsize, ksize, lda, ldb, cm,
                           batch_info)


# -- the emitter -----------------------------------------------------------------------------------
class _Emitter:
    def __init__(self, graph: LayerGraph):
        self.graph = graph
        self.cfg = graph.config
        self.T = _CTYPES[self.cfg.dtype]
        self.blas = "cblas_sgemm" if self.cfg.dtype == "float32" else "cblas_dgemm"
        self.lines: list[str] = []
        self.indent = 1

    def w(self, line: str = "") -> None:
        self.lines.append("  " * self.indent + line if line else "")

    def operands(self, op: Operator) -> dict[str, _Operand]:
        return {conn: _resolve(self.graph, t, a) for conn, (t, a) in self.graph.operands(op).items()}

    # loops ---------------------------------------------------------------------------------------
    def loops(self, letters: list[str], body, parallel: bool = True, inner_simd: bool = False,
              collapse_all: bool = False) -> None:
        """Nested loops over ``letters`` (outermost first); the outer ones (or all) collapsed for OpenMP."""
        outer = letters[:-1] if len(letters) > 1 and not collapse_all else letters
        if parallel and outer:
            self.w(f"#pragma omp parallel for collapse({len(outer)}) schedule(static)")
        for c in letters:
            if inner_simd and c == letters[-1] and len(letters) > 1:
                self.w("#pragma omp simd")
            self.w(f"for (int64_t i_{c} = 0; i_{c} < {_size(c)}; ++i_{c}) {{")
            self.indent += 1
        body()
        for _ in letters:
            self.indent -= 1
            self.w("}")

    # operators -----------------------------------------------------------------------------------
    def emit(self, op: Operator, timer: int | None = None) -> None:
        """Emit ``op``; with ``timer`` set, accumulate its wall time into slot ``timer``."""
        self.w(f"// {op.label} [{op.op_class}] {op.kind}: "
               + ", ".join(f"{c}={t}[{a}]" for c, (t, a) in sorted(self.graph.operands(op).items())))
        self.w("{")
        self.indent += 1
        if timer is not None:
            self.w("const double t0_ = omp_get_wtime();")
        getattr(self, f"_emit_{op.kind}")(op, self.operands(op), op.attrs)
        if timer is not None:
            self.w(f"g_op_seconds[{timer}] += omp_get_wtime() - t0_;")
        self.indent -= 1
        self.w("}")

    def _emit_contraction(self, op, ops, attrs):
        out = ops.pop("y")
        (a, b) = ops.values()
        plan = plan_contraction(a, b, out, op.label)
        alpha = attrs.get("alpha", 1.0)
        call = (f"{self.blas}(CblasRowMajor, {'CblasTrans' if plan.trans_a else 'CblasNoTrans'}, "
                f"{'CblasTrans' if plan.trans_b else 'CblasNoTrans'}, {_cxx(plan.m)}, {_cxx(plan.n)}, "
                f"{_cxx(plan.k)}, {alpha!r}, {plan.a.name} + {{oa}}, {_cxx(plan.lda)}, {plan.b.name} + {{ob}}, "
                f"{_cxx(plan.ldb)}, 0.0, {plan.c.name} + {{oc}}, {_cxx(plan.ldc)});")
        base = {x: (_cxx(o.base) if o.base != 0 else "0") for x, o in (("a", plan.a), ("b", plan.b), ("c", out))}
        if not plan.batch:
            self.w(call.format(oa=base["a"], ob=base["b"], oc=base["c"]))
            return

        def off(which, idx):
            terms = [base[which]] + [f"i_{x} * ({_cxx(s[idx])})" for x, *s in plan.batch if s[idx] != 0]
            return " + ".join(t for t in terms if t != "0") or "0"
        nbatch = " * ".join(_size(x) for x, *_ in plan.batch)
        inner = call.format(oa=off("a", 0), ob=off("b", 1), oc=off("c", 2))
        letters = [x for x, *_ in plan.batch]
        # Many small GEMMs: one per thread (BLAS runs single-threaded inside the parallel region).
        self.w(f"if ({nbatch} >= omp_get_max_threads()) {{")
        self.indent += 1
        self.loops(letters, lambda: self.w(inner), parallel=True, collapse_all=True)
        self.indent -= 1
        self.w("} else {")
        self.indent += 1
        self.loops(letters, lambda: self.w(inner), parallel=False)
        self.indent -= 1
        self.w("}")

    def _pointwise(self, out: _Operand, ins: dict[str, _Operand], expr: str, parallel=True) -> None:
        letters = _order(out, list(out.strides))

        def body():
            for conn, o in ins.items():
                self.w(f"const {self.T} v_{conn} = {o.name}[{o.offset()}];")
            self.w(f"{out.name}[{out.offset()}] = {expr};")
        self.loops(letters, body, parallel)

    def _emit_bias(self, op, ops, attrs):
        out = ops.pop("y")
        self._pointwise(out, ops, "v_x + v_b")

    def _emit_add(self, op, ops, attrs):
        out = ops.pop("y")
        self._pointwise(out, ops, " + ".join(f"v_{c}" for c in sorted(ops)))

    def _emit_mask(self, op, ops, attrs):
        out = ops.pop("y")
        expr = "v_x + v_m"
        if attrs.get("causal"):
            letters = [c for c in out.access if not c.isdigit()]
            j, k = letters[-2], letters[-1]
            expr = f"(i_{k} > i_{j}) ? ({self.T})(-INFINITY) : ({expr})"
        self._pointwise(out, ops, expr)

    def _emit_dropout(self, op, ops, attrs):
        out = ops.pop("y")
        p = attrs["p"]
        threshold = min(int(round(p * 2.0 ** 32)), 2 ** 32 - 1)
        scale = 1.0 / (1.0 - p)
        index = "0"
        for c in attrs["rng_dims"]:
            index = f"({index}) * {_size(c)} + i_{c}" if index != "0" else f"i_{c}"
        self.w("if (training) {")
        self.indent += 1
        self._pointwise(out, ops, f"ss::keep(seed, {attrs['stream']}u, (uint64_t)({index}), {threshold}u) "
                                  f"? v_x * ({self.T}){scale!r} : ({self.T})0")
        self.indent -= 1
        self.w("} else {")
        self.indent += 1
        self._pointwise(out, ops, "v_x")
        self.indent -= 1
        self.w("}")

    def _emit_activation(self, op, ops, attrs):
        out = ops.pop("y")
        self._pointwise(out, ops, f"ss::{attrs['function']}(v_x)")

    def _emit_activation_grad(self, op, ops, attrs):
        out = ops.pop("y")
        self._pointwise(out, ops, f"v_dy * ss::{attrs['function']}_grad(v_x)")

    # row kernels (reduction over one axis, parallel over the others) ----------------------------
    def _rows(self, main: _Operand, axis: str, body) -> None:
        letters = [c for c in _order(main, list(main.strides)) if c != axis]
        self.loops(letters, body, parallel=True) if letters else body()

    def _axis_loop(self, axis: str, stmts: list[str]) -> None:
        self.w(f"for (int64_t i_{axis} = 0; i_{axis} < {_size(axis)}; ++i_{axis}) {{")
        for s in stmts:
            self.w("  " + s)
        self.w("}")

    def _emit_softmax(self, op, ops, attrs):
        x, y, ax = ops["x"], ops["y"], attrs["axis"]

        def body():
            self.w(f"{self.T} mx = ({self.T})(-INFINITY);")
            self._axis_loop(ax, [f"mx = std::max(mx, x_[{x.offset()}]);".replace("x_", x.name)])
            self.w(f"if (mx == ({self.T})(-INFINITY)) {{  // every key masked: probabilities are 0")
            self._axis_loop(ax, [f"{y.name}[{y.offset()}] = 0;"])
            self.w("} else {")
            self.w("  double sum = 0;")
            self._axis_loop(ax, [f"const {self.T} e = std::exp({x.name}[{x.offset()}] - mx);",
                                 f"{y.name}[{y.offset()}] = e; sum += e;"])
            self.w(f"  const {self.T} inv = ({self.T})(1.0 / sum);")
            self._axis_loop(ax, [f"{y.name}[{y.offset()}] *= inv;"])
            self.w("}")
        self._rows(x, ax, body)

    def _emit_softmax_grad(self, op, ops, attrs):
        dy, yv, dx, ax = ops["dy"], ops["probs"], ops["y"], attrs["axis"]

        def body():
            self.w("double dot = 0;")
            self._axis_loop(ax, [f"dot += (double){dy.name}[{dy.offset()}] * {yv.name}[{yv.offset()}];"])
            self._axis_loop(ax, [f"{dx.name}[{dx.offset()}] = {yv.name}[{yv.offset()}] * "
                                 f"({dy.name}[{dy.offset()}] - ({self.T})dot);"])
        self._rows(dy, ax, body)

    def _emit_layer_norm(self, op, ops, attrs):
        x, g, b, y, mean, rstd = (ops[k] for k in ("x", "gamma", "beta", "y", "mean", "rstd"))
        ax = attrs["axis"]
        n = _size(ax)

        def body():
            self.w("double s = 0;")
            self._axis_loop(ax, [f"s += {x.name}[{x.offset()}];"])
            self.w(f"const double mu = s / {n};")
            self.w("double v = 0;")
            self._axis_loop(ax, [f"const double d = {x.name}[{x.offset()}] - mu; v += d * d;"])
            self.w(f"const double r = 1.0 / std::sqrt(v / {n} + {attrs['eps']!r});")
            self.w(f"{mean.name}[{mean.offset()}] = ({self.T})mu; {rstd.name}[{rstd.offset()}] = ({self.T})r;")
            self._axis_loop(ax, [f"{y.name}[{y.offset()}] = ({self.T})(({x.name}[{x.offset()}] - mu) * r) * "
                                 f"{g.name}[{g.offset()}] + {b.name}[{b.offset()}];"])
        self._rows(x, ax, body)

    def _emit_layer_norm_grad(self, op, ops, attrs):
        dy, x, mean, rstd, g, ax = ops["dy"], ops["x"], ops["mean"], ops["rstd"], ops["gamma"], attrs["axis"]
        dx = ops["y"]
        n = _size(ax)

        def body():
            self.w(f"const double mu = {mean.name}[{mean.offset()}], r = {rstd.name}[{rstd.offset()}];")
            self.w("double s1 = 0, s2 = 0;")
            self._axis_loop(ax, [f"const double gd = (double){g.name}[{g.offset()}] * {dy.name}[{dy.offset()}];",
                                 f"s1 += gd; s2 += gd * (({x.name}[{x.offset()}] - mu) * r);"])
            self.w(f"s1 /= {n}; s2 /= {n};")
            self._axis_loop(ax, [f"const double gd = (double){g.name}[{g.offset()}] * {dy.name}[{dy.offset()}];",
                                 f"{dx.name}[{dx.offset()}] = ({self.T})(r * (gd - s1 - "
                                 f"(({x.name}[{x.offset()}] - mu) * r) * s2));"])
        self._rows(x, ax, body)

    # column reductions (sum over every letter not in the outputs) --------------------------------
    def _column_reduce(self, main: _Operand, outs: list[_Operand], row_prelude: list[str],
                       terms: list[str]) -> None:
        """out_q[o] = sum over the reduced letters of terms[q], deterministic per thread count."""
        keep = list(outs[0].strides)
        red = [c for c in _order(main, list(main.strides)) if c not in keep]
        keep = [c for c in _order(main, list(main.strides)) if c in keep]
        nkeep = " * ".join(_size(c) for c in keep)
        nred = " * ".join(_size(c) for c in red) or "1"
        nq = len(outs)
        self.w(f"const int64_t nkeep = {nkeep}, nred = {nred};")
        self.w("const int nth = omp_get_max_threads();")
        self.w(f"std::vector<double> part((size_t)nth * {nq} * nkeep, 0.0);")
        self.w("#pragma omp parallel")
        self.w("{")
        self.indent += 1
        self.w("const int t = omp_get_thread_num(), nt = omp_get_num_threads();")
        self.w(f"double* acc = part.data() + (size_t)t * {nq} * nkeep;")
        self.w("const int64_t lo = nred * t / nt, hi = nred * (t + 1) / nt;")
        self.w("for (int64_t r_ = lo; r_ < hi; ++r_) {")
        self.indent += 1
        self.w("int64_t rem_ = r_;")
        for c in reversed(red):
            self.w(f"const int64_t i_{c} = rem_ % {_size(c)}; rem_ /= {_size(c)};")
        for s in row_prelude:
            self.w(s)
        self.w("int64_t o_ = 0;")

        def body():
            for q, term in enumerate(terms):
                self.w(f"acc[{q} * nkeep + o_] += {term};")
            self.w("++o_;")
        self.loops(keep, body, parallel=False)
        self.indent -= 1
        self.w("}")
        self.indent -= 1
        self.w("}")
        self.w("int64_t o_ = 0;")

        def store():
            for q, out in enumerate(outs):
                self.w(f"{{ double s_ = 0; for (int t = 0; t < nth; ++t) s_ += part[((size_t)t * {nq} + {q}) * nkeep + o_];")
                self.w(f"  {out.name}[{out.offset()}] = ({self.T})s_; }}")
            self.w("++o_;")
        self.loops(keep, store, parallel=False)

    def _emit_bias_grad(self, op, ops, attrs):
        dy, db = ops["dy"], ops["y"]
        self._column_reduce(dy, [db], [], [f"(double){dy.name}[{dy.offset()}]"])

    def _emit_layer_norm_param_grad(self, op, ops, attrs):
        dy, x, mean, rstd = ops["dy"], ops["x"], ops["mean"], ops["rstd"]
        prelude = [f"const double mu = {mean.name}[{mean.offset()}], r = {rstd.name}[{rstd.offset()}];"]
        self._column_reduce(dy, [ops["dgamma"], ops["dbeta"]], prelude,
                            [f"(double){dy.name}[{dy.offset()}] * (({x.name}[{x.offset()}] - mu) * r)",
                             f"(double){dy.name}[{dy.offset()}]"])


def _numel(dims: str) -> str:
    return " * ".join(_size(d) for d in dims)


def _timer_abi(ops: list[Operator]) -> list[str]:
    return [
        f"static double g_op_seconds[{len(ops)}];",
        'extern "C" const char* substation_op_names() {',
        f'  return "{",".join(op.label for op in ops)}";',
        "}",
        'extern "C" void substation_op_seconds(double* out, int32_t reset) {',
        f"  for (int i = 0; i < {len(ops)}; ++i) {{ out[i] = g_op_seconds[i]; if (reset) g_op_seconds[i] = 0; }}",
        "}",
        "",
    ]


def generate_cpu(graph: LayerGraph, instrument: bool = False) -> str:
    """C++ source of ``graph`` for the CPU (see the module docstring for the exported ABI).

    With ``instrument``, every operator is timed (``omp_get_wtime``) and the library also exports
    ``const char* substation_op_names()`` (comma-separated, in execution order) and
    ``void substation_op_seconds(double* out, int32_t reset)`` (seconds accumulated per operator
    since the last reset).

    Raises:
        LayoutError: a contraction's operand layouts need an explicit transpose.
    """
    cfg = graph.config
    sizes = cfg.sizes()
    em = _Emitter(graph)
    ops = graph.operators()
    for n, op in enumerate(ops):
        em.emit(op, n if instrument else None)
    args = [t for t in graph.tensors.values() if t.role != "temp"]
    temps = [t for t in graph.tensors.values() if t.role == "temp"]
    T = em.T
    src = [
        f"// Generated by Substation: {graph.sdfg.name} ({graph.phase}), config {cfg.name}.",
        '#include "substation_cpu.h"',
        "#include <mkl_cblas.h>",
        "",
        "namespace {",
        *(f"constexpr int64_t {d} = {sizes[d]};" for d in STATIC_DIMENSIONS),
        f"typedef {T} T;",
        "}",
        "",
        'extern "C" const char* substation_signature() {',
        f'  return "{",".join(t.name for t in args)}";',
        "}",
        "",
        *(_timer_abi(ops) if instrument else []),
        'extern "C" int64_t substation_workspace_bytes(const int64_t* sizes) {',
        "  const int64_t B = sizes[0], J = sizes[1], K = sizes[2];",
        "  (void)B; (void)J; (void)K;",
        "  int64_t total = 0;",
        *(f"  total += ss::align_up((int64_t)sizeof(T) * {_numel(t.dims)});" for t in temps),
        "  return total;",
        "}",
        "",
        'extern "C" int substation_run(void* const* args, const int64_t* sizes, void* workspace,',
        "                              uint64_t seed, int32_t training) {",
        "  const int64_t B = sizes[0], J = sizes[1], K = sizes[2];",
        "  (void)seed; (void)training;",
        *(f"  T* __restrict__ {t.name} = static_cast<T*>(args[{i}]);" for i, t in enumerate(args)),
        "  char* ws_ = static_cast<char*>(workspace);",
        "  (void)ws_;",
    ]
    for t in temps:
        src.append(f"  T* __restrict__ {t.name} = reinterpret_cast<T*>(ws_); "
                   f"ws_ += ss::align_up((int64_t)sizeof(T) * {_numel(t.dims)});")
    src += em.lines
    src += ["  return 0;", "}", ""]
    return "\n".join(src)
