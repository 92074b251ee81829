"""Interoperability with Hugging Face ``transformers`` and PyTorch encoder layers.

* :func:`from_hf` compiles a layer equivalent to a ``transformers`` ``BertLayer`` and copies its weights.
* :func:`from_torch` does the same for ``torch.nn.TransformerEncoderLayer``.
* :class:`HFBertLayer` wraps an :class:`~substation.EncoderLayer` so that it can stand in for a
  ``BertLayer`` inside a ``BertModel`` (``transformers`` 5.x calling convention).
* :func:`optimize` swaps every ``BertLayer`` of a model for a compiled one, in place.

Dimension letters: B batch, J query positions, K key positions (J = K), H heads, P = I / H head
size, I hidden size, U feed-forward size.

``transformers`` is imported lazily: the rest of Substation works without it.
"""
from __future__ import annotations

import functools
import math
import threading
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .config import DropoutConfig, EncoderConfig
from .runtime import TORCH_DTYPES, EncoderLayer

__all__ = ["HFBertLayer", "from_hf", "from_torch", "optimize"]

_DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
_SUPPORTED_ACTIVATIONS = "exact GELU (gelu, gelu_python), tanh-approximated GELU (gelu_new, gelu_pytorch_tanh, " \
                         "gelu_python_tanh, gelu_accurate, gelu_fast) or ReLU (relu)"


# ----------------------------------------------------------------------------------------------------------------
# helpers


def _dtype_name(dtype: torch.dtype, what: str) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"{what} has dtype {dtype}; Substation compiles float32 or float64 layers "
                        f"(convert the model with .float() or .double() first)") from None


def _check_uniform_dtype(module: nn.Module, what: str) -> str:
    """The dtype name shared by every parameter of ``module``; TypeError if they differ or are unsupported."""
    dtypes = {p.dtype for p in module.parameters()}
    if len(dtypes) != 1:
        raise TypeError(f"{what} mixes parameter dtypes {sorted(map(str, dtypes))}; convert it to one dtype first")
    return _dtype_name(dtypes.pop(), what)


_COMPILED: dict = {}
_COMPILED_LOCK = threading.Lock()


def _build(config: EncoderConfig) -> EncoderLayer:
    """A fresh :class:`EncoderLayer` for ``config``. Builds are memoised per process by config, so layers
    of equal configs share one loaded build (on top of Substation's on-disk build cache); each layer
    still gets its own parameters."""
    from . import compile as _compile
    with _COMPILED_LOCK:
        compiled = _COMPILED.get(config)
        if compiled is None:
            layer = _compile(config)
            _COMPILED[config] = layer.compiled
            return layer
    return EncoderLayer(compiled)


def _copy_parameters(layer: EncoderLayer, sources: dict[str, list[torch.Tensor | None]], fill: dict[str, float]):
    """Copy source tensors into ``layer``'s parameters. ``sources[name]`` is a list of tensors concatenated
    along dim 0 (Q, K, V for ``in_proj_*``); a ``None`` entry is filled with ``fill[name]``. Each
    parameter requires grad when any of its sources did."""
    with torch.no_grad():
        for name, parts in sources.items():
            dst = getattr(layer, name)
            present = [t for t in parts if t is not None]
            if len(present) != len(parts):
                if present:
                    raise ValueError(f"{name}: some but not all of the stacked source tensors are missing")
                dst.fill_(fill[name])
                continue
            src = torch.cat([t.detach().to("cpu", dst.dtype) for t in present], dim=0) if len(present) > 1 \
                else present[0].detach().to("cpu", dst.dtype)
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"{name}: source shape {tuple(src.shape)} does not match {tuple(dst.shape)}")
            dst.copy_(src)
            dst.requires_grad_(any(t.requires_grad for t in present))


