"""What the compiled layer is compared against: a Hugging Face ``BertLayer`` (sdpa) with the same
weights, else the reference layer, in eager mode; and the benchmarks' padding mask.

Dimension letters: B batch, J query positions, K key positions, I hidden size."""
from __future__ import annotations

from ..reference import ReferenceEncoderLayer

__all__ = ["HF_ACTIVATIONS", "eager_baseline", "hf_bert_layer", "padded_from", "padded_positions", "padding_mask"]


#: Config activation -> Hugging Face ``hidden_act`` of the same function.
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}


def padded_from(seq: int) -> int:
    """The first padded position of the benchmarks' padded rows: ``max(1, 3 * seq // 4)`` (every row
    keeps at least one real token, so J = 1 is not padded). Raises nothing."""
    return max(1, (3 * seq) // 4)


def padded_positions(batch: int, seq: int):
    """The benchmarks' padding as a bool [B, K] tensor (True = padding): batch rows ``B // 2`` and up
    are padded from position :func:`padded_from` on (with B = 1 that is the only row). Raises nothing."""
    import torch
    pad = torch.zeros(batch, seq, dtype=torch.bool)
    pad[batch // 2:, padded_from(seq):] = True
    return pad


def padding_mask(config, batch: int, seq: int, dtype):
    """:func:`padded_positions` as an additive key mask [B, K] of ``dtype`` (0 = attend, -inf =
    padding); None when the config has ``mask: none``. Raises nothing."""
    import torch
    if config.mask == "none":
        return None
    return torch.zeros(batch, seq, dtype=dtype).masked_fill_(padded_positions(batch, seq), float("-inf"))


def real_token_error(y, y_ref, mask) -> float:
    """max |y - y_ref| / max |y_ref| over the real tokens of [B, J, I] outputs: the positions whose key
    mask ``mask`` ([B, K] additive, 0 = real) is 0, or all positions when ``mask`` is None. Inference
    calls of Substation's layer return zeros at padded positions, which no other implementation does,
    so comparisons leave those out. Raises nothing."""
    diff, ref = (y.double() - y_ref.double()).abs(), y_ref.double().abs()
    if mask is not None:
        real = (mask == 0).to(diff.device)
        diff, ref = diff[real], ref[real]
    return float(diff.max() / ref.max())


def _hf_eligible(config) -> bool:
    return (config.layer_norm == "post" and config.mask in ("padding", "none")
            and config.dropout.activation == 0.0 and config.activation in HF_ACTIVATIONS)


def hf_bert_layer(layer, attn_implementation: str = "sdpa"):
    """A ``transformers`` ``BertLayer`` with the weights of ``layer`` (copied) in its train/eval mode.

    Args:
        layer: a post-LN :class:`~substation.EncoderLayer` without activation dropout.
        attn_implementation: ``"sdpa"`` (the Hugging Face default on the CPU) or ``"eager"``.

    Raises:
        ImportError: ``transformers`` is not installed.
        ValueError: the config has no ``BertLayer`` equivalent (pre-LN, causal mask, activation dropout).
    """
    import torch
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    c = layer.config
    if not _hf_eligible(c):
        raise ValueError(f"config {c.name} has no BertLayer equivalent (needs post-LN, no activation dropout, "
                         f"mask padding or none)")
    hf = BertLayer(BertConfig(
        hidden_size=c.hidden_size, num_attention_heads=c.num_heads, intermediate_size=c.ffn_size,
        hidden_act=HF_ACTIVATIONS[c.activation], hidden_dropout_prob=c.dropout.hidden,
        attention_probs_dropout_prob=c.dropout.attention, layer_norm_eps=c.layer_norm_eps,
        attn_implementation=attn_implementation)).to(layer.torch_dtype)
    sa, ao = hf.attention.self, hf.attention.output
    q, k, v = layer.in_proj_weight.detach().chunk(3)
    qb, kb, vb = layer.in_proj_bias.detach().chunk(3)
    pairs = [(sa.query.weight, q), (sa.key.weight, k), (sa.value.weight, v),
             (sa.query.bias, qb), (sa.key.bias, kb), (sa.value.bias, vb),
             (ao.dense.weight, layer.out_proj_weight), (ao.dense.bias, layer.out_proj_bias),
             (hf.intermediate.dense.weight, layer.linear1_weight), (hf.intermediate.dense.bias, layer.linear1_bias),
             (hf.output.dense.weight, layer.linear2_weight), (hf.output.dense.bias, layer.linear2_bias),
             (ao.LayerNorm.weight, layer.norm1_weight), (ao.LayerNorm.bias, layer.norm1_bias),
             (hf.output.LayerNorm.weight, layer.norm2_weight), (hf.output.LayerNorm.bias, layer.norm2_bias)]
    with torch.no_grad():
        for dst, src in pairs:
            dst.copy_(src.detach())
    return hf.train(layer.training)


def eager_baseline(layer, attn_implementation: str = "sdpa"):
    """The eager PyTorch module of the bench for ``layer`` and how to call it.

    Returns:
        ``(module, call, label)``: ``call(module, x, mask)`` runs it on ``x`` [B, J, I] with the
        additive mask [B, K] (or None); ``label`` names the module. A ``BertLayer``
        (:func:`hf_bert_layer`) when ``transformers`` is installed and the config is BERT-like, else a
        :class:`~substation.reference.ReferenceEncoderLayer`, with ``layer``'s weights, in its mode.

    Raises nothing beyond :func:`hf_bert_layer`'s construction errors.
    """

    if _hf_eligible(layer.config):
        try:
            module = hf_bert_layer(layer, attn_implementation)
        except ImportError:
            module = None
        if module is not None:
            def call_hf(m, x, mask):
                return m(x, None if mask is None else mask[:, None, None, :])
            return module, call_hf, f"transformers BertLayer (attn_implementation={attn_implementation})"
    ref = ReferenceEncoderLayer(layer.config, layer.torch_dtype)
    ref.load_state_dict(layer.state_dict())
    ref.train(layer.training)
    return ref, (lambda m, x, mask: m(x, mask)), "substation.reference.ReferenceEncoderLayer"
