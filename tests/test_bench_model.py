"""substation bench-model: whole-model training steps on a tiny BERT; the JSON is well formed (no speed
targets), both models start from the same weights, a failing torch.compile variant is reported."""
import json
import os

import pytest
import torch

from substation.perf import bench_model
from substation.cli import main

B, L, ROUNDS = 2, 16, 2
TOP_KEYS = {"schema", "model", "batch_size", "seq_len", "mode", "fp32_gemm", "dropout", "mask", "optimizer", "threads", "machine",
            "rounds", "warmup", "compile_backend", "memory_method", "heads"}
HEAD_KEYS = {"model_class", "parameters", "parameters_optimized", "initialised_parameters", "replaced_layers",
             "optimize_seconds", "substation_build_seconds", "substation_threads", "check", "variants",
             "median_seconds", "speedup_vs_eager", "speedup_vs_compile", "speedup_compiled_vs_compile"}
VARIANT_KEYS = {"label", "compiled", "error", "compile_seconds", "threads", "seconds", "peak_step_bytes"}
STAT_KEYS = {"median", "min", "max", "q1", "q3", "samples"}


def check_timed(v, rounds):
    assert VARIANT_KEYS <= set(v) and v["error"] is None
    assert set(v["seconds"]) == set(bench_model.PHASES)
    for p, s in v["seconds"].items():
        assert set(s) == STAT_KEYS and len(s["samples"]) == rounds
        assert 0 < s["min"] <= s["q1"] <= s["median"] <= s["q3"] <= s["max"], p
    for i in range(rounds):  # a step is that round's forward + backward + optimizer
        parts = sum(v["seconds"][p]["samples"][i] for p in ("forward", "backward", "optimizer"))
        assert v["seconds"]["step"]["samples"][i] == pytest.approx(parts)
    assert type(v["peak_step_bytes"]) is int and v["peak_step_bytes"] > 0
    assert v["threads"] == torch.get_num_threads()