def _activation_name(act: Any, label: str) -> str:
    """Map an activation (module, function or functools.partial) to a config activation name.

    Raises:
        ValueError: an activation Substation does not compile; the message names it.
    """
    # nn modules and plain functions from torch
    if isinstance(act, nn.ReLU) or act in (F.relu, torch.relu):
        return "relu"
    if isinstance(act, nn.GELU):
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    if act is F.gelu:
        return "gelu"
    if isinstance(act, functools.partial) and act.func is F.gelu and not act.args:
        approx = act.keywords.get("approximate", "none")
        if set(act.keywords) <= {"approximate"} and approx in ("none", "tanh"):
            return "gelu_tanh" if approx == "tanh" else "gelu"
    # transformers' activation classes, matched by exact type (subclasses such as ClippedGELU differ)
    try:
        from transformers import activations as hf
    except ImportError:  # pragma: no cover - transformers absent
        hf = None
    if hf is not None:
        exact = {getattr(hf, n) for n in ("GELUActivation",) if hasattr(hf, n)}
        tanh = {getattr(hf, n) for n in ("NewGELUActivation", "GELUTanh", "PytorchGELUTanh",
                                           "AccurateGELUActivation", "FastGELUActivation") if hasattr(hf, n)}
        if type(act) in exact:
            return "gelu"
        if type(act) in tanh:
            return "gelu_tanh"
    what = label if isinstance(label, str) and label else getattr(act, "__name__", type(act).__name__)
    raise ValueError(f"unsupported activation {what!r} ({type(act).__name__}); Substation supports "
                     f"{_SUPPORTED_ACTIVATIONS}")


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face BertLayer


def _hf_config_facts(bert_layer: nn.Module) -> tuple[str, int | None]:
    """(hidden_act label, max_position_embeddings) from the HF config the layer keeps, when reachable."""
    cfg = getattr(getattr(getattr(bert_layer, "attention", None), "self", None), "config", None)
    act = getattr(cfg, "hidden_act", None)
    label = act if isinstance(act, str) else ""
    max_pos = getattr(cfg, "max_position_embeddings", None)
    if isinstance(max_pos, bool) or not isinstance(max_pos, int) or max_pos < 1:
        max_pos = None
    return label, max_pos


def _hf_layer_config(bert_layer: nn.Module, overrides: dict) -> EncoderConfig:
    """Read the :class:`EncoderConfig` of a ``BertLayer`` (see :func:`from_hf` for the rules)."""
    for attr in ("attention", "intermediate", "output"):
        if not hasattr(bert_layer, attr):
            raise ValueError(f"{type(bert_layer).__name__} is not a transformers BertLayer (no .{attr})")
    if getattr(bert_layer, "is_decoder", False):
        raise ValueError("BertLayer is a decoder layer (config.is_decoder=True, causal self-attention with a KV "
                         "cache); Substation's from_hf converts encoder layers only")
    if getattr(bert_layer, "add_cross_attention", False) or hasattr(bert_layer, "crossattention"):
        raise ValueError("BertLayer has cross-attention (config.add_cross_attention=True); not supported")
    attn = bert_layer.attention
    sa = attn.self
    if getattr(attn, "is_cross_attention", False):
        raise ValueError("BertLayer's attention is cross-attention; not supported")
    pet = getattr(sa, "position_embedding_type", "absolute")
    if pet not in (None, "absolute"):
        raise ValueError(f"BertLayer uses position_embedding_type={pet!r} (relative position scores inside "
                         f"attention); Substation supports absolute position embeddings only")
    if getattr(sa, "is_causal", False):
        raise ValueError("BertLayer's self-attention is causal; from_hf converts bidirectional encoder layers only")

    i = sa.query.in_features
    h = int(sa.num_attention_heads)
    for name in ("query", "key", "value"):
        lin = getattr(sa, name)
        if (lin.in_features, lin.out_features) != (i, i):
            raise ValueError(f"attention.self.{name} is {lin.in_features} -> {lin.out_features}; Substation needs "
                             f"I -> I with I = {i} (no separate embedding size)")
    if i % h:
        raise ValueError(f"hidden size I={i} is not divisible by num_attention_heads H={h}")
    p = i // h
    scaling = getattr(sa, "scaling", p ** -0.5)
    if not math.isclose(float(scaling), p ** -0.5, rel_tol=1e-12):
        raise ValueError(f"attention scaling {scaling} differs from 1/sqrt(P) = {p ** -0.5}; not supported")
    u = bert_layer.intermediate.dense.out_features
    if bert_layer.output.dense.in_features != u or bert_layer.output.dense.out_features != i \
            or attn.output.dense.in_features != i or attn.output.dense.out_features != i:
        raise ValueError("BertLayer's dense layers have inconsistent sizes")

    label, max_pos = _hf_config_facts(bert_layer)
    activation = _activation_name(bert_layer.intermediate.intermediate_act_fn, label)

    ln1, ln2 = attn.output.LayerNorm, bert_layer.output.LayerNorm
    for name, ln in (("attention.output.LayerNorm", ln1), ("output.LayerNorm", ln2)):
        if tuple(ln.normalized_shape) != (i,):
            raise ValueError(f"{name} normalizes over {tuple(ln.normalized_shape)}, not the hidden size ({i},)")
    if ln1.eps != ln2.eps:
        raise ValueError(f"the two LayerNorms use different eps ({ln1.eps} and {ln2.eps}); Substation uses one")

    p_attn = float(sa.dropout.p)
    p_hidden, p_hidden2 = float(attn.output.dropout.p), float(bert_layer.output.dropout.p)
    if p_hidden != p_hidden2:
        raise ValueError(f"attention.output.dropout.p={p_hidden} and output.dropout.p={p_hidden2} differ; "
                         f"Substation uses one hidden dropout probability")

    dtype = _check_uniform_dtype(bert_layer, "BertLayer")
    base = EncoderConfig(
        batch_size=1, max_seq_len=max_pos or 512, hidden_size=i, num_heads=h, ffn_size=u,
        activation=activation, layer_norm="post",
        dropout=DropoutConfig(attention=p_attn, hidden=p_hidden, activation=0.0),
        layer_norm_eps=float(ln1.eps), dtype=dtype, mask="padding", target="cpu", name="hf-bert-layer")
    return base.replace(**overrides)


