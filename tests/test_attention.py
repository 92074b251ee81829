"""The fused attention kernel of forward-only CPU builds: which graphs get it, the bytes and workspace
it saves, and its output against the float64 reference (masks, fully masked rows, causal, several
query blocks); the bfloat16 kernels (AMX tiles, AVX512-BF16 dot products) against float64 and PyTorch's
fused attention in bfloat16."""
from __future__ import annotations

import ctypes
import math
import re
import subprocess

import pytest
import torch

from conftest import reference_for, rel
from substation import EncoderLayer
from substation.config import load_config
from substation.backends.cpu.build import FLAGS, cpu_flags, toolchain
from substation.ops.contraction import EPILOGUE_BIAS
from substation.passes.attention import find_attention
from substation.perf.analysis import count_graph
from substation.pipeline import cached_compile, compile_graphs
from substation.resources import csrc_dir

TINY = load_config("configs/tiny.yaml")


def _kinds(graph):
    return [op.kind for op in graph.operators()]


def test_inference_graphs_fuse_attention_and_training_graphs_do_not():
    fused, _ = compile_graphs(TINY, fuse_ops=True, mode="eval")
    apart, _ = compile_graphs(TINY, fuse_ops=True, mode="eval", attention=False)
    assert _kinds(fused).count("attention") == 1 and _kinds(fused).count("contraction") == 4
    assert len(_kinds(apart)) == len(_kinds(fused)) + 3  # QKV bias, scores, MS, context -> attention
    assert {"S", "A", "QKV"} <= set(apart.tensors) and not {"S", "S_masked", "A", "QKV"} & set(fused.tensors)
    attention = fused.find("attention")
    assert {c: t for c, (t, _) in fused.inputs_of(attention).items()} == {
        "q": "QKV_raw", "k": "QKV_raw", "v": "QKV_raw", "bq": "in_proj_bias", "bk": "in_proj_bias",
        "bv": "in_proj_bias", "m": "mask"}
    assert [fused.inputs_of(attention)[c][1] for c in ("bq", "bk", "bv")] == ["0HP", "1HP", "2HP"]
    assert find_attention(compile_graphs(TINY, mode="eval", attention=False)[0]) is not None
    train_fwd, train_bwd = compile_graphs(TINY, fuse_ops=True)
    assert "attention" not in _kinds(train_fwd) + _kinds(train_bwd)
    cuda, _ = compile_graphs(TINY.replace(target="cuda", dtype="float32"), fuse_ops=True, mode="eval")
    assert "attention" not in _kinds(cuda)


needs_bf16 = pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="bfloat16 CPU builds need AVX512-BF16")
#: What the AMX kernel needs; without it bf16 builds run the AVX512-BF16 kernel.
AMX = {"amx_tile", "amx_bf16"} <= cpu_flags()


def test_bf16_inference_fuses_attention():
    """bf16: the chain of the mixed-precision graph (float32 scores, the probabilities' cast to bf16)
    becomes one attention operator, Q, K, V biased by the QKV GEMM's epilogue; training graphs keep it."""
    config = TINY.replace(dtype="bfloat16")
    apart, _ = compile_graphs(config, fuse_ops=True, mode="eval", attention=False)
    assert "attention" not in _kinds(apart) and {"S", "A_bf16"} <= set(apart.tensors)
    fused, _ = compile_graphs(config, fuse_ops=True, mode="eval")
    assert _kinds(fused).count("attention") == 1 and _kinds(fused).count("contraction") == 4
    assert {c: t for c, (t, _) in fused.inputs_of(fused.find("attention")).items()} == {
        "q": "QKV", "k": "QKV", "v": "QKV", "m": "mask"}
    assert EPILOGUE_BIAS in fused.inputs_of(fused.find("qkv"))
    assert not {"S", "S_masked", "A", "A_bf16"} & set(fused.tensors)
    sizes = config.sizes()
    scores = sizes["B"] * sizes["H"] * sizes["J"] * sizes["K"]
    moved = {name: sum(c.bytes for c in count_graph(g, sizes)) for name, g in (("fused", fused), ("apart", apart))}
    assert moved["apart"] - moved["fused"] == 2 * scores * 4 + 2 * scores * 2  # S in float32, A_bf16 in bf16
    train, _ = compile_graphs(config, fuse_ops=True)
    assert "attention" not in _kinds(train)


