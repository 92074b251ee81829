"""float32 inference builds on oneDNN's GEMMs (``fp32_gemm="onednn"``): biases and GELU in the GEMM
epilogues, weights read from packed copies (one per chunk of k), fewer than 256 rows on MKL with the
epilogue applied after it; outputs against float64, kernels, bytes, and the oneDNN kernels that run."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from substation import EncoderLayer
from substation.config import load_config
from substation.perf.analysis import count_graph
from substation.pipeline import cached_compile, compile_graphs
from substation.reference import ReferenceEncoderLayer

#: I = 520 and U = 600: linear1 (k = I) and linear2 (k = U) are sums of two oneDNN calls (chunks of
#: 512), the GELU after linear1's last; P = 65.
WIDE = dict(dtype="float32", hidden_size=520, num_heads=8, ffn_size=600)


def _wide():
    return load_config("tiny").replace(**WIDE)


@pytest.fixture(scope="module")
def wide_layers():
    """(oneDNN build, MKL build, float64 reference) of the wide config, the same random weights."""
    torch.manual_seed(31)
    onednn = EncoderLayer(cached_compile(_wide(), fp32_gemm="onednn")).eval()
    for p in onednn.parameters():  # biases and norm weights away from 0 and 1: every epilogue term counts
        p.data.uniform_(-0.05, 0.05) if p.dim() > 1 else p.data.uniform_(-0.5, 0.5)
    mkl = EncoderLayer(cached_compile(_wide(), fp32_gemm="mkl")).eval()
    mkl.load_state_dict(onednn.state_dict())
    ref = ReferenceEncoderLayer(_wide(), torch.float64).eval()
    ref.load_state_dict(onednn.state_dict())
    return onednn, mkl, ref


def test_epilogues_and_packed_weights_in_the_onednn_graph_only():
    """MiniLM's float32 inference graph: on oneDNN every bias and the GELU finish their GEMMs (no
    element-wise kernel left; the bias-GELU row kernel BA is gone), every weight is read packed; the bytes
    saved are F1_raw written and read (4 B J U each), less the digest's pass over the weights."""
    cfg = load_config("minilm-l6")
    graphs = {lib: compile_graphs(cfg, fuse_ops=True, mode="eval", fp32_gemm=lib)[0] for lib in ("mkl", "onednn")}
    mkl, onednn = graphs["mkl"], graphs["onednn"]
    assert [op.op_class for op in mkl.operators()].count("EW") == 1
    assert [op.op_class for op in onednn.operators()].count("EW") == 0
    assert len(onednn.operators()) == len(mkl.operators()) - 1
    assert onednn.find("linear1").attrs["activation"] == "gelu" and "activation" not in mkl.find("linear1").attrs
    contractions = {op.label: op.attrs.get("packed_parameter") for op in onednn.operators() if op.kind == "contraction"}
    assert contractions == {"qkv": "in_proj_weight", "out_proj": "out_proj_weight", "linear1": "linear1_weight",
                            "linear2": "linear2_weight"}
    assert not any(op.attrs.get("packed_parameter") for op in mkl.operators())
    s = cfg.sizes()
    bj, i, u = s["B"] * s["J"], s["I"], s["U"]
    assert bj >= 256  # the packed copies are read (and digested) at these rows
    digest = 4 * (3 * i * i + i * i + 2 * i * u)
    before, after = (sum(c.bytes for c in count_graph(g)) for g in (mkl, onednn))
    assert before - after == 2 * 4 * bj * u - digest
    assert sum(c.flop for c in count_graph(mkl)) == sum(c.flop for c in count_graph(onednn))
    # training builds keep MKL under "auto" and take no epilogue even on oneDNN (products kept for backward
    # where the activation needs them)
    train, _ = compile_graphs(cfg, fuse_ops=True, fp32_gemm="onednn")
    assert "activation" not in train.find("linear1").attrs and not any(
        op.attrs.get("packed_parameter") for op in train.operators())


def test_generated_calls_of_the_onednn_build():
    source = cached_compile(_wide(), fp32_gemm="onednn", mode="eval").sources["forward"]
    assert source.count("ss::matmul<float>(") == 4  # Q/K/V (a loop over T), out_proj, linear1, linear2
    assert source.count(") >= 256) != 0) return 1;") == 4  # each reads its packed copy from 256 rows
    assert source.count("ss::GemmActivation::gelu, (B*J) >= 256)") == 1
    assert "ss::gelu(" not in source  # no row kernel applies it