def _from_hf(bert_layer: nn.Module, overrides: dict) -> EncoderLayer:
    config = _hf_layer_config(bert_layer, dict(overrides))
    layer = _build(config)
    sa, attn = bert_layer.attention.self, bert_layer.attention
    ln1, ln2 = attn.output.LayerNorm, bert_layer.output.LayerNorm
    _copy_parameters(layer, {
        "in_proj_weight": [sa.query.weight, sa.key.weight, sa.value.weight],
        "in_proj_bias": [sa.query.bias, sa.key.bias, sa.value.bias],
        "out_proj_weight": [attn.output.dense.weight], "out_proj_bias": [attn.output.dense.bias],
        "linear1_weight": [bert_layer.intermediate.dense.weight], "linear1_bias": [bert_layer.intermediate.dense.bias],
        "linear2_weight": [bert_layer.output.dense.weight], "linear2_bias": [bert_layer.output.dense.bias],
        "norm1_weight": [ln1.weight], "norm1_bias": [getattr(ln1, "bias", None)],
        "norm2_weight": [ln2.weight], "norm2_bias": [getattr(ln2, "bias", None)],
    }, fill={"in_proj_bias": 0.0, "out_proj_bias": 0.0, "linear1_bias": 0.0, "linear2_bias": 0.0,
             "norm1_weight": 1.0, "norm1_bias": 0.0, "norm2_weight": 1.0, "norm2_bias": 0.0})
    layer.train(bert_layer.training)
    return layer


