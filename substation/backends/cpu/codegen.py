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

``args`` holds one pointer per non-temporary tensor in :attr:`LayerGraph.tensors` order; for a
parameter taken in parts (:func:`~substation.ir.operands.split_stack_params`: the Q, K, V weights of
a forward-only library) it points to an array of T pointers, one per part.

A forward-only library whose X or Y only row kernels touch
(:func:`~substation.backends.rowkernel.row_indexed_tensors`) also exports::

    int     substation_run_rows(void* const* args, const int64_t* sizes, void* workspace, uint64_t seed,
                                int32_t training, const int64_t* X_rows, const int64_t* Y_rows);
    const char* substation_row_indexed();                               // "X,Y", "Y", ...

where row (b, j) of X and Y is row ``X_rows[b J + j]`` / ``Y_rows[b J + j]`` of the argument (null:
b J + j; a Y index of -1: not written), so a packed batch needs no gather or scatter copy;
``substation_run`` is that call with null indices. Libraries on oneDNN's GEMMs (bfloat16, float32 with ``fp32_gemm=
"onednn"``) also export ``substation_release_packed_parameters``, forward-only ones ``substation_hold_parameters(int32_t
on)`` (:meth:`~substation.runtime.CompiledGraph.parameters_held`). :mod:`substation.backends.cpu.contraction` emits
the contractions and the fused attention kernel.
"""
from __future__ import annotations

from ...config import ITEMSIZES
from ...ir.graph import STATIC_DIMENSIONS, LayerGraph, Operator, access_letters
from ...ir.operands import Operand, c_expr, dim_size, linear_index, resolve_operand, split_stack_params
from ..common import stat_tensors, workspace_slots
from ..rowkernel import ROW_INDEXED_CANDIDATES, RowEmitter, RowKernelModel, row_indexed_tensors, row_kernel_models, row_pitch
from .contraction import emit_attention, emit_contraction
from .gemm_libraries import FP32_GEMM_LIBRARIES, check_fp32_gemm, links_onednn

__all__ = ["generate_cpu", "tensor_dtypes"]

#: Tensor dtype -> C++ storage type (bfloat16: the raw 16 bits, converted on load and store).
_CTYPES = {"float32": "float", "float64": "double", "bfloat16": "ss::bf16_t"}
#: Config dtype -> C++ type of the arithmetic (bfloat16 builds compute and accumulate in float).
_COMPUTE = {"float32": "float", "float64": "double", "bfloat16": "float"}


# -- the emitter -----------------------------------------------------------------------------------
class _Emitter:
    def __init__(self, graph: LayerGraph, fp32_gemm: str = "mkl"):
        self.graph = graph
        self.cfg = graph.config
        self.onednn_fp32 = self.cfg.dtype == "float32" and fp32_gemm == "onednn"
        self.T = _COMPUTE[self.cfg.dtype]
        self.dtypes = tensor_dtypes(graph)
        self.split = frozenset(split_stack_params(graph))  # parameters given as per-T pointer tables
        self.row_models = row_kernel_models(graph)  # built once: row_indexed_tensors and emit read them
        self.row_indexed = row_indexed_tensors(graph, self.row_models)  # read / written through X_rows / Y_rows
        self.lines: list[str] = []
        self.indent = 1

    def w(self, line: str = "") -> None:
        self.lines.append("  " * self.indent + line if line else "")

    def loaded(self, t: str, element: str) -> str:
        """``element`` (an element of tensor ``t`` in memory) as a value of the compute type."""
        return f"ss::bf16_to_float({element})" if self.dtypes[t] == "bfloat16" else element

    def stored(self, t: str, value: str) -> str:
        """``value`` (compute or statistics type) as stored into tensor ``t`` (C++ converts between
        float and double by itself)."""
        return f"ss::float_to_bf16({value})" if self.dtypes[t] == "bfloat16" else value

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
            emit_contraction(self, op, self.operands(op))
        elif op.kind == "attention":
            emit_attention(self, op, self.operands(op))
        else:
            _RowKernel(self, self.row_models[op]).emit()
        if timer is not None:
            self.w(f"g_op_seconds[{timer}] += omp_get_wtime() - t0_;")
        self.indent -= 1
        self.w("}")

#: Rows a float column reduction sums in float before adding into its double accumulator (docs/precision.md).
COLUMN_BLOCK = 8
#: Row kernels touch the pages of the row this many rows ahead (:meth:`_RowKernel._prefetch_rows_ahead`).
PREFETCH_ROWS = 2
PAGE_BYTES = 4096
#: Elements per dropout-mask chunk when a row's random words are drawn next to the loop that uses
#: them: 256 elements are 32 Philox blocks, one two-chain AVX-512 call, and the chunk's generation
#: overlaps the previous chunk's loads and stores (a whole row first would stall on memory after).
RANDOM_CHUNK = 256
_CLAUSES = {"sum": "+", "max": "max"}


class _RowKernel(RowEmitter):
    """The CPU rendering of a :class:`~substation.backends.rowkernel.RowKernelModel`: parallel over rows, per
    thread one row at a time, every sweep an ``omp simd`` loop over the inner letters N.

    Per row, sweeps without a reduction between them run as one loop; produced tensors that later
    members read stay in per-thread row buffers (or registers, see :meth:`_render_row`); column
    reductions accumulate per thread and are combined in thread order after the rows (deterministic
    for a given thread count). Statistics (:attr:`S`) are double, float in bfloat16 builds; bfloat16
    tensors are converted to float on load and rounded on store.
    """

    target = "cpu"
    NAMESPACE = "ss::"

    def __init__(self, em: "_Emitter", model: RowKernelModel):
        super().__init__(model, em.T, "float" if em.cfg.dtype == "bfloat16" else "double")
        self.em, self.graph = em, em.graph
        self.N, self.R = list(model.inner), list(model.rows)
        self.buffers = list(model.row_values)  # per-thread row buffers, extended by output_buffer
        self.pending: list | None = None  # loops collected inside a row (None: write at once)
        self.row_items: list | None = None  # a row's lines and merged loops, rendered at its end
        self.prelude: list[str] = []
        self.random: dict[str, tuple] = {}  # row-random mask -> (member, declaration, chunked declaration)
        self.ready: set[str] = set()  # tensors produced by the members so far
        # float layers sum columns over blocks of rows in float (small, cache-resident), then in double.
        self.blocked = bool(model.column_outputs) and self.T == "float"
        self.acc = {t: f"blk_{t}" if self.blocked else f"acc_{t}" for t, _ in model.column_outputs}
        # tensors whose row (b, j) is row <t>_rows[b J + j] of the argument: the kernel reads them through
        # <t>_row_, a pointer to that row (a per-thread scratch row where a stored tensor's index is -1)
        self.pitch = {t: c_expr(row_pitch(self.graph, t, a, self.R)) for t, a in model.memory.items()
                      if t in em.row_indexed}

    # writing --------------------------------------------------------------------------------------
    def w(self, line: str = "") -> None:
        if self.row_items is None:
            self.em.w(line)
        else:
            self.row_items.append((self.em.indent, line))

    def _inner(self, stmts, reductions: list[str] = ()) -> None:
        """A loop over the inner letters N (``n_`` is the row-buffer index); ``stmts`` may be a
        callable. Inside a row, loops are collected and consecutive ones run as one loop (see
        :meth:`flush`); elsewhere the loop is written at once."""
        body = list(stmts() if callable(stmts) else stmts)
        if self.pending is None:
            self._loop([body], list(reductions))
        else:
            self.pending.append((body, list(reductions)))

    def stmt(self, line: str) -> None:
        """A row-level statement after the collected loops."""
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
            loop = ([b for b, _ in self.pending], [r for _, rs in self.pending for r in rs])
            if self.row_items is None:
                self._loop(*loop)
            else:
                self.row_items.append((self.em.indent, loop))
        self.pending = []

    def _render_row(self, items: list) -> None:
        """Write the row's lines and loops. The stores of a loop to a row buffer that nothing after
        the loop reads become register assignments (reads earlier in the loop still load the buffer,
        later ones take the register): those stores would only cost bandwidth. A dropout mask that one
        loop alone uses is drawn inside it, :data:`RANDOM_CHUNK` elements at a time."""
        text = [x if isinstance(x, str) else "\n".join(ln for b in x[0] for ln in b) for _, x in items]
        chunked: dict[int, list[str]] = {}  # loop item -> masks drawn chunk by chunk inside it
        for rw in self.random:
            users = [j for j, t in enumerate(text) if f"{rw}[" in t]
            if len(users) == 1 and not isinstance(items[users[0]][1], str):
                chunked.setdefault(users[0], []).append(rw)
        drawn_inside = {self.random[rw][1] for rws in chunked.values() for rw in rws}
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
                self.w(self.random[rw][2])
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

    # the RowEmitter hooks ------------------------------------------------------------------------
    def _hoist(self, line: str) -> None:
        if self.pending is None:
            self.w(line)
        else:
            self.prelude.append(line)

    def _after(self, line: str) -> None:
        self.stmt(line)

    def _member_start(self) -> None:
        m = self.member
        self.pre(f"// {m['name']} ({m['kind']})")

    def _member_end(self) -> None:
        self.ready.update(t for t, _ in self.member["outputs"].values())

    def _element(self, t: str, a: str) -> str:
        """The element of memory tensor ``t`` (access ``a``) at the current loop indices."""
        op = resolve_operand(self.graph, t, a)
        if t in self.pitch:
            return f"{t}_row_[{op.offset(self.N)}]"
        return f"{t}[{op.offset()}]"

    def _load(self, sweep, conn: str, t: str, a: str) -> str:
        if t in self.buffers and t in self.ready:
            value = f"buf_{t}[n_]"
        elif t in self.model.memory:
            value = self.em.loaded(t, self._element(t, a))
        else:
            raise AssertionError(f"tensor {t} is neither in memory nor produced earlier in the kernel")
        return sweep.let(f"v_{conn}", value)

    def _store(self, sweep, t: str, a: str, expr: str) -> None:
        if len(sweep.outputs) > 1:
            raise AssertionError(f"{self.member['name']}: one store per sweep")
        sweep.let("v_", expr)
        if t in self.buffers:
            sweep.stmt(f"buf_{t}[n_] = v_;")
        if t in self.model.memory:
            sweep.stmt(f"{self._element(t, a)} = {self.em.stored(t, 'v_')};")

    def _end_sweep(self, sweep) -> None:
        ops: dict[str, list[str]] = {}
        for acc, op in sweep.reductions:
            ops.setdefault(_CLAUSES[op], []).append(acc)
        self._inner(sweep.lines, [f"{op}:{','.join(accs)}" for op, accs in ops.items()])
        if sweep.reductions:  # the accumulators are complete after this loop
            self.flush()

    def _row_read(self, t: str, a: str, ctype: str) -> str:
        return self.cast(self.em.loaded(t, self._element(t, a)), ctype)

    def _store_row(self, t: str, a: str, value: str) -> None:
        self.stmt(f"{self._element(t, a)} = {self.em.stored(t, value)};")

    def _column(self, t: str) -> str:
        return f"{self.acc[t]}[n_]"

    def _index(self, letter: str) -> str:
        return f"i_{letter}"

    def _random_bits(self, sweep, stream: int, dims: str) -> str:
        if self.model.random_run(dims) != "row":
            return f"ss::random_bits(seed, {stream}u, (uint64_t)({linear_index(dims, lambda c: f'i_{c}')}))"
        # The row's random index is contiguous: one Philox block per eight elements, drawn for the
        # row (or chunk by chunk, see _render_row); eval mode reads the zero scratch instead.
        rw, = self.names("rw")
        scratch = f"rnd{self.index}_.data()"
        first = linear_index(dims, lambda c: "0" if c == dims[-1] else f"i_{c}")

        def draw(offset: str, count: str) -> str:
            return (f"const ss::bits16_t* {rw} = training ? ss::random_row(seed, {stream}u, "
                    f"(uint64_t)({first}){offset}, {count}, {scratch}) : ss::keep_all_bits({scratch});")
        self.random[rw] = (self.index, draw("", "nn_"), draw(" + c0_", "c1_ - c0_"))
        self.pre(self.random[rw][1])
        return f"{rw}[n_]"

    # CPU-only API for the kinds' overrides -----------------------------------------------------------
    def output_buffer(self, conn: str) -> str:
        """The row buffer of the member's output ``conn`` (added if the kernel has none), which the
        member may use as scratch before its final values go there."""
        t, _ = self.member["outputs"][conn]
        if t not in self.buffers:
            self.buffers.append(t)
        return f"buf_{t}"

    def row_start(self, conn: str) -> str | None:
        """The address of this row's first element of input ``conn`` when the row is contiguous (a
        row buffer, or unit stride along the single inner letter), else None."""
        t, a = self.member["inputs"][conn]
        if len(self.N) != 1:
            return None
        if t in self.buffers and t in self.ready:
            return f"&buf_{t}[0]"
        if t not in self.model.memory or _CTYPES[self.em.dtypes[t]] != self.T:
            return None
        op = resolve_operand(self.graph, t, a)
        if op.strides.get(self.N[0]) != 1:
            return None
        return f"&{t}_row_[0]" if t in self.pitch else f"&{t}[{op.offset(self.R)}]"

    def _row_indices(self, row: str, prefix: str, rem: str) -> None:
        """Declare ``<prefix>_<c>``, the index along each row letter c of the row number ``row`` (``rem``:
        the remainder variable)."""
        self.w(f"int64_t {rem} = {row};")
        for c in reversed(self.R):
            self.w(f"const int64_t {prefix}_{c} = {rem} % {dim_size(c)}; {rem} /= {dim_size(c)};")

    def _prefetch_rows_ahead(self) -> None:
        """Touch every 4 KiB page of the row PREFETCH_ROWS ahead of this one in each full-row tensor
        (a single inner letter) whose rows are a page or longer: the hardware prefetchers stop at page
        boundaries, and a tensor freshly allocated every step (a saved tensor) stalled on the address
        translation of each new page (the bf16 GELU of a BERT-base step, [1024, 3072]: 2.0 -> 1.2 ms).
        Shorter rows are left to the hardware (prefetching them made the layer norms slower)."""
        if len(self.N) != 1:
            return
        (n,) = self.N
        rows = set(self.R)
        full = []
        for t, a in self.model.memory.items():
            letters = set(access_letters(a))
            if n in letters and rows <= letters and letters <= rows | {n}:
                full.append((t, resolve_operand(self.graph, t, a)))
        if not full:
            return
        self.w(f"if (row_ + {PREFETCH_ROWS} < hi_) {{")
        self.em.indent += 1
        self._row_indices(f"row_ + {PREFETCH_ROWS}", "p", "pre_")
        written = set(self.model.stores)
        size = dim_size(n)
        for t, op in full:  # points a page apart from the row's first element to its last: one in each page
            step = PAGE_BYTES // ITEMSIZES[self.em.dtypes[t]]
            column = (lambda c: f"std::min<int64_t>(q_, {size} - 1)")
            if t in self.pitch:  # the row its index names, if any
                at = f"p{t}_ * ({self.pitch[t]}) + {op.offset(self.N, index=column)}"
                self.w(f"const int64_t p{t}_ = {t}_rows ? {t}_rows[row_ + {PREFETCH_ROWS}] : row_ + {PREFETCH_ROWS};")
                guard = f"p{t}_ >= 0 && {size} >= {step}"
            else:
                at = op.offset(index=lambda c: column(c) if c == n else f"p_{c}")
                guard = f"{size} >= {step}"
            self.w(f"if ({guard}) for (int64_t q_ = 0; q_ < {size} + {step - 1}; q_ += {step}) "
                   f"__builtin_prefetch(&{t}[{at}], {int(t in written)}, 3);")
        self.em.indent -= 1
        self.w("}")

    # the kernel ---------------------------------------------------------------------------------
    def emit(self) -> None:
        """Write the kernel: the row first (its buffers and random scratch follow from it), then the
        parallel region around it and the combination of the column reductions."""
        T = self.T
        outer = self.em.indent
        self.em.indent = outer + 2  # inside the parallel region and the row loop
        self.pending, self.row_items = [], []
        self.emit_members()
        self.flush()
        items, self.pending, self.row_items = self.row_items, None, None
        self.em.indent = outer
        nn = " * ".join(dim_size(c) for c in self.N)
        self.w(f"const int64_t nrows_ = {' * '.join(dim_size(c) for c in self.R) or '1'}, nn_ = {nn};")
        columns = self.model.column_outputs
        ncol = len(columns)
        if ncol:
            self.w("const int nth_ = omp_get_max_threads();")
            self.w(f"std::vector<double> part_((size_t)nth_ * {ncol} * nn_, 0.0);")
        self.w("#pragma omp parallel if (nrows_ * nn_ >= ss::kParallelMinElements)")
        self.w("{")
        self.em.indent += 1
        self.w("const int t_ = omp_get_thread_num(), nt_ = omp_get_num_threads(); (void)t_;")
        for k, _, _ in self.random.values():  # scratch of member k's random words (ss::random_row)
            self.w(f"std::vector<uint32_t> rnd{k}_(ss::random_row_words(nn_));")
        if self.buffers:
            self.w(f"std::vector<{T}> bufs_((size_t){len(self.buffers)} * nn_);")
            for k, t in enumerate(self.buffers):
                self.w(f"{T}* __restrict__ buf_{t} = bufs_.data() + (size_t){k} * nn_;")
        for t in self.pitch:
            if t in self.model.stores:  # the row of a slot whose index is -1 (a padding slot): not kept
                self.w(f"std::vector<{_CTYPES[self.em.dtypes[t]]}> {t}_scratch_((size_t)({self.pitch[t]}));")
        if self.blocked:
            self.w(f"std::vector<float> blk_((size_t){ncol} * nn_, 0.0f);")
        for q, (t, _) in enumerate(columns):
            self.w(f"double* __restrict__ acc_{t} = part_.data() + ((size_t)t_ * {ncol} + {q}) * nn_;")
            if self.blocked:
                self.w(f"float* __restrict__ blk_{t} = blk_.data() + (size_t){q} * nn_;")
        self.w("const int64_t lo_ = nrows_ * t_ / nt_, hi_ = nrows_ * (t_ + 1) / nt_;")
        self.w("for (int64_t row_ = lo_; row_ < hi_; ++row_) {")
        self.em.indent += 1
        if self.R:
            self._row_indices("row_", "i", "rem_")
            for t, pitch in self.pitch.items():
                ctype = _CTYPES[self.em.dtypes[t]]
                self.w(f"const int64_t r{t}_ = {t}_rows ? {t}_rows[row_] : row_;")
                row = f"{t} + r{t}_ * ({pitch})"
                self.w(f"{ctype}* __restrict__ {t}_row_ = "
                       + (f"r{t}_ >= 0 ? {row} : {t}_scratch_.data();" if t in self.model.stores else f"{row};"))
            self._prefetch_rows_ahead()
        self._render_row(items)
        self.em.indent = outer + 2
        if self.blocked:
            self.w(f"if (((row_ - lo_) & {COLUMN_BLOCK - 1}) == {COLUMN_BLOCK - 1} || row_ == hi_ - 1) {{")
            self._inner([f"acc_{t}[n_] += blk_{t}[n_]; blk_{t}[n_] = 0.0f;" for t in self.acc])
            self.w("}")
        self.em.indent -= 1
        self.w("}")
        self.em.indent -= 1
        self.w("}")
        for q, (t, a) in enumerate(columns):
            off = resolve_operand(self.graph, t, a).offset()
            self._inner([f"double s_ = 0; for (int t2_ = 0; t2_ < nth_; ++t2_) "
                         f"s_ += part_[((size_t)t2_ * {ncol} + {q}) * nn_ + n_];",
                         f"{t}[{off}] = {self.em.stored(t, f'({T})s_')};"])


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
    """Dtype name of every tensor of ``graph`` in a CPU build.

    - bfloat16 builds: the dtype the mixed-precision pass gave the tensor
      (:mod:`substation.passes.precision`: autocast's, float32 residual stream, statistics and parameter
      gradients), bfloat16 for a tensor it did not name;
    - float32 and float64 builds: the config's dtype, except normalization statistics
      (:func:`stat_tensors`): float64 (backward recomputes (x - mean) / std from them, and a float32 mean
      of a row with a large mean and a small spread would lose most of its digits).
    """
    cfg = graph.config
    if cfg.dtype == "bfloat16":
        return {n: info.dtype or "bfloat16" for n, info in graph.tensors.items()}
    stats = stat_tensors(graph)
    return {n: ("float64" if n in stats else cfg.dtype) for n in graph.tensors}


def generate_cpu(graph: LayerGraph, instrument: bool = False, fp32_gemm: str = "mkl") -> str:
    """C++ source of ``graph`` for the CPU (see the module docstring for the exported ABI).

    ``fp32_gemm`` (float32 graphs): the library of the token-wise contractions, ``"mkl"``
    (MKL through ``ss::gemm``, substation_blas.h) or ``"onednn"`` (``ss::matmul<float>``; the build then links oneDNN).

    With ``instrument``, every operator is timed (``omp_get_wtime``) and the library also exports
    ``const char* substation_op_names()`` (comma-separated, in execution order) and
    ``void substation_op_seconds(double* out, int32_t reset)`` (seconds accumulated per operator
    since the last reset).

    Raises:
        LayoutError: a contraction's operand layouts need an explicit transpose.
        ValueError: another ``fp32_gemm`` (a library: the pipeline resolves ``"auto"``).
    """
    check_fp32_gemm(fp32_gemm, FP32_GEMM_LIBRARIES)
    cfg = graph.config
    sizes = cfg.sizes()
    em = _Emitter(graph, fp32_gemm)
    ops = graph.operators()
    for n, op in enumerate(ops):
        em.emit(op, n if instrument else None)
    args = [t for t in graph.tensors.values() if t.role != "temp"]
    slots = workspace_slots(graph, em.dtypes)
    T = em.T
    ctype = {n: _CTYPES[d] for n, d in em.dtypes.items()}
    onednn = links_onednn(cfg.dtype, fp32_gemm)
    src = [
        f"// Generated by Substation: {graph.sdfg.name} ({graph.phase}), config {cfg.name}.",
        '#include "substation_cpu.h"',
        *(['#include "substation_dnnl.h"'] if onednn else []),
        *(['#include "substation_attention.h"'] if any(op.kind == "attention" for op in ops) else []),
        '#include "substation_blas.h"',
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
        'extern "C" const char* substation_last_error() { return ss::last_error().c_str(); }',
        "",
        *(['extern "C" uint64_t substation_release_packed_parameters() { return ss::release_packed_parameters(); }', ""]
          if onednn else []),
        *(['extern "C" void substation_hold_parameters(int32_t on) { ss::hold_parameters(on != 0); }', ""]
          if onednn and graph.forward_only else []),
        'extern "C" int64_t substation_workspace_bytes(const int64_t* sizes) {',
        "  const int64_t B = sizes[0], J = sizes[1], K = sizes[2];",
        "  (void)B; (void)J; (void)K;",
        "  int64_t total = 0;",
        *(f"  total += ss::align_up((int64_t)sizeof({ctype[slot[0]]}) * {_numel(graph.tensors[slot[0]].dims)});"
          for slot in slots),
        "  return total;",
        "}",
        "",
        *(_row_indexed_abi(em.row_indexed) if em.row_indexed else [
            'extern "C" int substation_run(void* const* args, const int64_t* sizes, void* workspace,',
            "                              uint64_t seed, int32_t training) {"]),
        "  const int64_t B = sizes[0], J = sizes[1], K = sizes[2];",
        "  (void)seed; (void)training;",
        *(f"  {ctype[t.name]}* const* {t.name}_parts_ = static_cast<{ctype[t.name]}* const*>(args[{i}]);"
          if t.name in em.split
          else f"  {ctype[t.name]}* __restrict__ {t.name} = static_cast<{ctype[t.name]}*>(args[{i}]);"
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
    if em.row_indexed:
        src += ['extern "C" int substation_run(void* const* args, const int64_t* sizes, void* workspace,',
                "                              uint64_t seed, int32_t training) {",
                "  return substation_run_rows(args, sizes, workspace, seed, training, "
                + ", ".join("nullptr" for _ in ROW_INDEXED_CANDIDATES) + ");", "}", ""]
    return "\n".join(src)


def _row_indexed_abi(indexed: tuple[str, ...]) -> list[str]:
    """The head of ``substation_run_rows`` (the body of a forward-only library whose X or Y rows are
    indexed) and ``substation_row_indexed``."""
    rows = [f"const int64_t* __restrict__ {t}_rows" for t in ROW_INDEXED_CANDIDATES]
    return [
        'extern "C" const char* substation_row_indexed() {',
        f'  return "{",".join(indexed)}";',
        "}",
        "",
        'extern "C" int substation_run_rows(void* const* args, const int64_t* sizes, void* workspace,',
        f"                                   uint64_t seed, int32_t training, {', '.join(rows)}) {{",
        *(f"  (void){t}_rows;" for t in ROW_INDEXED_CANDIDATES if t not in indexed),
    ]
