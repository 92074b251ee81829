"""C++ code generation for the CPU: one translation unit per :class:`~substation.ir.graph.LayerGraph`.

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

from ...ir.graph import STATIC_DIMENSIONS, LayerGraph, Operator
from ...ir.operands import Operand, c_expr, dim_size, linear_index, plan_contraction, resolve_operand
from ...ops import op_kind
from ..common import member_records, row_kernel_space, stat_tensors, workspace_slots

__all__ = ["generate_cpu", "tensor_dtypes"]

_CTYPES = {"float32": "float", "float64": "double"}


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

    def operands(self, op: Operator) -> dict[str, Operand]:
        return {conn: resolve_operand(self.graph, t, a) for conn, (t, a) in self.graph.operands(op).items()}

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
            self.w(f"for (int64_t i_{c} = 0; i_{c} < {dim_size(c)}; ++i_{c}) {{")
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
        if op.kind == "contraction":
            self._emit_contraction(op, self.operands(op), op.attrs)
        else:
            _RowKernel(self, member_records(self.graph, op), op.attrs.get("vector")).emit()
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
                f"{'CblasTrans' if plan.trans_b else 'CblasNoTrans'}, {c_expr(plan.m)}, {c_expr(plan.n)}, "
                f"{c_expr(plan.k)}, {alpha!r}, {plan.a.name} + {{oa}}, {c_expr(plan.lda)}, {plan.b.name} + {{ob}}, "
                f"{c_expr(plan.ldb)}, 0.0, {plan.c.name} + {{oc}}, {c_expr(plan.ldc)});")
        base = {x: (c_expr(o.base) if o.base != 0 else "0") for x, o in (("a", plan.a), ("b", plan.b), ("c", out))}
        if not plan.batch:
            self.w(call.format(oa=base["a"], ob=base["b"], oc=base["c"]))
            return

        def off(which, idx):
            terms = [base[which]] + [f"i_{x} * ({c_expr(s[idx])})" for x, *s in plan.batch if s[idx] != 0]
            return " + ".join(t for t in terms if t != "0") or "0"
        nbatch = " * ".join(dim_size(x) for x, *_ in plan.batch)
        inner = call.format(oa=off("a", 0), ob=off("b", 1), oc=off("c", 2))
        letters = [x for x, *_ in plan.batch]
        # Many small GEMMs: one per thread (BLAS runs single-threaded inside the parallel region).
        self.w(f"if ({nbatch} >= omp_get_max_threads()) {{")
        self.indent += 1
        if self.T == "float":  # AVX-512: our own per-thread GEMM (ss::gemm_small) beats a BLAS call at this size
            self.w("#if defined(__AVX512F__)")
            self.w("#pragma omp parallel")
            self.w("{")
            self.indent += 1
            self.w(f"std::vector<float> pack_(ss::gemm_small_pack_floats({c_expr(plan.n)}, {c_expr(plan.k)}));")
            self.w(f"#pragma omp for collapse({len(letters)}) schedule(static)")
            small = (f"ss::gemm_small({str(plan.trans_a).lower()}, {str(plan.trans_b).lower()}, {c_expr(plan.m)}, "
                     f"{c_expr(plan.n)}, {c_expr(plan.k)}, {alpha!r}f, {plan.a.name} + {off('a', 0)}, {c_expr(plan.lda)}, "
                     f"{plan.b.name} + {off('b', 1)}, {c_expr(plan.ldb)}, {plan.c.name} + {off('c', 2)}, "
                     f"{c_expr(plan.ldc)}, pack_.data());")
            self.loops(letters, lambda: self.w(small), parallel=False)
            self.indent -= 1
            self.w("}")
            self.w("#else")
        self.loops(letters, lambda: self.w(inner), parallel=True, collapse_all=True)
        if self.T == "float":
            self.w("#endif")
        self.indent -= 1
        self.w("} else {")
        self.indent += 1
        self.loops(letters, lambda: self.w(inner), parallel=False)
        self.indent -= 1
        self.w("}")

#: Rows a float column reduction sums in float before adding into its double accumulator.
COLUMN_BLOCK = 32
#: Elements per dropout-mask chunk when a row's random words are drawn next to the loop that uses
#: them: 256 elements are 32 Philox blocks, one two-chain AVX-512 call, and the chunk's generation
#: overlaps the previous chunk's loads and stores (a whole row first would stall on memory after).
RANDOM_CHUNK = 256


class _RowKernel:
    """One row kernel: EW and SN members over a shared iteration space F = rows R x inner letters N.

    Per row, members run in order over the inner letters; tensors produced and consumed inside stay
    in per-thread row buffers (full-width) or scalars (per-row statistics); column reductions
    accumulate per thread and are combined in thread order after the rows (deterministic for a
    given thread count).
    """

    #: For the kinds' member emitters (:mod:`substation.ops`): the row-major index over letters.
    linear_index = staticmethod(linear_index)

    def __init__(self, em: "_Emitter", members: list[dict], vector: str | None = None):
        self.em, self.graph, self.T = em, em.graph, em.T
        self.members = members
        self.full, self.N, self.R = row_kernel_space(self.graph, members, vector)
        self.pending: list | None = None  # loops collected inside a row (None: write at once)
        self.row_items: list | None = None  # a row's lines and merged loops, rendered at its end
        self.prelude: list[str] = []
        self.random: dict[str, tuple] = {}  # row-random mask name -> (declaration line, chunked form)
        self.column = [m for m in members if op_kind(m["kind"]).reduction == "column"]
        # Which produced tensors later members read (or softmax needs as scratch): buffered.
        self.buffers, self.scalars = [], []
        seen: dict[str, int] = {}
        for i, m in enumerate(members):
            for t, a in m["inputs"].values():
                if t in seen and t not in self.buffers + self.scalars:
                    (self.buffers if set(a) - set("0123456789") == self.full else self.scalars).append(t)
            for t, a in m["outputs"].values():
                seen[t] = i
                if m["kind"] == "softmax" and t not in self.buffers:
                    self.buffers.append(t)

    # helpers ------------------------------------------------------------------------------------
    def w(self, line: str = "") -> None:
        if self.row_items is None:
            self.em.w(line)
        else:
            self.row_items.append((self.em.indent, line))

    def memory(self, t: str) -> bool:
        return t in self.graph.tensors

    def read(self, t: str, a: str) -> str:
        if t in self.buffers and t in self.ready:
            return f"buf_{t}[n_]"
        if t in self.scalars and t in self.ready:
            return f"sc_{t}"
        if not self.memory(t):
            raise AssertionError(f"tensor {t} is neither in memory nor produced earlier in the kernel")
        return f"{t}[{resolve_operand(self.graph, t, a).offset()}]"

    def put(self, t: str, a: str, value: str) -> list[str]:
        res = []
        if t in self.buffers:
            res.append(f"buf_{t}[n_] = {value};")
        if t in self.scalars:
            res.append(f"sc_{t} = {value};")
        if self.memory(t):
            res.append(f"{t}[{resolve_operand(self.graph, t, a).offset()}] = {value};")
        return res

    def inner(self, stmts, reduction: str = "") -> None:
        """A loop over the inner letters N (``n_`` is the row-buffer index); ``stmts`` may be a
        callable. Inside a row, loops are collected and consecutive ones run as one loop (see
        :meth:`flush`); elsewhere the loop is written at once."""
        body = list(stmts() if callable(stmts) else stmts)
        if self.pending is None:
            self._loop([body], [reduction] if reduction else [])
        else:
            self.pending.append((body, reduction))

    def pre(self, line: str) -> None:
        """A row-level statement that does not depend on the loops collected so far (a load or a
        declaration): it is placed before them, so they can merge with the ones that follow."""
        if self.pending is None:
            self.w(line)
        else:
            self.prelude.append(line)

    def stmt(self, line: str) -> None:
        """A row-level statement that depends on the collected loops (or opens/closes a block)."""
        self.flush()
        self.w(line)

    def flush(self) -> None:
        """Write the collected preludes, then the collected loops merged into one loop: every loop of a
        row kernel runs over the same inner letters and touches element ``n_`` only, so running their
        bodies one after another per element keeps each element's order of operations."""
        for line in self.prelude:
            self.w(line)
        self.prelude = []
        if self.pending:
            loop = ([b for b, _ in self.pending], [r for _, r in self.pending if r])
            if self.row_items is None:
                self._loop(*loop)
            else:
                self.row_items.append((self.em.indent, loop))
        self.pending = []

    def _render_row(self) -> None:
        """Write the row's lines and loops. The stores of a loop to a row buffer that nothing after
        the loop reads become register assignments (reads earlier in the loop still load the buffer,
        later ones take the register): those stores would only cost bandwidth. A dropout mask that one
        loop alone uses is drawn inside it, :data:`RANDOM_CHUNK` elements at a time."""
        items, self.row_items = self.row_items, None
        text = [x if isinstance(x, str) else "\n".join(ln for b in x[0] for ln in b) for _, x in items]
        chunked: dict[int, list[str]] = {}  # loop item -> masks drawn chunk by chunk inside it
        for rw in self.random:
            users = [j for j, t in enumerate(text) if f"{rw}[" in t]
            if len(users) == 1 and not isinstance(items[users[0]][1], str):
                chunked.setdefault(users[0], []).append(rw)
        drawn_inside = {self.random[rw][0] for rws in chunked.values() for rw in rws}
        for i, (indent, item) in enumerate(items):
            self.em.indent = indent
            if isinstance(item, str):
                if item not in drawn_inside:
                    self.w(item)
                continue
            bodies, reductions = item
            later = "\n".join(text[i + 1:])
            local = [t for t in self.buffers if f"buf_{t}[" not in later
                     and any(ln.startswith(f"buf_{t}[n_] = ") for b in bodies for ln in b)]
            stored: set[str] = set()

            def rewrite(line: str) -> str:
                for t in local:
                    ref, head = f"buf_{t}[n_]", f"buf_{t}[n_] = "
                    if line.startswith(head):
                        rhs = line[len(head):]
                        line = f"reg_{t} = " + (rhs.replace(ref, f"reg_{t}") if t in stored else rhs)
                        stored.add(t)
                    elif t in stored:
                        line = line.replace(ref, f"reg_{t}")
                return line
            bodies = [[rewrite(ln) for ln in b] for b in bodies]
            head = [f"{self.T} " + ", ".join(f"reg_{t}" for t in local) + ";"] if local else []
            rws = chunked.get(i)
            if not rws:
                self._loop(bodies, reductions, head)
                continue
            # Masks used by this loop alone: drawn per chunk inside it, indexed from the chunk start.
            for rw in rws:
                bodies = [[ln.replace(f"{rw}[n_]", f"{rw}[n_ - c0_]") for ln in b] for b in bodies]
            self.w(f"for (int64_t c0_ = 0; c0_ < nn_; c0_ += {RANDOM_CHUNK}) {{")
            self.em.indent += 1
            self.w(f"const int64_t c1_ = std::min<int64_t>(c0_ + {RANDOM_CHUNK}, nn_);")
            for rw in rws:
                self.w(self.random[rw][1])
            self._loop(bodies, reductions, head, ("c0_", "c1_"))
            self.em.indent -= 1
            self.w("}")

    def _loop(self, bodies: list[list[str]], reductions: list[str], head: list[str] = (),
              span: tuple[str, str] | None = None) -> None:
        """Write one loop over the inner letters N (``span``: bounds of the single letter instead)."""
        for k, c in enumerate(self.N):
            if k == len(self.N) - 1:
                self.w("#pragma omp simd" + "".join(f" reduction({r})" for r in reductions))
            lo, hi = span or ("0", dim_size(c))
            self.w(f"for (int64_t i_{c} = {lo}; i_{c} < {hi}; ++i_{c}) {{")
            self.em.indent += 1
        self.w(f"const int64_t n_ = {linear_index(self.N, lambda c: f'i_{c}')}; (void)n_;")
        for line in head:
            self.w(line)
        for body in bodies:
            if len(bodies) > 1:
                self.w("{")
            for line in body:
                self.w(("  " if len(bodies) > 1 else "") + line)
            if len(bodies) > 1:
                self.w("}")
        for _ in self.N:
            self.em.indent -= 1
            self.w("}")

    # the kernel ---------------------------------------------------------------------------------
    def emit(self) -> None:
        T = self.T
        nn = " * ".join(dim_size(c) for c in self.N)
        self.w(f"const int64_t nrows_ = {' * '.join(dim_size(c) for c in self.R) or '1'}, nn_ = {nn};")
        ncol = sum(len(m["outputs"]) for m in self.column)
        if ncol:
            self.w("const int nth_ = omp_get_max_threads();")
            self.w(f"std::vector<double> part_((size_t)nth_ * {ncol} * nn_, 0.0);")
        self.w("#pragma omp parallel")
        self.w("{")
        self.em.indent += 1
        self.w("const int t_ = omp_get_thread_num(), nt_ = omp_get_num_threads(); (void)t_;")
        for k, m in enumerate(self.members):
            if self.row_random(m):  # scratch of member k's random words (ss::random_row)
                self.w(f"std::vector<uint32_t> rnd{k}_(ss::random_row_words(nn_));")
        if self.buffers:
            self.w(f"std::vector<{T}> bufs_((size_t){len(self.buffers)} * nn_);")
            for k, t in enumerate(self.buffers):
                self.w(f"{T}* __restrict__ buf_{t} = bufs_.data() + (size_t){k} * nn_;")
        q = 0
        self.acc = {}
        # float layers sum columns over blocks of rows in float (small, cache-resident), then in double.
        blocked = ncol and T == "float"
        if blocked:
            self.w(f"std::vector<float> blk_((size_t){ncol} * nn_, 0.0f);")
        for m in self.column:
            for conn, (t, _) in sorted(m["outputs"].items()):
                self.w(f"double* __restrict__ acc_{t} = part_.data() + ((size_t)t_ * {ncol} + {q}) * nn_;")
                if blocked:
                    self.w(f"float* __restrict__ blk_{t} = blk_.data() + (size_t){q} * nn_;")
                self.acc[t] = f"blk_{t}" if blocked else f"acc_{t}"
                q += 1
        self.w("const int64_t lo_ = nrows_ * t_ / nt_, hi_ = nrows_ * (t_ + 1) / nt_;")
        self.w("for (int64_t row_ = lo_; row_ < hi_; ++row_) {")
        self.em.indent += 1
        if self.R:
            self.w("int64_t rem_ = row_;")
            for c in reversed(self.R):
                self.w(f"const int64_t i_{c} = rem_ % {dim_size(c)}; rem_ /= {dim_size(c)};")
        for t in self.scalars:
            self.w(f"double sc_{t} = 0;")
        self.ready: set[str] = set()
        self.pending, self.row_items = [], []
        for k, m in enumerate(self.members):
            self.k = k  # row-level names of member k end in f"{k}_"
            self.pre(f"// {m['name']} ({m['kind']})")
            op_kind(m["kind"]).cpu(self, m, m["attrs"])
            self.ready.update(t for t, _ in m["outputs"].values())
        self.flush()
        self.pending = None
        self._render_row()
        if blocked:
            self.w(f"if (((row_ - lo_) & {COLUMN_BLOCK - 1}) == {COLUMN_BLOCK - 1} || row_ == hi_ - 1) {{")
            self.inner([f"acc_{t}[n_] += blk_{t}[n_]; blk_{t}[n_] = 0.0f;" for t in self.acc])
            self.w("}")
        self.em.indent -= 1
        self.w("}")
        self.em.indent -= 1
        self.w("}")
        q = 0
        for m in self.column:
            for conn, (t, a) in sorted(m["outputs"].items()):
                off = resolve_operand(self.graph, t, a).offset()
                qq = q
                self.inner(lambda: [f"double s_ = 0; for (int t2_ = 0; t2_ < nth_; ++t2_) "
                                    f"s_ += part_[((size_t)t2_ * {ncol} + {qq}) * nn_ + n_];",
                                    f"{t}[{off}] = ({T})s_;"])
                q += 1

    def ew(self, m, expr) -> None:
        (t, a), = m["outputs"].values()
        loads = [f"const {self.T} v_{c} = {self.read(*ta)};" for c, ta in sorted(m["inputs"].items())]
        self.inner(loads + [f"const {self.T} v_ = {expr};"] + self.put(t, a, "v_"))

    def row_random(self, m) -> bool:
        """Whether dropout member ``m`` draws its random words per row (its random index runs
        contiguously along the single inner letter)."""
        return m["kind"] == "dropout" and len(self.N) == 1 and m["attrs"]["rng_dims"][-1] == self.N[0]

    def names(self, *bases: str) -> list[str]:
        """Row-level variable names private to the current member."""
        return [f"{b}{self.k}_" for b in bases]

    def row_start(self, t: str, a: str, expr: str) -> str | None:
        """The address of this row's first element of operand ``expr`` (tensor ``t``, access ``a``) when
        the row is contiguous (a row buffer, or unit stride along the single inner letter), else None."""
        if len(self.N) != 1:
            return None
        if expr.startswith("buf_"):
            return f"&{expr.replace('[n_]', '[0]')}"
        if not self.memory(t):
            return None
        op = resolve_operand(self.graph, t, a)
        return f"&{t}[{op.offset(self.R)}]" if op.strides.get(self.N[0]) == 1 else None

    def split_statistics(self, mu: str, r: str, rstd_known: bool = True):
        """Declare ``{mu}h_``/``{mu}l_``, the double mean split into a head and a tail of the element type
        (and, when ``rstd_known``, ``{r}t_``: the double rstd in that type) and return
        ``xhat(x, scaled=True)``, the expression ``((x - head) - tail) [* {r}t_]``. ``x - head`` is exact
        near the mean (Sterbenz), so float rows with a large mean and a small spread keep their
        accuracy while every per-element operation stays in the element type (full SIMD width)."""
        T = self.T
        self.pre(f"const {T} {mu}h_ = ({T}){mu}, {mu}l_ = ({T})({mu} - (double){mu}h_);")
        if rstd_known:
            self.pre(f"const {T} {r}t_ = ({T}){r};")

        def xhat(x: str, scaled: bool = True) -> str:
            d = f"(({x} - {mu}h_) - {mu}l_)"
            return f"{d} * {r}t_" if scaled else d
        return xhat