def from_hf(bert_layer: nn.Module, **config_overrides) -> EncoderLayer:
    """Compile an :class:`~substation.EncoderLayer` equivalent to a Hugging Face ``transformers``
    ``BertLayer`` (post-LN, BERT) and copy its weights.

    Read from the layer: I (hidden size), H (``attention.self.num_attention_heads``), P = I / H,
    U (``intermediate.dense.out_features``); the activation (exact GELU -> ``gelu``; the tanh
    approximations ``gelu_new``, ``gelu_pytorch_tanh``, ``gelu_python_tanh``, ``gelu_accurate`` and
    ``gelu_fast`` -> ``gelu_tanh`` (``gelu_fast`` rounds sqrt(2/pi) to 10 digits, a relative difference
    of about 3e-12); ReLU -> ``relu``); the LayerNorm eps (both LayerNorms must agree); the dropout
    probabilities (``attention.self.dropout.p`` -> attention; ``attention.output.dropout.p`` =
    ``output.dropout.p`` -> hidden; activation 0); the dtype of the weights. The config is post-LN,
    ``mask: padding``, nominal B = 1 and L = the HF config's ``max_position_embeddings`` (512 if the
    layer does not reach its config). ``config_overrides`` are applied last with
    :meth:`EncoderConfig.replace` (e.g. ``max_seq_len=128``, ``name="bert"``).

    Weight mapping (all copied, the source is not modified): ``in_proj_weight`` [3I, I] = Q, K, V
    ``weight`` [I, I] stacked; ``in_proj_bias`` [3I] likewise; ``out_proj_*`` =
    ``attention.output.dense``; ``linear1_*`` [U, I] / [U] = ``intermediate.dense``; ``linear2_*``
    [I, U] / [I] = ``output.dense``; ``norm1_*`` [I] = ``attention.output.LayerNorm``; ``norm2_*`` [I] =
    ``output.LayerNorm``. Parameters are float32 or float64 like the source, on the CPU, and require
    grad where the source's did. The new layer is in the source's train/eval mode. Compiled builds
    are memoised per process by config (layers of equal configs share one). Chunked
    feed-forward (``chunk_size_feed_forward``) is accepted: it is the same function.

    Args:
        bert_layer: a ``transformers.models.bert.modeling_bert.BertLayer`` (or a structurally
            identical layer).
        **config_overrides: :class:`~substation.EncoderConfig` fields to change.

    Returns:
        An :class:`~substation.EncoderLayer`; ``forward(hidden_states [B, J, I], attention_mask)``.

    Raises:
        ValueError: a decoder layer, cross-attention, a causal or relative-position self-attention,
            an unsupported activation (the message names it), LayerNorms with different eps, differing
            hidden dropout probabilities, inconsistent sizes.
        TypeError: weights that are not float32 or float64, or of mixed dtypes.
        ConfigError: an invalid override. ToolchainError, BuildError: compilation failed.
    """
    return _from_hf(bert_layer, config_overrides)


# ----------------------------------------------------------------------------------------------------------------
# torch.nn.TransformerEncoderLayer


def _torch_layer_config(layer: nn.TransformerEncoderLayer, overrides: dict) -> EncoderConfig:
    if not isinstance(layer, nn.TransformerEncoderLayer):
        raise ValueError(f"expected a torch.nn.TransformerEncoderLayer, got {type(layer).__name__}")
    sa = layer.self_attn
    if not (getattr(sa, "batch_first", False) and getattr(layer.self_attn, "batch_first", False)):
        raise ValueError("the TransformerEncoderLayer has batch_first=False; Substation's layer takes [B, J, I] "
                         "(rebuild it with batch_first=True)")
    if not getattr(sa, "_qkv_same_embed_dim", True) or sa.in_proj_weight is None:
        raise ValueError("self_attn has separate kdim/vdim projections; Substation needs one in_proj_weight [3I, I]")
    if sa.in_proj_bias is None or sa.out_proj.bias is None or layer.linear1.bias is None \
            or layer.linear2.bias is None or getattr(layer.norm1, "bias", None) is None \
            or getattr(layer.norm2, "bias", None) is None:
        raise ValueError("the TransformerEncoderLayer was built with bias=False; Substation's layer has biases "
                         "in every projection and LayerNorm")
    if getattr(sa, "bias_k", None) is not None or getattr(sa, "add_zero_attn", False):
        raise ValueError("self_attn uses add_bias_kv or add_zero_attn; not supported")
    if layer.norm1.weight is None or layer.norm2.weight is None:
        raise ValueError("LayerNorm without elementwise_affine is not supported")
    i, h = sa.embed_dim, sa.num_heads
    u = layer.linear1.out_features
    for name, ln in (("norm1", layer.norm1), ("norm2", layer.norm2)):
        if tuple(ln.normalized_shape) != (i,):
            raise ValueError(f"{name} normalizes over {tuple(ln.normalized_shape)}, not the hidden size ({i},)")
    if layer.norm1.eps != layer.norm2.eps:
        raise ValueError(f"norm1.eps={layer.norm1.eps} and norm2.eps={layer.norm2.eps} differ; Substation uses one")
    activation = _activation_name(layer.activation, "")
    p1, p2 = float(layer.dropout1.p), float(layer.dropout2.p)
    if p1 != p2:
        raise ValueError(f"dropout1.p={p1} and dropout2.p={p2} differ; Substation uses one hidden dropout probability")
    dtype = _check_uniform_dtype(layer, "TransformerEncoderLayer")
    base = EncoderConfig(
        batch_size=1, max_seq_len=512, hidden_size=i, num_heads=h, ffn_size=u, activation=activation,
        layer_norm="pre" if layer.norm_first else "post",
        dropout=DropoutConfig(attention=float(sa.dropout), hidden=p1, activation=float(layer.dropout.p)),
        layer_norm_eps=float(layer.norm1.eps), dtype=dtype, mask="padding", target="cpu", name="torch-encoder-layer")
    return base.replace(**overrides)