def test_bytes_saved_are_the_scores_and_probabilities():
    sizes = TINY.sizes()
    fused, _ = compile_graphs(TINY, fuse_ops=True, mode="eval")
    apart, _ = compile_graphs(TINY, fuse_ops=True, mode="eval", attention=False)
    moved = {name: sum(c.bytes for c in count_graph(g, sizes)) for name, g in (("fused", fused), ("apart", apart))}
    scores = sizes["B"] * sizes["H"] * sizes["J"] * sizes["K"]
    qkv = sizes["B"] * sizes["J"] * 3 * sizes["H"] * sizes["P"]
    # S, A and the biased QKV are each written once and read once by the unfused kernels
    assert moved["apart"] - moved["fused"] == (4 * scores + 2 * qkv) * TINY.itemsize
    chain = find_attention(compile_graphs(TINY, mode="eval", attention=False)[0])
    assert chain.bytes_saved(compile_graphs(TINY, mode="eval", attention=False)[0], sizes, TINY.itemsize) \
        == (6 * scores + 2 * qkv) * TINY.itemsize  # S, S_masked, A (before mask and softmax fuse) and QKV


def _workspace(compiled, b, j):
    fn = compiled.forward.lib.substation_workspace_bytes
    fn.restype = ctypes.c_int64
    return fn((ctypes.c_int64 * 3)(b, j, j))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_fused_attention_matches_float64(dtype):
    config = TINY.replace(dtype=dtype)
    fused = cached_compile(config, mode="eval")
    apart = cached_compile(config, mode="eval", attention=False)
    assert "ss::attention_forward" in fused.sources["forward"]
    assert "ss::attention_forward" not in apart.sources["forward"]
    b, j = 3, 300  # float64: 13 queries per block, so several blocks and a short last one
    scores_bytes = b * config.num_heads * j * j * config.itemsize
    assert _workspace(apart, b, j) - _workspace(fused, b, j) >= 2 * scores_bytes
    torch.manual_seed(5)
    layer = EncoderLayer(fused).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    ref = reference_for(layer).eval()
    x = torch.randn(b, j, config.hidden_size, dtype=torch.float64)
    mask = torch.zeros(b, j, dtype=torch.float64)
    mask[0, 200:] = -3.0  # soft: not packed, every position computed
    mask[1, :] = float("-inf")  # a fully masked sequence: zero probabilities
    mask[2, ::3] = float("-inf")
    with torch.no_grad():
        y = layer(x.to(layer.torch_dtype), mask.to(layer.torch_dtype))
        want = ref(x, mask)
    assert rel(y, want) <= (1e-12 if dtype == "float64" else 2e-6)
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_fused_attention_causal(dtype):
    """Causal masks; J = 43 leaves the float kernel's softmax (four rows at a time) a short group of rows
    and K a partial 16-key vector."""
    config = TINY.replace(mask="causal", name="tiny-causal", dtype=dtype)
    compiled = cached_compile(config, mode="eval")
    assert "attention" in _kinds(compiled.forward.graph)
    torch.manual_seed(6)
    layer = EncoderLayer(compiled).eval()
    ref = reference_for(layer).eval()
    x = torch.randn(2, 43, config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        assert rel(layer(x.to(layer.torch_dtype)), ref(x)) <= (1e-12 if dtype == "float64" else 2e-6)


def test_bench_attention_cli(tmp_path, capsys):
    import json

    from substation.cli import main
    out = tmp_path / "attention.json"
    assert main(["bench", "tiny", "--attention-lengths", "8,40", "--repeats", "2", "--warmup", "0",
                 "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["schema"] == "substation-bench-attention/1" and [x["seq_len"] for x in r["lengths"]] == [8, 40]
    assert r["fp32_gemm"] is None  # tiny is float64
    for row in r["lengths"]:
        b, j = row["batch_size"], row["seq_len"]
        assert b == max(1, TINY.batch_size * TINY.max_seq_len // j)
        scores = b * TINY.num_heads * j * j * TINY.itemsize
        qkv = b * j * 3 * TINY.hidden_size * TINY.itemsize  # the biased QKV, written and read once
        assert row["bytes_saved"] == row["bytes"]["unfused"] - row["bytes"]["fused"] == 4 * scores + 2 * qkv
        assert row["workspace_bytes"]["unfused"] - row["workspace_bytes"]["fused"] >= 2 * scores
        for key in ("attention_seconds", "layer_seconds"):
            assert all(len(v["samples"]) == 2 and v["median"] > 0 for v in row[key].values())
        assert row["attention_speedup"] == pytest.approx(
            row["attention_seconds"]["unfused"]["median"] / row["attention_seconds"]["fused"]["median"])
    assert "attn ms fused" in capsys.readouterr().out
    assert main(["bench", "tiny", "--attention-lengths", "8", "--mode", "eval"]) == 2
    assert main(["bench", "tiny", "--attention-lengths", "8", "--mode", "train"]) == 2
    assert main(["bench", "tiny", "--attention-lengths", "8", "--compare-layouts"]) == 2
    assert "it takes no --kernels, --compare-layouts, --mode" in capsys.readouterr().err
    assert main(["bench", "tiny", "--attention-lengths", "99999999999", "--repeats", "1"]) == 2
    assert re.search(r"L=99999999999: the unfused chain needs [\d.]+ GiB of workspace at B=1, over half of this "
                     r"machine's [\d.]+ GiB; give shorter lengths", capsys.readouterr().err)
    with pytest.raises(SystemExit):
        main(["bench", "tiny", "--attention-lengths", "0"])
    assert "argument --attention-lengths: must be >= 1, got 0" in capsys.readouterr().err


@needs_bf16
def test_bf16_fused_attention_matches_float64_like_autocast():
    """A float32 layer under autocast in inference runs the bf16 kernel; against float64 it stays within
    2x of PyTorch's own layer under autocast, and within bf16 rounding of the unfused bf16 chain
    (several query blocks, a short last one, K = 300 not a multiple of the tile's 32, P = 4)."""
    config = TINY.replace(dtype="float32")
    layer = EncoderLayer(cached_compile(config)).eval()
    fused = cached_compile(config.replace(dtype="bfloat16"), mode="eval", float32_masters=True)  # as autocast runs it
    apart = cached_compile(config.replace(dtype="bfloat16"), mode="eval", attention=False, float32_masters=True)
    assert "ss::attention_forward_bf16(" in fused.sources["forward"]
    assert "ss::attention_forward_bf16(" not in apart.sources["forward"]
    assert _workspace(apart, 3, 300) - _workspace(fused, 3, 300) >= 3 * config.num_heads * 300 * 300 * 4
    torch.manual_seed(7)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    x = torch.randn(3, 300, config.hidden_size)
    mask = torch.zeros(3, 300)
    mask[0, 200:] = -3.0
    mask[1, :] = float("-inf")
    mask[2, ::3] = float("-inf")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x, mask)
        y32 = reference_for(layer, torch.float32).eval()(x, mask)
    assert layer.compiled.for_autocast().forward_only().sources["forward"] == fused.sources["forward"]
    with torch.no_grad():
        exact = reference_for(layer).eval()(x.double(), mask.double())
    assert torch.isfinite(y).all()
    assert rel(y, exact) <= 2 * rel(y32.float(), exact)


_HARNESS = r"""
#include "substation_attention.h"
extern "C" int run(int64_t B, int64_t H, int64_t J, int64_t K, int64_t P, float alpha, const uint16_t* q,
                   const int64_t* qs, const uint16_t* k, const int64_t* ks, const uint16_t* v, const int64_t* vs,
                   const uint16_t* m, int64_t mb, int causal, uint16_t* y, const int64_t* ys) {
#if KERNEL_AMX
  if (!ss::amx_permitted()) return 1;
  ss::attention_forward_amx(B, H, J, K, P, alpha, q, qs, k, ks, v, vs, m, mb, causal, y, ys);
#else
  ss::attention_forward_dp(B, H, J, K, P, alpha, q, qs, k, ks, v, vs, m, mb, causal, y, ys);
#endif
  return 0;
}
"""


@needs_bf16
@pytest.mark.parametrize("kernel", ["dp", pytest.param("amx", marks=pytest.mark.skipif(not AMX, reason="no AMX"))])
def test_bf16_kernels_shapes_masks_and_causal(tmp_path, kernel):
    """ss::attention_forward_amx and ss::attention_forward_dp on their own (strided Q, K, V views of one
    QKV block): P of 3 to 80 (odd, not multiples of 32 included), J and K of 1 to 300, a fully masked
    sequence (zeros), causal masks; against float64 within bf16 rounding, and no worse than PyTorch's
    SDPA in bf16 where it applies."""
    tc = toolchain()
    (tmp_path / "harness.cpp").write_text(_HARNESS)
    lib_path = tmp_path / "harness.so"
    subprocess.run([tc.cxx, *FLAGS, f"-DKERNEL_AMX={int(kernel == 'amx')}", f"-I{csrc_dir()}", f"-I{tc.blas_include}",
                    str(tmp_path / "harness.cpp"),
                    "-o", str(lib_path)], check=True, capture_output=True)
    lib = ctypes.CDLL(str(lib_path))

    def strides(t):
        return (ctypes.c_int64 * 3)(*t.stride()[:3])
    torch.manual_seed(8)
    for b, h, j, k, p, causal in [(2, 3, 128, 128, 32, False), (1, 2, 24, 24, 32, False), (2, 2, 17, 40, 64, False),
                                  (2, 1, 5, 7, 4, False), (2, 2, 33, 33, 48, True), (2, 2, 130, 130, 80, False),
                                  (3, 1, 1, 1, 32, False), (2, 2, 9, 9, 5, False), (2, 2, 19, 19, 3, True),
                                  (2, 3, 300, 300, 64, False)]:
        qkv = torch.randn(b, max(j, k), 3, h, p).bfloat16()
        q, key, v = qkv[:, :j, 0], qkv[:, :k, 1], qkv[:, :k, 2]
        mask = torch.zeros(b, k)
        mask[0, k * 3 // 4 + 1:] = float("-inf")
        if b > 1:
            mask[1] = float("-inf")  # every key masked: zero probabilities, as the unfused softmax gives
        mask = mask.bfloat16()
        y = torch.full((b, j, h, p), float("nan"), dtype=torch.bfloat16)
        alpha = 1 / math.sqrt(p)
        assert lib.run(*(ctypes.c_int64(n) for n in (b, h, j, k, p)), ctypes.c_float(alpha),
                       ctypes.c_void_p(q.data_ptr()), strides(q), ctypes.c_void_p(key.data_ptr()), strides(key),
                       ctypes.c_void_p(v.data_ptr()), strides(v), ctypes.c_void_p(mask.data_ptr()), ctypes.c_int64(k),
                       ctypes.c_int(causal), ctypes.c_void_p(y.data_ptr()), strides(y)) == 0
        s = torch.einsum("bjhp,bkhp->bhjk", q.double(), key.double()) * alpha + mask.double()[:, None, None, :]
        if causal:
            s = s.masked_fill(torch.ones(j, k, dtype=torch.bool).triu(1), float("-inf"))
        exact = torch.einsum("bhjk,bkhp->bjhp", torch.softmax(s, -1).nan_to_num(0.0), v.double())
        err = (y.double() - exact).abs().max().item()
        assert err <= 4e-3 * exact.abs().max().item(), (b, h, j, k, p, causal, err)
        if b > 1:
            assert y[1].abs().max() == 0
        live = slice(0, 1)  # SDPA gives NaN for the fully masked sequence
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q[live].transpose(1, 2), key[live].transpose(1, 2), v[live].transpose(1, 2),
            attn_mask=mask[live, None, None, :], is_causal=False) if not causal else None
        if sdpa is not None:
            sdpa_err = (sdpa.transpose(1, 2).double() - exact[live]).abs().max().item()
            assert (y[live].double() - exact[live]).abs().max().item() <= 2 * sdpa_err + 1e-6


def test_amx_kernel_compiles_on_any_cpu(tmp_path):
    """The AMX kernel is compiled only where ``-march=native`` has AMX, so a CPU without it would never
    see it break: build the harness for Sapphire Rapids (not run) and find the tile multiplications."""
    tc = toolchain()
    (tmp_path / "harness.cpp").write_text(_HARNESS)
    lib_path = tmp_path / "harness.so"
    flags = [f if f != "-march=native" else "-march=sapphirerapids" for f in FLAGS]
    assert flags != list(FLAGS)
    build = subprocess.run([tc.cxx, *flags, "-DKERNEL_AMX=1", f"-I{csrc_dir()}", f"-I{tc.blas_include}",
                            str(tmp_path / "harness.cpp"), "-o", str(lib_path)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    code = subprocess.run(["objdump", "-d", str(lib_path)], check=True, capture_output=True, text=True).stdout
    assert code.count("tdpbf16ps") >= 2 and "ldtilecfg" in code  # scores and context products on the tiles


@needs_bf16
def test_bench_attention_bf16(tmp_path):
    """``--attention-lengths --dtype bfloat16``: the bytes saved are S (float32) and the bf16
    probabilities, each written and read once."""
    import json

    from substation.cli import main
    out = tmp_path / "attention.json"
    assert main(["bench", "tiny", "--attention-lengths", "40", "--dtype", "bfloat16", "--repeats", "2",
                 "--warmup", "0", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    (row,) = r["lengths"]
    assert r["config"]["dtype"] == "bfloat16"
    scores = row["batch_size"] * TINY.num_heads * 40 * 40
    assert row["bytes_saved"] == 2 * scores * 4 + 2 * scores * 2
    assert row["attention_seconds"]["fused"]["median"] > 0