def _numel(dims: str) -> str:
    return " * ".join(dim_size(d) for d in dims)


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


def tensor_dtypes(graph: LayerGraph) -> dict[str, str]:
    """Dtype name of every tensor of ``graph`` in a CPU build: the config's dtype, except normalization
    statistics (:func:`stat_tensors`), kept in float64: backward recomputes (x - mean) / std from them,
    and a float32 mean of a row with a large mean and a small spread would lose most of its digits."""
    stats = stat_tensors(graph)
    return {n: ("float64" if n in stats else graph.config.dtype) for n in graph.tensors}


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
    dtypes = tensor_dtypes(graph)
    slots = workspace_slots(graph, dtypes)
    T = em.T
    ctype = {n: _CTYPES[d] for n, d in dtypes.items()}
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
        *(f"  total += ss::align_up((int64_t)sizeof({ctype[slot[0]]}) * {_numel(graph.tensors[slot[0]].dims)});"
          for slot in slots),
        "  return total;",
        "}",
        "",
        'extern "C" int substation_run(void* const* args, const int64_t* sizes, void* workspace,',
        "                              uint64_t seed, int32_t training) {",
        "  const int64_t B = sizes[0], J = sizes[1], K = sizes[2];",
        "  (void)seed; (void)training;",
        *(f"  {ctype[t.name]}* __restrict__ {t.name} = static_cast<{ctype[t.name]}*>(args[{i}]);"
          for i, t in enumerate(args)),
        "  char* ws_ = static_cast<char*>(workspace);",
        "  (void)ws_;",
    ]
    for slot in slots:
        # Temporaries sharing a slot alias one buffer at different times: no __restrict__ for them.
        qualifier = " __restrict__" if len(slot) == 1 else ""
        for t in slot:
            src.append(f"  {ctype[t]}*{qualifier} {t} = reinterpret_cast<{ctype[t]}*>(ws_);")
        src.append(f"  ws_ += ss::align_up((int64_t)sizeof({ctype[slot[0]]}) * {_numel(graph.tensors[slot[0]].dims)});")
    src += em.lines
    src += ["  return 0;", "}", ""]
    return "\n".join(src)