def from_torch(layer: nn.TransformerEncoderLayer, **config_overrides) -> EncoderLayer:
    """Compile an :class:`~substation.EncoderLayer` equivalent to ``torch.nn.TransformerEncoderLayer``
    and copy its weights.

    Read from the layer: I (``self_attn.embed_dim``), H (``self_attn.num_heads``), P = I / H, U
    (``linear1.out_features``); the activation (``layer.activation``: ``F.relu`` / ``nn.ReLU`` ->
    ``relu``, ``F.gelu`` / ``nn.GELU()`` -> ``gelu``, ``nn.GELU(approximate="tanh")`` -> ``gelu_tanh``);
    ``norm_first`` -> ``layer_norm: pre`` (else ``post``); dropout probabilities (``self_attn.dropout``
    -> attention, ``dropout1.p`` = ``dropout2.p`` -> hidden, ``dropout.p`` -> activation); the LayerNorm
    eps; the dtype of the weights. Nominal B = 1, L = 512, ``mask: padding``; ``config_overrides`` are
    applied last with :meth:`EncoderConfig.replace`.

    The parameters have the same names and shapes as PyTorch's (``in_proj_weight`` [3I, I],
    ``in_proj_bias`` [3I], ``out_proj_weight`` [I, I], ``linear1_weight`` [U, I], ``linear2_weight``
    [I, U], ``norm{1,2}_{weight,bias}`` [I], ...) and are copied. Call the result with
    ``key_padding_mask`` (bool [B, K], True = pad) where PyTorch takes ``src_key_padding_mask``.
    A query whose keys are all padded gets zeros from the attention (PyTorch gives NaN).

    Returns:
        An :class:`~substation.EncoderLayer` in the source's train/eval mode; ``forward(x [B, J, I])``.

    Raises:
        ValueError: ``batch_first=False``, ``bias=False``, separate kdim/vdim, ``add_bias_kv`` /
            ``add_zero_attn``, an unsupported activation (named in the message), differing
            ``dropout1``/``dropout2`` probabilities or LayerNorm eps, or not a TransformerEncoderLayer.
        TypeError: weights that are not float32 or float64, or of mixed dtypes.
        ConfigError: an invalid override. ToolchainError, BuildError: compilation failed.
    """
    config = _torch_layer_config(layer, dict(config_overrides))
    new = _build(config)
    sa = layer.self_attn
    _copy_parameters(new, {
        "in_proj_weight": [sa.in_proj_weight], "in_proj_bias": [sa.in_proj_bias],
        "out_proj_weight": [sa.out_proj.weight], "out_proj_bias": [sa.out_proj.bias],
        "linear1_weight": [layer.linear1.weight], "linear1_bias": [layer.linear1.bias],
        "linear2_weight": [layer.linear2.weight], "linear2_bias": [layer.linear2.bias],
        "norm1_weight": [layer.norm1.weight], "norm1_bias": [layer.norm1.bias],
        "norm2_weight": [layer.norm2.weight], "norm2_bias": [layer.norm2.bias],
    }, fill={})
    new.train(layer.training)
    return new


