"""Flop and data-movement analysis of the encoder layer's graphs (Ivanov et al. 2020, section 3).

Every operator of a :class:`~substation.ir.graph.LayerGraph` is counted from the graph alone:

* **bytes read / written**: for every connector of the operator, the elements its access string
  touches (the product of the sizes of its letters; a digit, a fixed index, contributes 1) times the
  itemsize of the config's dtype (4 or 8 bytes). Each connector counts once per operator: no cache
  reuse across operators, full reuse inside one. A tensor read through two connectors (``QKV[BJ0HP]``
  and ``QKV[BK1HP]`` in ``scores``) counts both slices.
* **flop**: a contraction does ``2 x`` the product of the sizes of every distinct letter of its
  operands (one multiply-add = 2 flop); every other kind does a fixed number of arithmetic operations
  per element (and per row for normalizations), declared with each kind in :mod:`substation.ops`
  and listed in ``docs/analysis.md``.

Both are sympy expressions in the dimension letters ``B, J, K, H, P, I, U`` (``T``, the Q/K/V stack, is
3) and integers for a config. The counting works on any graph the pipeline produces: an operator of
kind ``fused`` (a group of EW/SN operators fused into one kernel) counts as one operator whose flop
is the sum of its members' flop (``attrs["ops"]``) and whose bytes are those of its own connectors,
i.e. what the fused kernel moves to and from memory.

The measured side (:func:`measure`) runs the compiled layer with per-operator timers and a
STREAM-like copy to get the machine's copy bandwidth; :meth:`Analysis.to_json`, :func:`format_report`
and :func:`plot_report` present the result.
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import json
import math
import statistics
import time
from typing import Callable, Mapping

import sympy

from ..config import EncoderConfig, load_config
from ..files import atomic_write
from ..ir.graph import OP_CLASSES, LayerGraph, Operator
from ..ops import op_kind
from ..ops.kind import elements

__all__ = [
    "SYMBOLS", "PAPER_CLASS_SHARES", "PAPER_MAX_REDUCTION_PCT", "PASSES",
    "OperatorCount", "Measurement", "Analysis",
    "access_elements", "kind_flop", "operator_count", "count_graph", "optimized_graphs", "analyze",
    "copy_bandwidth", "measure", "differences", "format_report", "write_json", "plot_report",
]
from ..backends.cpu.build import build_library
from ..layer import EncoderLayer
from ..pipeline import compile_graphs, compile_layer
from ..resources import csrc_file

#: The dimension symbols of the symbolic counts (``T`` is the constant 3).
SYMBOLS: dict[str, sympy.Symbol] = {d: sympy.Symbol(d, positive=True, integer=True) for d in "BJKHPIU"}

#: Passes of a report, in order; ``total`` is forward + backward.
PASSES = ("forward", "backward")

#: Ivanov et al. 2020, Table 1 ("Proportions for operator classes in PyTorch"; BERT-large encoder
#: layer, forward + backward, V100): share of flop and of runtime per operator class, in percent.
PAPER_CLASS_SHARES = {
    "TC": {"flop_pct": 99.80, "runtime_pct": 61.0},
    "SN": {"flop_pct": 0.17, "runtime_pct": 25.5},
    "EW": {"flop_pct": 0.03, "runtime_pct": 13.5},
}
#: The paper's data-movement reduction from fusion ("up to 22.91%").
PAPER_MAX_REDUCTION_PCT = 22.91


# -- counting ------------------------------------------------------------------------------------
def _symbolic_size(letter: str):
    return sympy.Integer(3) if letter == "T" else SYMBOLS[letter]


def _sizer(sizes: Mapping[str, int] | None) -> Callable[[str], object]:
    """letter -> size: sympy symbols when ``sizes`` is None, else integers from ``sizes``."""
    if sizes is None:
        return _symbolic_size
    return lambda letter: 3 if letter == "T" else int(sizes[letter])


def access_elements(access, size: Callable[[str], object] | Mapping[str, int] | None = None):
    """Elements one access touches: the product of the sizes of its letters (digits count 1).

    Args:
        access: an access string (``"BJ0HP"``) or a (tensor, access) pair.
        size: letter -> size (a function or a mapping such as ``config.sizes()``); None: symbolic.

    Returns:
        A sympy expression (symbolic) or an int (elements, not bytes).

    Raises:
        KeyError: a letter without a size. TypeError: a malformed operand.
    """
    if size is None or isinstance(size, Mapping):
        size = _sizer(size)
    return elements(access, size)


def kind_flop(kind: str, attrs: Mapping, inputs: Mapping, outputs: Mapping,
              size: Callable[[str], object] | Mapping[str, int] | None = None):
    """Flop of one operator of ``kind``, from its attributes and operand accesses.

    Works for a top-level :class:`~substation.ir.graph.Operator` (``op.kind, op.attrs``,
    ``graph.inputs_of(op)``, ``graph.outputs_of(op)``) and for a member dict of a fused operator
    (``m["kind"], m["attrs"], m["inputs"], m["outputs"]``); a ``fused`` kind sums its members
    (``attrs["ops"]``, recursively).

    Args:
        kind: the operator kind (``contraction``, ``bias``, ..., ``fused``).
        attrs: kind-specific attributes (``axis``, ``function``, ``ops``).
        inputs, outputs: connector -> access string or (tensor, access) pair.
        size: letter -> size (function or mapping); None gives a sympy expression in B, J, K, H, P, I, U.

    Returns:
        flop (2 per multiply-add in contractions, 1 per arithmetic operation elsewhere), as a sympy
        expression or an int.

    Raises:
        ValueError: an unknown kind or activation function, or operands the kind does not have.
    """
    if size is None or isinstance(size, Mapping):
        size = _sizer(size)
    attrs = attrs or {}
    if kind == "fused":
        members = attrs.get("ops")
        if not members:
            raise ValueError("a fused operator needs its member operators in attrs['ops']")
        total = 0
        for m in members:
            total = total + kind_flop(m["kind"], m.get("attrs", {}), m.get("inputs", {}), m.get("outputs", {}), size)
        return total
    return op_kind(kind).flop(attrs, inputs, outputs, size)


@dataclasses.dataclass(frozen=True)
class OperatorCount:
    """Flop and bytes of one operator (or one fused kernel) of one pass.

    Attributes:
        name: the operator label. phase: ``forward`` or ``backward``. op_class: TC, SN or EW. kind: its kind.
        flop_expr, read_expr, written_expr: sympy expressions in B, J, K, H, P, I, U (flop, bytes, bytes).
        flop, bytes_read, bytes_written: their values for the analysed sizes (flop, bytes, bytes).
        members: names of the member operators of a fused kernel (empty otherwise).
        seconds: measured median time per call in seconds (None when not measured).
    """

    name: str
    phase: str
    op_class: str
    kind: str
    flop_expr: object
    read_expr: object
    written_expr: object
    flop: int
    bytes_read: int
    bytes_written: int
    members: tuple[str, ...] = ()
    seconds: float | None = None

    @property
    def bytes(self) -> int:
        """Bytes moved: read + written."""
        return self.bytes_read + self.bytes_written

    @property
    def intensity(self) -> float:
        """Arithmetic intensity in flop per byte moved (inf for an operator that moves nothing)."""
        return self.flop / self.bytes if self.bytes else math.inf

    def bandwidth(self) -> float | None:
        """Achieved bandwidth in bytes/s (bytes moved / measured seconds), None when not measured."""
        return self.bytes / self.seconds if self.seconds else None

    def efficiency(self, peak_bandwidth: float | None) -> float | None:
        """MUE-like efficiency, a fraction: required bytes / (seconds x ``peak_bandwidth`` in bytes/s)."""
        if not self.seconds or not peak_bandwidth:
            return None
        return self.bytes / (self.seconds * peak_bandwidth)


def operator_count(graph: LayerGraph, op: Operator, sizes: Mapping[str, int] | None = None) -> OperatorCount:
    """Count one operator of ``graph`` (a fused one counts as one operator, see the module docstring).

    Args:
        sizes: letter -> size for the values (default ``graph.config.sizes()``).

    Raises:
        ValueError: a kind without a flop rule.
    """
    cfg = graph.config
    item = cfg.itemsize
    sizes = dict(sizes or cfg.sizes())
    ins, outs = graph.inputs_of(op), graph.outputs_of(op)
    attrs = op.attrs
    num, sym = _sizer(sizes), _sizer(None)
    read_e = sum((access_elements(a, sym) for _, a in ins.values()), sympy.Integer(0))
    written_e = sum((access_elements(a, sym) for _, a in outs.values()), sympy.Integer(0))
    members = tuple(m.get("name", "?") for m in attrs.get("ops", ())) if op.kind == "fused" else ()
    return OperatorCount(
        name=op.label, phase=graph.phase, op_class=op.op_class, kind=op.kind,
        flop_expr=sympy.expand(kind_flop(op.kind, attrs, ins, outs, sym)),
        read_expr=sympy.expand(item * read_e), written_expr=sympy.expand(item * written_e),
        flop=int(kind_flop(op.kind, attrs, ins, outs, num)),
        bytes_read=item * sum(int(access_elements(a, num)) for _, a in ins.values()),
        bytes_written=item * sum(int(access_elements(a, num)) for _, a in outs.values()),
        members=members)


def count_graph(graph: LayerGraph, sizes: Mapping[str, int] | None = None) -> list[OperatorCount]:
    """:func:`operator_count` of every operator of ``graph``, in execution order."""
    return [operator_count(graph, op, sizes) for op in graph.operators()]


# -- graphs --------------------------------------------------------------------------------------
def optimized_graphs(config: EncoderConfig):
    """The (forward, backward) graphs after the pipeline's optimization passes (fusion), PyTorch's layouts."""
    return compile_graphs(load_config(config), fuse_ops=True)


# -- analysis ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Measurement:
    """What one run of the compiled layer measured.

    Attributes:
        op_seconds: (phase, operator label) -> median seconds per call.
        pass_seconds: phase -> median wall seconds of that pass as seen from Python (timed operators
            plus allocation, the autograd machinery and the call overhead).
        copy_bandwidth: STREAM-like copy bandwidth in bytes/s (2 x buffer bytes per copy / seconds).
        copy_buffer_bytes: the size of one copy buffer in bytes.
        repeats, warmup: timed and untimed forward+backward steps.
    """

    op_seconds: dict
    pass_seconds: dict
    copy_bandwidth: float
    copy_buffer_bytes: int
    repeats: int
    warmup: int


@dataclasses.dataclass(frozen=True)
class Analysis:
    """Per-operator counts of the forward and backward graphs of one config.

    Attributes:
        config: the encoder config. sizes: letter -> size the values were evaluated at.
        optimized: whether the graphs are those of :func:`optimized_graphs`.
        operators: forward operators then backward operators (:class:`OperatorCount`).
        unfused_bytes: total bytes (forward + backward) of the unoptimized graphs, when ``optimized``.
        measurement: the :class:`Measurement`, when measured.
    """

    config: EncoderConfig
    sizes: dict
    optimized: bool
    operators: tuple[OperatorCount, ...]
    unfused_bytes: int | None = None
    measurement: Measurement | None = None

    # aggregation -------------------------------------------------------------------------------
    def select(self, phase: str = "total", op_class: str = "all") -> list[OperatorCount]:
        """Operators of ``phase`` (``forward``, ``backward`` or ``total``) and ``op_class`` (or ``all``)."""
        return [o for o in self.operators if phase in ("total", o.phase) and op_class in ("all", o.op_class)]

    def total(self, phase: str = "total", op_class: str = "all") -> dict:
        """Sums for ``phase`` and ``op_class``: ``flop``, ``bytes_read``, ``bytes_written``, ``bytes``
        (ints) and, when measured, ``seconds`` (the sum of the per-operator medians), ``bandwidth``
        (bytes/s) and ``efficiency`` (a fraction)."""
        ops = self.select(phase, op_class)
        res = {"flop": sum(o.flop for o in ops), "bytes_read": sum(o.bytes_read for o in ops),
               "bytes_written": sum(o.bytes_written for o in ops)}
        res["bytes"] = res["bytes_read"] + res["bytes_written"]
        if self.measurement is not None:
            secs = sum(o.seconds or 0.0 for o in ops)
            res["seconds"] = secs
            res["bandwidth"] = res["bytes"] / secs if secs else None
            bw = self.measurement.copy_bandwidth
            res["efficiency"] = res["bytes"] / (secs * bw) if secs and bw else None
        return res

    def totals(self) -> dict:
        """pass (``forward``, ``backward``, ``total``) -> class (TC, SN, EW, ``all``) -> :meth:`total`."""
        return {p: {c: self.total(p, c) for c in (*OP_CLASSES, "all")} for p in (*PASSES, "total")}

    def kernels(self) -> dict:
        """pass -> class -> number of operators (a fused kernel counts once)."""
        return {p: {c: len(self.select(p, c)) for c in (*OP_CLASSES, "all")} for p in (*PASSES, "total")}

    def shares(self) -> dict:
        """pass -> class -> ``flop_pct``, ``bytes_pct`` (and ``time_pct`` when measured): percent of the pass."""
        out = {}
        for p in (*PASSES, "total"):
            whole = self.total(p)
            out[p] = {}
            for c in OP_CLASSES:
                part = self.total(p, c)
                row = {"flop_pct": _pct(part["flop"], whole["flop"]), "bytes_pct": _pct(part["bytes"], whole["bytes"])}
                if self.measurement is not None:
                    row["time_pct"] = _pct(part["seconds"], whole["seconds"])
                out[p][c] = row
        return out

    def contraction_flop(self) -> dict:
        """pass -> flop of the TC operators (the paper's closed-form contraction counts)."""
        return {p: self.total(p, "TC")["flop"] for p in (*PASSES, "total")}

    @property
    def data_movement_reduction_pct(self) -> float | None:
        """100 x (1 - optimized bytes / unfused bytes), forward + backward; None unless ``optimized``."""
        if self.unfused_bytes is None:
            return None
        return 100.0 * (1.0 - self.total()["bytes"] / self.unfused_bytes)

    def with_measurement(self, m: Measurement) -> "Analysis":
        """A copy with ``m``'s per-operator times attached (operators without a timer keep None)."""
        ops = tuple(dataclasses.replace(o, seconds=m.op_seconds.get((o.phase, o.name))) for o in self.operators)
        return dataclasses.replace(self, operators=ops, measurement=m)

    # output ------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        """The report as plain data (see docs/analysis.md for the keys). Units: flop, bytes, seconds,
        bytes/s; ``*_pct`` in percent; ``efficiency`` a fraction."""
        m = self.measurement
        bw = m.copy_bandwidth if m else None
        ops = []
        for o in self.operators:
            row = {"name": o.name, "pass": o.phase, "class": o.op_class, "kind": o.kind, "flop": o.flop,
                   "bytes_read": o.bytes_read, "bytes_written": o.bytes_written,
                   "intensity": o.intensity if math.isfinite(o.intensity) else None,
                   "flop_expr": str(o.flop_expr), "bytes_read_expr": str(o.read_expr),
                   "bytes_written_expr": str(o.written_expr)}
            if o.members:
                row["members"] = list(o.members)
            if m is not None:
                row.update(seconds=o.seconds, bandwidth=o.bandwidth(), efficiency=o.efficiency(bw))
            ops.append(row)
        data = {
            "config": self.config.to_dict(), "sizes": {k: v for k, v in self.sizes.items() if k != "T"},
            "dtype": self.config.dtype, "itemsize": self.config.itemsize, "optimized": self.optimized,
            "operators": ops, "totals": self.totals(), "kernels": self.kernels(), "shares": self.shares(),
            "contraction_flop": self.contraction_flop(),
            "paper": {"class_shares": PAPER_CLASS_SHARES, "max_data_movement_reduction_pct": PAPER_MAX_REDUCTION_PCT,
                      "source": "Ivanov et al. 2020, Table 1 (BERT-large, forward+backward, PyTorch, V100)"},
        }
        if self.optimized:
            data["data_movement_reduction_pct"] = self.data_movement_reduction_pct
            data["unfused_bytes"] = self.unfused_bytes
        if m is not None:
            data["measured"] = {"copy_bandwidth": m.copy_bandwidth, "copy_buffer_bytes": m.copy_buffer_bytes,
                                "pass_seconds": m.pass_seconds, "repeats": m.repeats, "warmup": m.warmup}
        return data


def _pct(part, whole) -> float:
    return 100.0 * part / whole if whole else 0.0


def analyze(config, optimized: bool = False) -> Analysis:
    """Count the forward and backward graphs of ``config`` (a config, a YAML path or a bundled name).

    With ``optimized``, counts the graphs of :func:`optimized_graphs` and also the unfused ones, for
    :attr:`Analysis.data_movement_reduction_pct`. Needs no compilation.

    Raises:
        ConfigError, FileNotFoundError: a bad config.
        NotImplementedError: ``optimized`` while the pipeline has no optimization stage.
        ValueError: an operator kind without a flop rule.
    """

    config = load_config(config)
    sizes = config.sizes()
    unfused = compile_graphs(config)
    unfused_ops = [c for g in unfused for c in count_graph(g, sizes)]
    if not optimized:
        return Analysis(config, sizes, False, tuple(unfused_ops))
    opt_ops = [c for g in optimized_graphs(config) for c in count_graph(g, sizes)]
    return Analysis(config, sizes, True, tuple(opt_ops), unfused_bytes=sum(o.bytes for o in unfused_ops))


# -- measurement ---------------------------------------------------------------------------------
def _l3_bytes() -> int:
    """The largest CPU cache in bytes (from sysfs), 32 MiB when unknown."""
    best = 0
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(path) as f:
                text = f.read().strip()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
            best = max(best, int(text.rstrip("KkMmGg")) * mult)
        except (OSError, ValueError):
            continue
    return best or 32 << 20


class _CopyTimer:
    """Times one STREAM-like copy ``dst.copy_(src)`` (torch, all threads) of float64 buffers per call.

    Buffers are ``buffer_bytes`` each (default 4x the largest cache, at least 64 MiB); two untimed
    copies at construction touch every page.
    """

    def __init__(self, buffer_bytes: int | None = None):
        import torch

        n = int(buffer_bytes or max(4 * _l3_bytes(), 64 << 20)) // 8
        self.buffer_bytes = n * 8
        self._src = torch.ones(n, dtype=torch.float64)
        self._dst = torch.empty_like(self._src)
        self._dst.copy_(self._src)
        self._dst.copy_(self._src)
        self.seconds: list[float] = []

    def __call__(self) -> None:
        t0 = time.perf_counter()
        self._dst.copy_(self._src)
        self.seconds.append(time.perf_counter() - t0)

    def bandwidth(self) -> float:
        """Bytes/s of the median timed copy, counting read + write = 2 x buffer bytes as STREAM does."""
        return 2 * self.buffer_bytes / statistics.median(self.seconds)


def copy_bandwidth(buffer_bytes: int | None = None, repeats: int = 10) -> tuple[float, int]:
    """STREAM-like copy bandwidth: median over ``repeats`` of ``dst.copy_(src)`` (torch, all threads).

    Args:
        buffer_bytes: bytes per buffer; default 4x the largest cache (at least 64 MiB).
        repeats: timed copies (two untimed ones come first).

    Returns:
        (bytes/s, counting read + write = 2 x buffer bytes per copy as STREAM does; buffer bytes).

    Raises:
        ValueError: ``repeats`` < 1.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    timer = _CopyTimer(buffer_bytes)
    for _ in range(repeats):
        timer()
    return timer.bandwidth(), timer.buffer_bytes


@functools.lru_cache(maxsize=None)
def _probe_library():
    """The machine-probe library (``csrc/substation_probe.cpp``), built through the build cache."""
    import ctypes


    with open(csrc_file("substation_probe.cpp")) as f:
        lib = ctypes.CDLL(build_library(f.read(), "probe").path)
    lib.substation_probe_gemm_seconds.restype = ctypes.c_double
    lib.substation_probe_gemm_seconds.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_int32] * 2
    lib.substation_probe_fma_flops.restype = ctypes.c_double
    lib.substation_probe_fma_flops.argtypes = [ctypes.c_int64, ctypes.c_int32]
    return lib


