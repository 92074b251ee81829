"""The compilation pipeline: one list of passes, in order, from a config to a loaded layer.

Each pass (DaCe's ``Pass`` / ``Pipeline`` contract in ``dace/transformation/pass_pipeline.py`` is the
model) has a name, says which artifacts it needs and which it changes, and runs on a
:class:`PipelineState`; :class:`PipelineOptions` are typed and serializable, so a recipe can be saved
and replayed. The graphs are validated after every pass that changes them (``sdfg.validate()`` and
:meth:`~substation.ir.graph.LayerGraph.check`). :data:`PASSES` is the single list the API, the CLI and its
progress bar, and the tests use.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import threading
from typing import Any, Callable, Mapping

import torch

from .backends.cpu.build import ToolchainError, build_libraries, require_bf16_isa
from .backends.cpu.codegen import generate_cpu
from .backends.cpu.gemm_libraries import check_fp32_gemm, links_onednn
from .backends.cuda.build import build_cuda_libraries
from .backends.cuda.codegen import generate_cuda
from .config import CUDA_DTYPES, DTYPES, EncoderConfig, load_config
from .ir.graph import LayerGraph, build_forward
from .passes.attention import applies_to, fuse_attention
from .passes.autodiff import build_backward
from .passes.epilogue import applies_to as epilogue_applies
from .passes.epilogue import fuse_epilogues, pack_parameters
from .passes.fusion import fuse as fuse_graph
from .passes.layout import LayoutPlan, apply_plan, default_plan, load_plan
from .passes.precision import applies_to as mixed_precision_applies
from .passes.precision import cast_backward_contraction_inputs, mixed_precision
from .perf.gemm_choice import fixed_fp32_gemm, resolve_fp32_gemm
from .runtime.library import DTYPE_NAMES, CompiledGraph, CompiledLayer

__all__ = ["PASSES", "Pass", "Pipeline", "MODES", "PipelineOptions", "PipelineState", "build_after_apply", "cached_compile",
           "compile_graphs", "compile_layer", "compiled_from_state", "compiled_state", "fp32_gemm_library",
           "rebuild_for"]


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """The options of one pipeline run.

    Attributes:
        fuse: run the fusion pass (row kernels); False: one kernel per operator.
        attention: in forward-only CPU builds with ``fuse`` (float32, float64 and bfloat16), fuse
            scores, mask, softmax and context into one ``attention`` kernel
            (:mod:`substation.passes.attention`); False keeps them apart (to compare).
        layout: a layout plan: a path, a bundled plan name or a :class:`LayoutPlan`; ``"default"``
            keeps PyTorch's layouts; None: the config's default plan
            (:func:`~substation.passes.layout.default_plan`: PyTorch's layouts, except that bfloat16 CPU
            builds store QKV T-major).
        instrument: per-operator timers in the CPU libraries (``CompiledGraph.op_seconds``).
        mode: ``train`` (forward and backward libraries; forward writes what backward reads) or
            ``eval`` (the inference build: a forward library only: no dropout, nothing saved, intermediates in a
            workspace whose buffers are reused once dead; the default plan), one of :data:`MODES`.
        fp32_gemm: the library of float32 CPU builds' token-wise contractions (other builds ignore it):
            ``"auto"`` (default: inference builds the library measured faster on this machine, training
            builds MKL; :mod:`substation.perf.gemm_choice`), ``"mkl"`` (``cblas_sgemm``) or ``"onednn"``
            (``ss::matmul<float>``: 1.18-1.22x faster GEMMs on AMD Zen 4, and in inference builds the
            bias and GELU epilogues and packed weights; up to 2.2-3.5x PyTorch float32's error on weight
            gradients; docs/toolchain.md), one of
            :data:`~substation.backends.cpu.gemm_libraries.FP32_GEMM_CHOICES`.
        float32_masters: bfloat16 CPU builds that a float32 layer runs under autocast: its parameters are
            float32 master weights. The inference build then takes the weights its GEMMs read from packed
            copies in float32 and rounds them to bf16 as it packs them (found again by their content),
            instead of a bf16 cast of every weight on every call (:func:`~substation.passes.epilogue.pack_parameters`);
            other builds ignore it.

    Raises:
        TypeError: an option of the wrong type. ValueError: an unknown mode or fp32_gemm; fp32_gemm
            ``"auto"`` with ``$SUBSTATION_FP32_GEMM`` set to something else than a library.
        FileNotFoundError: a layout path or name that names no plan file and no bundled plan.
        PlanError: a layout plan file that is no plan (:func:`~substation.passes.layout.load_plan`).
    """

    fuse: bool = True
    attention: bool = True
    layout: Any = None
    instrument: bool = False
    mode: str = "train"
    fp32_gemm: str = "auto"
    float32_masters: bool = False

    def __post_init__(self):
        for name in ("fuse", "attention", "instrument", "float32_masters"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"PipelineOptions.{name} must be a bool, got {getattr(self, name)!r}")
        if self.mode not in MODES:
            raise ValueError(f"PipelineOptions.mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        check_fp32_gemm(self.fp32_gemm)
        if self.fp32_gemm == "auto":
            fixed_fp32_gemm()  # a bad $SUBSTATION_FP32_GEMM is named at the compile, not at a later inference call
        if self.mode == "eval" and self.layout not in (None, "default"):
            raise ValueError("layout plans are chosen for the training graphs (forward and backward together); "
                             "an inference build uses PyTorch's layouts (pass layout=None)")
        if not (self.layout is None or isinstance(self.layout, (str, os.PathLike, LayoutPlan))):
            raise TypeError(f"PipelineOptions.layout must be None, a plan path or name, or a LayoutPlan; "
                            f"got {type(self.layout).__name__}")
        if isinstance(self.layout, (str, os.PathLike)):
            load_plan(self.layout)  # a missing or malformed plan is named here, before any pass runs

    def to_dict(self) -> dict:
        """Plain data (a layout plan object becomes its JSON mapping)."""
        layout = self.layout.to_dict() if isinstance(self.layout, LayoutPlan) else \
            (os.fspath(self.layout) if self.layout is not None else None)
        return {"fuse": self.fuse, "attention": self.attention, "layout": layout, "instrument": self.instrument,
                "mode": self.mode, "fp32_gemm": self.fp32_gemm, "float32_masters": self.float32_masters}

    @classmethod
    def from_dict(cls, data: Mapping) -> "PipelineOptions":
        """The inverse of :meth:`to_dict`.

        Raises:
            KeyError: an unknown option. TypeError: a wrong type.
        """
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise KeyError(f"unknown pipeline options {sorted(unknown)}")
        layout = data.get("layout")
        if isinstance(layout, Mapping):
            layout = load_plan(layout)
        return cls(fuse=data.get("fuse", True), attention=data.get("attention", True), layout=layout,
                   instrument=data.get("instrument", False), mode=data.get("mode", "train"),
                   fp32_gemm=data.get("fp32_gemm", "auto"), float32_masters=data.get("float32_masters", False))


@dataclasses.dataclass
class PipelineState:
    """What the passes read and write (the artifacts).

    Attributes:
        config: the encoder config. options: the run's options.
        forward, backward: the :class:`~substation.ir.graph.LayerGraph` pair (SDFGs inside); no
            backward graph in mode ``eval``.
        sources: generated source of each graph (``forward``/``backward``).
        fp32_gemm: the library the float32 token-wise GEMMs of the sources call (``options.fp32_gemm``
            resolved; None for CUDA and other dtypes).
        built: the build results (library paths, build seconds).
        compiled: the loaded :class:`~substation.runtime.CompiledLayer`.
    """

    config: EncoderConfig
    options: PipelineOptions
    forward: LayerGraph | None = None
    backward: LayerGraph | None = None
    sources: dict | None = None
    fp32_gemm: str | None = None
    built: dict | None = None
    compiled: CompiledLayer | None = None


@dataclasses.dataclass(frozen=True)
class Pass:
    """One pass.

    Attributes:
        name: the pass' name (progress bar, ``until=``).
        description: what it does, one line.
        needs: artifacts (:class:`PipelineState` fields) it reads.
        changes: artifacts it writes.
        run: ``state -> None``.
        enabled: ``options -> bool`` (a disabled pass is skipped, e.g. fusion with ``fuse=False``).
    """

    name: str
    description: str
    needs: frozenset
    changes: frozenset
    run: Callable[[PipelineState], None]
    enabled: Callable[[PipelineOptions], bool] = lambda options: True


def _graph(state: PipelineState) -> None:
    state.forward = build_forward(state.config, dropout=state.options.mode == "train")


def _precision(state: PipelineState) -> None:
    state.forward = mixed_precision(state.forward)


def _autodiff(state: PipelineState) -> None:
    state.forward, backward = build_backward(state.forward)
    state.backward = cast_backward_contraction_inputs(backward)


def _graphs(state: PipelineState) -> dict[str, LayerGraph]:
    """The state's graphs by phase (``backward`` absent in mode ``eval``)."""
    return {p: g for p, g in (("forward", state.forward), ("backward", state.backward)) if g is not None}