def test_bench_model_cli_tiny(tmp_path, capsys):
    js, png = tmp_path / "m.json", tmp_path / "m.png"
    assert main(["bench-model", "--model", "tiny", "--head", "both", "--batch", str(B), "--seq-len", str(L),
                 "--rounds", str(ROUNDS), "--no-compile", "--json", str(js), "--plot", str(png)]) == 0
    r = json.loads(js.read_text())
    assert set(r) == TOP_KEYS and r["schema"] == "substation-bench-model/1" and r["mode"] == "train"
    assert (r["batch_size"], r["seq_len"], r["rounds"], r["compile_backend"]) == (B, L, ROUNDS, None)
    assert r["model"]["num_layers"] == 2 and r["model"]["hidden_size"] == 64 and r["model"]["num_heads"] == 2
    assert r["threads"] == torch.get_num_threads() and r["machine"]["cpu"]
    assert list(r["heads"]) == ["mlm", "cls"]
    for head, h in r["heads"].items():
        assert set(h) == HEAD_KEYS, head
        assert h["replaced_layers"] == 2 and h["parameters"] == h["parameters_optimized"] > 0
        assert list(h["variants"]) == ["plain_eager", "optimized_eager"] == list(h["median_seconds"])
        for v in h["variants"].values():
            check_timed(v, ROUNDS)
        med = h["median_seconds"]
        for n in med:
            assert med[n] == h["variants"][n]["seconds"]["step"]["median"] > 0
        assert h["speedup_vs_eager"] == med["plain_eager"] / med["optimized_eager"]
        assert h["speedup_vs_compile"] is None and h["speedup_compiled_vs_compile"] is None
        # same weights: with dropout off, the first step's loss agrees, and it is the loss of a model built anew
        ck = h["check"]
        assert ck["abs_diff"] == abs(ck["loss_plain"] - ck["loss_optimized"]) <= 1e-5
        model, _ = bench_model.build_model(bench_model.model_spec("tiny"), head, seed=0)
        with torch.no_grad():
            loss = float(model.eval()(**bench_model.make_batch(model.config, head, B, L, seed=0)).loss)
        assert loss == ck["loss_plain"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "speedup_vs_eager" in out and "optimized eager" in out and r["machine"]["cpu"] in out


def test_failing_torch_compile_is_reported_per_variant(monkeypatch):
    """torch.compile of the optimized model raises: that variant carries the error and is not timed; the
    others run (here torch.compile of the plain model is the identity, so nothing is compiled)."""
    def fake_compile(model, backend=None):
        if bench_model.compiled_layers(model)[0]:
            raise RuntimeError("cannot compile this")
        return model
    monkeypatch.setattr(torch, "compile", fake_compile)
    r = bench_model.run_bench_model("tiny", head="cls", batch=B, seq_len=L, rounds=ROUNDS, warmup=0)
    h = r["heads"]["cls"]
    assert list(h["variants"]) == list(bench_model.VARIANTS)
    failed = h["variants"]["optimized_compile"]
    assert failed["error"] == "RuntimeError: cannot compile this"
    assert failed["seconds"] is None and failed["peak_step_bytes"] is None and failed["compile_seconds"] is None
    assert failed["graph_breaks"] == 0 and failed["graph_break_reasons"] == {}
    assert h["variants"]["plain_compile"]["compile_seconds"] > 0
    med = h["median_seconds"]
    assert list(med) == ["plain_eager", "plain_compile", "optimized_eager"]
    assert h["speedup_vs_compile"] == med["plain_compile"] / med["optimized_eager"]
    assert h["speedup_compiled_vs_compile"] is None
    assert "failed: RuntimeError: cannot compile this" in bench_model.format_bench_model(r)


def test_batch_labels_and_mask():
    spec = bench_model.model_spec("tiny")
    mlm = bench_model.make_batch(spec.config, "mlm", 4, 8, seed=1)
    assert mlm["attention_mask"].tolist() == [[1] * 8] * 2 + [[1] * 6 + [0] * 2] * 2
    assert bool((mlm["input_ids"][mlm["attention_mask"] == 0] == spec.config.pad_token_id).all())
    labelled = mlm["labels"] != -100
    assert labelled.any() and not bool((labelled & (mlm["attention_mask"] == 0)).any())
    cls = bench_model.make_batch(spec.config, "cls", 4, 8)
    assert cls["labels"].shape == (4,) and set(cls["labels"].tolist()) <= {0, 1}
    with pytest.raises(ValueError, match="max_position_embeddings"):
        bench_model.make_batch(spec.config, "cls", 2, 10_000)
    with pytest.raises(ValueError, match="unknown head"):
        bench_model.make_batch(spec.config, "lm", 2, 8)


def test_peak_step_bytes_sees_the_step_allocations():
    def step():
        a = torch.empty(1 << 20, dtype=torch.uint8)
        b = torch.empty(1 << 19, dtype=torch.uint8)
        del a, b
    assert bench_model.peak_step_bytes(step) >= (1 << 20) + (1 << 19)


def test_bench_model_cli_errors(tmp_path, capsys):
    assert main(["bench-model", "--model", "tiny", "--rounds", "0"]) == 2
    assert "--rounds must be >= 1" in capsys.readouterr().err
    assert main(["bench-model", "--model", "no-such-model", "--no-compile"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err
    assert main(["bench-model", "--model", "tiny", "--seq-len", "4096", "--no-compile"]) == 2
    assert "max_position_embeddings" in capsys.readouterr().err
    other = tmp_path / "gpt2.json"
    other.write_text(json.dumps({"model_type": "gpt2"}))
    assert main(["bench-model", "--model", str(other), "--no-compile"]) == 2
    assert "model_type 'bert'" in capsys.readouterr().err


def test_peak_step_bytes_counts_a_step_and_drops_only_kinetos_notices(capfd):
    def step():
        torch.ones(1000, 1000).sum()
        os.write(2, b"from the step\n")
    assert bench_model.peak_step_bytes(step) >= 4_000_000  # the 1000 x 1000 float32 temporary
    err = capfd.readouterr().err
    assert "from the step" in err and "profiler_start" not in err and "profiler_stop" not in err