def _probe_dtype(dtype: str) -> int:
    if dtype not in ("float32", "float64"):
        raise ValueError(f"dtype must be float32 or float64 (the CPU target's dtypes), got {dtype!r}")
    return int(dtype == "float64")


def gemm_rate(dtype: str = "float32", shapes=((2048, 2048, 2048),), repeats: int = 5) -> float:
    """The BLAS's GEMM rate in flop/s: the best over ``shapes`` (``(m, n, k)`` tuples) of 2 m n k /
    seconds of the fastest of ``repeats`` row-major ``C[m, n] = A[m, k] B[k, n]`` calls of
    ``cblas_sgemm`` (``float32``) or ``cblas_dgemm`` (``float64``) of the library the generated code
    links (MKL), on the generated code's OpenMP threads; one untimed call per shape comes first.

    Raises:
        ValueError: another dtype, no shapes, a size < 1 or ``repeats`` < 1.
        ToolchainError, BuildError: the probe library cannot be built.
    """
    use_double = _probe_dtype(dtype)
    shapes = [tuple(int(v) for v in s) for s in shapes]
    if not shapes or any(len(s) != 3 or min(s) < 1 for s in shapes) or repeats < 1:
        raise ValueError(f"need shapes of (m, n, k) >= 1 and repeats >= 1, got {shapes} and {repeats}")
    lib = _probe_library()
    return max(2.0 * m * n * k / lib.substation_probe_gemm_seconds(m, n, k, repeats, use_double)
               for m, n, k in shapes)


