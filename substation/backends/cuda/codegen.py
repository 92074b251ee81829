"""CUDA code generation: one ``.cu`` translation unit per :class:`~substation.ir.graph.LayerGraph`.

The same graphs as the CPU target (fused or not, any layout the graph carries) become:

* **contractions** (TC): one cuBLAS call each (:mod:`substation.backends.cuda.contraction`:
  ``cublasGemmEx``, ``cublasGemmStridedBatchedEx`` where the batch letters' strides merge, else one
  pointer-array ``cublasGemmBatchedEx``) with float32 accumulation (``CUBLAS_COMPUTE_32F``) for
  float32, float16 and bfloat16 (``CUBLAS_COMPUTE_64F`` for float64).
* **row kernels** (fused EW/SN groups and single EW/SN operators): one CUDA kernel over rows R x
  inner letters N, the iteration space :mod:`substation.passes.fusion` assigns. A row is handled by
  lanes of a warp (rows of at most 64 vectors: the smallest power of two of lanes holding the row's
  vectors, so short rows share a warp; 128-thread blocks) or one block (long rows); every thread
  owns the same inner elements in every loop of the kernel, so intermediate tensors live in
  registers inside a loop and in shared-memory row buffers (lane-interleaved, free of bank
  conflicts) across loops without any barrier, and only row reductions (softmax, layer norm, RMSNorm
  and their gradients: shuffles among the row's lanes plus a shared-memory step across warps)
  synchronize.
  Along the contiguous inner letter, 16-byte vector loads and stores are used when the launcher
  finds every operand contiguous and aligned (otherwise a scalar instantiation runs). Math is in
  float32 for float32/float16/bfloat16 tensors (loads convert, stores round), float64 for float64.
  Dropout is the CPU build's counter-based Philox: same (seed, stream, element index), same mask.
  Column reductions (bias and norm parameter gradients) write per-row-slot partial sums to
  the workspace (a fixed number of slots, independent of the GPU) and a second kernel adds them in
  a fixed order: results are deterministic.

Normalization statistics (``*_mean``, ``*_rstd``) are stored in the compute type (float32 for float16
and bfloat16 layers): see :func:`tensor_dtypes`. Every other tensor has the config's dtype.

The generated library exports the CPU ABI plus a stream::

    int64_t substation_workspace_bytes(const int64_t* sizes);          // sizes = {B, J, K}
    int     substation_run(void* const* args, const int64_t* sizes, void* workspace,
                           uint64_t seed, int32_t training, void* stream);   // cudaStream_t
    const char* substation_signature();     // argument names, comma-separated
    const char* substation_target();        // "cuda" (or "cuda-emulated", see build_cuda)
    const char* substation_last_error();    // message of the last failed call on this thread

``args`` are device pointers, one per non-temporary tensor in :attr:`LayerGraph.tensors` order; all
work is queued on ``stream`` (kernels and cuBLAS); nothing synchronizes with the host.
``workspace`` (``substation_workspace_bytes`` bytes, 256-byte aligned, used on ``stream`` only) holds the
cuBLAS workspace (32 MiB, set with ``cublasSetWorkspace`` on every call), the temporaries, the
pointer arrays of the batched GEMMs and the column partial sums.
"""
from __future__ import annotations

import dataclasses
import re

import sympy

from ...ir.graph import STATIC_DIMENSIONS, LayerGraph, access_letters
from ...ir.operands import LayoutError, c_expr, dim_size, dim_symbol, linear_index, resolve_operand
from ..common import stat_tensors
from ..rowkernel import RowEmitter, RowKernelModel, build_row_kernel
from .contraction import ContractionCalls
from .launch import RED_SLOTS, RowLaunchPlan, check_fits, row_shared_elements

__all__ = ["generate_cuda", "row_launch_plans", "tensor_dtypes", "stat_tensors", "STORAGE_TYPES", "COMPUTE_DTYPES",
           "LayoutError"]

