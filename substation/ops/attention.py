"""Kind ``attention`` (TC): ``y = softmax_K(alpha * q k^T + m) v`` in one kernel, for forward-only
builds: the scores of a block of queries stay in a per-thread buffer and never reach memory.

:mod:`substation.passes.attention` makes it from the unfused graph's ``scores`` (contraction),
``mask`` (optional), ``softmax`` and ``context`` (contraction) operators. Operands: ``q`` [B, J, H, P],
``k`` and ``v`` [B, K, H, P], ``m`` the additive key mask [B, K] (absent with ``mask: none``), ``y``
[B, J, H, P]; attributes ``alpha`` (the score scale) and ``causal``. A query whose scores are all -inf
gets zero probabilities, as the unfused softmax gives. Flop: the two contractions, 2 B H J K P each,
plus the mask (1 per score) and the softmax (5 per score and 1 per row), as the operators it replaces.
No gradient rule: the kernel keeps nothing for backward.
"""
from __future__ import annotations

from .kind import OpKind, op_kind, register


def _attention_flop(attrs, inputs, outputs, size):
    scores = size("B") * size("H") * size("J") * size("K")
    return 4 * scores * size("P") + (6 if "m" in inputs else 5) * scores + size("B") * size("H") * size("J")


def _attention_reference(ins, outs, attrs):
    scores_letters = "BHJK"
    s = op_kind("contraction").reference({"q": ins["q"], "k": ins["k"]}, {"y": scores_letters},
                                         {"alpha": attrs["alpha"]})["y"]
    if "m" in ins:
        s = op_kind("mask").reference({"x": (s, scores_letters), "m": ins["m"]}, {"y": scores_letters},
                                      {"causal": attrs.get("causal", False)})["y"]
    probs = op_kind("softmax").reference({"x": (s, scores_letters)}, {"y": scores_letters}, {"axis": "K"})["y"]
    return op_kind("contraction").reference({"attn": (probs, scores_letters), "v": ins["v"]}, outs, {})


ATTENTION = register(OpKind("attention", "TC", flop=_attention_flop, reference=_attention_reference,
                                    autocast="lower_precision_fp"))