def fma_peak(dtype: str = "float32", iterations: int = 30_000_000, repeats: int = 3) -> float:
    """The cores' fused-multiply-add peak in flop/s (2 flop per FMA lane), the best of ``repeats``
    runs in which every OpenMP thread runs 12 independent chains of ``iterations`` FMAs on the widest
    vectors of the build (AVX-512, AVX2 or scalar); an upper bound for any GEMM of ``dtype`` on
    these threads.

    Raises:
        ValueError: another dtype, ``iterations`` < 1 or ``repeats`` < 1.
        ToolchainError, BuildError: the probe library cannot be built.
    """
    use_double = _probe_dtype(dtype)
    if iterations < 1 or repeats < 1:
        raise ValueError(f"need iterations >= 1 and repeats >= 1, got {iterations} and {repeats}")
    return max(_probe_library().substation_probe_fma_flops(iterations, use_double) for _ in range(repeats))


def measure(config, repeats: int = 5, warmup: int = 1, seed: int = 0, compiled=None,
            copy_bytes: int | None = None, optimized: bool = False) -> Measurement:
    """Run the compiled layer (train mode, random input at the config's sizes) with per-operator timers.

    Compiles ``config`` with ``instrument=True`` (and the pipeline's optimization stages only when
    ``optimized``, so the timers match the graphs :func:`analyze` counted with the same flag) unless an
    instrumented ``compiled`` (:class:`~substation.runtime.CompiledLayer`) is given, runs ``warmup``
    untimed and ``repeats`` timed forward+backward steps, and measures the copy bandwidth
    (:func:`copy_bandwidth`'s copy with buffers of ``copy_bytes``, default 4x the last-level cache) in
    the same run: four copies timed after each timed step, the median over all of them, so the copy
    sees the same machine state as the kernels (the memory bandwidth of a shared machine drifts by
    tens of percent within seconds).

    Returns:
        a :class:`Measurement` (seconds per call are medians over the repeats).

    Raises:
        ValueError: ``repeats`` < 1 or ``warmup`` < 0. RuntimeError: ``compiled`` has no timers.
        ConfigError, ToolchainError, BuildError: as :func:`~substation.pipeline.compile_layer`.
    """
    import torch


    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    config = load_config(config)
    if compiled is None:
        compiled = compile_layer(config, instrument=True, fuse=optimized)
    if not (compiled.forward.instrumented and compiled.backward.instrumented):
        raise RuntimeError("measure() needs a layer compiled with instrument=True")
    layer = EncoderLayer(compiled).train()
    gen = torch.Generator().manual_seed(seed)
    b, j, i = config.batch_size, config.max_seq_len, config.hidden_size
    x = torch.randn(b, j, i, generator=gen, dtype=layer.torch_dtype)
    dy = torch.randn(b, j, i, generator=gen, dtype=layer.torch_dtype)
    mask = torch.zeros(b, j, dtype=layer.torch_dtype) if config.mask != "none" else None
    per_op: dict = {}
    per_pass: dict = {"forward": [], "backward": []}
    copy = _CopyTimer(copy_bytes)
    for r in range(warmup + repeats):
        compiled.forward.op_seconds(reset=True)
        compiled.backward.op_seconds(reset=True)
        xg = x.detach().requires_grad_()
        t0 = time.perf_counter()
        y = layer(xg, attention_mask=mask)
        t1 = time.perf_counter()
        y.backward(dy)
        t2 = time.perf_counter()
        if r < warmup:
            continue
        per_pass["forward"].append(t1 - t0)
        per_pass["backward"].append(t2 - t1)
        for phase, lib in (("forward", compiled.forward), ("backward", compiled.backward)):
            for name, s in lib.op_seconds(reset=True).items():
                per_op.setdefault((phase, name), []).append(s)
        for _ in range(4):
            copy()
    return Measurement({k: statistics.median(v) for k, v in per_op.items()},
                       {k: statistics.median(v) for k, v in per_pass.items()}, copy.bandwidth(),
                       copy.buffer_bytes, repeats, warmup)