#: Config dtype -> C++ storage type of the generated code.
STORAGE_TYPES = {"float32": "float", "float64": "double", "float16": "__half", "bfloat16": "__nv_bfloat16"}
#: Config dtype -> dtype of the arithmetic (and of normalization statistics).
COMPUTE_DTYPES = {"float32": "float32", "float64": "float64", "float16": "float32", "bfloat16": "float32"}
_CTYPE = {"float32": "float", "float64": "double"}
def tensor_dtypes(graph: LayerGraph) -> dict[str, str]:
    """Dtype name of every tensor of ``graph`` in a CUDA build: the config's dtype, except normalization
    statistics (:func:`~substation.backends.common.stat_tensors`), which have the compute dtype (float32 for
    float16/bfloat16 layers), so that backward recomputes normalized values from exact statistics."""
    dt = graph.config.dtype
    stats = stat_tensors(graph)
    return {n: (COMPUTE_DTYPES[dt] if n in stats else dt) for n in graph.tensors}


# -- row kernels -----------------------------------------------------------------------------------
#: Where a thread's vector nv_ lies in its row buffers (lane-interleaved: sscuda::buf_pos).
_BUF_POS = "const sscuda::BufPos bp_ = sscuda::buf_pos<V>(nv_, tid_, G_, nvec_);"

@dataclasses.dataclass
class _Loop:
    pre: list      # declarations before the loop (accumulators, row-level loads)
    body: list     # statements inside the loop over this thread's vectors
    shared: bool = False  # whether the body touches a row buffer (needs the buffer position bp_)


