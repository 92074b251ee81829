"""Flop and data-movement analysis of the encoder layer's graphs (Ivanov et al. 2020, section 3).

Every operator of a :class:`~substation.ir.graph.LayerGraph` is counted from the graph alone:

* **bytes read / written**: for every connector of the operator, the elements its access string
  touches (the product of the sizes of its letters; a digit, a fixed index, contributes 1) times the
  itemsize of that tensor's dtype in the build (:func:`~substation.runtime.graph_tensor_dtypes`: the
  config's dtype, 8, 4 or 2 bytes; float64 statistics of float32 CPU builds; float32 statistics and
  parameter gradients of bfloat16 builds). Each connector counts once per operator: no cache
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

Under ``torch.autocast`` a bfloat16 CPU build also casts the float32 master weights of its linear
layers to bfloat16 once per call, inside the operator (backward reuses the copies):
:func:`master_weight_casts` counts that as one more forward EW operator, ``master_weight_casts``
(4 bytes read and 2 written per weight element; a pure-bf16 layer skips it, its parameters are bf16).

The measured side (:func:`measure`) runs the compiled layer with per-operator timers and a
STREAM-like copy to get the machine's copy bandwidth; :meth:`Analysis.to_json`, :func:`format_report`
and :func:`plot_report` present the result.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Callable, Mapping

import sympy

from ..backends.cpu.contraction import PACKED_PARAMETER_ROWS
from ..config import ITEMSIZES, EncoderConfig, load_config
from ..ir.graph import OP_CLASSES, LayerGraph, Operator, access_letters
from ..ops import op_kind
from ..ops.kind import elements
from ..passes.epilogue import float32_master
from ..runtime.library import graph_tensor_dtypes

__all__ = [
    "SYMBOLS", "PAPER_CLASS_SHARES", "PAPER_MAX_REDUCTION_PCT", "PASSES",
    "OperatorCount", "Measurement", "Analysis",
    "access_elements", "kind_flop", "operator_count", "count_graph", "master_weight_casts", "optimized_graphs",
    "analyze",
    "measure",
]
from ..layer import EncoderLayer
from ..pipeline import compile_graphs, compile_layer, fp32_gemm_library
from .probes import CopyTimer
from .timing import Candidate, time_step

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
    item = {t: ITEMSIZES[d] for t, d in graph_tensor_dtypes(graph).items()}
    sizes = dict(sizes or cfg.sizes())
    ins, outs = graph.inputs_of(op), graph.outputs_of(op)
    attrs = op.attrs
    num, sym = _sizer(sizes), _sizer(None)

    # a float32 master weight of a bf16 GEMM is read from its packed bf16 copy (and digested in float32)
    packed = attrs.get("packed_parameter") if op.kind == "contraction" else None
    read_item = dict(item, **({packed: ITEMSIZES[cfg.dtype]} if packed is not None else {}))

    def nbytes(operands, sizer, sizes_of=item):
        return sum((sizes_of[t] * access_elements(a, sizer) for t, a in operands.values()), sympy.Integer(0))
    members = tuple(m.get("name", "?") for m in attrs.get("ops", ())) if op.kind == "fused" else ()
    digest_sym, digest = _parameter_digest(graph, op, item, sizes)
    return OperatorCount(
        name=op.label, phase=graph.phase, op_class=op.op_class, kind=op.kind,
        flop_expr=sympy.expand(kind_flop(op.kind, attrs, ins, outs, sym)),
        read_expr=sympy.expand(nbytes(ins, sym, read_item)) + digest_sym, written_expr=sympy.expand(nbytes(outs, sym)),
        flop=int(kind_flop(op.kind, attrs, ins, outs, num)),
        bytes_read=int(nbytes(ins, num, read_item)) + digest, bytes_written=int(nbytes(outs, num)),
        members=members)


def _parameter_digest(graph: LayerGraph, op: Operator, item: dict, sizes: Mapping[str, int]):
    """(symbolic, numeric) bytes a ``packed_parameter`` contraction reads for the digest of its
    parameter (one more pass over it, at B x J >= PACKED_PARAMETER_ROWS rows, or always for float32
    master weights of a bf16 graph); (0, 0) otherwise."""
    name = op.attrs.get("packed_parameter")
    if op.kind != "contraction" or name is None:
        return sympy.Integer(0), 0
    access = next(a for t, a in graph.inputs_of(op).values() if t == name)
    own = set(access_letters(access))
    rows = "".join(c for c in access_letters(graph.outputs_of(op)["y"][1]) if c not in own)  # B x J

    def count(sizer):
        return access_elements(rows, sizer), item[name] * access_elements(access, sizer)
    (rows_sym, bytes_sym), (rows_num, bytes_num) = count(_sizer(None)), count(_sizer(sizes))
    if float32_master(graph, name):  # digested every call
        return bytes_sym, int(bytes_num)
    return (sympy.Piecewise((bytes_sym, sympy.Ge(rows_sym, PACKED_PARAMETER_ROWS)), (0, True)),
            int(bytes_num) if rows_num >= PACKED_PARAMETER_ROWS else 0)


def count_graph(graph: LayerGraph, sizes: Mapping[str, int] | None = None) -> list[OperatorCount]:
    """:func:`operator_count` of every operator of ``graph``, in execution order."""
    return [operator_count(graph, op, sizes) for op in graph.operators()]


def master_weight_casts(forward: LayerGraph, sizes: Mapping[str, int] | None = None) -> OperatorCount | None:
    """The cast of the float32 master weights to the bfloat16 parameters a build of ``forward`` reads,
    once per call under autocast (``runtime.custom_ops``): read 4 and write 2 bytes per element of every
    parameter the build keeps in bfloat16 (an inference build with ``float32_masters`` packs its weights
    from float32 and casts only the rest); None for builds without one (float32, float64, CUDA)."""
    dtypes = graph_tensor_dtypes(forward)
    low = [t for n, t in forward.tensors.items() if t.role == "param" and ITEMSIZES[dtypes[n]] < 4]
    if forward.config.target != "cpu" or not low:
        return None
    num, sym = _sizer(dict(sizes or forward.config.sizes())), _sizer(None)

    def count(sizer):
        return sum((elements(t.dims, sizer) for t in low), sympy.Integer(0))
    n_sym, n = sympy.expand(count(sym)), int(count(num))
    return OperatorCount(name="master_weight_casts", phase="forward", op_class="EW", kind="cast",
                         flop_expr=sympy.Integer(0), read_expr=4 * n_sym, written_expr=2 * n_sym, flop=0,
                         bytes_read=4 * n, bytes_written=2 * n)


def _counts(graphs, sizes) -> list[OperatorCount]:
    """Every operator of ``graphs`` (forward, backward or None) in execution order: the master-weight
    casts (done when the call starts), then each graph's operators."""
    casts = master_weight_casts(graphs[0], sizes)
    return ([casts] if casts is not None else []) + [c for g in graphs if g is not None for c in count_graph(g, sizes)]


