"""Loaded libraries: :class:`CompiledGraph` (one generated library behind ctypes, callable on torch
tensors), :class:`CompiledLayer` (a layer's forward and backward libraries) and the per-process registry
the custom operators find layers in; dtype tables and the parameter list of a config."""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import itertools
import math
import os
import re
import threading
import weakref
from typing import Callable

import torch

from ..backends.cpu.codegen import tensor_dtypes as cpu_tensor_dtypes
from ..backends.cuda.codegen import tensor_dtypes as cuda_tensor_dtypes
from ..backends.rowkernel import ROW_INDEXED_CANDIDATES
from ..config import EncoderConfig
from ..ir.graph import LayerGraph, TensorInfo, parameters, size_symbol
from ..ir.operands import STACK_LETTER, split_stack_params

__all__ = ["ALL_TORCH_DTYPES", "BoundParameters", "CompiledGraph", "graph_tensor_dtypes", "CompiledLayer", "DTYPE_NAMES", "PARAMETER_NAMES", "TORCH_DTYPES",
           "keep_freed_memory", "parameter_names", "parameter_shapes", "pin_layer", "register_layer", "registered_layer",
           "release_packed_parameters"]

TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
#: Every config dtype, including target cuda's float16 (TORCH_DTYPES: the CPU's).
ALL_TORCH_DTYPES = {**TORCH_DTYPES, "float16": torch.float16}
#: torch dtype -> config dtype name.
DTYPE_NAMES = {v: k for k, v in ALL_TORCH_DTYPES.items()}


def graph_tensor_dtypes(graph: LayerGraph, target: str | None = None) -> dict[str, str]:
    """Tensor name -> dtype name of every tensor of ``graph`` as the build for ``target`` (default: the
    config's; ``cuda-emulated`` counts as ``cuda``) stores it: the back end's ``tensor_dtypes``."""
    target = target or graph.config.target
    return (cpu_tensor_dtypes if target == "cpu" else cuda_tensor_dtypes)(graph)


def parameter_names(config: EncoderConfig) -> tuple[str, ...]:
    """The layer's parameters in the order the operators take them (names of torch.nn.TransformerEncoderLayer;
    ``norm_type: rms_norm`` has no ``norm1_bias`` / ``norm2_bias``): :func:`substation.ir.graph.parameters`."""
    return tuple(parameters(config))


def parameter_shapes(config: EncoderConfig) -> dict[str, tuple[int, ...]]:
    """PyTorch's shape of each parameter (``in_proj_weight`` [3I, I], ``out_proj_weight`` [I, I],
    ``linear1_weight`` [U, I], ...): the dims of :func:`substation.ir.graph.parameters` with the stack
    letter T and the head letters H, P merged into PyTorch's dimensions."""
    sizes = config.sizes()
    out = {}
    for name, dims in parameters(config).items():
        shape = []
        for group in re.findall(r"THP|HP|.", dims):
            shape.append(math.prod([sizes[d] for d in group]))
        out[name] = tuple(shape)
    return out


