"""substation.interop: parity with Hugging Face BertLayer / BertModel and torch.nn.TransformerEncoderLayer,
and the errors of from_hf / from_torch.

Sizes are small (I = 32, H = 4, P = 8, U = 48, J = 8) so that the file runs in seconds once the builds are
cached. Errors are measured as max |ours - reference| / max |reference| per tensor.
"""
import copy
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from transformers import BertConfig, BertModel  # noqa: E402
from transformers.masking_utils import create_bidirectional_mask  # noqa: E402
from transformers.models.bert.modeling_bert import BertLayer  # noqa: E402

from conftest import real_rel, rel  # noqa: E402
from substation import EncoderLayer  # noqa: E402
from substation.interop import SubstationLayer, drop_in, optimize  # noqa: E402
from substation.runtime.packing import computed_queries  # noqa: E402

from_hf, from_torch = EncoderLayer.from_hf, EncoderLayer.from_torch

I, H, U, B, J = 32, 4, 48, 3, 8
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def bert_config(**kw):
    base = dict(hidden_size=I, num_attention_heads=H, intermediate_size=U, num_hidden_layers=2, vocab_size=64,
                max_position_embeddings=16, attention_probs_dropout_prob=0.1, hidden_dropout_prob=0.2)
    base.update(kw)
    return BertConfig(**base)


def randomize_(module, seed):
    """Random biases and LayerNorm parameters (PyTorch initialises them to 0 / 1) so every gradient is exercised."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "LayerNorm.weight" in name or
                                                      name.startswith("norm") and "weight" in name else 0.0))
    return module


def hf_layer(dtype, **kw):
    kw.setdefault("attn_implementation", "eager")
    torch.manual_seed(0)
    layer = BertLayer(bert_config(**kw)).to(dtype)
    return randomize_(layer, 1).eval()


def packed_rel(ours, ref, attend):
    """``rel`` over the positions an inference call computes (``attend`` [B, K], 1 = real: the real
    tokens and position 0 of each sequence with one, :func:`computed_queries`); the other padded
    positions must be zeros."""
    computed = computed_queries(attend.bool())
    assert float(ours[~computed].abs().sum()) == 0.0
    return real_rel(ours, ref, computed)


def key_mask_2d():
    """[B, K] int, 1 = attend: half of the keys of every sequence masked, at different positions."""
    am = torch.ones(B, J, dtype=torch.long)
    am[0, J // 2:] = 0          # padding at the end
    am[1, :J // 2] = 0          # first half masked
    am[2, 0::2] = 0             # every other key
    return am


def hf_mask(config, x, am):
    """The mask BertModel gives its layers in transformers 5.x (create_bidirectional_mask)."""
    return create_bidirectional_mask(config=config, inputs_embeds=x, attention_mask=am)


def layer_grads(layer):
    """Gradients of a Hugging Face layer (or its drop-in) by parameter name."""
    return {n: p.grad for n, p in layer.named_parameters()}


def hf_grads(layer):
    """HF BertLayer gradients under Substation's parameter names (Q, K, V stacked into in_proj)."""
    sa, ao = layer.attention.self, layer.attention.output
    g = lambda m: m.grad  # noqa: E731
    return {
        "in_proj_weight": torch.cat([g(sa.query.weight), g(sa.key.weight), g(sa.value.weight)]),
        "in_proj_bias": torch.cat([g(sa.query.bias), g(sa.key.bias), g(sa.value.bias)]),
        "out_proj_weight": g(ao.dense.weight), "out_proj_bias": g(ao.dense.bias),
        "linear1_weight": g(layer.intermediate.dense.weight), "linear1_bias": g(layer.intermediate.dense.bias),
        "linear2_weight": g(layer.output.dense.weight), "linear2_bias": g(layer.output.dense.bias),
        "norm1_weight": g(ao.LayerNorm.weight), "norm1_bias": g(ao.LayerNorm.bias),
        "norm2_weight": g(layer.output.LayerNorm.weight), "norm2_bias": g(layer.output.LayerNorm.bias),
    }


def forward_backward(module, x, g, *args, **kwargs):
    x = x.detach().clone().requires_grad_()
    module.zero_grad()
    y = module(x, *args, **kwargs)
    y.backward(g)
    return y.detach(), x.grad.detach()