# -- presentation --------------------------------------------------------------------------------
def differences(analysis: "Analysis") -> list[str]:
    """Why our class shares differ from the paper's Table 1 (one sentence each; details in docs/analysis.md)."""
    k = analysis.kernels()
    notes = [
        "flop: the paper does not publish its per-operator counting rules; ours count every arithmetic "
        "operation (erf/exp/tanh = 1; GELU 5 flop per element forward, 11 backward), every dropout multiply "
        "and the attention-mask add" + ("; a fused kernel counts as SN when any member is SN, so the flop of "
                                        "its EW members move to SN." if analysis.optimized else "."),
        "bytes vs runtime: the paper's runtime shares come from PyTorch on a V100 (tensor cores, fp16); ours "
        "are required bytes and, with --measure, CPU time, where GEMMs are slow relative to memory, so TC's "
        "time share is larger than the paper's and SN+EW's smaller.",
    ]
    if analysis.optimized:
        nf = k["forward"]["all"] - k["forward"]["TC"]
        nb = k["backward"]["all"] - k["backward"]["TC"]
        notes.append(f"after fusion we run {nf} non-TC kernels forward and {nb} backward (paper: 5 and 9); "
                     "intermediates inside a fused kernel never reach memory.")
    else:
        notes.append("our unfused graph writes and re-reads every intermediate (QKV_raw, S, S_masked, O_raw, "
                     "F2_drop, ...): mask, biases and residuals are separate operators; dropout masks are "
                     "regenerated from a counter-based RNG (no mask bytes, but Philox costs time); backward "
                     "sums gradients with explicit add operators.")
    return notes