# ----------------------------------------------------------------------------------------------------------------
# drop-in BertLayer replacement


def _attentions_requested() -> bool:
    """Whether a transformers 5.x ``capture_outputs`` collector is currently recording attentions."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except Exception:  # pragma: no cover - other transformers versions
        return False
    collected = _active_collector.get()
    return isinstance(collected, dict) and ("attentions" in collected or "cross_attentions" in collected)


class HFBertLayer(nn.Module):
    """A compiled :class:`~substation.EncoderLayer` behind the call signature of ``transformers`` 5.x
    ``BertLayer.forward`` (encoder, non-decoder use).

    ``forward(hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
    cache=None, **kwargs)`` returns the layer output tensor [B, J, I], as ``BertLayer`` does in 5.x.

    ``attention_mask`` is whatever ``BertModel`` passes its layers:

    * ``None`` (no padding in the batch: 5.x drops an all-ones mask, for every attention implementation);
    * a bool [B, 1, J, K] mask, True = attend (``sdpa``, the default implementation on the CPU);
    * an additive float [B, 1, J, K] mask of the model's dtype, 0 or ``finfo.min`` (``eager``);
    * also the 2-D forms [B, K] (additive float, or bool/int with True/1 = attend) and [B, 1, 1, K].

    A [B, 1, J, K] mask must be the same for every query (a key padding mask); it is reduced to [B, K].
    A sequence that is entirely padding gets uniform attention probabilities with an eager
    (``finfo.min``) mask and zero probabilities with a bool (sdpa) mask, which is also what ``BertLayer``
    computes in those two cases (transformers 5.24, torch 2.13).

    ``encoder_hidden_states`` / ``encoder_attention_mask`` are ignored, as a non-decoder ``BertLayer``
    ignores them; ``position_ids`` and other keyword arguments are accepted and ignored.

    Attributes:
        layer: the wrapped :class:`~substation.EncoderLayer` (parameters ``layer.in_proj_weight`` etc.).

    Raises (from forward):
        ValueError: a cache (KV caching is for decoders), a mask that varies between queries or has
            the wrong shape, attention probabilities requested (``output_attentions=True``: the
            compiled layer does not materialise them).
        TypeError: a mask that is not a tensor (e.g. a flex-attention ``BlockMask``), or
            ``hidden_states`` of a dtype other than the layer's.
    """

    is_decoder = False
    add_cross_attention = False

    def __init__(self, layer: EncoderLayer):
        super().__init__()
        if not isinstance(layer, EncoderLayer):
            raise TypeError(f"HFBertLayer wraps a substation.EncoderLayer, got {type(layer).__name__}")
        if layer.config.layer_norm != "post":
            raise ValueError("HFBertLayer stands in for BertLayer, which is post-LN; this layer is pre-LN")
        self.layer = layer
        self.train(layer.training)

    @property
    def config(self) -> EncoderConfig:
        """The wrapped layer's :class:`~substation.EncoderConfig`."""
        return self.layer.config

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                encoder_hidden_states: torch.Tensor | None = None,
                encoder_attention_mask: torch.Tensor | None = None, cache: Any = None,
                **kwargs: Any) -> torch.Tensor:
        """Run the compiled layer: ``hidden_states`` [B, J, I] (the layer's dtype, CPU) -> [B, J, I].

        See the class docstring for the accepted ``attention_mask`` forms and the errors.
        """
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        else:
            kwargs.pop("past_key_values", None)
        if cache is not None:
            raise ValueError("HFBertLayer is an encoder layer: a KV cache (cache/past_key_values) is not supported")
        if kwargs.get("output_attentions") or _attentions_requested():
            raise ValueError("output_attentions=True is not supported by Substation's compiled BertLayer "
                             "replacement: attention probabilities are not materialised")
        mask = attention_mask
        if mask is not None:
            if not isinstance(mask, torch.Tensor):
                raise TypeError(f"attention_mask must be None or a tensor, got {type(mask).__name__} (flex "
                                f"attention's BlockMask is not supported; use attn_implementation='sdpa' or 'eager')")
            if mask.dim() == 4:
                b, j = hidden_states.shape[0], hidden_states.shape[1]
                if mask.shape[0] not in (1, b) or mask.shape[1] != 1 or mask.shape[2] not in (1, j):
                    raise ValueError(f"a 4-D attention_mask must be [B, 1, J, K] or [B, 1, 1, K]; "
                                     f"got {tuple(mask.shape)}")
                if mask.shape[2] > 1 and not bool((mask == mask[:, :, :1, :]).all()):
                    raise ValueError("attention_mask [B, 1, J, K] differs between queries; Substation's "
                                     "BertLayer replacement supports key padding masks only")
                mask = mask[:, 0, 0, :].expand(b, mask.shape[-1])
        return self.layer(hidden_states, attention_mask=mask)

    def extra_repr(self) -> str:
        return "compiled by Substation"