# ------------------------------------------------------------------------------------------------ (a) BertLayer


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_from_hf_parity_forward_and_all_gradients(dtype, attn):
    ref = hf_layer(dtype, attn_implementation=attn)
    ours = drop_in(copy.deepcopy(ref))
    c = ours.substation_compiled.config
    assert (c.hidden_size, c.num_heads, c.ffn_size, c.activation, c.layer_norm) == (I, H, U, "gelu", "post")
    assert (c.dropout.attention, c.dropout.hidden, c.dropout.activation) == (0.1, 0.2, 0.0)
    assert c.layer_norm_eps == 1e-12 and c.dtype == str(dtype).split(".")[1] and c.mask == "padding"
    assert (c.batch_size, c.max_seq_len) == (1, 16)  # max_position_embeddings of the HF config
    assert not ours.training and isinstance(ours, BertLayer)

    torch.manual_seed(2)
    x = torch.randn(B, J, I, dtype=dtype)
    g = torch.randn(B, J, I, dtype=dtype)
    mask = hf_mask(ref.attention.self.config, x, key_mask_2d())
    assert mask.shape == (B, 1, J, J)
    assert mask.dtype == (dtype if attn == "eager" else torch.bool)  # eager: additive finfo.min; sdpa: bool

    y_ref, dx_ref = forward_backward(ref, x, g, mask)
    y, dx = forward_backward(ours, x, g, mask)
    errors = {"Y": rel(y, y_ref), "dX": rel(dx, dx_ref)}
    want, got = layer_grads(ref), layer_grads(ours)
    assert set(got) == set(want) and len(want) == 16
    for n in want:
        errors[n] = rel(got[n], want[n])
    # the key bias gradient is zero in exact arithmetic (softmax ignores a per-row shift): measured
    # against the scale of the stacked Q/K/V bias gradient, as the compiled in_proj_bias gradient is
    bias_scale = float(want["attention.self.query.bias"].abs().max())
    errors["attention.self.key.bias"] = float((got["attention.self.key.bias"] - want["attention.self.key.bias"])
                                              .abs().max()) / bias_scale
    print(dtype, attn, {k: f"{v:.1e}" for k, v in errors.items()})
    bad = {k: v for k, v in errors.items() if not v <= TOL[dtype]}
    assert not bad, f"relative errors above {TOL[dtype]}: {bad}"


def test_from_hf_weights_copied_and_source_untouched():
    ref = hf_layer(torch.float64)
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    ours = from_hf(ref)
    sa = ref.attention.self
    assert torch.equal(ours.in_proj_weight.detach(), torch.cat([sa.query.weight, sa.key.weight, sa.value.weight]))
    assert torch.equal(ours.norm2_bias.detach(), ref.output.LayerNorm.bias)
    assert ours.in_proj_weight.data_ptr() != sa.query.weight.data_ptr()
    for k, v in ref.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_from_hf_keeps_train_mode():
    ref = hf_layer(torch.float64).train()
    assert from_hf(ref).training
    assert not from_hf(ref.eval()).training


@pytest.mark.parametrize("act,expected", [("gelu_new", "gelu_tanh"), ("relu", "relu")])
def test_from_hf_activations(act, expected):
    ref = hf_layer(torch.float64, hidden_act=act)
    ours = drop_in(ref, max_seq_len=J, name=f"hf-{act}")  # config overrides apply last
    assert ours.substation_compiled.config.activation == expected
    assert (ours.substation_compiled.config.max_seq_len, ours.substation_compiled.config.name) == (J, f"hf-{act}")
    torch.manual_seed(3)
    x = torch.randn(B, J, I, dtype=torch.float64)
    mask = hf_mask(ref.attention.self.config, x, key_mask_2d())
    with torch.no_grad():
        assert packed_rel(ours(x, mask), ref(x, mask), key_mask_2d()) <= 1e-10


def test_from_hf_chunked_feed_forward_is_accepted():
    ref = hf_layer(torch.float64, chunk_size_feed_forward=2)
    ours = drop_in(ref)
    torch.manual_seed(4)
    x = torch.randn(B, J, I, dtype=torch.float64)
    mask = hf_mask(ref.attention.self.config, x, key_mask_2d())
    with torch.no_grad():
        assert packed_rel(ours(x, mask), ref(x, mask), key_mask_2d()) <= 1e-10


