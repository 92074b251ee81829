"""Kind ``attention`` (TC): ``y = softmax_K(alpha * q k^T + m) v`` in one kernel, for forward-only
builds: the scores of a block of queries stay in a per-thread buffer and never reach memory.

:mod:`substation.passes.attention` makes it from the unfused graph's ``scores`` (contraction),
``mask`` (optional), ``softmax`` and ``context`` (contraction) operators. Operands: ``q`` [B, J, H, P],
``k`` and ``v`` [B, K, H, P], ``m`` the additive key mask [B, K] (absent with ``mask: none``), optional
biases ``bq``, ``bk``, ``bv`` [H, P] added to q, k, v as the kernel loads them (the bias add of QKV the
pass folded in), ``y`` [B, J, H, P]; attributes ``alpha`` (the score scale) and ``causal``. A query whose
scores are all -inf gets zero probabilities, as the unfused softmax gives. Flop: the two contractions,
2 B H J K P each, plus the mask (1 per score), the softmax (5 per score and 1 per row) and the biases
(1 per element of q, k, v), as the operators it replaces. No gradient rule: the kernel keeps nothing
for backward.
"""
from __future__ import annotations

from .kind import OpKind, op_kind, register


def _attention_flop(attrs, inputs, outputs, size):
    scores = size("B") * size("H") * size("J") * size("K")
    biases = sum(size("B") * size("H") * size("J" if c == "bq" else "K") * size("P") for c in ("bq", "bk", "bv")
                 if c in inputs)
    return 4 * scores * size("P") + (6 if "m" in inputs else 5) * scores + size("B") * size("H") * size("J") + biases


def _attention_reference(ins, outs, attrs):
    scores_letters = "BHJK"
    ins = dict(ins)
    for c in ("q", "k", "v"):
        if f"b{c}" in ins:
            ins[c] = (op_kind("bias").reference({"x": ins[c], "b": ins[f"b{c}"]}, {"y": ins[c][1]}, {})["y"], ins[c][1])
    s = op_kind("contraction").reference({"q": ins["q"], "k": ins["k"]}, {"y": scores_letters},
                                         {"alpha": attrs["alpha"]})["y"]
    if "m" in ins:
        s = op_kind("mask").reference({"x": (s, scores_letters), "m": ins["m"]}, {"y": scores_letters},
                                      {"causal": attrs.get("causal", False)})["y"]
    probs = op_kind("softmax").reference({"x": (s, scores_letters)}, {"y": scores_letters}, {"axis": "K"})["y"]
    return op_kind("contraction").reference({"attn": (probs, scores_letters), "v": ins["v"]}, outs, {})


ATTENTION = register(OpKind("attention", "TC", flop=_attention_flop, reference=_attention_reference,
                                    autocast="lower_precision_fp"))
