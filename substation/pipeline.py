"""The compilation pipeline: named stages, in order, from a config to a loaded layer."""
from __future__ import annotations

import os

from .autodiff import build_backward
from .build import build_libraries
from .codegen import generate_cpu
from .config import EncoderConfig, load_config
from .graph import build_forward
from .runtime import CompiledGraph, CompiledLayer

__all__ = ["STAGES", "compile_graphs", "compile_layer"]

#: The stages, in order: (name, what it does).
STAGES = (
    ("graph", "build the forward SDFG from the config"),
    ("autodiff", "derive the backward SDFG; mark what forward saves"),
    ("codegen", "generate C++ for each graph"),
    ("build", "compile and link against BLAS, through the build cache"),
    ("load", "load the libraries behind torch.autograd"),
)


def compile_graphs(config: EncoderConfig):
    """Stages ``graph`` and ``autodiff``: the (forward, backward) :class:`~substation.graph.LayerGraph`."""
    return build_backward(build_forward(config))


def compile_layer(config: "EncoderConfig | str | os.PathLike", progress=None, instrument: bool = False) -> CompiledLayer:
    """Run every stage for ``config`` (a config, a YAML path or a bundled config name).

    ``progress``, if given, is called with each stage name as it starts. ``instrument`` adds
    per-operator timers (:meth:`~substation.runtime.CompiledGraph.op_seconds`).

    Raises:
        ConfigError, FileNotFoundError: a bad config.
        LayoutError: layouts that need a transpose. ToolchainError, BuildError: the compiler failed.
    """
    config = load_config(config)
    step = progress or (lambda name: None)
    step("graph")
    step("autodiff")
    fwd, bwd = compile_graphs(config)
    step("codegen")
    sources = {"forward": generate_cpu(fwd, instrument), "backward": generate_cpu(bwd, instrument)}
    step("build")
    built = build_libraries(sources)
    step("load")
    return CompiledLayer(config, CompiledGraph(fwd, built["forward"].path), CompiledGraph(bwd, built["backward"].path),
                         {k: v.seconds for k, v in built.items()}, sources)