# ------------------------------------------------------------------------------------------------ (b) torch layer


def torch_grads(layer):
    sa = layer.self_attn
    return {"in_proj_weight": sa.in_proj_weight.grad, "in_proj_bias": sa.in_proj_bias.grad,
            "out_proj_weight": sa.out_proj.weight.grad, "out_proj_bias": sa.out_proj.bias.grad,
            **{f"{m}_{p}": getattr(getattr(layer, m), p).grad
               for m in ("linear1", "linear2", "norm1", "norm2") for p in ("weight", "bias")}}


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_from_torch_parity(norm_first, activation):
    torch.manual_seed(5)
    ref = nn.TransformerEncoderLayer(I, H, dim_feedforward=U, dropout=0.1, activation=activation,
                                     layer_norm_eps=1e-6, batch_first=True, norm_first=norm_first,
                                     dtype=torch.float64)
    randomize_(ref, 6).eval()
    ours = from_torch(ref)
    c = ours.config
    assert (c.activation, c.layer_norm, c.layer_norm_eps) == (activation, "pre" if norm_first else "post", 1e-6)
    assert (c.dropout.attention, c.dropout.hidden, c.dropout.activation) == (0.1, 0.1, 0.1)
    assert not ours.training

    torch.manual_seed(7)
    x = torch.randn(B, J, I, dtype=torch.float64)
    g = torch.randn(B, J, I, dtype=torch.float64)
    pad = torch.zeros(B, J, dtype=torch.bool)
    pad[1, 5:] = True
    pad[2, 2:] = True
    y_ref, dx_ref = forward_backward(ref, x, g, src_key_padding_mask=pad)
    y, dx = forward_backward(ours, x, g, key_padding_mask=pad)
    errors = {"Y": rel(y, y_ref), "dX": rel(dx, dx_ref)}
    want = torch_grads(ref)
    for n, p in ours.named_parameters():
        errors[n] = rel(p.grad, want[n])
    assert len(errors) == 14
    print(norm_first, activation, {k: f"{v:.1e}" for k, v in errors.items()})
    bad = {k: v for k, v in errors.items() if not v <= 1e-10}
    assert not bad, bad


def test_from_torch_errors():
    with pytest.raises(ValueError, match="batch_first"):
        from_torch(nn.TransformerEncoderLayer(I, H, U))
    with pytest.raises(ValueError, match="bias=False"):
        from_torch(nn.TransformerEncoderLayer(I, H, U, batch_first=True, bias=False))
    with pytest.raises(ValueError, match="Tanh"):
        from_torch(nn.TransformerEncoderLayer(I, H, U, batch_first=True, activation=nn.Tanh()))


# ------------------------------------------------------------------------------------------------ (c) optimize()


@pytest.mark.parametrize("attn", [None, "eager", "sdpa"])
def test_optimize_bert_model(attn):
    kw = {} if attn is None else {"attn_implementation": attn}
    torch.manual_seed(8)
    model = BertModel(bert_config(**kw)).double().eval()
    ids = torch.randint(0, 64, (B, J))
    am = torch.ones(B, J, dtype=torch.long)
    am[1, 5:] = 0
    am[2, 3:] = 0  # padding
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=am, output_hidden_states=True)
        full = model(input_ids=ids)  # no padding: BertModel passes attention_mask=None to its layers

    params_before = list(model.parameters())
    assert optimize(model) is model
    layers = [m for m in model.modules() if isinstance(m, SubstationLayer)]
    assert len(layers) == 2 and all(isinstance(m, SubstationLayer) for m in model.encoder.layer)
    assert layers[0].substation_compiled is layers[1].substation_compiled            # one shared build
    assert all(a is b for a, b in zip(params_before, model.parameters()))            # the same parameter objects
    assert len(params_before) == len(list(model.parameters()))
    assert not layers[0].training
    assert str(model.substation_summary).startswith("substation.optimize: replaced 2 layer(s)")
    assert model.substation_summary.replaced == {"BertLayer": 2} and model.substation_summary.kept == []

    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=am, output_hidden_states=True)
        out_full = model(input_ids=ids)
    # inference with padding: real tokens as Hugging Face's, zeros at padded positions
    err = packed_rel(out.last_hidden_state, ref.last_hidden_state, am)
    err_full = float((out_full.last_hidden_state - full.last_hidden_state).abs().max())
    print(attn, f"padded {err:.1e}, unpadded {err_full:.1e}")
    assert err <= 1e-10 and err_full <= 1e-10
    assert float((out.pooler_output - ref.pooler_output).abs().max()) <= 1e-10
    # output_hidden_states still works: the drop-in layers are BertLayers to transformers' capture hooks
    assert len(out.hidden_states) == len(ref.hidden_states) == 3
    assert float((out.hidden_states[0] - ref.hidden_states[0]).abs().max()) == 0.0  # the embeddings
    for a, b in zip(out.hidden_states[1:], ref.hidden_states[1:]):
        assert packed_rel(a, b, am) <= 1e-10


