"""The libraries a CPU build's GEMMs call, as a build option (``fp32_gemm``): names and checks only,
no imports, so that the command line can offer them without loading the compiler."""
from __future__ import annotations

__all__ = ["FP32_GEMM_CHOICES", "FP32_GEMM_LIBRARIES", "check_fp32_gemm", "links_onednn"]

#: Libraries of float32 builds' token-wise contractions (:func:`~substation.backends.cpu.codegen.generate_cpu`'s ``fp32_gemm``).
FP32_GEMM_LIBRARIES = ("mkl", "onednn")
#: Values of the ``fp32_gemm`` option: ``"auto"`` (inference builds take the library measured faster on
#: this machine, training builds MKL: :mod:`substation.perf.gemm_choice`) or a library.
FP32_GEMM_CHOICES = ("auto", *FP32_GEMM_LIBRARIES)


def check_fp32_gemm(fp32_gemm, allowed: tuple = FP32_GEMM_CHOICES) -> None:
    """Refuse a ``fp32_gemm`` that is not one of ``allowed`` (any value: a list too).

    Raises:
        ValueError: names the value and the allowed ones.
    """
    if fp32_gemm not in allowed:
        raise ValueError(f"fp32_gemm (the library of float32 builds' token-wise GEMMs) must be one of "
                         f"{', '.join(allowed)}, got {fp32_gemm!r}")


def links_onednn(dtype: str, fp32_gemm: str) -> bool:
    """Whether the CPU build of a ``dtype`` graph calls oneDNN: every bfloat16 build, and float32 builds
    with ``fp32_gemm`` ``"onednn"``."""
    return dtype == "bfloat16" or (dtype == "float32" and fp32_gemm == "onednn")