@pytest.mark.parametrize("batch,seq", [(4, 64), (2, 150), (1, 64), (3, 5)])
def test_onednn_build_matches_float64(wide_layers, batch, seq):
    """256 and 300 rows: oneDNN with epilogues, packed weights, two chunks along k; 64 and 15 rows:
    MKL, the epilogue applied after it. Within 3x the MKL build's error against float64 (and below
    1.5e-6: float32 rounding of outputs of size ~1), padded keys included."""
    onednn, mkl, ref = wide_layers
    torch.manual_seed(batch * 1000 + seq)
    x = torch.randn(batch, seq, WIDE["hidden_size"])
    mask = torch.zeros(batch, seq)
    mask[-1, seq * 2 // 3:] = float("-inf")
    real = mask == 0
    with torch.inference_mode():
        want = ref(x.double(), mask.double())
        errors = [float((layer(x, attention_mask=mask).double() - want)[real].abs().max()) for layer in (onednn, mkl)]
    assert errors[0] <= max(3 * errors[1], 1e-6) and errors[0] < 1.5e-6, errors


def test_packed_copies_follow_weights_changed_in_place(wide_layers):
    """A weight overwritten through ``.data`` (same address, no version bump) is packed again by content."""
    onednn, _, ref = wide_layers
    x = torch.randn(4, 64, WIDE["hidden_size"])
    saved = {n: p.detach().clone() for n, p in onednn.named_parameters()}
    try:
        with torch.inference_mode():
            before = onednn(x)
            onednn.linear2_weight.data.mul_(-0.5)
            onednn.linear1_weight.data[:, :8] = 0.01  # the last chunk of k = I only
            after = onednn(x)
        ref.load_state_dict(onednn.state_dict())
        want = ref(x.double()).detach()
        assert float((after.double() - want).abs().max()) < 3e-6
        assert float((after - before).abs().max()) > 0.1
    finally:
        with torch.no_grad():
            for n, p in onednn.named_parameters():
                p.copy_(saved[n])
        ref.load_state_dict(onednn.state_dict())


_VERBOSE_RUN = """
import torch
from substation import EncoderLayer
from substation.config import load_config
from substation.pipeline import cached_compile
layer = EncoderLayer(cached_compile(load_config('tiny').replace(**{wide}), fp32_gemm='onednn')).eval()
with torch.inference_mode():
    layer(torch.randn(4, 64, {hidden}))
"""


def test_every_onednn_float32_call_runs_a_jit_kernel():
    """oneDNN's verbose log of one inference call: each chunk of each GEMM (the sum and GELU post-ops
    included) runs a jit or brgemm kernel, none the reference kernel; the packed copies are made by reorders."""
    script = _VERBOSE_RUN.format(wide=repr(WIDE), hidden=WIDE["hidden_size"])
    run = subprocess.run([sys.executable, "-c", script], env={**os.environ, "ONEDNN_VERBOSE": "1"},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    calls = [line.split(",") for line in run.stdout.splitlines() if line.startswith("onednn_verbose,exec,cpu,")]
    matmuls = [c for c in calls if c[3] == "matmul"]
    # Q, K, V, out_proj: one call each (k = 520: two chunks each), linear1 and linear2: two chunks each
    assert len(matmuls) == 2 * 6, [c[4] for c in matmuls]
    assert not [c for c in calls if c[4].startswith("ref")], [c[3:5] for c in calls]
    assert sum(c[3] == "reorder" for c in calls) == len(matmuls)  # one packed copy per chunk of a weight


def test_release_frees_the_float32_packed_copies(wide_layers):
    """The float32 oneDNN library exports the cache's release and the per-thread hold, as bf16 ones do."""
    from substation.runtime import release_packed_parameters
    onednn, _, _ = wide_layers
    lib = onednn.compiled.forward_only().forward.lib
    assert hasattr(lib, "substation_release_packed_parameters") and hasattr(lib, "substation_hold_parameters")
    with torch.inference_mode():
        onednn(torch.randn(4, 64, WIDE["hidden_size"]))  # 256 rows: every weight packed
    i, u = WIDE["hidden_size"], WIDE["ffn_size"]
    assert release_packed_parameters() >= 4 * (4 * i * i + 2 * i * u)  # float32 copies, oneDNN's padding on top
    assert release_packed_parameters() == 0


def test_report_counts_the_graphs_of_the_library_asked_for(tmp_path, capsys):
    """``report --fp32-gemm``: the graphs of that library, named in the first line and the JSON."""
    import json

    from substation.cli import main
    tables = {}
    for library in ("mkl", "onednn"):
        out = tmp_path / f"{library}.json"
        assert main(["report", "minilm-l6", "--mode", "eval", "--optimized", "--fp32-gemm", library,
                     "--json", str(out)]) == 0
        tables[library] = capsys.readouterr().out
        report = json.loads(out.read_text())
        assert report["fp32_gemm"] == library
        assert report["kernels"]["forward"]["EW"] == (1 if library == "mkl" else 0)  # BA, or GELU in linear1
    assert "float32 (4 bytes) (mkl GEMMs) post-LN" in tables["mkl"].splitlines()[0]
    assert "(onednn GEMMs, MKL under 256 token rows)" in tables["onednn"].splitlines()[0]
    assert "\nBA " in tables["mkl"] and "\nBA " not in tables["onednn"]