#: :func:`parameter_names` of a layer-norm layer (the default ``norm_type``).
PARAMETER_NAMES = parameter_names(EncoderConfig())

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: Entries a memo of :class:`CompiledLayer` keeps (sets of parameters: the layers of the models that share
#: a build) before it starts again.
MEMO_ENTRIES = 256


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory instead of returning it to the OS (process-wide).

    The tensors a layer saves for backward are freed after every step; when glibc unmaps them, the
    next step page-faults on fresh pages (about 2,900 faults per BERT-base step here, 300 with this
    setting). Called once when the first :class:`CompiledGraph` loads, unless the environment sets
    ``SUBSTATION_MALLOC_TUNING=0``; it affects PyTorch eager in the same process alike.

    Returns:
        True if the settings were applied (glibc found and tuning not disabled).
    """
    if os.environ.get("SUBSTATION_MALLOC_TUNING", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30) and libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1))


@dataclasses.dataclass(frozen=True)
class BoundParameters:
    """Parameter arguments of one :class:`CompiledGraph`, checked once (dtype, element count,
    contiguity, parts) and turned into the addresses its library reads (:meth:`CompiledGraph.bind`), for
    a caller that passes the same parameter tensors call after call (:meth:`CompiledGraph.run_into`'s
    ``bound``). It holds addresses, not tensors: the caller keeps the tensors alive, at the same
    addresses and with the same dtypes and shapes, while it uses the binding.

    Attributes:
        graph: the library it was checked for. addresses: name -> the address passed for that argument
            (a split parameter's: that of its table of T part addresses, held in ``tables``).
    """

    graph: "CompiledGraph"
    addresses: dict
    tables: tuple


class CompiledGraph:
    """One loaded library of a :class:`LayerGraph`, callable on torch tensors.

    Raises:
        RuntimeError: the library's argument signature does not match the graph (a stale or foreign build).
    """

    _malloc_tuned = False

    def __init__(self, graph: LayerGraph, path: str):
        if not CompiledGraph._malloc_tuned:
            CompiledGraph._malloc_tuned = True
            keep_freed_memory()
        self.graph = graph
        self.path = path
        self.lib = ctypes.CDLL(path)
        self.args: list[TensorInfo] = [t for t in graph.tensors.values() if t.role != "temp"]
        self.lib.substation_signature.restype = ctypes.c_char_p
        sig = self.lib.substation_signature().decode()
        if sig != ",".join(t.name for t in self.args):
            raise RuntimeError(f"library {path} does not match the {graph.phase} graph (signature {sig!r})")
        target = getattr(self.lib, "substation_target", None)
        if target is not None:
            target.restype = ctypes.c_char_p
        #: ``cpu``, ``cuda`` (codegen_cuda) or ``cuda-emulated`` (CUDA code built to run on the CPU, for tests).
        self.target = target().decode() if target is not None else "cpu"
        #: Device type of the tensors the library reads and writes.
        self.device_type = "cuda" if self.target == "cuda" else "cpu"
        self._stream_arg = () if self.target == "cpu" else (None,)
        self._run = self.lib.substation_run
        self._run.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int64), ctypes.c_void_p,
                              ctypes.c_uint64, ctypes.c_int32] + ([ctypes.c_void_p] if self._stream_arg else [])
        self._run.restype = ctypes.c_int
        #: Arguments this library reads or writes through a row index (``run_into(..., rows=)``): X, Y, both
        #: or neither (forward-only CPU libraries; :func:`~substation.backends.rowkernel.row_indexed_tensors`).
        self.row_indexed: tuple[str, ...] = ()
        if hasattr(self.lib, "substation_run_rows"):
            self.lib.substation_row_indexed.restype = ctypes.c_char_p
            self.row_indexed = tuple(n for n in self.lib.substation_row_indexed().decode().split(",") if n)
            self._run_rows = self.lib.substation_run_rows
            self._run_rows.argtypes = self._run.argtypes + [ctypes.c_void_p] * len(ROW_INDEXED_CANDIDATES)
            self._run_rows.restype = ctypes.c_int
        self._ws = self.lib.substation_workspace_bytes
        self._ws.argtypes = [ctypes.POINTER(ctypes.c_int64)]
        self._ws.restype = ctypes.c_int64
        self.dtype = ALL_TORCH_DTYPES[graph.config.dtype]
        #: dtype of each argument tensor (normalization statistics: float64 on the CPU, the compute type in CUDA).
        dtypes = graph_tensor_dtypes(graph, self.target)
        self.dtypes = {t.name: ALL_TORCH_DTYPES[dtypes[t.name]] for t in self.args}
        # Temporaries live only during a call: one workspace is reused (fresh pages would fault
        # on every call); a concurrent call from another thread gets its own.
        self._workspace: torch.Tensor | None = None  # made on the first run (never under a fake-tensor mode)
        self._workspace_lock = threading.Lock()
        self._numels: dict[tuple[int, int], list[int]] = {}  # (B, J) -> each argument's element count
        self.instrumented = hasattr(self.lib, "substation_op_names")
        if self.instrumented:
            self.lib.substation_op_names.restype = ctypes.c_char_p
            self.op_names = self.lib.substation_op_names().decode().split(",")
        self.produced = [t for t in self.args if t.role in ("output", "saved") and t.name in self._written()]
        #: Parameters this library also takes in parts, a tuple of one tensor per T (the Q, K, V weights
        #: apart: :func:`~substation.ir.operands.split_stack_params`); a stacked tensor works as well.
        self.split = frozenset(split_stack_params(graph))
        self._stack = int(size_symbol(STACK_LETTER))

    @contextlib.contextmanager
    def parameters_held(self):
        """Within this context the calling thread promises not to change the parameters it passes to
        this library, so a library that reads packed copies of them (inference builds on oneDNN's
        GEMMs) digests each parameter's content once instead of on every call (a packed batch calls it
        once per group). Outside it, and in libraries without packed parameters, nothing changes.
        """
        hold = getattr(self.lib, "substation_hold_parameters", None)
        if hold is None:
            yield
            return
        hold(1)
        try:
            yield
        finally:
            hold(0)

    def op_seconds(self, reset: bool = True) -> dict[str, float]:
        """Seconds spent in each operator since the last reset (instrumented builds only).

        Raises:
            RuntimeError: the library was built without ``instrument=True``.
        """
        if not self.instrumented:
            raise RuntimeError("this library was built without per-operator timers (instrument=True)")
        out = (ctypes.c_double * len(self.op_names))()
        self.lib.substation_op_seconds(out, int(reset))
        return dict(zip(self.op_names, out))

    def _written(self) -> set[str]:
        names = set()
        for op in self.graph.operators():
            names.update(t for t, _ in self.graph.outputs_of(op).values())
        return names

    def _pieces(self, t: TensorInfo, value, numel: int) -> list:
        """(tensor, element count it needs) of each piece of argument ``t``: the tensor, or its T parts."""
        if not isinstance(value, (tuple, list)):
            return [(value, numel)]
        if t.name not in self.split or len(value) != self._stack:
            raise ValueError(f"{self.graph.phase} library argument {t.name} given as {len(value)} parts; "
                             + (f"it takes one tensor or {self._stack} parts (one per {STACK_LETTER})"
                                if t.name in self.split else "it takes one tensor"))
        return [(v, numel // self._stack) for v in value]

    def _rows_numel(self, t: TensorInfo, value: torch.Tensor, numel: int, index: torch.Tensor, positions: int) -> int:
        """The element count argument ``t`` (``value``, read or written through the row ``index``) must
        have: R whole rows of the ``numel / positions`` elements one position takes; checks ``index``."""
        per_row = numel // max(positions, 1)
        if not isinstance(index, torch.Tensor) or index.dtype != torch.int64:
            raise TypeError(f"the row index of {t.name} must be an int64 tensor, got "
                            f"{index.dtype if isinstance(index, torch.Tensor) else type(index).__name__}")
        if index.numel() != positions or not index.is_contiguous():
            raise ValueError(f"the row index of {t.name} must be contiguous with B x J = {positions} entries, got "
                             f"shape {tuple(index.shape)}")
        count = value.numel() // per_row
        lo, hi = torch.aminmax(index) if positions else (torch.tensor(0), torch.tensor(-1))
        lowest = -1 if t.role == "output" else 0
        if int(lo) < lowest or int(hi) >= count:
            raise ValueError(f"the row index of {t.name} must lie in [{lowest}, {count}) (its rows), got "
                             f"[{int(lo)}, {int(hi)}]")
        return count * per_row

    def _part_pointers(self, pieces: list) -> list[int]:
        """Addresses of the T parts of a split argument given stacked or in parts."""
        if len(pieces) > 1:
            return [v.data_ptr() for v, _ in pieces]
        v, n = pieces[0]
        step = n // self._stack * v.element_size()
        return [v.data_ptr() + k * step for k in range(self._stack)]

    def __call__(self, given: dict[str, torch.Tensor], batch: int, seq: int, seed: int = 0,
                 training: bool = False, bound: BoundParameters | None = None) -> dict[str, torch.Tensor]:
        """Run the graph. ``given`` maps every input, parameter and (backward) saved tensor name to a
        contiguous tensor of the graph's dtype (:attr:`dtypes`) on :attr:`device_type` (CUDA: all on
        one device), the parameters in ``bound`` excepted; returns the tensors the graph writes (outputs
        and forward-saved tensors), freshly allocated. A CUDA library queues its work on PyTorch's
        current stream of that device.

        Raises:
            ValueError: CUDA tensors on different devices. RuntimeError: the library failed."""
        sizes = self.graph.config.sizes(batch, seq)
        device = torch.device("cpu")
        if self.device_type == "cuda":
            device = next(iter(given.values())).device
            bad = sorted(n for n, v in given.items() if v.device != device)
            if bad:
                raise ValueError(f"tensors {', '.join(bad)} are not on {device}")
        produced = {t.name: torch.empty(t.shape(sizes), dtype=self.dtypes[t.name], device=device)
                    for t in self.produced}
        self.run_into({**given, **produced}, batch, seq, seed, training, bound=bound)
        return produced

    def _checked_pieces(self, args: list[TensorInfo], values: list, numels: list[int], where: str) -> list:
        """:meth:`_pieces` of each argument, checked: the dtype :attr:`dtypes` says, the element count,
        contiguous, its values in memory (no lazy negation: the library reads the bytes).

        Raises:
            TypeError: a piece of another dtype. ValueError: another element count, not contiguous, a
                lazy negation, or parts where :meth:`_pieces` refuses them."""
        pieces = [self._pieces(t, v, n) for t, v, n in zip(args, values, numels)]
        wrong = [f"{t.name}{'' if len(ps) == 1 else f' part {k}'} is {v.dtype}, not {self.dtypes[t.name]}"
                 for t, ps in zip(args, pieces) for k, (v, _) in enumerate(ps) if v.dtype != self.dtypes[t.name]]
        if wrong:
            raise TypeError(f"{self.graph.phase} library arguments of the wrong dtype: {'; '.join(wrong)}")
        wrong = [f"{t.name}{'' if len(ps) == 1 else f' part {k}'} {tuple(v.shape)}"
                 f"{'' if v.is_contiguous() else ' non-contiguous'}"
                 f"{' a lazy negation (torch._neg_view: pass .resolve_neg())' if v.is_neg() else ''} (needs {n} elements)"
                 for t, ps in zip(args, pieces) for k, (v, n) in enumerate(ps)
                 if v.numel() != n or not v.is_contiguous() or v.is_neg()]
        if wrong:
            raise ValueError(f"{self.graph.phase} library arguments{where} must be contiguous tensors of their "
                             f"sizes: {'; '.join(wrong)}")
        return pieces

    def bind(self, parameters: dict) -> BoundParameters:
        """Check parameter arguments once and keep their addresses (:class:`BoundParameters`).

        Args:
            parameters: name -> tensor (a parameter of :attr:`split`: or a tuple of its T parts) for some
                or all of the library's parameters, as :meth:`run_into` takes them.

        Raises:
            ValueError: a name that is not a parameter of this library; as :meth:`run_into` for the
                tensors (TypeError for a dtype)."""
        args = {t.name: t for t in self.args if t.role == "param"}
        unknown = sorted(set(parameters) - set(args))
        if unknown:
            raise ValueError(f"{self.graph.phase} library has no parameter {', '.join(unknown)} (it takes "
                             f"{', '.join(args)})")
        bound = [args[n] for n in parameters]
        sizes = self.graph.config.sizes(1, 1)  # a parameter's size does not depend on B or J
        pieces = self._checked_pieces(bound, list(parameters.values()),
                                      [math.prod(t.shape(sizes)) for t in bound], "")
        addresses, tables = {}, []
        for t, ps in zip(bound, pieces):
            if t.name in self.split:
                tables.append((ctypes.c_void_p * self._stack)(*self._part_pointers(ps)))
                addresses[t.name] = ctypes.addressof(tables[-1])
            else:
                addresses[t.name] = ps[0][0].data_ptr()
        return BoundParameters(self, addresses, tuple(tables))

    def run_into(self, tensors: dict[str, torch.Tensor], batch: int, seq: int, seed: int = 0,
                 training: bool = False, rows: dict[str, torch.Tensor] | None = None,
                 bound: BoundParameters | None = None) -> None:
        """Run the graph on caller-owned tensors: ``tensors`` maps every argument name (inputs,
        parameters, saved tensors and the outputs it writes) to a contiguous tensor of :attr:`dtypes`
        and the graph's shape at ``batch`` x ``seq`` (a parameter of :attr:`split`: that, or a tuple of
        its T parts, each contiguous); nothing is allocated besides the workspace (reused on the CPU).
        Benchmarks and the tuner time this call. ``bound`` (from :meth:`bind` of this library): those
        parameters' checked addresses, in place of entries of ``tensors``.

        ``rows`` (arguments in :attr:`row_indexed` only): name -> int64 [B x J], the row of that
        argument, an [R, I] tensor of any R, that position (b, j) reads or writes (at index b J + j):
        a gather and a scatter without copies (packed batches). An output's index may be -1: that
        position's row is not written.

        Raises:
            KeyError: an argument is missing. TypeError: an argument of another dtype than
            :attr:`dtypes` says; a row index that is not int64. ValueError: an argument of another size
            (element count), not contiguous, or a lazy negation (``torch._neg_view``); parts for an
            argument not in :attr:`split`, or not T of them; a row index for an argument not in
            :attr:`row_indexed`, of another size than B x J, or out of range; a binding of another
            library. RuntimeError: the library failed."""
        addresses = {} if bound is None else bound.addresses
        if bound is not None and bound.graph is not self:
            raise ValueError(f"parameters bound for the library {bound.graph.path}, not {self.path}")
        numels = self._numels.get((batch, seq))
        if numels is None:
            if len(self._numels) >= 1024:  # one entry per (B, J) seen: bounded
                self._numels.clear()
            sizes = self.graph.config.sizes(batch, seq)
            numels = self._numels[batch, seq] = [math.prod(t.shape(sizes)) for t in self.args]
        rows = rows or {}
        if not set(rows) <= set(self.row_indexed):
            raise ValueError(f"{self.graph.phase} library takes row indices for "
                             f"{', '.join(self.row_indexed) or 'no argument'}, got them for {', '.join(sorted(rows))}")
        given = [(t, n) for t, n in zip(self.args, numels) if t.name not in addresses]
        args = [t for t, _ in given]
        values = [tensors[t.name] for t in args]
        numels = [self._rows_numel(t, v, n, rows[t.name], batch * seq) if t.name in rows else n
                  for (t, n), v in zip(given, values)]
        pieces = dict(zip((t.name for t in args), self._checked_pieces(args, values, numels,
                                                                       f" at B={batch}, J={seq}")))
        device = next(iter(pieces.values()))[0][0].device
        tables = [(ctypes.c_void_p * self._stack)(*self._part_pointers(pieces[t.name]))
                  for t in args if t.name in self.split]
        split = iter(tables)
        ptrs = (ctypes.c_void_p * len(self.args))(*(
            addresses[t.name] if t.name in addresses
            else ctypes.addressof(next(split)) if t.name in self.split else pieces[t.name][0][0].data_ptr()
            for t in self.args))
        dims = (ctypes.c_int64 * 3)(batch, seq, seq)
        need = self._ws(dims)
        run, extra = self._run, self._stream_arg
        if self.row_indexed:
            run, extra = self._run_rows, tuple(rows[n].data_ptr() if n in rows else None for n in ROW_INDEXED_CANDIDATES)
        if self.device_type == "cuda":
            # A fresh workspace from PyTorch's caching allocator: stream-ordered, safe across streams.
            with torch.cuda.device(device):
                ws = torch.empty(max(need, 1), dtype=torch.uint8, device=device)
                stream = torch.cuda.current_stream(device).cuda_stream
                rc = self._run(ptrs, dims, ws.data_ptr(), seed & 0xFFFFFFFFFFFFFFFF, int(training), stream)
        elif self._workspace_lock.acquire(blocking=False):
            try:
                if self._workspace is None or self._workspace.numel() < need:
                    self._workspace = torch.empty(need, dtype=torch.uint8)
                rc = run(ptrs, dims, self._workspace.data_ptr(), seed & 0xFFFFFFFFFFFFFFFF, int(training), *extra)
            finally:
                self._workspace_lock.release()
        else:
            ws = torch.empty(need, dtype=torch.uint8)
            rc = run(ptrs, dims, ws.data_ptr(), seed & 0xFFFFFFFFFFFFFFFF, int(training), *extra)
        if rc != 0:
            detail = ""
            if hasattr(self.lib, "substation_last_error"):
                self.lib.substation_last_error.restype = ctypes.c_char_p
                detail = ": " + self.lib.substation_last_error().decode(errors="replace")
            raise RuntimeError(f"{self.graph.phase} library returned error code {rc}{detail}")


@dataclasses.dataclass
class CompiledLayer:
    """The compiled graphs of one config plus build facts: forward and backward (mode ``train``) or
    forward alone (mode ``eval``).

    Attributes:
        config: the encoder config.
        forward, backward: the loaded graphs (backward None in mode ``eval``).
        build_seconds: compile time of each library (0 when it came from the cache).
        sources: generated C++ source of each graph.
        options: the keyword arguments of :func:`substation.pipeline.compile_layer` that produced it
            (``fuse``, ``layout``, ``instrument``, ``mode``, ``fp32_gemm`` ...), so it can be rebuilt (e.g.
            after unpickling).
        inference_build: ``() -> CompiledLayer``, the forward-only build of the same config (the
            pipeline supplies it; built through the cache on first use); None for the build itself.
        autocast_build: ``() -> CompiledLayer``, the bfloat16 build of the same config and
            options (its own default layout plan: a float32 plan does not carry over), run under
            ``torch.autocast("cpu", dtype=torch.bfloat16)`` (float32 CPU builds on CPUs with AVX512-BF16;
            else None); called with ``mode="eval"``: its forward-only build alone.
        autocast_note: why a float32 CPU build has no :attr:`autocast_build` (the CPU lacks
            AVX512-BF16), warned about once under bf16 autocast; else None.
        no_dropout_build: ``() -> CompiledLayer``, the training build of the same config without dropout,
            for calls that need gradients but draw no dropout (``training=False``), where that changes the
            arithmetic: bfloat16 CPU builds whose attention probabilities pass a dropout keep their scores
            in bfloat16, as autocast's unfused attention does, while without dropout autocast runs
            PyTorch's fused attention, whose scores stay float32 (:mod:`substation.passes.precision`);
            else None.
        fp32_gemm_library: the library the libraries' float32 token-wise GEMMs call (``"mkl"`` or
            ``"onednn"``: ``options["fp32_gemm"]`` resolved, :func:`~substation.perf.gemm_choice.resolve_fp32_gemm`);
            None for builds without float32 GEMMs on the CPU.
    """

    config: EncoderConfig
    forward: CompiledGraph
    backward: CompiledGraph | None
    build_seconds: dict
    sources: dict
    options: dict = dataclasses.field(default_factory=dict)
    inference_build: Callable[[], "CompiledLayer"] | None = dataclasses.field(default=None, repr=False)
    autocast_build: Callable[[], "CompiledLayer"] | None = dataclasses.field(default=None, repr=False)
    autocast_note: str | None = None
    no_dropout_build: Callable[[], "CompiledLayer"] | None = dataclasses.field(default=None, repr=False)
    fp32_gemm_library: str | None = None

    def __post_init__(self):
        self.key = register_layer(self)
        #: :func:`parameter_names` and :func:`parameter_shapes` of the config, asked on every call, and the
        #: stacked parameters (along :data:`~substation.ir.operands.STACK_LETTER`: ``in_proj_*``).
        self.parameter_names = parameter_names(self.config)
        self.parameter_shapes = parameter_shapes(self.config)
        self.stacked_parameters = frozenset(n for n, dims in parameters(self.config).items()
                                            if dims.startswith(STACK_LETTER))
        #: Memos of :func:`~substation.runtime.run_layer`'s eager calls, keyed by what it checks of the
        #: parameters (each tensor's address, dtype, shape and device; contiguous tensors only): the keys
        #: that passed its checks (a set), and (forward-only builds) the library's binding of those
        #: tensors (a dict). Addresses only: no tensor is kept alive; bounded (:data:`MEMO_ENTRIES`).
        self.checked_parameters: set = set()
        self.bound_parameters: dict = {}

    @property
    def mode(self) -> str:
        """``train`` (with a backward library) or ``eval``."""
        return "train" if self.backward is not None else "eval"

    def forward_only(self) -> "CompiledLayer":
        """The build to run when no gradient is needed and no dropout is drawn: the inference build
        (this build itself in mode ``eval``, or when none was supplied)."""
        if self.backward is None or self.inference_build is None:
            return self
        return self.inference_build()

    def without_dropout(self) -> "CompiledLayer":
        """The build to run when gradients are needed and no dropout is drawn: :attr:`no_dropout_build`
        (compiled through the cache on first use), else this build (which skips its dropout).

        Raises:
            ToolchainError, BuildError: compiling that build failed.
        """
        return self if self.no_dropout_build is None else self.no_dropout_build()

    def for_autocast(self, forward_only: bool = False) -> "CompiledLayer":
        """The build to run under CPU bfloat16 autocast: :attr:`autocast_build` (compiled through the cache
        on first use), else this build. ``forward_only``: instead that build's forward-only build
        (what :meth:`forward_only` of it returns), compiled without it: a call that needs no gradient
        never compiles the bfloat16 training libraries.

        Raises:
            ToolchainError, BuildError: compiling the bfloat16 build failed.
        """
        if self.autocast_build is None:
            return self.forward_only() if forward_only else self
        return self.autocast_build(mode="eval") if forward_only else self.autocast_build()

    @property
    def saved_names(self) -> list[str]:
        """Tensors the backward graph reads besides dY: forward tensors and parameters (none in mode
        ``eval``)."""
        if self.backward is None:
            return []
        return [t.name for t in self.backward.args if t.role in ("saved", "param")]

    @property
    def produced_names(self) -> list[str]:
        """Tensors the forward library writes: ``Y`` first, then those saved for backward."""
        names = [t.name for t in self.forward.produced]
        return ["Y"] + [n for n in names if n != "Y"]


# Operators take no Python objects: they reach their layer's libraries through a per-process key. The
# registry holds layers weakly, so a layer nobody uses any more (and its workspaces) is freed; a pending
# backward keeps its layer alive through the autograd context, a traced program through pin_layer.
_REGISTRY: "weakref.WeakValueDictionary[str, CompiledLayer]" = weakref.WeakValueDictionary()
_REGISTRY_KEYS = itertools.count()
_REGISTRY_LOCK = threading.Lock()


def register_layer(compiled: CompiledLayer) -> str:
    """A new per-process key under which :func:`registered_layer` finds ``compiled`` while it is alive
    (the registry holds it weakly)."""
    with _REGISTRY_LOCK:
        key = f"{compiled.config.name}#{next(_REGISTRY_KEYS)}"
        _REGISTRY[key] = compiled
    return key


_PINNED: dict[str, CompiledLayer] = {}


def pin_layer(compiled: CompiledLayer) -> None:
    """Keep ``compiled`` registered for the rest of the process (a ``torch.export`` / ``torch.jit.trace``
    program holds only its key and may outlive every module)."""
    with _REGISTRY_LOCK:
        _PINNED[compiled.key] = compiled


def registered_layer(key: str) -> CompiledLayer:
    """The layer registered under ``key``.

    Raises:
        KeyError: no living layer has that key in this process (never registered, or freed since).
    """
    try:
        return _REGISTRY[key]
    except KeyError:
        raise KeyError(f"no compiled layer {key!r} in this process (it was freed, or belongs to another "
                       f"process)") from None


def release_packed_parameters() -> int:
    """Drop the packed copies of parameters that inference builds on oneDNN's GEMMs keep (bfloat16, and
    float32 with ``fp32_gemm`` resolved to ``"onednn"``; one cache per process, its capacity
    ``ss::packed_parameter_bytes()``: 1 GiB or an eighth of the machine's memory, whichever is more; a
    copy per parameter, packed layout and chunk: a new content packed from a parameter's address
    replaces the copy made from there before) and hand the freed memory back to the OS (glibc's
    ``malloc_trim``: :func:`keep_freed_memory` keeps freed memory otherwise); the next inference call
    packs what it reads again.

    Returns:
        The bytes the copies held (0 when no build on oneDNN's GEMMs is loaded).
    """
    with _REGISTRY_LOCK:
        layers = list(_REGISTRY.values())
    for layer in layers:
        release = getattr(layer.forward.lib, "substation_release_packed_parameters", None)
        if release is not None:
            release.restype = ctypes.c_uint64
            held = int(release())  # every oneDNN build shares the one cache (substation_dnnl.h)
            try:
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            except (OSError, AttributeError):  # not glibc: its allocator decides
                pass
            return held
    return 0