def test_left_padding_keeps_the_pooler_output_and_logits():
    """With left padding position 0 is padding; inference computes it as Hugging Face does (its key
    masked), so BERT's pooler and a classification head agree with Hugging Face's, packed or not."""
    from transformers import BertForSequenceClassification

    torch.manual_seed(13)
    ref = BertForSequenceClassification(bert_config(num_labels=3)).double().eval()
    ours = optimize(copy.deepcopy(ref))
    ids = torch.randint(0, 64, (B, J))
    packs = torch.ones(B, J, dtype=torch.long)
    packs[1, :3] = 0
    packs[2, :6] = 0
    one = torch.ones(1, J, dtype=torch.long)
    one[0, 0] = 0  # one pad token: not worth packing
    for am, x in ((packs, ids), (one, ids[:1])):
        with torch.inference_mode():
            want = ref.bert(input_ids=x, attention_mask=am)
            got = ours.bert(input_ids=x, attention_mask=am)
            logits, ref_logits = ours(input_ids=x, attention_mask=am).logits, ref(input_ids=x, attention_mask=am).logits
        assert float((got.pooler_output - want.pooler_output).abs().max()) <= 1e-10
        assert float((logits - ref_logits).abs().max()) <= 1e-10
        computed = am.bool()
        computed[:, 0] = True
        assert rel(got.last_hidden_state[computed], want.last_hidden_state[computed]) <= 1e-10
        assert float(got.last_hidden_state[~computed].abs().sum()) == 0.0  # the other padded positions


def test_optimize_with_onednn_float32_gemms():
    """fp32_gemm reaches every layer's build, survives pickling, and the output stays within float32
    rounding of Hugging Face's; an unknown library is refused before any layer is replaced."""
    import pickle

    torch.manual_seed(12)
    model = BertModel(bert_config()).eval()
    ids = torch.randint(0, 64, (B, J))
    am = torch.ones(B, J, dtype=torch.long)
    am[1, 4:] = 0
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=am).last_hidden_state
    with pytest.raises(ValueError, match="fp32_gemm .* must be one of auto, mkl, onednn, got 'cublas'"):
        optimize(model, fp32_gemm="cublas")
    assert not any(isinstance(m, SubstationLayer) for m in model.modules())
    optimize(model, fp32_gemm="onednn")
    layers = [m for m in model.modules() if isinstance(m, SubstationLayer)]
    assert len(layers) == 2 and all(m.substation_compiled.options["fp32_gemm"] == "onednn" for m in layers)
    build = layers[0].substation_compiled
    assert build.sources["forward"].count("ss::matmul<float>(") == 4                  # the token-wise GEMMs
    assert build.forward_only().sources["forward"].count("ss::matmul<float>(") == 4   # what eval calls run
    copied = pickle.loads(pickle.dumps(model))
    assert all(m.substation_compiled.options["fp32_gemm"] == "onednn"
               for m in copied.modules() if isinstance(m, SubstationLayer))
    with torch.no_grad():
        out, out_copy = model(input_ids=ids, attention_mask=am).last_hidden_state, \
            copied(input_ids=ids, attention_mask=am).last_hidden_state
    assert packed_rel(out, ref, am) < 1e-5
    assert torch.equal(out, out_copy)
    single = from_hf(hf_layer(torch.float32), fp32_gemm="onednn")
    assert single.compiled.options["fp32_gemm"] == "onednn"
    with pytest.raises(ValueError, match="fp32_gemm .* must be one of auto, mkl, onednn, got \\['mkl'\\]"):
        from_hf(hf_layer(torch.float32), fp32_gemm=["mkl"])
    # optimizing again keeps the builds, and says so when another library is asked for
    with pytest.warns(UserWarning, match="keep their builds \\(fp32_gemm='onednn'\\)"):
        optimize(model, fp32_gemm="mkl")
    assert all(m.substation_compiled.options["fp32_gemm"] == "onednn" for m in layers)