def _fusion(state: PipelineState) -> None:
    if state.options.attention and applies_to(state.forward, state.backward is not None):
        state.forward = fuse_attention(state.forward)
    if epilogue_applies(state.config, state.fp32_gemm):
        state.forward = fuse_epilogues(state.forward)
        if state.backward is None:
            state.forward = pack_parameters(state.forward, state.options.float32_masters)
    for phase, graph in _graphs(state).items():
        setattr(state, phase, fuse_graph(graph))


def _layout(state: PipelineState) -> None:
    plan = state.options.layout if state.options.layout is not None else default_plan(state.config)
    state.forward, state.backward = apply_plan(state.forward, state.backward, plan)


def fp32_gemm_library(config: EncoderConfig, fp32_gemm: str = "auto", mode: str = "train") -> str | None:
    """The library the token-wise GEMMs of a float32 CPU build of ``config`` in ``mode`` call for
    ``fp32_gemm`` (:func:`~substation.perf.gemm_choice.resolve_fp32_gemm`: ``"mkl"`` or ``"onednn"``);
    None for builds without float32 CPU GEMMs, which ignore the option.

    Raises:
        ValueError: as :func:`~substation.perf.gemm_choice.resolve_fp32_gemm`.
    """
    if config.target == "cpu" and config.dtype == "float32":
        return resolve_fp32_gemm(fp32_gemm, config, mode)
    return None