def _fmt_rate(v, scale, fmt="{:.1f}") -> str:
    return fmt.format(v / scale) if v is not None else "-"


def format_report(analysis: Analysis) -> str:
    """The per-operator table, the class summary next to the paper's Table 1, and notes (text).

    Units: GFLOP, MB (1e6 bytes), flop/byte; with a measurement ms, GB/s (1e9 bytes/s) and % efficiency.
    """
    a, m = analysis, analysis.measurement
    bw = m.copy_bandwidth if m else None
    c = a.config
    lines = [f"{c.name}: B={c.batch_size} J=K={c.max_seq_len} I={c.hidden_size} H={c.num_heads} P={c.head_size} "
             f"U={c.ffn_size} {c.dtype} ({c.itemsize} bytes) {c.layer_norm}-LN {c.activation}"
             + ("  [optimized graphs]" if a.optimized else "  [unfused graphs]")]
    width = max([len("operator")] + [len(o.name) for o in a.operators])
    head = f"{'operator':<{width}} {'pass':<8} {'class':<5} {'GFLOP':>9} {'MB read':>9} {'MB writ.':>9} {'flop/B':>8}"
    if m:
        head += f" {'ms':>8} {'GFLOP/s':>8} {'GB/s':>7} {'eff %':>6}"
    lines += ["", head, "-" * len(head)]
    for o in a.operators:
        row = (f"{o.name:<{width}} {o.phase:<8} {o.op_class:<5} {o.flop / 1e9:>9.4f} {o.bytes_read / 1e6:>9.2f} "
               f"{o.bytes_written / 1e6:>9.2f} {o.intensity:>8.2f}")
        if m:
            eff = o.efficiency(bw)
            rate = o.flop / o.seconds if o.seconds else None
            row += (f" {_fmt_rate(o.seconds, 1e-3, '{:.3f}'):>8} {_fmt_rate(rate, 1e9):>8} "
                    f"{_fmt_rate(o.bandwidth(), 1e9):>7} {_fmt_rate(eff, 0.01):>6}")
        lines.append(row)
    lines += ["", "class summary (share of the pass; kernels = operators, a fused kernel counts once)"]
    head = f"{'pass':<9} {'class':<5} {'kernels':>7} {'GFLOP':>9} {'MB':>9} {'flop %':>7} {'bytes %':>7}"
    if m:
        head += f" {'ms':>8} {'time %':>7} {'GB/s':>7} {'eff %':>6}"
    head += f"  {'paper flop %':>12} {'paper time %':>12}"
    lines += [head, "-" * len(head)]
    shares, kernels = a.shares(), a.kernels()
    for p in (*PASSES, "total"):
        for cl in (*OP_CLASSES, "all"):
            t = a.total(p, cl)
            sh = shares[p].get(cl, {"flop_pct": 100.0, "bytes_pct": 100.0, "time_pct": 100.0})
            row = (f"{p:<9} {cl:<5} {kernels[p][cl]:>7} {t['flop'] / 1e9:>9.3f} {t['bytes'] / 1e6:>9.1f} "
                   f"{sh['flop_pct']:>7.2f} {sh['bytes_pct']:>7.2f}")
            if m:
                row += (f" {t['seconds'] * 1e3:>8.2f} {sh['time_pct']:>7.2f} {_fmt_rate(t['bandwidth'], 1e9):>7} "
                        f"{_fmt_rate(t['efficiency'], 0.01):>6}")
            if p == "total" and cl in PAPER_CLASS_SHARES:
                row += f"  {PAPER_CLASS_SHARES[cl]['flop_pct']:>12.2f} {PAPER_CLASS_SHARES[cl]['runtime_pct']:>12.1f}"
            lines.append(row)
    tc = a.contraction_flop()
    lines += ["", f"contraction flop: forward {tc['forward'] / 1e9:.2f} GFLOP, backward {tc['backward'] / 1e9:.2f} "
                  f"GFLOP, forward+backward {tc['total'] / 1e9:.2f} GFLOP"]
    tot = a.total()
    lines.append(f"data movement: forward {a.total('forward')['bytes'] / 1e6:.1f} MB, backward "
                 f"{a.total('backward')['bytes'] / 1e6:.1f} MB, forward+backward {tot['bytes'] / 1e6:.1f} MB")
    if a.optimized:
        lines.append(f"data movement reduction vs the unfused graphs: {a.data_movement_reduction_pct:.2f}% "
                     f"({a.unfused_bytes / 1e6:.1f} MB -> {tot['bytes'] / 1e6:.1f} MB; paper: up to "
                     f"{PAPER_MAX_REDUCTION_PCT}%)")
    if m:
        lines.append(f"measured: copy bandwidth {m.copy_bandwidth / 1e9:.2f} GB/s (STREAM-like copy, "
                     f"{m.copy_buffer_bytes / 2 ** 20:.0f} MiB buffers); "
                     f"forward {m.pass_seconds['forward'] * 1e3:.2f} ms, backward "
                     f"{m.pass_seconds['backward'] * 1e3:.2f} ms wall (median of {m.repeats}); "
                     f"timed operators {tot['seconds'] * 1e3:.2f} ms")
    sh = shares["total"]
    paper_other = PAPER_CLASS_SHARES["SN"]["runtime_pct"] + PAPER_CLASS_SHARES["EW"]["runtime_pct"]
    line = (f"ours vs the paper (forward+backward): TC flop {sh['TC']['flop_pct']:.2f}% "
            f"(paper {PAPER_CLASS_SHARES['TC']['flop_pct']:.2f}%); SN+EW move "
            f"{sh['SN']['bytes_pct'] + sh['EW']['bytes_pct']:.1f}% of the bytes")
    if m:
        line += f" and take {sh['SN']['time_pct'] + sh['EW']['time_pct']:.1f}% of the operator time"
    lines += ["", line + f" (paper: {paper_other:.1f}% of the runtime)"]
    gap = max(abs(sh[c]["flop_pct"] - PAPER_CLASS_SHARES[c]["flop_pct"]) for c in OP_CLASSES)
    lines.append(f"  flop shares differ from the paper's by at most {gap:.2f} percentage points; why:")
    lines += [f"  - {d}" for d in differences(a)]
    if m:
        missing = [f"{o.phase}/{o.name}" for o in a.operators if o.seconds is None]
        if missing:
            lines.append(f"  warning: no timer for {len(missing)} operators ({', '.join(missing[:5])}"
                         f"{', ...' if len(missing) > 5 else ''}): the measured build is not the analysed graph")
    return "\n".join(lines)