def test_output_attentions_runs_the_hugging_face_forward():
    torch.manual_seed(9)
    plain = BertModel(bert_config(attn_implementation="eager")).double().eval()
    model = optimize(copy.deepcopy(plain))
    ids = torch.randint(0, 64, (B, J))
    with pytest.warns(UserWarning, match="output_attentions=True"):
        out = model(input_ids=ids, output_attentions=True)
    ref = plain(input_ids=ids, output_attentions=True)
    assert len(out.attentions) == 2 and out.attentions[0].shape == (B, H, J, J)
    assert max(float((a - b).abs().max()) for a, b in zip(out.attentions, ref.attentions)) <= 1e-12
    assert float((out.last_hidden_state - ref.last_hidden_state).abs().max()) <= 1e-12


# ------------------------------------------------------------------------------------------------ (d) errors


def test_from_hf_unsupported_activation_named():
    layer = BertLayer(bert_config(hidden_act="quick_gelu"))
    with pytest.raises(ValueError, match="quick_gelu"):
        from_hf(layer)


def test_from_hf_other_errors():
    with pytest.raises(ValueError, match="decoder"):
        from_hf(BertLayer(bert_config(is_decoder=True)))
    with pytest.raises(ValueError, match="cross-attention|decoder"):
        from_hf(BertLayer(bert_config(is_decoder=True, add_cross_attention=True)))
    layer = BertLayer(bert_config())
    layer.output.LayerNorm.eps = 1e-5
    with pytest.raises(ValueError, match="different eps"):
        from_hf(layer)
    with pytest.raises(ValueError, match="weights are torch.float16; target cpu compiles float32, float64, bfloat16"):
        from_hf(BertLayer(bert_config()).to(torch.float16))


def test_from_hf_separate_hidden_dropouts():
    layer = BertLayer(bert_config())
    layer.output.dropout.p = 0.3
    c = from_hf(layer).config
    assert (c.dropout.attention_output, c.dropout.hidden) == (0.2, 0.3)
    assert c.dropout.probability("attention_output") == 0.2


def test_per_query_masks_run_the_hugging_face_forward(monkeypatch):
    """A causal mask runs Hugging Face's forward, warning once at the caller's line (not inside
    transformers); an eager layer gets it as the additive mask its model makes."""
    import substation.interop.layers as layers

    monkeypatch.setattr(layers, "_WARNED", set())
    ref = hf_layer(torch.float64)
    ours = drop_in(copy.deepcopy(ref))
    x = torch.randn(1, J, I, dtype=torch.float64)
    causal = torch.ones(J, J, dtype=torch.bool).tril()[None, None]
    additive = torch.zeros(1, 1, J, J, dtype=torch.float64).masked_fill(~causal, torch.finfo(torch.float64).min)
    with pytest.warns(UserWarning, match="differs between queries") as caught:
        y = ours(x, causal)
    assert [w.filename for w in caught] == [__file__]
    assert rel(y, ref(x, additive)) <= 1e-12


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_calls_that_fall_back_get_the_mask_their_model_would_pass(implementation, monkeypatch):
    """Where a call runs the Hugging Face forward (output_attentions, a forward hook on a submodule, a
    mask that differs between queries), the drop-in layer hands it the mask the model makes for its
    attention implementation (bool under sdpa, additive under eager): a [B, K] mask (which would
    broadcast along the queries when B = J), an integer mask, a float mask of another dtype are
    converted; each gives the output of the same mask in the model's form, to float64 rounding."""
    import substation.interop.layers as layers

    monkeypatch.setattr(layers, "_WARNED", set())
    ref = hf_layer(torch.float64, attn_implementation=implementation)
    ours = drop_in(copy.deepcopy(ref))
    b = J
    x = torch.randn(b, J, I, dtype=torch.float64)
    attend = torch.ones(b, J, dtype=torch.bool)
    attend[0, J - 3:] = False
    attend[2, :2] = False
    low = torch.finfo(torch.float64).min
    additive = torch.zeros(b, 1, 1, J, dtype=torch.float64).masked_fill(~attend[:, None, None, :], low)
    expected = ref(x, additive)
    key_masks = (attend, attend.long(), attend[:, None, None, :].to(torch.uint8), additive[:, 0, 0, :].float(),
                 additive.to(torch.bfloat16), additive.half())
    for mask in key_masks:
        assert real_rel(ours(x, mask, output_attentions=True), expected, attend) <= 1e-12, mask.dtype
    hooked = drop_in(copy.deepcopy(ref))
    hooked.attention.self.query.register_forward_hook(lambda *args: None)
    for mask in key_masks:
        assert real_rel(hooked(x, mask), expected, attend) <= 1e-12, mask.dtype
    causal = torch.ones(J, J, dtype=torch.bool).tril().expand(b, 1, J, J)
    expected = ref(x, torch.zeros(b, 1, J, J, dtype=torch.float64).masked_fill(~causal, low))
    for mask in (causal, causal.to(torch.uint8), causal.long(), causal.double(), causal.bfloat16(), causal.half()):
        if mask.is_floating_point():
            mask = torch.zeros_like(mask).masked_fill(~causal, float("-inf"))
        assert rel(ours(x, mask), expected) <= 1e-12, mask.dtype


