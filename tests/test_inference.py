"""The forward-only inference build: no backward library, nothing saved, no dropout, a workspace whose
buffers are reused, chosen at call time when no gradient is needed; its analysis and bench modes."""
from __future__ import annotations

import json

import pytest
import torch

from substation import EncoderLayer
from substation.backends.common import workspace_slots
from substation.backends.cpu.codegen import tensor_dtypes
from substation.cli import main
from substation.perf.analysis import analyze
from substation.pipeline import PipelineOptions, cached_compile, compile_graphs
from substation.reference import ReferenceEncoderLayer
from substation.runtime import CompiledLayer, parameter_names


@pytest.fixture(scope="module")
def timed():
    """The instrumented tiny build (float64, dropout 0.1) and its inference build."""
    compiled = cached_compile("tiny", instrument=True)
    return compiled, compiled.forward_only()


def _workspace_bytes(lib, b, j):
    import ctypes
    fn = lib.lib.substation_workspace_bytes
    fn.restype = ctypes.c_int64
    return fn((ctypes.c_int64 * 3)(b, j, j))


def test_inference_build_reads_the_inputs_and_writes_y_alone(timed):
    train, inference = timed
    assert train.mode == "train" and inference.mode == "eval"
    assert inference.backward is None and inference.saved_names == [] and inference.produced_names == ["Y"]
    assert inference.forward_only() is inference and train.forward_only() is inference
    assert [t.name for t in inference.forward.args] == ["X", "mask", *parameter_names(train.config), "Y"]
    assert not any(t.role == "saved" for t in inference.forward.graph.tensors.values())
    assert {t.name for t in train.forward.produced} > {"Y"}  # the training forward saves for backward


def test_inference_graph_has_no_dropout_and_fewer_operators():
    config = "tiny"
    train_fwd, _ = compile_graphs(config)
    inf_fwd, inf_bwd = compile_graphs(config, mode="eval")
    assert inf_bwd is None
    train_kinds = [op.kind for op in train_fwd.operators()]
    inf_kinds = [op.kind for op in inf_fwd.operators()]
    dropouts = train_kinds.count("dropout")
    assert dropouts == 3  # attention, attention output, feed-forward output (tiny: activation dropout 0)
    assert "dropout" not in inf_kinds and len(inf_kinds) == len(train_kinds) - dropouts
    fused, _ = compile_graphs(config, fuse_ops=True, mode="eval")
    assert all(m["kind"] != "dropout" for op in fused.operators() if op.kind == "fused" for m in op.attrs["ops"])


def test_workspace_buffers_are_reused_once_dead(timed):
    train, inference = timed
    graph = inference.forward.graph
    slots = workspace_slots(graph, tensor_dtypes(graph))
    temps = [t for t, info in graph.tensors.items() if info.role == "temp"]
    assert sorted(t for s in slots for t in s) == sorted(temps)
    assert len(slots) < len(temps)
    b, j = 4, 16
    sizes = graph.config.sizes(b, j)
    # the training forward writes its saved tensors besides its workspace; the inference build keeps
    # every intermediate in a workspace of reused buffers
    saved = sum(8 * _numel(t, sizes) for t in train.forward.graph.tensors.values() if t.role == "saved")
    assert _workspace_bytes(inference.forward, b, j) < _workspace_bytes(train.forward, b, j) + saved


def _numel(info, sizes):
    n = 1
    for d in info.dims:
        n *= sizes[d]
    return n


def _op_total(lib):
    return sum(lib.op_seconds(reset=True).values())


def test_no_grad_eval_runs_the_inference_build_and_matches_float64(timed):
    train, inference = timed
    layer = EncoderLayer(train)
    ref = ReferenceEncoderLayer(train.config, torch.float64)
    ref.load_state_dict(layer.state_dict())
    layer.eval(), ref.eval()
    b, j = 3, 9
    x = torch.randn(b, j, train.config.hidden_size, dtype=torch.float64)
    mask = torch.zeros(b, j, dtype=torch.float64)
    mask[1, 6:] = float("-inf")
    mask[2, :] = float("-inf")  # a fully padded row
    _op_total(train.forward), _op_total(inference.forward)
    real = mask == 0
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            y = layer(x, mask)
        assert _op_total(inference.forward) > 0 and _op_total(train.forward) == 0
        # real tokens only (packed): padded positions are zeros
        assert float((y[real] - ref(x, mask).detach()[real]).abs().max()) <= 1e-12
        assert float(y[~real].abs().max()) == 0.0
    # nothing requires grad: also forward-only
    for p in layer.parameters():
        p.requires_grad_(False)
    layer(x, mask)
    assert _op_total(inference.forward) > 0 and _op_total(train.forward) == 0
    for p in layer.parameters():
        p.requires_grad_(True)
    # a gradient is needed: the training build
    y = layer(x.requires_grad_(), mask)
    assert _op_total(train.forward) > 0 and _op_total(inference.forward) == 0
    y.sum().backward()
    assert x.grad is not None


