"""Substation: a data-movement-optimizing compiler for transformer encoder layers.

``substation.compile(config)`` turns an encoder config into an :class:`EncoderLayer`, a
``torch.nn.Module`` whose forward and backward passes run generated, BLAS-backed C++.

The public names load on first use (PEP 562), so that ``import substation`` and the command line's
``--help`` and ``--version`` do not wait for PyTorch, DaCe and SymPy.
"""
from __future__ import annotations

import importlib

from .version import __version__

# public name -> the module that defines it
_SOURCES = {
    "BuildError": ".backends.cpu.build",
    "ToolchainError": ".backends.cpu.build",
    "ConfigError": ".config",
    "EncoderConfig": ".config",
    "load_config": ".config",
    "optimize": ".interop",
    "LayoutError": ".ir.operands",
    "EncoderLayer": ".layer",
}


def __getattr__(name: str):
    if name not in _SOURCES:
        raise AttributeError(f"module 'substation' has no attribute {name!r}")
    value = getattr(importlib.import_module(_SOURCES[name], __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SOURCES))


def compile(config, progress=None, fp32_gemm: str = "auto"):  # noqa: A001 - the package's verb
    """Compile an encoder config (an :class:`EncoderConfig`, a YAML path, a mapping or a bundled
    config name such as ``"bert-base"``) into an :class:`EncoderLayer` with freshly initialised
    parameters. ``progress``, if given, is called with each pass name as it starts; ``fp32_gemm`` is the
    library of a float32 build's token-wise GEMMs: ``"auto"`` (default: the inference build takes the
    library measured faster on this machine, the training build MKL), ``"mkl"`` or ``"onednn"``
    (:class:`~substation.pipeline.PipelineOptions`, docs/toolchain.md); other dtypes ignore it.

    Raises:
        ConfigError: an invalid config. FileNotFoundError: no such config file. ValueError: an unknown
        ``fp32_gemm``. ToolchainError, BuildError: the C++ compiler or MKL is missing, or compilation failed.
    """
    from .layer import EncoderLayer
    from .pipeline import compile_layer
    return EncoderLayer(compile_layer(config, progress, fp32_gemm=fp32_gemm))


__all__ = ["BuildError", "ConfigError", "LayoutError", "ToolchainError", "EncoderConfig", "EncoderLayer", "compile",
           "load_config", "optimize", "__version__"]
