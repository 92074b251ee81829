"""The compilation pipeline: named stages, in order, from a config to a loaded layer."""
from __future__ import annotations

import os
import threading

from .autodiff import build_backward
from .build import build_libraries
from .codegen import generate_cpu
from .config import EncoderConfig, load_config
from .graph import build_forward
from .passes import fuse as fuse_pass
from .runtime import CompiledGraph, CompiledLayer

__all__ = ["STAGES", "cached_compile", "compile_graphs", "compile_layer"]

#: The stages, in order: (name, what it does).
STAGES = (
    ("graph", "build the forward SDFG from the config"),
    ("autodiff", "derive the backward SDFG; mark what forward saves"),
    ("fusion", "group element-wise and normalization operators into row kernels"),
    ("layout", "apply a layout plan: tensor strides, explicit transposes, vectorized letters"),
    ("codegen", "generate C++ for each graph"),
    ("build", "compile and link against BLAS, through the build cache"),
    ("load", "load the libraries behind torch.autograd"),
)


def compile_graphs(config: EncoderConfig, fuse_ops: bool = False, layout=None):
    """Stages ``graph``, ``autodiff``, (with ``fuse_ops``) ``fusion`` and (with ``layout``, a plan path,
    name or :class:`~substation.passes.layout.LayoutPlan`; None/"default" keeps PyTorch's layouts)
    ``layout``: the (forward, backward) :class:`~substation.graph.LayerGraph` pair."""
    fwd, bwd = build_backward(build_forward(config))
    if fuse_ops:
        fwd, bwd = fuse_pass(fwd), fuse_pass(bwd)
    if layout is not None:
        from .passes.layout import apply_plan
        fwd, bwd = apply_plan(fwd, bwd, layout)
    return fwd, bwd


def optimize_graphs(config: EncoderConfig):
    """The optimized (forward, backward) graphs: every optimization stage applied."""
    return compile_graphs(config, fuse_ops=True)


def compile_layer(config: "EncoderConfig | str | os.PathLike", progress=None, instrument: bool = False,
                  fuse: bool = True, layout=None) -> CompiledLayer:
    """Run every stage for ``config`` (a config, a YAML path or a bundled config name).

    ``progress``, if given, is called with each stage name as it starts. ``instrument`` adds
    per-operator timers (:meth:`~substation.runtime.CompiledGraph.op_seconds`); ``fuse=False`` skips
    the fusion stage (one kernel per operator). ``layout`` is a layout plan (path, bundled name or
    :class:`~substation.passes.layout.LayoutPlan`) applied after fusion; None or ``"default"`` keeps
    PyTorch's layouts (PlanError: a plan that does not fit the graphs).

    Raises:
        ConfigError, FileNotFoundError: a bad config.
        LayoutError: layouts that need a transpose. ToolchainError, BuildError: the compiler failed
            (target ``cuda``: nvcc of CUDA >= 12 or cuBLAS missing, see docs/cuda.md).
        ValueError: ``instrument`` with target ``cuda``.
    """
    config = load_config(config)
    step = progress or (lambda name: None)
    step("graph")
    fwd = build_forward(config)
    step("autodiff")
    fwd, bwd = build_backward(fwd)
    step("fusion")
    if fuse:
        fwd, bwd = fuse_pass(fwd), fuse_pass(bwd)
    step("layout")
    if layout is not None:
        from .passes.layout import apply_plan
        fwd, bwd = apply_plan(fwd, bwd, layout)
    step("codegen")
    if config.target == "cuda":  # nvcc + cuBLAS (docs/cuda.md); B, J, K stay runtime sizes
        from .build_cuda import build_cuda_libraries
        from .codegen_cuda import generate_cuda
        if instrument:
            raise ValueError("instrument=True (per-operator timers) is CPU-only; use a CUDA profiler for target cuda")
        sources = {"forward": generate_cuda(fwd), "backward": generate_cuda(bwd)}
        step("build")
        built = build_cuda_libraries(sources, config.cuda_arch)
    else:
        sources = {"forward": generate_cpu(fwd, instrument), "backward": generate_cpu(bwd, instrument)}
        step("build")
        built = build_libraries(sources)
    step("load")
    return CompiledLayer(config, CompiledGraph(fwd, built["forward"].path), CompiledGraph(bwd, built["backward"].path),
                         {k: v.seconds for k, v in built.items()}, sources,
                         {"fuse": fuse, "layout": layout, "instrument": instrument})


_LOADED: dict = {}
_LOADED_LOCK = threading.Lock()


def cached_compile(config: "EncoderConfig | str | os.PathLike", fuse: bool = True, layout=None,
                   instrument: bool = False) -> CompiledLayer:
    """:func:`compile_layer`, memoised per process by config and options: layers of equal configs (the
    twelve layers of a BERT model, a pickled layer loaded twice) share one loaded build, on top of
    the on-disk build cache. A layout given as a :class:`~substation.passes.layout.LayoutPlan`
    object is memoised by identity.

    Raises:
        as :func:`compile_layer`.
    """
    config = load_config(config)
    key = (config, fuse, layout if layout is None or isinstance(layout, (str, os.PathLike)) else id(layout), instrument)
    with _LOADED_LOCK:
        compiled = _LOADED.get(key)
        if compiled is None:
            compiled = _LOADED[key] = compile_layer(config, fuse=fuse, layout=layout, instrument=instrument)
    return compiled