def _gemm_library(state: PipelineState) -> None:
    state.fp32_gemm = fp32_gemm_library(state.config, state.options.fp32_gemm, state.options.mode)


def _codegen(state: PipelineState) -> None:
    if state.config.target == "cuda":  # nvcc + cuBLAS (docs/cuda.md); B, J, K stay runtime sizes
        if state.options.instrument:
            raise ValueError("instrument=True (per-operator timers) is CPU-only; use a CUDA profiler for target cuda")
        state.sources = {p: generate_cuda(g) for p, g in _graphs(state).items()}
    else:
        if state.config.dtype == "bfloat16":
            require_bf16_isa()
        library = state.fp32_gemm or "mkl"  # the float32 library; other dtypes' GEMMs ignore it
        state.sources = {p: generate_cpu(g, state.options.instrument, library) for p, g in _graphs(state).items()}


def _libraries(state: PipelineState, sources: dict[str, str]) -> dict:
    """The built (or cached) library of each source, by phase."""
    if state.config.target == "cuda":
        return build_cuda_libraries(sources, state.config.cuda_arch)
    return build_libraries(sources, with_onednn=links_onednn(state.config.dtype, state.fp32_gemm))


def _build(state: PipelineState) -> None:
    state.built = _libraries(state, state.sources)


def _loaded(state: PipelineState, phase: str, graph: LayerGraph) -> CompiledGraph:
    """The library of ``phase`` loaded; built again once when its cache entry was removed after it was
    built (``substation cache --clear`` in another process meanwhile)."""
    try:
        return CompiledGraph(graph, state.built[phase].path)
    except OSError:
        if os.path.exists(state.built[phase].path):
            raise
    state.built.update(_libraries(state, {phase: state.sources[phase]}))
    return CompiledGraph(graph, state.built[phase].path)