def format_kernels(analysis: Analysis) -> str:
    """The memory-bound (SN/EW) kernels of each pass, one line each: name, class, MB moved and the
    operators it runs (a fused kernel lists its members in order; an unfused operator is its own
    kernel). Contractions are not kernels of this list. Raises nothing."""
    ops = {phase: [o for o in analysis.select(phase) if o.op_class != "TC"] for phase in PASSES}
    width = max([len("kernel")] + [len(o.name) for group in ops.values() for o in group])
    lines = ["memory-bound kernels (contractions not counted)" + (" after fusion" if analysis.optimized else ""),
             f"{'pass':<9} {'kernel':<{width}} {'class':<5} {'MB':>10}  operators"]
    for phase, group in ops.items():
        for o in group:
            lines.append(f"{phase:<9} {o.name:<{width}} {o.op_class:<5} {o.bytes / 1e6:>10.4g}  "
                         + (" + ".join(o.members) if o.members else o.name))
        lines.append(f"{phase:<9} {len(group)} kernels")
    return "\n".join(lines)


def write_json(analysis: Analysis, path: str) -> None:
    """Write :meth:`Analysis.to_json` to ``path`` atomically (temporary file + rename).

    Raises:
        OSError: the folder cannot be written.
    """
    data = analysis.to_json()

    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
    atomic_write(path, write)