def _install_capture_hooks(model: nn.Module) -> None:
    """Install transformers 5.x's output-capturing hooks (``output_hidden_states``) on every
    ``PreTrainedModel`` inside ``model`` now, so that they can be carried over to the new layers."""
    try:
        from transformers import PreTrainedModel
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except Exception:  # pragma: no cover - other transformers versions
        return
    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            try:
                maybe_install_capturing_hooks(m)
            except Exception:  # pragma: no cover - defensive: hooks are a convenience
                pass


def optimize(model: nn.Module, **config_overrides) -> nn.Module:
    """Replace, in place, every ``transformers`` ``BertLayer`` inside ``model`` with
    ``HFBertLayer(from_hf(layer, **config_overrides))`` and return ``model``.

    ``model`` is any ``nn.Module`` (``BertModel``, ``BertForSequenceClassification``, a
    sentence-transformers ``SentenceTransformer``, ...); layers are found with ``named_modules`` and
    replaced on their parent (``ModuleList`` entries included). Layers with equal configs share one
    compiled build; each gets its own copy of its weights (float32/float64, CPU), and keeps its
    train/eval mode. Forward hooks of the old layers (including the ``output_hidden_states`` capture
    hooks of transformers 5.x, installed here first) are carried over. The hidden states of the model
    keep their shapes [B, J, I].

    Returns:
        ``model``, modified.

    Raises:
        ValueError, TypeError: a layer :func:`from_hf` cannot convert (nothing is replaced then), or
            ``model`` is itself a ``BertLayer``.
        RuntimeError: ``transformers`` older than 5.0 (its BertLayer calling convention differs).
        ImportError: ``transformers`` is not installed.
        ToolchainError, BuildError: compilation failed.
    """
    import transformers
    from transformers.models.bert.modeling_bert import BertLayer

    major = int(str(transformers.__version__).split(".")[0])
    if major < 5:
        raise RuntimeError(f"optimize() needs transformers >= 5 (BertLayer returns a tensor and BertModel passes "
                           f"4-D masks from 5.0 on); found {transformers.__version__}")
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, BertLayer)]
    if not targets:
        warnings.warn(f"optimize(): no transformers BertLayer inside {type(model).__name__}; nothing replaced",
                      stacklevel=2)
        return model
    if targets[0][0] == "":
        raise ValueError("optimize() replaces the BertLayers inside a model; wrap a bare BertLayer with "
                         "HFBertLayer(from_hf(layer)) instead")
    _install_capture_hooks(model)
    new_layers = [HFBertLayer(_from_hf(m, config_overrides)) for _, m in targets]  # convert all, then swap
    for (name, old), new in zip(targets, new_layers):
        new._forward_pre_hooks.update(old._forward_pre_hooks)
        new._forward_hooks.update(old._forward_hooks)
        for attr in ("_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called"):
            if hasattr(old, attr):
                getattr(new, attr).update(getattr(old, attr))
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)
    return model
