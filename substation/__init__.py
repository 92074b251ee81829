"""Substation: a data-movement-optimizing compiler for transformer encoder layers.

``substation.compile(config)`` turns an encoder config into an :class:`EncoderLayer`, a
``torch.nn.Module`` whose forward and backward passes run generated, BLAS-backed C++.
"""
from .backends.cpu.build import BuildError, ToolchainError
from .config import ConfigError, EncoderConfig, load_config
from .interop import optimize
from .ir.operands import LayoutError
from .layer import EncoderLayer
from .pipeline import compile_layer
from .version import __version__


def compile(config, progress=None) -> EncoderLayer:  # noqa: A001 - the package's verb
    """Compile an encoder config (an :class:`EncoderConfig`, a YAML path, a mapping or a bundled
    config name such as ``"bert-base"``) into an :class:`EncoderLayer` with freshly initialised
    parameters.

    Raises:
        ConfigError: an invalid config. FileNotFoundError: no such config file.
        ToolchainError, BuildError: the C++ compiler or MKL is missing, or compilation failed.
    """
    return EncoderLayer(compile_layer(config, progress))


__all__ = ["BuildError", "ConfigError", "LayoutError", "ToolchainError", "EncoderConfig", "EncoderLayer", "compile", "load_config", "optimize", "__version__"]