def _load(state: PipelineState) -> None:
    opts = state.options
    loaded = {p: _loaded(state, p, g) for p, g in _graphs(state).items()}
    autocast_build, autocast_note = None, None
    if state.config.target == "cpu" and state.config.dtype == "float32":
        try:
            require_bf16_isa()
            # a float32 layout plan names the float32 graphs' tensors and was chosen for their costs: the
            # bf16 build takes its own default plan
            autocast_build = functools.partial(cached_compile, state.config.replace(dtype="bfloat16"), fuse=opts.fuse,
                                               instrument=opts.instrument, mode=opts.mode, attention=opts.attention,
                                               float32_masters=True)
        except ToolchainError as e:
            autocast_note = str(e)
    options = {"fuse": opts.fuse, "attention": opts.attention, "layout": opts.layout, "instrument": opts.instrument,
               "fp32_gemm": opts.fp32_gemm, "float32_masters": opts.float32_masters}
    no_dropout_build = None
    if opts.mode == "train" and mixed_precision_applies(state.config.dtype, state.config.target) \
            and state.config.dropout.attention > 0:
        no_dropout_build = functools.partial(
            cached_compile, state.config.replace(dropout={"attention": 0.0, "hidden": 0.0, "activation": 0.0,
                                                          "attention_output": None}),
            fuse=opts.fuse, instrument=opts.instrument, mode="train", attention=opts.attention,
            fp32_gemm=opts.fp32_gemm, float32_masters=opts.float32_masters)  # its own default layout plan
    state.compiled = CompiledLayer(
        state.config, loaded["forward"], loaded.get("backward"), {k: v.seconds for k, v in state.built.items()},
        state.sources, {**options, "mode": opts.mode},
        inference_build=functools.partial(cached_compile, state.config, fuse=opts.fuse, instrument=opts.instrument,
                                          mode="eval", attention=opts.attention, fp32_gemm=opts.fp32_gemm,
                                          float32_masters=opts.float32_masters),
        autocast_build=autocast_build, autocast_note=autocast_note, no_dropout_build=no_dropout_build,
        fp32_gemm_library=state.fp32_gemm)


_GRAPHS = frozenset({"forward", "backward"})
_FORWARD = frozenset({"forward"})

#: Build modes (:attr:`PipelineOptions.mode`).
MODES = ("train", "eval")

#: The passes, in order. In mode ``eval`` autodiff is skipped and the later passes work on the
#: forward graph alone.
PASSES = (
    Pass("graph", "build the forward SDFG from the config", frozenset({"config"}), _FORWARD, _graph),
    Pass("precision", "mixed precision (bfloat16 CPU builds): autocast's dtype for every tensor, float32 "
         "residual stream, casts before contractions", _FORWARD, _FORWARD, _precision),
    Pass("autodiff", "derive the backward SDFG; mark what forward saves; casts before float32 inputs of "
         "bf16 GEMMs", _FORWARD, _GRAPHS, _autodiff,
         lambda o: o.mode == "train"),
    Pass("gemm-library", "choose the float32 CPU builds' GEMM library (inference builds: the one measured "
         "faster on this machine)", frozenset({"config"}), frozenset({"fp32_gemm"}), _gemm_library),
    Pass("fusion", "fuse attention (forward-only CPU builds), move biases and inference activations into "
         "GEMM epilogues and read parameters from packed copies in inference (builds on oneDNN's GEMMs), "
         "then group element-wise and normalization operators into row kernels", _FORWARD | {"fp32_gemm"},
         _GRAPHS, _fusion, lambda o: o.fuse),
    Pass("layout", "apply a layout plan (given, or the dtype's default): tensor strides, explicit transposes, "
         "vectorized letters", _FORWARD, _GRAPHS, _layout),
    Pass("codegen", "generate C++ (CPU) or CUDA for each graph", _FORWARD | {"fp32_gemm"},
         frozenset({"sources"}), _codegen),
    Pass("build", "compile and link against BLAS / cuBLAS, through the build cache",
         frozenset({"sources", "fp32_gemm"}), frozenset({"built"}), _build),
    Pass("load", "load the libraries behind the torch custom operators",
         frozenset({"built", "fp32_gemm"}) | _FORWARD, frozenset({"compiled"}), _load),
)