def test_masks_of_other_types_are_refused_by_name():
    """Masks the layer cannot read are named at the call: unsigned integers wider than 8 bits and
    float8 (PyTorch has no reductions for them), also on a call that falls back and on a ``mask: none``
    layer; a list, an array, a number or a string instead of a tensor."""
    x = torch.randn(2, J, I, dtype=torch.float64)
    calls = [(drop_in(hf_layer(torch.float64)), {}), (drop_in(hf_layer(torch.float64)), {"output_attentions": True}),
             (drop_in(hf_layer(torch.float64), mask="none"), {"output_attentions": True})]
    for ours, kw in calls:
        for dtype in (torch.uint16, torch.uint32, torch.float8_e4m3fn):
            with pytest.raises(TypeError, match=f"attention_mask has dtype {dtype}; give a bool or integer"):
                ours(x, torch.ones(2, J).to(dtype), **kw)
    ours = drop_in(hf_layer(torch.float64))
    for mask in ([[1] * J] * 2, torch.ones(2, J).numpy(), 0.0, "none"):
        with pytest.raises(TypeError, match=f"must be a tensor or None, got a {type(mask).__name__}"):
            ours(x, mask)


def test_an_eager_fallback_gives_a_fully_masked_row_the_models_minimum_not_nan(monkeypatch):
    """-inf in a float mask becomes finfo.min on an eager-attention fallback, as the model makes it:
    a row whose keys are all masked stays finite (eager softmax gives NaN for a row of -inf, and the
    NaN reached every parameter's gradient), and the other rows are unchanged."""
    import substation.interop.layers as layers

    monkeypatch.setattr(layers, "_WARNED", set())
    ref = hf_layer(torch.float64)
    ours = drop_in(copy.deepcopy(ref))
    keep = torch.ones(2, J, dtype=torch.bool)
    keep[0, J - 2:] = False
    keep[1] = False
    x = torch.randn(2, J, I, dtype=torch.float64, requires_grad=True)
    y = ours(x, torch.zeros(2, J, dtype=torch.float64).masked_fill(~keep, float("-inf")), output_attentions=True)
    (y * keep[:, :, None]).sum().backward()
    assert bool(y.isfinite().all()) and bool(x.grad.isfinite().all())
    assert all(bool(p.grad.isfinite().all()) for p in ours.parameters())
    expected = ref(x, torch.zeros(2, 1, 1, J, dtype=torch.float64).masked_fill(~keep[:, None, None, :],
                                                                               torch.finfo(torch.float64).min))
    assert rel(y, expected) <= 1e-12