class _RowKernel(RowEmitter):
    """The CUDA rendering of a :class:`~substation.backends.rowkernel.RowKernelModel` (see the module
    docstring): every sweep is a loop over this thread's vectors of V lanes; a sweep that reduces
    ends its loop with a group reduction."""

    target = "cuda"
    NAMESPACE = "sscuda::"

    def __init__(self, gen: "_Generator", model: RowKernelModel, name: str):
        super().__init__(model, "comp_t", "comp_t")
        self.gen, self.graph, self.name = gen, gen.graph, name
        self.N, self.R = list(model.inner), list(model.rows)
        self.last = self.N[-1]
        col_names = {t for t, _ in model.column_outputs}
        # Memory operands: kernel parameters, in first-use order.
        self.params = [(t, a, t in model.stores) for t, a in model.memory.items() if t not in col_names]
        self.vector_possible = self._vector_possible()

    # static facts ---------------------------------------------------------------------------------
    def _vector_possible(self) -> bool:
        vmax = 16 // self.graph.config.itemsize
        size = dim_symbol(self.last)
        if isinstance(size, int) or size.is_number:
            if int(size) % vmax:
                return False
        elif str(size) in STATIC_DIMENSIONS and self.graph.config.sizes()[str(size)] % vmax:
            return False
        for t, a, _ in self.params:
            op = resolve_operand(self.graph, t, a)
            if self.last in op.strides and sympy.simplify(op.strides[self.last] - 1) != 0:
                return False
        return True

    def _vector_condition(self) -> str:
        """C++ condition under which the vector instantiation is valid at run time."""
        conds = [f"({dim_size(self.last)}) % VMAX == 0"]
        for t, a, _ in self.params:
            op = resolve_operand(self.graph, t, a)
            if self.last not in op.strides:
                continue
            base = "0" if op.base == 0 else c_expr(op.base)
            conds.append(f"sscuda::aligned16({t} + {base})")
            for c, s in op.strides.items():
                if c != self.last:
                    conds.append(f"({c_expr(s)}) % VMAX == 0")
        return " && ".join(dict.fromkeys(conds))

    # emission state -------------------------------------------------------------------------------
    def _reset(self, plan) -> None:
        self.plan = plan                 # None during the dry run
        self.rows: list[str] = []        # the row loop's body
        self.loop: _Loop | None = None
        self.loop_id = 0
        self.regs: set[str] = set()      # tensors with a register array in the open loop
        self.produced: dict[str, int] = {}   # tensor -> loop that produced it (in-kernel)
        self.reads: dict[str, set] = {}      # tensor -> loops that read it
        self.loaded: set[str] = set()        # cached memory tensors already in their buffer
        self.reduces = False                 # whether a sweep reduces rows (needs the `red_` slots)
        self.begin_members()

    def open_loop(self) -> _Loop:
        if self.loop is None:
            self.loop = _Loop([], [])
            self.regs = set()
        return self.loop

    def _close(self) -> None:
        if self.loop is None:
            return
        lp = self.loop
        self.rows.extend(lp.pre)
        self.rows.append("for (int64_t nv_ = tid_; nv_ < nvec_; nv_ += G_) {")
        self.rows.append("  const int64_t n0_ = nv_ * V;")
        if lp.shared:
            self.rows.append(f"  {_BUF_POS}")
        self.rows.extend("  " + s for s in self._inner_index("n0_"))
        self.rows.extend("  " + s for s in lp.body)
        self.rows.append("}")
        self.loop = None
        self.regs = set()
        self.loop_id += 1

    def _inner_index(self, var: str) -> list[str]:
        if len(self.N) == 1:
            return [f"const int64_t i_{self.N[0]} = {var};"]
        res = [f"int64_t rem_ = {var};"]
        for c in reversed(self.N):
            res.append(f"const int64_t i_{c} = rem_ % {dim_size(c)}; rem_ /= {dim_size(c)};")
        return res + ["(void)rem_;"]

    def _offset(self, t: str, a: str) -> str:
        return resolve_operand(self.graph, t, a).offset()

    def _buffered(self, t: str) -> bool:
        return self.plan is not None and t in self.plan["buffers"]

    def val(self, t: str, a: str) -> str:
        """Per-lane expression of tensor ``t`` (access ``a``) inside the open loop, loading it first."""
        lp = self.open_loop()
        self.reads.setdefault(t, set()).add(self.loop_id)
        if t in self.regs:
            return f"r_{t}[l_]"
        self.regs.add(t)
        lp.body.append(f"comp_t r_{t}[V];")
        if t in self.produced or (t in self.loaded and self._buffered(t)):
            if self.plan is not None and not self._buffered(t):
                raise AssertionError(f"{self.name}: {t} is needed in a later loop but has no buffer")
            lp.shared = True
            lp.body.append(f"SS_UNROLL for (int l_ = 0; l_ < V; ++l_) r_{t}[l_] = buf_{t}[bp_(l_)];")
            return f"r_{t}[l_]"
        if t not in self.graph.tensors:
            raise AssertionError(f"{self.name}: tensor {t} is neither in memory nor produced earlier")
        op = resolve_operand(self.graph, t, a)
        fn = "load" if self.last in op.strides else "load_bcast"
        lp.body.append(f"sscuda::{fn}<V>({t} + ({op.offset()}), r_{t});")
        if self._buffered(t):
            lp.shared = True
            lp.body.append(f"SS_UNROLL for (int l_ = 0; l_ < V; ++l_) buf_{t}[bp_(l_)] = r_{t}[l_];")
            self.loaded.add(t)
        return f"r_{t}[l_]"

    # the RowEmitter hooks ------------------------------------------------------------------------
    def _hoist(self, line: str) -> None:
        self.open_loop().pre.append(line)

    def _after(self, line: str) -> None:
        self._close()
        self.rows.append(line)

    def _load(self, sweep, conn: str, t: str, a: str) -> str:
        return self.val(t, a)

    def _store(self, sweep, t: str, a: str, expr: str) -> None:
        sweep.stmt(f"r_{t}[l_] = {expr};")

    def _end_sweep(self, sweep) -> None:
        lp = self.open_loop()
        for t, _ in sweep.outputs:
            lp.body.append(f"comp_t r_{t}[V];")
        lp.body.append("SS_UNROLL for (int l_ = 0; l_ < V; ++l_) {")
        lp.body.extend("  " + s for s in sweep.lines)
        lp.body.append("}")
        for t, a in sweep.outputs:
            self.regs.add(t)
            self.produced[t] = self.loop_id
            if t in self.graph.tensors:
                lp.body.append(f"sscuda::store<V>({t} + ({self._offset(t, a)}), r_{t});")
            if self._buffered(t):
                lp.shared = True
                lp.body.append(f"SS_UNROLL for (int l_ = 0; l_ < V; ++l_) buf_{t}[bp_(l_)] = r_{t}[l_];")
        if sweep.reductions:  # each thread holds a partial result: combine them across the row's group
            self.reduces = True
            self._close()
            for acc, op in sweep.reductions:
                self.rows.append(f"{acc} = sscuda::group_{op}<WARP>({acc}, red_, G_);")

    def _row_read(self, t: str, a: str, ctype: str) -> str:
        return f"sscuda::cvt<{ctype}>({t}[{self._offset(t, a)}])"

    def _store_row(self, t: str, a: str, value: str) -> None:
        self._after(f"if (tid_ == 0) {t}[{self._offset(t, a)}] = sscuda::to_x<{self.gen.ctype(t)}>({value});")

    def _column(self, t: str) -> str:
        self.open_loop().shared = True
        return f"acc_{t}[bp_(l_)]"

    def _index(self, letter: str) -> str:
        return f"(i_{letter} + l_)" if letter == self.last else f"i_{letter}"

    def _random_bits(self, sweep, stream: int, dims: str) -> str:
        if self.model.random_run(dims) is None:
            return f"sscuda::random_bits(seed, {stream}u, (uint64_t)({linear_index(dims, self._index)}))"
        # The lanes' random indices are consecutive: blocks of eight elements.
        rw, = self.names("rw")
        self.open_loop().body += [f"uint32_t {rw}[V];",
                                  f"if (training) sscuda::random_bits_run<V>(seed, {stream}u, "
                                  f"(uint64_t)({linear_index(dims, lambda c: f'i_{c}')}), {rw});"]
        return f"{rw}[l_]"

    # whole kernel ---------------------------------------------------------------------------------
    def _emit_rows(self, plan) -> list[str]:
        self._reset(plan)
        self.emit_members()
        self._close()
        return self.rows

    def _make_plan(self) -> dict:
        """Which tensors need a shared-memory row buffer: those produced in the kernel and read in a
        later loop, and memory tensors (full rows) read in more than one loop."""
        buffers = []
        for t, loops in self.reads.items():
            if t in self.produced:
                if any(k > self.produced[t] for k in loops):
                    buffers.append(t)
            elif len(loops) > 1 and t in self.model.loads and frozenset(access_letters(self.model.memory[t])) == self.model.full:
                buffers.append(t)
        return {"buffers": buffers}

    def nrows(self) -> str:
        return " * ".join(dim_size(c) for c in self.R) or "1"

    def nn(self) -> str:
        return " * ".join(dim_size(c) for c in self.N)

    def _prepare(self) -> None:
        """Emit the kernel body twice: a dry run finds which tensors need row buffers, the second
        run uses them."""
        if getattr(self, "_rows", None) is None:
            self._emit_rows(None)
            self.buffers = self._make_plan()["buffers"]
            self._rows = self._emit_rows({"buffers": self.buffers})

    def launch_plan(self) -> RowLaunchPlan:
        """The shared memory this kernel's launches need at the config's sizes (the larger of the
        scalar and the vector instantiation, :func:`~substation.backends.cuda.launch.row_shared_elements`)."""
        self._prepare()
        cfg = self.graph.config
        sizes = cfg.sizes()
        nn = 1
        for c in self.N:
            nn *= int(sympy.sympify(dim_symbol(c)).subs({sympy.Symbol(k): v for k, v in sizes.items()}))
        nslots = len(self.buffers) + len(self.model.column_outputs)
        csize = 8 if COMPUTE_DTYPES[cfg.dtype] == "float64" else 4
        widths = [1] + ([16 // cfg.itemsize] if self.vector_possible and nn % (16 // cfg.itemsize) == 0 else [])
        worst = max(row_shared_elements(nn, v, nslots, self.reduces) for v in widths)
        return RowLaunchPlan(self.name, tuple(m["name"] for m in self.model.members), nn, nslots, self.reduces,
                             worst * csize)

    def generate(self) -> tuple[list[str], list[str], str]:
        """(kernel definitions, launch statements for ``substation_run``, workspace bytes expression
        of the column partial sums or "0")."""
        self._prepare()
        rows, buffers = self._rows, self.buffers
        ncol = len(self.model.column_outputs)
        nslots = len(buffers) + ncol
        red = RED_SLOTS if self.reduces else 0
        k = self.name
        params = [f"{'' if w else 'const '}{self.gen.ctype(t)}* __restrict__ {t}" for t, _, w in self.params]
        if ncol:
            params.append("comp_t* __restrict__ part_")
        params += ["const int64_t B", "const int64_t J", "const int64_t K", "const uint64_t seed",
                   "const int32_t training"]
        src = [f"// {k}: rows {''.join(self.R) or '-'} x inner {''.join(self.N)}; members: "
               + ", ".join(f"{m['name']} ({m['kind']})" for m in self.model.members),
               "template <int V, bool WARP>",
               f"SS_KERNEL(sscuda::row_block_max<WARP>()) void {k}({', '.join(params)}) {{",
               "  (void)B; (void)J; (void)K; (void)seed; (void)training;",
               f"  const int64_t nrows_ = {self.nrows()}, nn_ = {self.nn()}, nvec_ = nn_ / V;",
               "  const sscuda::RowThreads rt_ = sscuda::row_threads<WARP>(nvec_, (int)SS_TID, (int)SS_BDIM);",
               "  const int G_ = rt_.lanes, tid_ = rt_.lane, grp_ = rt_.group, rpb_ = rt_.groups;",
               "  SS_SMEM(comp_t, smem_);",
               "  comp_t* red_ = smem_; (void)red_;",
               f"  comp_t* row_mem_ = smem_ + {red} + (int64_t)grp_ * sscuda::row_region({nslots} * nn_, G_); "
               "(void)row_mem_;"]
        for q, t in enumerate(buffers):
            src.append(f"  comp_t* buf_{t} = row_mem_ + (int64_t){q} * nn_;")
        for q, (t, _) in enumerate(self.model.column_outputs):
            src.append(f"  comp_t* acc_{t} = row_mem_ + (int64_t){len(buffers) + q} * nn_;")
        if ncol:
            src.append("  for (int64_t nv_ = tid_; nv_ < nvec_; nv_ += G_) {")
            src.append(f"    {_BUF_POS}")
            src.append("    for (int l_ = 0; l_ < V; ++l_) {")
            src += [f"      acc_{t}[bp_(l_)] = 0;" for t, _ in self.model.column_outputs]
            src.append("    }")
            src.append("  }")
        src.append("  for (int64_t row_ = (int64_t)SS_BID * rpb_ + grp_; row_ < nrows_; "
                   "row_ += (int64_t)SS_GDIM * rpb_) {")
        if self.R:
            src.append("    int64_t rrem_ = row_;")
            for c in reversed(self.R):
                src.append(f"    const int64_t i_{c} = rrem_ % {dim_size(c)}; rrem_ /= {dim_size(c)};")
        src += ["    " + s for s in rows]
        src.append("  }")
        if ncol:
            src.append("  const int64_t slot_ = (int64_t)SS_BID * rpb_ + grp_;")
            src.append("  for (int64_t nv_ = tid_; nv_ < nvec_; nv_ += G_) {")
            src.append(f"    {_BUF_POS}")
            src.append("    for (int l_ = 0; l_ < V; ++l_) {")
            for q, (t, _) in enumerate(self.model.column_outputs):
                src.append(f"      part_[(slot_ * {ncol} + {q}) * nn_ + nv_ * V + l_] = acc_{t}[bp_(l_)];")
            src.append("    }")
            src.append("  }")
        src += ["}", ""]
        # The second pass of the column reductions: columns x slot groups per block, each thread adds
        # a fixed subset of slots in order, then one thread per column adds the groups in order.
        for q, (t, a) in enumerate(self.model.column_outputs):
            src += [f"SS_KERNEL(sscuda::kColBlock) void {k}_sum{q}(const comp_t* __restrict__ part_, {self.gen.ctype(t)}* __restrict__ {t}, "
                    "const int64_t slots_, const int64_t B, const int64_t J, const int64_t K) {",
                    "  (void)B; (void)J; (void)K;",
                    f"  const int64_t nn_ = {self.nn()};",
                    "  SS_SMEM(double, sums_);",
                    "  const int cx_ = (int)SS_TID % sscuda::kColX, sy_ = (int)SS_TID / sscuda::kColX;",
                    "  for (int64_t c0_ = (int64_t)SS_BID * sscuda::kColX; c0_ < nn_; "
                    "c0_ += (int64_t)SS_GDIM * sscuda::kColX) {",
                    "    const int64_t n_ = c0_ + cx_;",
                    "    double s_ = 0;",
                    "    if (n_ < nn_)",
                    f"      for (int64_t q_ = sy_; q_ < slots_; q_ += sscuda::kColY) s_ += (double)part_[(q_ * {ncol} + {q}) * nn_ + n_];",
                    "    SS_SYNC();",
                    "    sums_[sy_ * sscuda::kColX + cx_] = s_;",
                    "    SS_SYNC();",
                    "    if (sy_ == 0 && n_ < nn_) {",
                    "      double tot_ = 0;",
                    "      for (int y_ = 0; y_ < sscuda::kColY; ++y_) tot_ += sums_[y_ * sscuda::kColX + cx_];",
                    *("      " + s for s in self._inner_index("n_")),
                    f"      {t}[{self._offset(t, a)}] = sscuda::to_x<{self.gen.ctype(t)}>((comp_t)tot_);",
                    "    }",
                    "  }",
                    "}", ""]
        # Launch.
        args = ", ".join([t for t, _, _ in self.params] + (["part_"] if ncol else []) + ["B", "J", "K", "seed", "training"])
        col = "true" if ncol else "false"
        vec = self._vector_condition() if self.vector_possible else "false"
        if self.vector_possible:
            pick = (f"vec_ ? (cfg_.warp ? &{k}<VMAX, true> : &{k}<VMAX, false>) "
                    f": (cfg_.warp ? &{k}<1, true> : &{k}<1, false>)")
        else:
            pick = f"cfg_.warp ? &{k}<1, true> : &{k}<1, false>"
        launch = [f"{{  // {k}",
                  f"  const int64_t nrows_ = {self.nrows()}, nn_ = {self.nn()};",
                  f"  const bool vec_ = {vec};",
                  f"  const sscuda::RowCfg cfg_ = sscuda::row_cfg(nrows_, nn_, vec_ ? VMAX : 1, {nslots}, {red}, {col}, sizeof(comp_t));",
                  f"  auto kern_ = {pick};",
                  f"  SS_CHECK(sscuda::launch(\"{k}\", kern_, cfg_.grid, cfg_.block, cfg_.smem, stream_, {args}));"]
        for q, (t, _) in enumerate(self.model.column_outputs):
            launch.append(f"  SS_CHECK(sscuda::launch(\"{k}_sum{q}\", &{k}_sum{q}, "
                          f"std::min<int64_t>((nn_ + sscuda::kColX - 1) / sscuda::kColX, 65535), "
                          f"sscuda::kColBlock, sizeof(double) * sscuda::kColBlock, "
                          f"stream_, part_, {t}, cfg_.partial_slots, B, J, K));")
        launch.append("}")
        ws = "0"
        if ncol:
            vs = ["1"] + (["VMAX"] if self.vector_possible else [])
            terms = [f"sscuda::row_cfg({self.nrows()}, {self.nn()}, {v}, {nslots}, {red}, true, sizeof(comp_t))"
                     f".partial_slots" for v in vs]
            slots = terms[0] if len(terms) == 1 else f"std::max({terms[0]}, {terms[1]})"
            ws = f"(int64_t)sizeof(comp_t) * {ncol} * ({self.nn()}) * {slots}"
        return src, launch, ws


# -- the translation unit --------------------------------------------------------------------------
class _Generator:
    def __init__(self, graph: LayerGraph):
        self.graph = graph
        self.dtypes = tensor_dtypes(graph)

    def ctype(self, tensor: str) -> str:
        return "store_t" if self.dtypes[tensor] == self.graph.config.dtype else "comp_t"


def _kernel_name(index: int, label: str) -> str:
    return f"k{index}_" + re.sub(r"[^A-Za-z0-9_]", "_", label)


def _numel(dims: str) -> str:
    return " * ".join(dim_size(d) for d in dims)


def row_launch_plans(graph: LayerGraph) -> list[RowLaunchPlan]:
    """The shared memory of every row kernel :func:`generate_cuda` makes from ``graph``, in operator
    order, at the config's sizes (J = K = ``max_seq_len``).

    Raises:
        RowTooLongError (substation.backends.cuda.launch): as :func:`generate_cuda`.
    """
    gen = _Generator(graph)
    plans = []
    for n, op in enumerate(graph.operators()):
        if op.kind != "contraction":
            plan = _RowKernel(gen, build_row_kernel(graph, op), _kernel_name(n, op.label)).launch_plan()
            check_fits(graph.config, plan)
            plans.append(plan)
    return plans


def generate_cuda(graph: LayerGraph) -> str:
    """CUDA C++ source of ``graph`` (see the module docstring for the exported ABI).

    Tensors: every non-temporary tensor of ``graph`` is an argument, of the config's dtype
    (float32, float64, float16 or bfloat16) except normalization statistics ([B, J], compute dtype);
    H, P, I, U are compile-time constants, B, J, K runtime sizes. Compile with
    :func:`substation.build_cuda.build_cuda_library`.

    Raises:
        LayoutError: a contraction's operand layouts need an explicit transpose, or give more batch
            groups than a batched GEMM takes (:mod:`substation.backends.cuda.contraction`).
        RowTooLongError: a row kernel's rows at the config's sizes (J = K = ``max_seq_len``) need more
            shared memory than a block has on ``cuda_arch`` (the message names the kernel and the bytes;
            longer sequences than ``max_seq_len`` are checked at launch).
        ValueError: the config's dtype has no CUDA storage type.
    """
    cfg = graph.config
    if cfg.dtype not in STORAGE_TYPES:
        raise ValueError(f"dtype {cfg.dtype!r} has no CUDA implementation (one of {', '.join(STORAGE_TYPES)})")
    gen = _Generator(graph)
    gemms = ContractionCalls(graph)
    sizes = cfg.sizes()
    kernels, body, ws_parts = [], [], []
    for n, op in enumerate(graph.operators()):
        body.append(f"// {op.label} [{op.op_class}] {op.kind}: "
                    + ", ".join(f"{c}={t}[{a}]" for c, (t, a) in sorted(graph.operands(op).items())))
        if op.kind == "contraction":
            body.append(gemms.call(op))
            continue
        rk = _RowKernel(gen, build_row_kernel(graph, op), _kernel_name(n, op.label))
        check_fits(graph.config, rk.launch_plan())
        src, launch, ws = rk.generate()
        kernels += src
        body += launch
        if ws != "0":
            ws_parts.append(ws)
    args = [t for t in graph.tensors.values() if t.role != "temp"]
    temps = [t for t in graph.tensors.values() if t.role == "temp"]
    item = {"store_t": "sizeof(store_t)", "comp_t": "sizeof(comp_t)"}
    partial = "0"
    for w in ws_parts:
        partial = w if partial == "0" else f"std::max<int64_t>({partial}, {w})"
    src = [
        f"// Generated by Substation (CUDA): {graph.sdfg.name} ({graph.phase}), config {cfg.name}, "
        f"dtype {cfg.dtype}.",
        '#include "substation_cuda.cuh"',
        "",
        "namespace {",
        *(f"constexpr int64_t {d} = {sizes[d]};" for d in STATIC_DIMENSIONS),
        f"typedef {STORAGE_TYPES[cfg.dtype]} store_t;",
        f"typedef {_CTYPE[COMPUTE_DTYPES[cfg.dtype]]} comp_t;",
        "constexpr int VMAX = 16 / (int)sizeof(store_t);  // elements per 16-byte vector",
        "",
        *kernels,
        "int64_t partial_bytes(const int64_t B, const int64_t J, const int64_t K) {",
        "  (void)B; (void)J; (void)K;",
        f"  return {partial};",
        "}",
        "int64_t batch_pointer_bytes(const int64_t B, const int64_t J, const int64_t K) {",
        "  (void)B; (void)J; (void)K;",
        f"  return {gemms.pointer_bytes()};",
        "}",
        "}  // namespace",
        "",
        'extern "C" const char* substation_signature() {',
        f'  return "{",".join(t.name for t in args)}";',
        "}",
        'extern "C" const char* substation_target() { return SS_TARGET; }',
        'extern "C" const char* substation_last_error() { return sscuda::last_error(); }',
        "",
        'extern "C" int64_t substation_workspace_bytes(const int64_t* sizes) {',
        "  const int64_t B = sizes[0], J = sizes[1], K = sizes[2];",
        "  int64_t total = sscuda::align_up(sscuda::kBlasWorkspace);",
        *(f"  total += sscuda::align_up((int64_t){item[gen.ctype(t.name)]} * {_numel(t.dims)});" for t in temps),
        "  total += sscuda::align_up(batch_pointer_bytes(B, J, K));",
        "  total += sscuda::align_up(partial_bytes(B, J, K));",
        "  return total;",
        "}",
        "",
        'extern "C" int substation_run(void* const* args, const int64_t* sizes, void* workspace,',
        "                              uint64_t seed, int32_t training, void* stream) {",
        "  const int64_t B = sizes[0], J = sizes[1], K = sizes[2];",
        "  (void)seed; (void)training;",
        "  const sscuda::Stream stream_ = (sscuda::Stream)stream;",
        *(f"  {gen.ctype(t.name)}* {t.name} = static_cast<{gen.ctype(t.name)}*>(args[{i}]);"
          for i, t in enumerate(args)),
        "  char* ws_ = static_cast<char*>(workspace);",
        "  SS_CHECK(sscuda::begin(stream_, ws_));  // the cuBLAS workspace comes first",
        "  ws_ += sscuda::align_up(sscuda::kBlasWorkspace);",
    ]
    for t in temps:
        ct = gen.ctype(t.name)
        src.append(f"  {ct}* {t.name} = reinterpret_cast<{ct}*>(ws_); "
                   f"ws_ += sscuda::align_up((int64_t){item[ct]} * {_numel(t.dims)});")
    src.append("  void** batch_next_ = reinterpret_cast<void**>(ws_); (void)batch_next_;")
    src.append("  ws_ += sscuda::align_up(batch_pointer_bytes(B, J, K));")
    src.append("  comp_t* part_ = reinterpret_cast<comp_t*>(ws_); (void)part_;")
    src += ["  " + s for s in gemms.setup()]
    src += ["  " + s for s in body]
    src += ["  return sscuda::finish();", "}", ""]
    return "\n".join(src)