class Pipeline:
    """Runs a list of passes (default :data:`PASSES`) in order, checking each one's needs and
    validating the graphs after each pass that changes them.

    Raises (from :meth:`run`):
        ValueError: ``until`` is not a pass name; a pass whose needs are missing (a bad pass list).
        ConfigError, FileNotFoundError: a bad config. PlanError: a layout plan that does not fit.
        LayoutError: layouts that need a transpose. ToolchainError, BuildError: the compiler failed.
        dace's InvalidSDFGError: a pass produced an invalid SDFG.
    """

    def __init__(self, passes: tuple = PASSES):
        self.passes = tuple(passes)

    @property
    def names(self) -> list[str]:
        """The passes' names, in order."""
        return [p.name for p in self.passes]

    def run(self, config, options: PipelineOptions | None = None, until: str | None = None,
            progress: Callable[[str], None] | None = None) -> PipelineState:
        """Run the passes on ``config`` (a config, a YAML path or a bundled name), up to and including
        ``until``; ``progress`` is called with each pass' name as it starts (skipped passes too)."""
        if until is not None and until not in self.names:
            raise ValueError(f"until={until!r} is not a pass (passes: {', '.join(self.names)})")
        state = PipelineState(load_config(config), options or PipelineOptions())
        have = {"config"}
        for p in self.passes:
            if progress is not None:
                progress(p.name)
            if p.enabled(state.options):
                missing = p.needs - have
                if missing:
                    raise ValueError(f"pass {p.name} needs {sorted(missing)}, which no earlier pass produced")
                p.run(state)
                have |= p.changes
                for name in sorted(p.changes & _GRAPHS):
                    graph = getattr(state, name)
                    if graph is not None:
                        graph.sdfg.validate()
                        graph.check()
            if p.name == until:
                break
        return state


def compile_graphs(config: "EncoderConfig | str | os.PathLike", fuse_ops: bool = False, layout=None,
                   mode: str = "train", attention: bool = True, float32_masters: bool = False,
                   fp32_gemm: str = "auto"):
    """The (forward, backward) :class:`~substation.ir.graph.LayerGraph` pair after the passes up to
    ``layout`` (fusion with ``fuse_ops``; ``layout``, ``mode``, ``attention``, ``float32_masters`` and
    ``fp32_gemm`` as :class:`PipelineOptions`: float32 inference graphs on oneDNN's GEMMs take their
    biases and activations in GEMM epilogues; backward is None in mode ``eval``)."""
    options = PipelineOptions(fuse=fuse_ops, layout=layout, mode=mode, attention=attention,
                              float32_masters=float32_masters, fp32_gemm=fp32_gemm)
    state = Pipeline().run(config, options, until="layout")
    return state.forward, state.backward


def compile_layer(config: "EncoderConfig | str | os.PathLike", progress=None, instrument: bool = False,
                  fuse: bool = True, layout=None, mode: str = "train", attention: bool = True,
                  fp32_gemm: str = "auto", float32_masters: bool = False) -> CompiledLayer:
    """Run every pass for ``config`` (a config, a YAML path or a bundled config name) and return the
    loaded :class:`~substation.runtime.CompiledLayer`.

    ``progress``, if given, is called with each pass name as it starts. ``instrument``, ``fuse``,
    ``layout``, ``mode``, ``attention``, ``fp32_gemm`` and ``float32_masters``: see :class:`PipelineOptions`.

    Raises:
        as :class:`PipelineOptions` (a bad option or layout plan, before any pass runs) and
        :meth:`Pipeline.run`; ValueError: ``instrument`` with target ``cuda``.
    """
    options = PipelineOptions(fuse=fuse, layout=layout, instrument=instrument, mode=mode, attention=attention,
                              fp32_gemm=fp32_gemm, float32_masters=float32_masters)
    return Pipeline().run(config, options, progress=progress).compiled


