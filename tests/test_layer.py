"""Forward output and every gradient of the compiled layer against an fp64 PyTorch reference."""
import itertools

import pytest
import torch

from conftest import NO_DROPOUT, additive, make_layer, reference_for, rel, run
from substation.config import EncoderConfig

SMALL = EncoderConfig(name="small", batch_size=3, max_seq_len=13, hidden_size=64, num_heads=4, ffn_size=96,
                      layer_norm_eps=1e-5).replace(dropout=NO_DROPOUT)

VARIANTS = list(itertools.product(("post", "pre"), ("gelu", "relu"), (True, False)))


def inputs(config, dtype, masked):
    torch.manual_seed(1)
    b, j, i = config.batch_size, config.max_seq_len, config.hidden_size
    x = torch.randn(b, j, i, dtype=torch.float64)
    g = torch.randn(b, j, i, dtype=torch.float64)
    pad = None
    if masked:
        pad = torch.zeros(b, j, dtype=torch.bool)
        pad[1:, j // 2:] = True  # later sequences padded to half length
    return x, g, pad


@pytest.mark.parametrize("placement,activation,masked", VARIANTS)
def test_float64_matches_reference(placement, activation, masked):
    config = SMALL.replace(layer_norm=placement, activation=activation, dtype="float64",
                           max_seq_len=7, batch_size=2, hidden_size=32, ffn_size=40)
    layer = make_layer(config)
    ref = reference_for(layer)
    x, g, pad = inputs(config, torch.float64, masked)
    ours = run(layer, x, g, key_padding_mask=pad)
    want = run(ref, x, g, mask=additive(pad, torch.float64))
    assert set(ours) == set(want) and len(ours) == 14
    for name in want:
        assert ours[name].shape == want[name].shape, name
        assert rel(ours[name], want[name]) <= 1e-10, (name, rel(ours[name], want[name]))


# every variant with MKL's SGEMM; with oneDNN's float32 matmul (the faster one on some CPUs) too
FP32_VARIANTS = [(*v, "mkl") for v in VARIANTS] + [(*v, "onednn") for v in VARIANTS if v[2]]


@pytest.mark.parametrize("placement,activation,masked,fp32_gemm", FP32_VARIANTS)
def test_float32_error_within_twice_pytorch(placement, activation, masked, fp32_gemm):
    config = SMALL.replace(layer_norm=placement, activation=activation, dtype="float32")
    layer = make_layer(config, fp32_gemm=fp32_gemm)
    # token-wise GEMMs (forward 4, backward 8: dX and dW of each) on the chosen library (MKL through
    # ss::gemm); the per-head batches (forward 2, backward 4) on ss::gemm_small, each with two MKL
    # fallbacks (no AVX-512, few heads)
    for graph, token_wise, batched in (("forward", 4, 2), ("backward", 8, 4)):
        source = layer.compiled.sources[graph]
        onednn = token_wise if fp32_gemm == "onednn" else 0
        assert source.count("ss::matmul<float>(") == onednn, graph
        assert source.count("ss::gemm<float>(") == token_wise - onednn + 2 * batched, graph
        assert source.count("ss::gemm_small(") == batched, graph
    ref64 = reference_for(layer, torch.float64)
    ref32 = reference_for(layer, torch.float32)
    x, g, pad = inputs(config, torch.float32, masked)
    want = run(ref64, x, g, mask=additive(pad, torch.float64))
    torch32 = run(ref32, x.float(), g, mask=additive(pad, torch.float32))
    # Hugging Face convention here (True = attend); the float64 test uses PyTorch's key_padding_mask.
    ours = run(layer, x.float(), g, attention_mask=None if pad is None else ~pad)
    for name in want:
        e_ours, e_torch = rel(ours[name], want[name]), rel(torch32[name], want[name])
        assert e_ours <= 2 * e_torch, (name, e_ours, e_torch)
        assert e_ours < 1e-4, (name, e_ours)


@pytest.mark.parametrize("fp32_gemm,batch,seq", [("mkl", 4, 80), ("onednn", 4, 80), ("onednn", 1, 24)])
def test_float32_gemm_libraries_at_oneDNN_sizes(fp32_gemm, batch, seq):
    """320 token rows (from kFloatMinRows = 256 rows oneDNN's float32 matmul runs every token-wise GEMM)
    and 24 (below, they go to MKL), with an inner dimension U = 600 > kFloatChunk = 512
    (at 320 rows linear2 and linear1's dX sum two chunks, the last of 88): every output and gradient within
    2x (MKL) or 3x (oneDNN) PyTorch float32's error against float64."""
    config = SMALL.replace(batch_size=batch, max_seq_len=seq, ffn_size=600, dtype="float32")
    layer = make_layer(config, fp32_gemm=fp32_gemm)
    x, g, pad = inputs(config, torch.float32, True)
    want = run(reference_for(layer, torch.float64), x, g, mask=additive(pad, torch.float64))
    torch32 = run(reference_for(layer, torch.float32), x.float(), g, mask=additive(pad, torch.float32))
    ours = run(layer, x.float(), g, key_padding_mask=pad)
    # oneDNN's float32 matmul sums k in longer sequences than MKL: weight gradients reached 2.2x PyTorch's
    # error in other shapes (docs/toolchain.md), which is why it is not the default
    bound = 2 if fp32_gemm == "mkl" else 3
    for name in want:
        e_ours, e_torch = rel(ours[name], want[name]), rel(torch32[name], want[name])
        assert e_ours <= bound * e_torch and e_ours < 1e-5, (name, e_ours, e_torch)


_GEMM_HARNESS = r"""
#include "substation_blas.h"
extern "C" void gemm(int64_t m, int64_t n, int64_t k, int trans_b, const float* a, const float* b, float* c) {
  ss::gemm<float>(false, trans_b != 0, m, n, k, 0.5f, a, k, b, trans_b ? k : n, c, n);
}
extern "C" void gemm64(int64_t m, int64_t n, int64_t k, const double* a, const double* b, double* c) {
  ss::gemm<double>(false, false, m, n, k, 1.0, a, k, b, n, c, n);
}
"""


def test_token_wise_gemms_split_their_columns_at_few_rows():
    """ss::gemm (the float32 and float64 builds' token-wise GEMMs): below kSplitRows = 256 rows the
    columns of C go to the threads in blocks of single-threaded MKL calls (B plain and transposed, column
    counts not a multiple of 16, too few columns to split); every element within MKL's float32 error of
    the float64 product, and float64 exact to 1e-12."""
    import ctypes

    from substation.backends.cpu import build as cpu_build
    lib = ctypes.CDLL(cpu_build.build_library(_GEMM_HARNESS, "gemm_split", with_onednn=False).path)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.gemm.argtypes = [i64, i64, i64, ctypes.c_int, ptr, ptr, ptr]
    lib.gemm64.argtypes = [i64, i64, i64, ptr, ptr, ptr]
    torch.manual_seed(5)
    for m, n, k in [(1, 1152, 384), (7, 600, 96), (24, 1536, 384), (24, 40, 64), (100, 385, 1536), (255, 77, 33),
                    (300, 1152, 384)]:
        a = torch.randn(m, k)
        for trans_b in (0, 1):
            b = torch.randn(n, k) if trans_b else torch.randn(k, n)
            exact = 0.5 * (a.double() @ (b.double().T if trans_b else b.double()))
            c = torch.full((m, n), float("nan"))
            lib.gemm(m, n, k, trans_b, ptr(a.data_ptr()), ptr(b.data_ptr()), ptr(c.data_ptr()))
            torch_error = rel(0.5 * (a @ (b.T if trans_b else b)), exact)
            assert rel(c, exact) <= 2 * torch_error + 1e-9, (m, n, k, trans_b)
        a64, b64 = a.double(), torch.randn(k, n, dtype=torch.float64)
        c64 = torch.empty(m, n, dtype=torch.float64)
        lib.gemm64(m, n, k, ptr(a64.data_ptr()), ptr(b64.data_ptr()), ptr(c64.data_ptr()))
        assert rel(c64, a64 @ b64) < 1e-12


@pytest.mark.parametrize("variant", [{"activation": "gelu_tanh"}, {"mask": "causal"}, {"mask": "none"},
                                     {"mask": "causal", "layer_norm": "pre"}])
def test_other_variants_float64(variant, tiny_nodrop):
    config = tiny_nodrop.replace(**variant)
    layer = make_layer(config)
    ref = reference_for(layer)
    x, g, pad = inputs(config, torch.float64, config.mask != "none")
    want = run(ref, x, g, mask=additive(pad, torch.float64))
    ours = run(layer, x, g, key_padding_mask=pad)
    for name in want:
        assert rel(ours[name], want[name]) <= 1e-10, (name, rel(ours[name], want[name]))


@pytest.mark.parametrize("b,j", [(1, 1), (1, 7), (2, 3), (5, 11)])
def test_runtime_sizes_differ_from_config(b, j, tiny_nodrop):
    layer = make_layer(tiny_nodrop)
    ref = reference_for(layer)
    torch.manual_seed(3)
    x = torch.randn(b, j, tiny_nodrop.hidden_size, dtype=torch.float64)
    g = torch.randn_like(x)
    want = run(ref, x, g)
    ours = run(layer, x, g)
    for name in want:
        assert rel(ours[name], want[name]) <= 1e-10, (name, b, j)