def plot_report(analysis: Analysis, path: str) -> None:
    """Bar chart of the flop, bytes and (when measured) time share of each class, one panel per pass
    (forward, backward, forward+backward), with the paper's shares beside the forward+backward panel;
    written to ``path`` (PNG) atomically.

    Raises:
        ImportError: matplotlib is not installed. OSError: the folder cannot be written.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a, m = analysis, analysis.measurement
    shares = a.shares()
    series = [("flop", "flop_pct", "#4c72b0"), ("bytes", "bytes_pct", "#dd8452")]
    if m:
        series.append(("time (measured)", "time_pct", "#55a868"))
    panels = [("forward", "forward"), ("backward", "backward"), ("total", "forward + backward")]
    fig, axes = plt.subplots(1, 4, figsize=(17, 5.2), gridspec_kw={"width_ratios": [3, 3, 3, 2.2]})
    x = list(range(len(OP_CLASSES)))
    width = 0.8 / len(series)
    for ax, (phase, title) in zip(axes, panels):
        t = a.total(phase)
        for k, (label, key, color) in enumerate(series):
            vals = [shares[phase][c][key] for c in OP_CLASSES]
            pos = [xi - 0.4 + width * (k + 0.5) for xi in x]
            bars = ax.bar(pos, vals, width, label=label, color=color)
            for b_, v in zip(bars, vals):
                ax.annotate(f"{v:.1f}" if v >= 0.05 or v == 0 else f"{v:.2f}", (b_.get_x() + b_.get_width() / 2, v),
                            ha="center", va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
        k = a.kernels()[phase]
        ax.set_xticks(x, [f"{c}\n({k[c]} kernel{'' if k[c] == 1 else 's'})" for c in OP_CLASSES])
        sub = f"{t['flop'] / 1e9:.1f} GFLOP, {t['bytes'] / 1e6:.0f} MB"
        if m:
            sub += f", {t['seconds'] * 1e3:.1f} ms"
        ax.set_title(f"{title}\n{sub}", fontsize=10)
        ax.set_ylim(0, 112)
        ax.set_ylabel("share of the pass (%)")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(loc="upper right", fontsize=9)
    ax = axes[3]
    pw = 0.38
    paper_series = (("paper flop", "flop_pct", "#8172b3"), ("paper runtime", "runtime_pct", "#937860"))
    for k, (label, key, color) in enumerate(paper_series):
        vals = [PAPER_CLASS_SHARES[c][key] for c in OP_CLASSES]
        bars = ax.bar([xi - 0.4 + pw * (k + 0.5) + 0.02 for xi in x], vals, pw, label=label, color=color)
        for b_, v in zip(bars, vals):
            ax.annotate(f"{v:g}", (b_.get_x() + b_.get_width() / 2, v), ha="center", va="bottom", fontsize=8,
                        xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(x, list(OP_CLASSES))
    ax.set_ylim(0, 112)
    ax.set_title("paper, Table 1\n(BERT-large fwd+bwd, V100)", fontsize=10)
    ax.legend(loc="upper right", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    c = a.config
    fig.suptitle(f"{c.name} (B={c.batch_size}, J={c.max_seq_len}, I={c.hidden_size}, {c.dtype}): share per operator "
                 f"class, {'optimized' if a.optimized else 'unfused'} graphs", fontsize=12)
    fig.tight_layout()

    def write(tmp):
        fig.savefig(tmp, format="png", dpi=110)
    try:
        atomic_write(path, write)
    finally:
        plt.close(fig)