# -- graphs --------------------------------------------------------------------------------------
def optimized_graphs(config: EncoderConfig, mode: str = "train", fp32_gemm: str = "auto"):
    """The (forward, backward) graphs after the pipeline's optimization passes (fusion), PyTorch's
    layouts; backward None in mode ``eval``. A bfloat16 build is counted as autocast runs it, on float32
    master weights (``float32_masters``: :func:`master_weight_casts` counts what is still cast per call);
    a float32 CPU build as it runs on ``fp32_gemm`` (on oneDNN: epilogues, packed weights in inference)."""
    return compile_graphs(load_config(config), fuse_ops=True, mode=mode, float32_masters=True, fp32_gemm=fp32_gemm)


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
        fp32_gemm: the library the measured build's float32 token-wise GEMMs call (``"mkl"`` or
            ``"onednn"``); None for other dtypes.
    """

    op_seconds: dict
    pass_seconds: dict
    copy_bandwidth: float
    copy_buffer_bytes: int
    repeats: int
    warmup: int
    fp32_gemm: str | None = None


@dataclasses.dataclass(frozen=True)
class Analysis:
    """Per-operator counts of the forward and backward graphs of one config.

    Attributes:
        config: the encoder config. sizes: letter -> size the values were evaluated at.
        optimized: whether the graphs are those of :func:`optimized_graphs`.
        operators: forward operators then backward operators (:class:`OperatorCount`).
        unfused_bytes: total bytes (forward + backward) of the unoptimized graphs, when ``optimized``.
        measurement: the :class:`Measurement`, when measured.
        mode: ``train`` (forward and backward graphs) or ``eval`` (the inference build's forward
            graph alone).
        fp32_gemm: the GEMM library whose float32 CPU graphs were counted (``"mkl"`` or ``"onednn"``);
            None for other configs.
    """

    config: EncoderConfig
    sizes: dict
    optimized: bool
    operators: tuple[OperatorCount, ...]
    unfused_bytes: int | None = None
    measurement: Measurement | None = None
    mode: str = "train"
    fp32_gemm: str | None = None

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
        """pass -> flop of the TC operators: in unfused graphs the contractions alone (the paper's
        closed-form counts, 2 x the product of the dimensions); in optimized graphs a TC kernel also
        counts the arithmetic fused into it (GEMM-epilogue biases and GELU, the attention kernel's mask,
        softmax and Q/K/V biases): a few hundredths of a percent more."""
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
            "mode": self.mode, "fp32_gemm": self.fp32_gemm,
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
                                "pass_seconds": m.pass_seconds, "repeats": m.repeats, "warmup": m.warmup,
                                "fp32_gemm": m.fp32_gemm}
        return data


def _pct(part, whole) -> float:
    return 100.0 * part / whole if whole else 0.0


def analyze(config, optimized: bool = False, mode: str = "train", fp32_gemm: str = "auto") -> Analysis:
    """Count the forward and backward graphs of ``config`` (a config, a YAML path or a bundled name);
    ``mode="eval"``: the forward graph of the inference build alone (no dropout, nothing saved).

    With ``optimized``, counts the fused graphs and also the unfused ones, for
    :attr:`Analysis.data_movement_reduction_pct`; a float32 CPU config's fused graphs are those of the
    GEMM library ``fp32_gemm`` resolves to (:func:`~substation.pipeline.fp32_gemm_library`, recorded in
    :attr:`Analysis.fp32_gemm`: oneDNN's builds take biases and activations in GEMM epilogues). Needs no
    compilation (``"auto"`` may measure the library choice once, :mod:`~substation.perf.gemm_choice`).

    Raises:
        ConfigError, FileNotFoundError: a bad config.
        NotImplementedError: ``optimized`` while the pipeline has no optimization stage.
        ValueError: an operator kind without a flop rule; an unknown ``fp32_gemm``.
    """

    config = load_config(config)
    sizes = config.sizes()
    library = fp32_gemm_library(config, fp32_gemm, mode)
    resolved = library or fp32_gemm  # the library itself: the pipeline runs below need not resolve it again
    unfused_ops = _counts(compile_graphs(config, mode=mode, fp32_gemm=resolved), sizes)
    if not optimized:
        return Analysis(config, sizes, False, tuple(unfused_ops), mode=mode, fp32_gemm=library)
    opt_ops = _counts(optimized_graphs(config, mode, resolved), sizes)
    return Analysis(config, sizes, True, tuple(opt_ops), unfused_bytes=sum(o.bytes for o in unfused_ops), mode=mode,
                    fp32_gemm=library)


# -- measurement ---------------------------------------------------------------------------------


def measure(config, repeats: int = 5, warmup: int = 1, seed: int = 0, compiled=None,
            copy_bytes: int | None = None, optimized: bool = False, mode: str = "train",
            fp32_gemm: str = "auto") -> Measurement:
    """Run the compiled layer (train mode, random input at the config's sizes) with per-operator timers;
    ``mode="eval"``: forward passes of the inference build in eval mode under ``torch.inference_mode``.

    Compiles ``config`` with ``instrument=True`` (and the pipeline's optimization stages only when
    ``optimized``, so the timers match the graphs :func:`analyze` counted with the same flag) unless an
    instrumented ``compiled`` (:class:`~substation.runtime.CompiledLayer`) is given, runs ``warmup``
    untimed and ``repeats`` timed forward+backward steps, and measures the copy bandwidth
    (:func:`copy_bandwidth`'s copy with buffers of ``copy_bytes``, default 4x the last-level cache) in
    the same run: four copies timed after each timed step, the median over all of them, so the copy
    sees the same machine state as the kernels (the memory bandwidth of a shared machine drifts by
    tens of percent within seconds). A bfloat16 build is measured as autocast runs it
    (``float32_masters``: an inference build takes the weights it packs in float32) with bf16 parameters
    otherwise; the cast of float32 master weights it does under autocast (:func:`master_weight_casts`) is
    timed after each step on float32 copies of those parameters. ``fp32_gemm``: the float32 GEMM
    library of the build it compiles (:func:`analyze` with the same value counts its graphs).

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
        compiled = compile_layer(config, instrument=True, fuse=optimized, mode=mode, float32_masters=True,
                                 fp32_gemm=fp32_gemm)
    libs = {"forward": compiled.forward}
    if mode == "train":
        libs["backward"] = compiled.backward
    if compiled.mode != mode or not all(lib.instrumented for lib in libs.values()):
        raise RuntimeError(f"measure() needs a layer compiled with instrument=True and mode={mode!r}")
    layer = EncoderLayer(compiled).train(mode == "train")
    gen = torch.Generator().manual_seed(seed)
    b, j, i = config.batch_size, config.max_seq_len, config.hidden_size
    x = torch.randn(b, j, i, generator=gen, dtype=layer.torch_dtype)
    dy = torch.randn(b, j, i, generator=gen, dtype=layer.torch_dtype) if mode == "train" else None
    mask = torch.zeros(b, j, dtype=layer.torch_dtype) if config.mask != "none" else None
    per_op: dict = {}
    per_pass: dict = {phase: [] for phase in libs}
    casts = master_weight_casts(compiled.forward.graph)
    masters = [] if casts is None else [p.detach().float() for n, p in layer.named_parameters()
                                        if compiled.forward.dtypes[n] == torch.bfloat16]
    copy = CopyTimer(copy_bytes)
    step = Candidate("substation", lambda xg: layer(xg, attention_mask=mask), list(layer.parameters()))
    for r in range(warmup + repeats):
        for lib in libs.values():
            lib.op_seconds(reset=True)
        seconds = dict(zip(("forward", "backward"), time_step(step, x, dy)))
        if r < warmup:
            continue
        for phase in libs:
            per_pass[phase].append(seconds[phase])
        for phase, lib in libs.items():
            for name, s in lib.op_seconds(reset=True).items():
                per_op.setdefault((phase, name), []).append(s)
        if masters:
            t0 = time.perf_counter()
            for m in masters:
                m.to(torch.bfloat16)
            per_op.setdefault(("forward", casts.name), []).append(time.perf_counter() - t0)
        for _ in range(4):
            copy()
    return Measurement({k: statistics.median(v) for k, v in per_op.items()},
                       {k: statistics.median(v) for k, v in per_pass.items()}, copy.bandwidth(),
                       copy.buffer_bytes, repeats, warmup, compiled.fp32_gemm_library)


# -- presentation --------------------------------------------------------------------------------


