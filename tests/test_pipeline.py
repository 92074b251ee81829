"""The pipeline: one list of passes with declared needs and changes, typed serializable options,
graphs validated between passes, and the CLI's progress bar over the same list."""
import dataclasses
import json

import pytest

from substation.config import load_config
from substation.pipeline import PASSES, Pass, Pipeline, PipelineOptions, compile_graphs


def test_the_passes_in_order_and_their_contracts():
    assert Pipeline().names == ["graph", "precision", "autodiff", "gemm-library", "fusion", "layout", "codegen", "build",
                                "load"]
    have = {"config"}
    for p in PASSES:
        assert p.needs <= have, p.name          # each pass needs only what earlier passes changed
        have |= p.changes
        assert p.description
    assert have >= {"forward", "backward", "fp32_gemm", "sources", "built", "compiled"}


def test_options_are_typed_and_round_trip_through_json():
    options = PipelineOptions(fuse=False, layout="bert-base", instrument=True, fp32_gemm="onednn")
    assert PipelineOptions.from_dict(json.loads(json.dumps(options.to_dict()))) == options
    with pytest.raises(ValueError, match="fp32_gemm .* must be one of auto, mkl, onednn, got 'blas'"):
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
    assert seen == ["graph", "precision", "autodiff", "gemm-library", "fusion", "layout"]
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
