"""The pipeline: one list of passes with declared needs and changes, typed serializable options,
graphs validated between passes, and the CLI's progress bar over the same list."""
import dataclasses
import json

import pytest

from substation.config import load_config
from substation.pipeline import PASSES, Pass, Pipeline, PipelineOptions, compile_graphs


def test_the_passes_in_order_and_their_contracts():
    assert Pipeline().names == ["graph", "precision", "autodiff", "fusion", "layout", "codegen", "build", "load"]
    have = {"config"}
    for p in PASSES:
        assert p.needs <= have, p.name          # each pass needs only what earlier passes changed
        have |= p.changes
        assert p.description
    assert have >= {"forward", "backward", "sources", "built", "compiled"}


def test_options_are_typed_and_round_trip_through_json():
    options = PipelineOptions(fuse=False, layout="bert-base", instrument=True, fp32_gemm="onednn")
    assert PipelineOptions.from_dict(json.loads(json.dumps(options.to_dict()))) == options
    with pytest.raises(ValueError, match="PipelineOptions.fp32_gemm must be one of auto, mkl, onednn, got 'blas'"):
        PipelineOptions(fp32_gemm="blas")
    with pytest.raises(TypeError, match="PipelineOptions.fuse must be a bool"):
        PipelineOptions(fuse="yes")
    with pytest.raises(TypeError, match="PipelineOptions.layout must be None"):
        PipelineOptions(layout=3)
    with pytest.raises(KeyError, match="unknown pipeline options"):
        PipelineOptions.from_dict({"fuse": True, "vectorize": 1})


def test_run_until_and_progress_report_every_pass():
    seen = []
    state = Pipeline().run("tiny", PipelineOptions(fuse=True), until="layout", progress=seen.append)
    assert seen == ["graph", "precision", "autodiff", "fusion", "layout"]
    assert state.sources is None and state.compiled is None
    fused = sum(op.kind == "fused" for op in state.forward.operators())
    assert fused >= 3
    unfused, _ = compile_graphs(load_config("tiny"))
    assert not any(op.kind == "fused" for op in unfused.operators())
    with pytest.raises(ValueError, match="until='optimise' is not a pass"):
        Pipeline().run("tiny", until="optimise")


def test_a_pass_list_with_missing_needs_is_refused():
    with pytest.raises(ValueError, match=r"pass precision needs \[.forward.\]"):
        Pipeline(PASSES[1:]).run("tiny")


def test_graphs_are_validated_after_each_pass():
    def corrupt(state):
        info = state.forward.tensors["Y"]
        state.forward.tensors["Y"] = dataclasses.replace(info, dims="BJ")
    broken = (*PASSES[:2], Pass("corrupt", "break a graph", frozenset({"forward"}), frozenset({"forward"}), corrupt))
    with pytest.raises(ValueError, match="forward graph: tensor Y has layout BJI for dims BJ"):
        Pipeline(broken).run("tiny")


def test_the_float32_gemm_library_is_measured_once_and_kept_in_the_cache(monkeypatch):
    """fp32_gemm_library() times MKL against oneDNN once per machine and keeps the choice with its
    figures (atomically written JSON); a later process reads the record instead of measuring."""
    import glob
    import os

    from substation.backends.cpu.build import cache_dir
    from substation.perf import probes
    choice = probes.fp32_gemm_library()
    assert choice in probes.FP32_GEMM_LIBRARIES
    records = glob.glob(os.path.join(cache_dir(), "fp32-gemm-library-*.json"))
    if not records:  # no oneDNN or no AVX-512 F/BW/DQ: MKL without measuring
        assert choice == "mkl"
        return
    (path,) = records
    with open(path) as f:
        original = f.read()
    record = json.loads(original)
    assert record["choice"] == choice and record["margin"] == probes.ONEDNN_FP32_MARGIN
    rates = record["gflops"]
    assert len(rates["mkl"]) == len(rates["onednn"]) == len(probes.FP32_PROBE_SHAPES) == 6
    assert all(0 < r < 1e5 for r in rates["mkl"] + rates["onednn"])
    speedup = record["onednn_speedup"]
    assert (speedup >= probes.ONEDNN_FP32_MARGIN) == (choice == "onednn")
    other = "mkl" if choice == "onednn" else "onednn"
    try:  # a record is trusted as it stands: no second measurement
        with open(path, "w") as f:
            json.dump({**record, "choice": other}, f)
        probes.fp32_gemm_library.cache_clear()
        monkeypatch.setattr(probes, "_onednn_seconds", lambda *a: pytest.fail("measured again"))
        assert probes.fp32_gemm_library() == other
    finally:
        with open(path, "w") as f:
            f.write(original)
        probes.fp32_gemm_library.cache_clear()
    assert probes.fp32_gemm_library() == choice
