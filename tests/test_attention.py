"""The fused attention kernel of forward-only CPU builds: which graphs get it, the bytes and workspace
it saves, and its output against the float64 reference (masks, fully masked rows, causal, several
query blocks)."""
from __future__ import annotations

import ctypes

import pytest
import torch

from conftest import reference_for, rel
from substation import EncoderLayer
from substation.config import load_config
from substation.passes.attention import find_attention
from substation.perf.analysis import count_graph
from substation.pipeline import cached_compile, compile_graphs

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
    bf16, _ = compile_graphs(TINY.replace(dtype="bfloat16"), fuse_ops=True, mode="eval")
    assert "attention" not in _kinds(bf16)  # its products stay on oneDNN's bf16 matmul
    cuda, _ = compile_graphs(TINY.replace(target="cuda", dtype="float32"), fuse_ops=True, mode="eval")
    assert "attention" not in _kinds(cuda)


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


def test_fused_attention_causal():
    config = TINY.replace(mask="causal", name="tiny-causal")
    compiled = cached_compile(config, mode="eval")
    assert "attention" in _kinds(compiled.forward.graph)
    torch.manual_seed(6)
    layer = EncoderLayer(compiled).eval()
    ref = reference_for(layer).eval()
    x = torch.randn(2, 40, config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        assert rel(layer(x), ref(x)) <= 1e-12


def test_bench_attention_cli(tmp_path, capsys):
    import json

    from substation.cli import main
    out = tmp_path / "attention.json"
    assert main(["bench", "tiny", "--attention-lengths", "8,40", "--repeats", "2", "--warmup", "0",
                 "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["schema"] == "substation-bench-attention/1" and [x["seq_len"] for x in r["lengths"]] == [8, 40]
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
    assert main(["bench", "tiny", "--attention-lengths", "0"]) == 2
    assert "lengths >= 1" in capsys.readouterr().err