def test_train_mode_without_grad_still_draws_dropout(timed):
    train, inference = timed
    layer = EncoderLayer(train).train()
    x = torch.randn(2, 8, train.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        torch.manual_seed(1)
        y_train = layer(x)
        y_eval = layer.eval()(x)
    assert _op_total(train.forward) > 0
    assert float((y_train - y_eval).abs().max()) > 1e-3  # dropout was applied in train mode


def test_forward_only_under_torch_compile_without_graph_breaks(timed):
    train, _ = timed
    layer = EncoderLayer(train).eval()
    x = torch.randn(2, 8, train.config.hidden_size, dtype=torch.float64)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    with torch.inference_mode():
        y, y_ref = compiled(x), layer(x)
    assert torch.equal(y, y_ref)


def test_drop_in_layers_choose_the_inference_build(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from substation.interop import drop_in
    cfg = transformers.BertConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64, torch_dtype="float64")
    hf = transformers.models.bert.modeling_bert.BertLayer(cfg).double().eval()
    layer = drop_in(hf)
    calls = []
    original = CompiledLayer.forward_only

    def counting(self):
        calls.append(self.mode)
        return original(self)
    monkeypatch.setattr(CompiledLayer, "forward_only", counting)
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    with torch.no_grad():
        layer(x)
    assert calls == ["train"]
    layer(x.requires_grad_())
    assert calls == ["train"]


def test_pipeline_options_mode():
    assert PipelineOptions.from_dict(PipelineOptions(mode="eval").to_dict()).mode == "eval"
    with pytest.raises(ValueError, match="mode must be one of train, eval"):
        PipelineOptions(mode="inference")
    with pytest.raises(ValueError, match="inference build uses PyTorch's layouts"):
        PipelineOptions(mode="eval", layout="bert-base")


def test_analysis_of_the_inference_build(tmp_path):
    train = analyze("tiny", optimized=True)
    inference = analyze("tiny", optimized=True, mode="eval")
    assert inference.mode == "eval" and not inference.select("backward")
    # the fused attention kernel (TC) also does the mask and softmax arithmetic (6 per score, 1 per row)
    # and the Q, K, V bias adds (1 per element)
    sizes = inference.sizes
    scores = sizes["B"] * sizes["H"] * sizes["J"] * sizes["K"]
    assert inference.total("forward", "TC")["flop"] == train.total("forward", "TC")["flop"] + 6 * scores \
        + sizes["B"] * sizes["H"] * sizes["J"] + 3 * sizes["B"] * sizes["J"] * sizes["H"] * sizes["P"]
    # no dropout and nothing saved for backward: fewer bytes than the training forward
    assert inference.total("forward")["bytes"] < train.total("forward")["bytes"]
    out = tmp_path / "eval.json"
    assert main(["report", "tiny", "--optimized", "--mode", "eval", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["mode"] == "eval" and all(o["pass"] == "forward" for o in data["operators"])
    assert data["totals"]["forward"]["all"]["bytes"] == inference.total("forward")["bytes"]


def test_jit_trace_with_gradients_enabled_and_the_traced_module_differentiates(timed):
    import warnings
    train, _ = timed
    layer = EncoderLayer(train).eval()
    x = torch.randn(2, 7, train.config.hidden_size, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(layer, (x,))  # the tracer checks the trace again under no_grad
    xg = x.clone().requires_grad_()
    traced(xg).sum().backward()
    ref = x.clone().requires_grad_()
    layer(ref).sum().backward()
    assert float((xg.grad - ref.grad).abs().max()) <= 1e-12


def test_inference_build_takes_the_qkv_weight_in_parts(timed):
    """The forward-only library takes in_proj_weight as three Q, K, V pointers (no per-call concatenation
    for drop-in layers): one GEMM per T in its code, results equal to the stacked weight's bit for bit;
    the training build keeps one stacked argument."""
    from substation.ir.operands import split_stack_params
    train, inference = timed
    assert inference.forward.split == {"in_proj_weight"}
    assert split_stack_params(inference.forward.graph) == ("in_proj_weight",)
    assert train.forward.split == frozenset() and split_stack_params(train.backward.graph) == ()
    source = inference.sources["forward"]
    assert source.count("in_proj_weight_parts_[i_T]") == 1 and "in_proj_weight_parts_ = " in source
    layer = EncoderLayer(train).eval()
    params = [getattr(layer, n) for n in layer.parameter_names]
    w = layer.in_proj_weight
    i = train.config.hidden_size
    parts = tuple(w.detach()[k * i:(k + 1) * i].clone() for k in range(3))  # three separate buffers
    from substation.runtime import run_layer
    split_params = [parts if n == "in_proj_weight" else p for n, p in zip(layer.parameter_names, params)]
    for batch, seq in ((2, 7), (2, 130)):  # 14 and 260 token rows: either side of ss::kSplitRows
        x = torch.randn(batch, seq, i, dtype=torch.float64)
        with torch.no_grad():
            y_stacked = run_layer(train, x, params, training=False)
            _op_total(inference.forward)
            y_parts = run_layer(train, x, split_params, training=False)
            assert _op_total(inference.forward) > 0
        assert torch.equal(y_stacked, y_parts)
    # with a gradient needed the parts are concatenated differentiably: each part gets its slice of the gradient
    leaves = tuple(q.clone().requires_grad_() for q in parts)  # leaves
    split_params = [leaves if n == "in_proj_weight" else p for n, p in zip(layer.parameter_names, params)]
    run_layer(train, x, split_params, training=False).square().sum().backward()
    y_ref = layer(x)
    y_ref.square().sum().backward()
    for k, q in enumerate(leaves):
        assert torch.allclose(q.grad, w.grad[k * i:(k + 1) * i], rtol=1e-12, atol=1e-12)


def test_parts_of_the_wrong_count_dtype_or_size_are_named(timed):
    _, inference = timed
    lib = inference.forward
    i = inference.config.hidden_size
    layer = EncoderLayer(inference)
    given = {n: getattr(layer, n).detach() for n in layer.parameter_names}
    given["X"] = torch.randn(1, 4, i, dtype=torch.float64)
    if "mask" in lib.dtypes:
        given["mask"] = torch.zeros(1, 4, dtype=lib.dtypes["mask"])
    w = given["in_proj_weight"]
    cases = [((w[:i], w[i:2 * i]), ValueError, "given as 2 parts"),
             ((w[:i], w[i:2 * i], w[2 * i:].float()), TypeError, "in_proj_weight part 2 is torch.float32"),
             ((w[:i], w[i:2 * i], w[2 * i:-1]), ValueError, "in_proj_weight part 2"),
             ((w[:i], w[i:2 * i], w[2 * i:].t()), ValueError, "non-contiguous")]
    for value, error, text in cases:
        with pytest.raises(error, match=text):
            lib({**given, "in_proj_weight": value}, 1, 4)
    with pytest.raises(ValueError, match="out_proj_weight given as 3 parts; it takes one tensor"):
        lib({**given, "out_proj_weight": (w[:1], w[1:2], w[2:3])}, 1, 4)


def test_run_layer_checks_every_parameter_and_part_shape(timed):
    """Shapes are checked, not only element counts: a Q weight reshaped to [I/2, 2I] is refused (the
    library alone would read it as [I, I]); parts only for the stacked parameters, T of them."""
    from substation.runtime import run_layer
    train, _ = timed
    layer = EncoderLayer(train).eval()
    names = layer.parameter_names
    params = [getattr(layer, n).detach() for n in names]
    i = train.config.hidden_size
    w = params[0]
    q, k, v = (w[n * i:(n + 1) * i] for n in range(3))
    x = torch.randn(1, 4, i, dtype=torch.float64)
    cases = [((q.reshape(i // 2, 2 * i), k, v), r"in_proj_weight part 0 has shape \(%d, %d\); this layer takes \[%d, %d\]"
              % (i // 2, 2 * i, i, i)),
             ((q.reshape(-1), k, v), "in_proj_weight part 0 has shape"),
             ((), r"in_proj_weight given as 0 parts; it takes one tensor \[%d, %d\] or 3 parts" % (3 * i, i)),
             (w.reshape(i, 3 * i), r"parameter in_proj_weight has shape \(%d, %d\)" % (i, 3 * i))]
    for value, text in cases:
        with torch.no_grad(), pytest.raises(ValueError, match=text):
            run_layer(train, x, [value, *params[1:]], training=False)
    with torch.no_grad(), pytest.raises(ValueError, match="out_proj_weight given as 2 parts; it takes one tensor"):
        run_layer(train, x, [w, params[1], (params[2][:1], params[2][1:]), *params[3:]], training=False)