def test_a_mask_that_requires_grad_runs_the_hugging_face_forward_and_gets_its_gradient(monkeypatch):
    """A learned additive mask (requires grad) runs Hugging Face's forward with a warning, so the mask
    gets the gradient the unoptimized layer gives it; without gradients (inference) it runs compiled."""
    import substation.interop.layers as layers

    monkeypatch.setattr(layers, "_WARNED", set())
    ref = hf_layer(torch.float64)
    ours = drop_in(copy.deepcopy(ref))
    x = torch.randn(2, J, I, dtype=torch.float64)
    learned = (0.5 * torch.randn(2, 1, 1, J, dtype=torch.float64)).requires_grad_()
    with pytest.warns(UserWarning, match="requires grad"):
        y = ours(x, learned)
    grad, = torch.autograd.grad(y.square().sum(), learned)
    expected = torch.autograd.grad(ref(x, learned).square().sum(), learned)[0]
    assert rel(grad, expected) <= 1e-12 and grad.abs().max() > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            assert rel(ours(x, learned), ref(x, learned)) <= 1e-12


def test_per_head_masks_run_compiled_when_the_heads_agree():
    """A [B, H, J, K] mask: equal heads run the compiled layer (no warning), differing heads the Hugging
    Face forward; a wrong shape is named as given."""
    ref = hf_layer(torch.float64)
    ours = drop_in(copy.deepcopy(ref))
    heads = ours.substation_compiled.config.num_heads
    x = torch.randn(2, J, I, dtype=torch.float64)
    pad = torch.zeros(2, 1, 1, J, dtype=torch.float64)
    pad[1, ..., J - 3:] = torch.finfo(torch.float64).min
    same = pad.expand(2, heads, J, J).contiguous()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = ours(x, same)
    assert rel(y, ref(x, same)) <= 1e-12
    differ = same.clone()
    differ[0, 1, :, 0] = torch.finfo(torch.float64).min
    with pytest.warns(UserWarning, match="differs between heads"):
        y = ours(x, differ)
    assert rel(y, ref(x, differ)) <= 1e-12
    with pytest.raises(ValueError, match=rf"\[B, H, J, K\] with H = {heads}; got \(2, {heads}, {J}, {J + 1}\)"):
        ours(x, torch.zeros(2, heads, J, J + 1, dtype=torch.float64))
    wrong = torch.zeros(2, heads + 1, J, J, dtype=torch.float64)
    wrong[0, 1, :, 0] = -1.0  # heads differ too: the shape is named first, nothing reaches Hugging Face's forward
    with pytest.raises(ValueError, match=rf"got \(2, {heads + 1}, {J}, {J}\)"):
        ours(x, wrong)
    # under torch.compile the layer cannot fall back: equal heads run compiled, differing heads are refused
    compiled = torch.compile(ours, backend="eager", fullgraph=True)
    assert rel(compiled(x, same), ref(x, same)) <= 1e-12
    with pytest.raises(Exception, match="differs between heads"):
        compiled(x, differ)


def test_a_nan_in_a_per_query_mask_is_refused_not_run_by_hugging_face():
    """NaN != NaN: the check that sends per-query masks to Hugging Face's forward treats NaN as equal,
    so a [B, 1, J, K] mask with a NaN reaches the mask check and raises."""
    ours = drop_in(hf_layer(torch.float64))
    mask = torch.zeros(2, 1, J, J, dtype=torch.float64)
    mask[1, 0, :, J - 2:] = torch.finfo(torch.float64).min
    mask[1, 0, 3, 2] = float("nan")
    with pytest.raises(ValueError, match="holds NaN"):
        ours(torch.randn(2, J, I, dtype=torch.float64), mask)


def test_layer_rejects_per_query_masks_inside_the_operator():
    layer = from_hf(hf_layer(torch.float64))
    causal = torch.ones(J, J, dtype=torch.bool).tril()[None, None]
    with pytest.raises(ValueError, match="differs between queries"):
        layer(torch.randn(1, J, I, dtype=torch.float64), attention_mask=causal)


def test_optimize_warns_when_nothing_is_replaced():
    model = nn.Sequential(nn.Linear(3, 3))
    with pytest.warns(UserWarning, match="no layer of a supported family inside Sequential"):
        assert optimize(model) is model
    assert model.substation_summary.replaced == {}