_LOADED: dict = {}
_LOADED_LOCK = threading.Lock()


def cached_compile(config: "EncoderConfig | str | os.PathLike", fuse: bool = True, layout=None,
                   instrument: bool = False, mode: str = "train", attention: bool = True,
                   fp32_gemm: str = "auto", float32_masters: bool = False) -> CompiledLayer:
    """:func:`compile_layer`, memoised per process by config and options: layers of equal configs (the
    twelve layers of a BERT model, a pickled layer loaded twice) share one loaded build, on top of
    the on-disk build cache. A layout given as a :class:`~substation.passes.layout.LayoutPlan`
    object is memoised by identity.

    Raises:
        as :func:`compile_layer`.
    """
    config = load_config(config)
    key = (config, fuse, layout if layout is None or isinstance(layout, (str, os.PathLike)) else id(layout), instrument,
           mode, attention, fp32_gemm, float32_masters)
    with _LOADED_LOCK:
        compiled = _LOADED.get(key)
        if compiled is None:
            compiled = _LOADED[key] = compile_layer(config, fuse=fuse, layout=layout, instrument=instrument, mode=mode,
                                                    attention=attention, fp32_gemm=fp32_gemm,
                                                    float32_masters=float32_masters)
    return compiled


def rebuild_for(compiled: CompiledLayer, dtype: torch.dtype, device: torch.device) -> CompiledLayer:
    """The compiled layer of ``compiled``'s config for another parameter dtype and device, through the
    build cache (``compiled`` itself when nothing changes). Used by ``.to()``, ``.double()`` etc. A
    CUDA float16/bfloat16 layer given float32 parameters keeps its build: those are master weights, cast
    under ``torch.autocast``; on the CPU, float32 parameters get the float32 build (which runs its
    bfloat16 build under bf16 autocast).

    Raises:
        TypeError: a dtype or device the config's target does not compile (the message names what does).
    """
    config = compiled.config
    names = DTYPE_NAMES
    allowed = CUDA_DTYPES if config.target == "cuda" else DTYPES
    runs_on = compiled.forward.device_type
    if device.type != runs_on:
        hint = f" (compile with target: {device.type} instead)" if device.type in ("cpu", "cuda") else ""
        raise TypeError(f"Substation's layers of this build run on {'the CPU' if runs_on == 'cpu' else 'CUDA'} only; "
                        f"moving them to {device} is not supported{hint}")
    if names.get(dtype) not in allowed:
        raise TypeError(f"Substation's target {config.target} compiles {', '.join(allowed)} layers; converting "
                        f"them to {dtype} is not supported")
    if names[dtype] == config.dtype or (config.target == "cuda" and dtype == torch.float32
                                        and config.dtype in ("float16", "bfloat16")):
        return compiled
    return cached_compile(config.replace(dtype=names[dtype]), **compiled.options)


def build_after_apply(compiled: CompiledLayer, fn, dtype: torch.dtype) -> CompiledLayer:
    """The build a layer needs after ``nn.Module._apply(fn)`` (``.to()``, ``.double()``, ...): ``fn`` is
    probed on a CPU tensor of ``dtype`` (the layer's parameter dtype: ``.to("cpu")`` keeps a float64
    layer float64) and :func:`rebuild_for` picks the build of the resulting dtype and device, raising
    before any parameter is converted.

    Raises:
        TypeError: as :func:`rebuild_for`.
    """
    probe = fn(torch.zeros(1, dtype=dtype))
    return rebuild_for(compiled, probe.dtype, probe.device) if probe.dtype.is_floating_point else compiled


def compiled_state(compiled: CompiledLayer) -> tuple:
    """What rebuilds ``compiled`` in another process (its config and build options): libraries do not pickle."""
    return compiled.config, compiled.options


def compiled_from_state(state: tuple) -> CompiledLayer:
    """The inverse of :func:`compiled_state`: the layer's libraries, from the build cache when present."""
    config, options = state
    return cached_compile(config, **options)
