"""Shared fixtures: compiled layers are built once per session (and reused from the build cache)."""
import functools
import os

import pytest
import torch

import substation
from substation.config import load_config
from substation.reference import ReferenceEncoderLayer

NO_DROPOUT = {"attention": 0.0, "hidden": 0.0, "activation": 0.0}

# What fp32_gemm="auto" means is pinned for the suite, so that every machine runs the same builds
# (tests/test_gemm_choice.py tests the measured choice); SUBSTATION_FP32_GEMM=onednn runs the suite's
# inference builds on oneDNN's float32 matmul instead.
os.environ.setdefault("SUBSTATION_FP32_GEMM", "mkl")


def nvcc_skip_reason() -> str | None:
    from substation.backends.cpu.build import ToolchainError
    from substation.backends.cuda.build import cuda_toolchain
    try:
        cuda_toolchain().require_cublas()
    except ToolchainError as e:
        return f"no CUDA build toolchain here: {e}"
    return None


#: Tests that compile CUDA with nvcc and cuBLAS (skipped, with the reason, where either is missing).
needs_nvcc = pytest.mark.skipif(nvcc_skip_reason() is not None, reason=str(nvcc_skip_reason()))


@functools.lru_cache(maxsize=None)
def _compiled(config, fp32_gemm="mkl"):
    from substation.pipeline import compile_layer
    return compile_layer(config, fp32_gemm=fp32_gemm)


def make_layer(config, seed: int = 0, fp32_gemm: str = "mkl") -> substation.EncoderLayer:
    """A fresh EncoderLayer for ``config`` (compiled once per session and ``fp32_gemm``), parameters
    drawn from ``seed``, biases and layer-norm parameters randomised so every gradient is exercised."""
    torch.manual_seed(seed)
    layer = substation.EncoderLayer(_compiled(config, fp32_gemm))
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if name.startswith("norm") and "weight" in name else 0.0))
    return layer


def reference_for(layer, dtype=torch.float64) -> ReferenceEncoderLayer:
    """The PyTorch reference layer with ``layer``'s weights in ``dtype``."""
    ref = ReferenceEncoderLayer(layer.config, dtype)
    ref.load_state_dict({k: v.to(dtype) for k, v in layer.state_dict().items()})
    ref.train(layer.training)
    return ref


def rel(ours, ref) -> float:
    """max |ours - ref| / max |ref|, in float64."""
    ref = ref.detach().double()
    return float((ours.detach().double() - ref).abs().max() / ref.abs().max())


def real_rel(ours, ref, attend) -> float:
    """:func:`rel` over the real tokens of [B, J, I] outputs (``attend`` [B, K], nonzero = real token;
    None: every position). Inference calls with a padding mask return zeros at padded positions, other
    implementations do not."""
    if attend is None:
        return rel(ours, ref)
    real = attend.bool()
    return rel(ours[real], ref[real])


def run(module, x, g, **mask) -> dict:
    """Output ``Y``, input gradient ``dX`` and parameter gradients (by name) of one forward+backward
    of ``module(x, **mask)`` with upstream gradient ``g``."""
    x = x.detach().clone().requires_grad_()
    module.zero_grad()
    y = module(x, **mask)
    y.backward(g.to(y.dtype))
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters()}
    return {"Y": y.detach(), "dX": x.grad.detach(), **grads}


def additive(pad, dtype=torch.float64, value=float("-inf")):
    """The additive [B, K] mask of a bool padding mask (True = padding), or None."""
    return None if pad is None else torch.zeros(pad.shape, dtype=dtype).masked_fill(pad, value)


@pytest.fixture
def fresh_toolchain(monkeypatch, tmp_path):
    """Builds go to a private cache (``tmp_path / "cache"``) and the detected C++ and CUDA toolchains
    are forgotten before and after the test; yields ``monkeypatch`` (undone before the caches clear)."""
    from substation.backends.cpu.build import toolchain
    from substation.backends.cuda.build import cuda_toolchain

    monkeypatch.setenv("SUBSTATION_CACHE_DIR", str(tmp_path / "cache"))
    toolchain.cache_clear()
    cuda_toolchain.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    toolchain.cache_clear()
    cuda_toolchain.cache_clear()


@pytest.fixture(scope="session")
def tiny():
    return load_config("tiny")


@pytest.fixture(scope="session")
def tiny_nodrop(tiny):
    return tiny.replace(dropout=NO_DROPOUT)
