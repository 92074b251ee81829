"""The Hugging Face encoder-layer families Substation converts: where each keeps its weights and how its
config maps onto an :class:`~substation.EncoderConfig`.

A :class:`Family` is declared once per layer class: the ``transformers`` module and class name, the
layer-norm placement, the attribute path of every Substation parameter inside the layer, and a reader
that takes sizes, activation, eps and dropout from the layer (raising :class:`NotConvertible` with a
one-line reason for layers whose math Substation does not implement).

Dimension letters: I hidden size, H heads, P = I / H head size, U feed-forward size.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import CUDA_DTYPES, DTYPES, ConfigError, DropoutConfig, EncoderConfig
from ..runtime import DTYPE_NAMES, PARAMETER_NAMES

__all__ = ["FAMILIES", "Family", "NotConvertible", "activation_name", "family_of", "layer_config"]

_SUPPORTED_ACTIVATIONS = "exact GELU (gelu, gelu_python), tanh-approximated GELU (gelu_new, gelu_pytorch_tanh, " \
                         "gelu_python_tanh, gelu_accurate, gelu_fast) or ReLU (relu)"


class NotConvertible(ValueError):
    """A layer whose math Substation does not implement; the message is a one-line reason."""


def activation_name(act: Any, label: str = "") -> str:
    """Map an activation (module, function or ``functools.partial``) to a config activation name.

    ``gelu_fast`` rounds sqrt(2/pi) to 10 digits (a relative difference of about 3e-12 to ``gelu_tanh``).

    Raises:
        NotConvertible: an activation Substation does not compile; the message names it.
    """
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
    try:
        from transformers import activations as hf
    except ImportError:  # pragma: no cover - transformers absent
        hf = None
    if hf is not None:
        # matched by exact type: subclasses such as ClippedGELU compute something else
        exact = {getattr(hf, n) for n in ("GELUActivation",) if hasattr(hf, n)}
        tanh = {getattr(hf, n) for n in ("NewGELUActivation", "GELUTanh", "PytorchGELUTanh",
                                           "AccurateGELUActivation", "FastGELUActivation") if hasattr(hf, n)}
        if type(act) in exact:
            return "gelu"
        if type(act) in tanh:
            return "gelu_tanh"
    what = getattr(act, "__name__", type(act).__name__)
    configured = f", config {label!r}" if isinstance(label, str) and label else ""
    raise NotConvertible(f"unsupported activation {what!r} ({type(act).__name__}{configured}); Substation supports "
                         f"{_SUPPORTED_ACTIVATIONS}")


def _get(layer: nn.Module, path: str) -> Any:
    obj = layer
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _zero_bias(module: nn.Module) -> torch.Tensor:
    """The bias a module without one adds: zeros [out features] (its weight's dim 0), like its weight."""
    w = module.weight
    return torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)


def _linear(layer: nn.Module, path: str, i: int, o: int, what: str) -> nn.Linear:
    lin = _get(layer, path)
    if (lin.in_features, lin.out_features) != (i, o):
        raise NotConvertible(f"{path} is {lin.in_features} -> {lin.out_features}; {what} needs {i} -> {o}")
    return lin


def _layer_norms(layer: nn.Module, paths: tuple[str, str], i: int) -> float:
    eps = set()
    for path in paths:
        ln = _get(layer, path)
        if not isinstance(ln, nn.LayerNorm):
            raise NotConvertible(f"{path} is a {type(ln).__name__}, not an nn.LayerNorm")
        if tuple(ln.normalized_shape) != (i,):
            raise NotConvertible(f"{path} normalizes over {tuple(ln.normalized_shape)}, not the hidden size ({i},)")
        if ln.weight is None:
            raise NotConvertible(f"{path} has no elementwise affine parameters")
        eps.add(float(ln.eps))
    if len(eps) != 1:
        raise NotConvertible(f"the two LayerNorms use different eps ({', '.join(map(str, sorted(eps)))}); "
                             f"Substation uses one")
    return eps.pop()


def _check_scaling(module: nn.Module, p: int) -> None:
    scaling = getattr(module, "scaling", p ** -0.5)
    if not math.isclose(float(scaling), p ** -0.5, rel_tol=1e-12):
        raise NotConvertible(f"attention scaling {scaling} differs from 1/sqrt(P) = {p ** -0.5}")


def _hf_config(module: nn.Module) -> Any:
    return getattr(module, "config", None)


def _check_sizes(layer: nn.Module, attention: nn.Module, i: int, h: int, p: int, projections: tuple[str, ...],
                 ffn: tuple[str, str]) -> int:
    """Check that the Q, K, V and output projections are I -> I, H * P = I, the attention scaling is
    1/sqrt(P) and the feed-forward is I -> U -> I; return U."""
    for path in projections:
        _linear(layer, path, i, i, "Substation (no separate embedding size)")
    if h < 1 or h * p != i:
        raise NotConvertible(f"H * P = {h} * {p} differs from the hidden size I={i}")
    _check_scaling(attention, p)
    u = _get(layer, ffn[0]).out_features
    _linear(layer, ffn[0], i, u, "the feed-forward input")
    _linear(layer, ffn[1], u, i, "the feed-forward output")
    return u


def _activation(layer: nn.Module, path: str, config_owner: nn.Module, key: str) -> str:
    label = getattr(_hf_config(config_owner), key, "")
    return activation_name(_get(layer, path), label if isinstance(label, str) else "")


def _read_bert(layer: nn.Module) -> dict:
    """BERT, RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA: post-LN, ``attention.self.{query,key,value}``."""
    if getattr(layer, "is_decoder", False):
        raise NotConvertible("a decoder layer (config.is_decoder=True: causal self-attention with a KV cache)")
    if getattr(layer, "add_cross_attention", False) or hasattr(layer, "crossattention"):
        raise NotConvertible("has cross-attention (config.add_cross_attention=True)")
    attn, sa = layer.attention, layer.attention.self
    if getattr(attn, "is_cross_attention", False) or getattr(sa, "is_cross_attention", False):
        raise NotConvertible("its attention is cross-attention")
    pet = getattr(sa, "position_embedding_type", None) or getattr(_hf_config(sa), "position_embedding_type", None)
    if pet not in (None, "absolute"):
        raise NotConvertible(f"position_embedding_type={pet!r} (relative position scores inside attention)")
    if getattr(sa, "is_causal", False):
        raise NotConvertible("its self-attention is causal")
    i, h = sa.query.in_features, int(sa.num_attention_heads)
    u = _check_sizes(layer, sa, i, h, int(getattr(sa, "attention_head_size", i // max(h, 1))),
                     ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"),
                     ("intermediate.dense", "output.dense"))
    p_hidden, p_hidden2 = float(attn.output.dropout.p), float(layer.output.dropout.p)
    dropout = DropoutConfig(attention=float(sa.dropout.p), hidden=p_hidden2, activation=0.0,
                            attention_output=None if p_hidden == p_hidden2 else p_hidden)
    return dict(hidden_size=i, num_heads=h, ffn_size=u,
                activation=_activation(layer, "intermediate.intermediate_act_fn", sa, "hidden_act"),
                layer_norm_eps=_layer_norms(layer, ("attention.output.LayerNorm", "output.LayerNorm"), i),
                dropout=dropout)


def _read_distilbert(layer: nn.Module) -> dict:
    """DistilBERT's ``TransformerBlock``: post-LN, ``attention.{q,k,v,out}_lin``, ``ffn.lin{1,2}``; no dropout
    on the attention output projection."""
    sa = layer.attention
    if getattr(sa, "is_causal", False):
        raise NotConvertible("its self-attention is causal")
    i, h = sa.q_lin.in_features, int(sa.n_heads)
    u = _check_sizes(layer, sa, i, h, int(getattr(sa, "attention_head_size", i // max(h, 1))),
                     ("attention.q_lin", "attention.k_lin", "attention.v_lin", "attention.out_lin"),
                     ("ffn.lin1", "ffn.lin2"))
    return dict(hidden_size=i, num_heads=h, ffn_size=u, activation=_activation(layer, "ffn.activation", sa, "activation"),
                layer_norm_eps=_layer_norms(layer, ("sa_layer_norm", "output_layer_norm"), i),
                dropout=DropoutConfig(attention=float(sa.dropout.p), hidden=float(layer.ffn.dropout.p),
                                      activation=0.0, attention_output=0.0))


def _read_vit(layer: nn.Module) -> dict:
    """ViT and DeiT: pre-LN image encoders, ``attention.{q,k,v,o}_proj``, ``mlp.fc{1,2}``, one dropout."""
    attn = layer.attention
    i, h = attn.q_proj.in_features, int(attn.num_attention_heads)
    if (attn.q_proj.bias is None) != (attn.k_proj.bias is None) or (attn.q_proj.bias is None) != (attn.v_proj.bias is None):
        raise NotConvertible("some but not all of the Q/K/V projections have a bias")
    if attn.o_proj.bias is None:
        raise NotConvertible("the attention output projection has no bias")
    u = _check_sizes(layer, attn, i, h, int(getattr(attn, "head_dim", i // max(h, 1))),
                     ("attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.o_proj"),
                     ("mlp.fc1", "mlp.fc2"))
    p_hidden = float(layer.dropout.p)
    return dict(hidden_size=i, num_heads=h, ffn_size=u,
                activation=_activation(layer, "mlp.activation_fn", attn, "hidden_act"),
                layer_norm_eps=_layer_norms(layer, ("layernorm_before", "layernorm_after"), i),
                dropout=DropoutConfig(attention=float(attn.attention_dropout), hidden=p_hidden, activation=0.0))


def _paths(q: str, k: str, v: str, out: str, lin1: str, lin2: str, norm1: str, norm2: str) -> dict:
    paths = {"in_proj_weight": (f"{q}.weight", f"{k}.weight", f"{v}.weight"),
             "in_proj_bias": (f"{q}.bias", f"{k}.bias", f"{v}.bias"),
             "out_proj_weight": (f"{out}.weight",), "out_proj_bias": (f"{out}.bias",),
             "linear1_weight": (f"{lin1}.weight",), "linear1_bias": (f"{lin1}.bias",),
             "linear2_weight": (f"{lin2}.weight",), "linear2_bias": (f"{lin2}.bias",),
             "norm1_weight": (f"{norm1}.weight",), "norm1_bias": (f"{norm1}.bias",),
             "norm2_weight": (f"{norm2}.weight",), "norm2_bias": (f"{norm2}.bias",)}
    assert tuple(paths) == PARAMETER_NAMES
    return paths


_BERT_PATHS = _paths("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
                     "intermediate.dense", "output.dense", "attention.output.LayerNorm", "output.LayerNorm")
_VIT_PATHS = _paths("attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.o_proj",
                    "mlp.fc1", "mlp.fc2", "layernorm_before", "layernorm_after")


@dataclasses.dataclass(frozen=True)
class Family:
    """One Hugging Face encoder-layer class Substation replaces.

    Attributes:
        name: the family's name (``BERT``, ``RoBERTa``, ...).
        module: the ``transformers`` module defining the layer class.
        class_name: the layer class' name in that module.
        layer_norm: ``post`` (BERT-like: residual then LayerNorm) or ``pre`` (ViT: LayerNorm on each branch input).
        paths: Substation parameter name -> attribute paths of the tensors it is made of, inside the
            layer (``in_proj_*``: the Q, K, V projections, concatenated along dim 0 as [3I, I] / [3I]).
        read: layer -> :class:`~substation.EncoderConfig` fields (sizes, activation, eps, dropout);
            raises :class:`NotConvertible`.
    """

    name: str
    module: str
    class_name: str
    layer_norm: str
    paths: dict
    read: Callable[[nn.Module], dict]

    @property
    def layer_class(self) -> type | None:
        """The ``transformers`` class, or None when this ``transformers`` has no such module."""
        try:
            return getattr(importlib.import_module(self.module), self.class_name, None)
        except ImportError:
            return None

    def owners(self, layer: nn.Module) -> list[tuple]:
        """For each of :data:`PARAMETER_NAMES`, the (module, attribute name) pairs that hold its parts
        in ``layer``: valid while no submodule is replaced (the drop-in layer keeps them between calls
        for as long as its fingerprint, which includes every submodule's identity, is unchanged)."""
        out = []
        for name in PARAMETER_NAMES:
            out.append(tuple((_get(layer, owner), attr) for owner, _, attr in (p.rpartition(".") for p in self.paths[name])))
        return out

    def tensors(self, layer: nn.Module, owners: list | None = None) -> list:
        """The layer's current weights as Substation's parameters, in :data:`PARAMETER_NAMES` order and
        PyTorch's shapes; a stacked one (``in_proj_weight`` [3I, I], ``in_proj_bias`` [3I]) as the tuple
        of its Q, K, V parts, which :func:`~substation.runtime.run_layer` takes apart or concatenates (a
        missing bias is zeros). Read on every call, so replaced, loaded or edited parameters
        are seen; ``owners`` (:meth:`owners` of ``layer``) saves looking the modules up."""
        out = []
        for name, slots in zip(PARAMETER_NAMES, owners or self.owners(layer)):
            parts = [m._parameters[a] if a in m._parameters else getattr(m, a) for m, a in slots]
            # a missing bias (bias=False, ViT's qkv_bias=False, bias set to None) adds nothing: zeros
            parts = [_zero_bias(m) if t is None and a == "bias" else t for t, (m, a) in zip(parts, slots)]
            out.append(parts[0] if len(parts) == 1 else tuple(parts))
        return out


FAMILIES = (
    Family("BERT", "transformers.models.bert.modeling_bert", "BertLayer", "post", _BERT_PATHS, _read_bert),
    Family("RoBERTa", "transformers.models.roberta.modeling_roberta", "RobertaLayer", "post", _BERT_PATHS, _read_bert),
    Family("XLM-RoBERTa", "transformers.models.xlm_roberta.modeling_xlm_roberta", "XLMRobertaLayer", "post",
           _BERT_PATHS, _read_bert),
    Family("CamemBERT", "transformers.models.camembert.modeling_camembert", "CamembertLayer", "post",
           _BERT_PATHS, _read_bert),
    Family("ELECTRA", "transformers.models.electra.modeling_electra", "ElectraLayer", "post", _BERT_PATHS, _read_bert),
    Family("DistilBERT", "transformers.models.distilbert.modeling_distilbert", "TransformerBlock", "post",
           _paths("attention.q_lin", "attention.k_lin", "attention.v_lin", "attention.out_lin", "ffn.lin1", "ffn.lin2",
                  "sa_layer_norm", "output_layer_norm"), _read_distilbert),
    Family("ViT", "transformers.models.vit.modeling_vit", "ViTLayer", "pre", _VIT_PATHS, _read_vit),
    Family("DeiT", "transformers.models.deit.modeling_deit", "DeiTLayer", "pre", _VIT_PATHS, _read_vit),
)


def family_of(module: nn.Module) -> Family | None:
    """The :class:`Family` whose layer class is exactly ``type(module)`` (a Substation drop-in layer
    reports the family of the class it replaces), or None."""
    cls = getattr(type(module), "substation_replaces", type(module))
    for family in FAMILIES:
        if family.layer_class is cls:
            return family
    return None


def _weights_dtype_and_target(layer: nn.Module) -> tuple[str, str]:
    """(config dtype, target) from the layer's parameters (meta tensors count by dtype: weights loaded later).

    Raises:
        NotConvertible: mixed dtypes or devices, or a dtype the device's target does not compile.
    """
    dtypes = {p.dtype for p in layer.parameters()}
    devices = {p.device.type for p in layer.parameters()} - {"meta"}
    if len(dtypes) != 1:
        raise NotConvertible(f"mixed parameter dtypes {sorted(map(str, dtypes))}; convert the model to one dtype first")
    if len(devices) > 1:
        raise NotConvertible(f"parameters on several devices ({', '.join(sorted(devices))})")
    target = "cuda" if devices == {"cuda"} else "cpu"
    if devices - {"cpu", "cuda"}:
        raise NotConvertible(f"parameters on {devices.pop()}; Substation runs on the CPU and on CUDA GPUs")
    dtype = DTYPE_NAMES.get(next(iter(dtypes)))
    allowed = CUDA_DTYPES if target == "cuda" else DTYPES
    if dtype not in allowed:
        raise NotConvertible(f"weights are {next(iter(dtypes))}; target {target} compiles {', '.join(allowed)} "
                             f"(call optimize() on the float32 model)")
    return dtype, target


def _max_positions(layer: nn.Module) -> int | None:
    for module in layer.modules():
        n = getattr(getattr(module, "config", None), "max_position_embeddings", None)
        if isinstance(n, int) and not isinstance(n, bool) and n >= 1:
            return n
    return None


def layer_config(layer: nn.Module, family: Family | None = None, **config_overrides) -> EncoderConfig:
    """The :class:`~substation.EncoderConfig` of a Hugging Face encoder layer of a supported family.

    Read from the layer: I, H, P = I / H, U; the activation; the LayerNorm eps (both must agree);
    the dropout probabilities; the weights' dtype and device (target ``cpu`` or ``cuda``); the
    layer-norm placement of the family (BERT-like: post, ViT/DeiT: pre). Nominal B = 1 and L = the
    model config's ``max_position_embeddings`` (512 if the layer does not reach its config),
    ``mask: padding``; ``config_overrides`` are applied last with :meth:`EncoderConfig.replace`.

    Raises:
        NotConvertible: a layer whose math Substation does not implement (the one-line reason says why),
            or not a layer of a supported family.
        ConfigError: an invalid override. ValueError: an override of ``norm_type`` (the weights are LayerNorm's).
    """
    family = family or family_of(layer)
    if family is None:
        raise NotConvertible(f"{type(layer).__name__} is not a layer class Substation converts")
    try:
        fields = family.read(layer)
        dtype, target = _weights_dtype_and_target(layer)
        base = EncoderConfig(batch_size=1, max_seq_len=_max_positions(layer) or 512, layer_norm=family.layer_norm,
                             dtype=dtype, mask="padding", target=target, name="hf-layer", **fields)
    except ConfigError as e:  # a setting the layer allows but Substation does not compile (dropout p = 1)
        raise NotConvertible(str(e)) from e
    config = base.replace(**config_overrides)
    if config.norm_type != base.norm_type:
        raise ValueError(f"norm_type={config.norm_type!r} cannot override a {family.name} layer: its weights are "
                         f"those of {base.norm_type} (the compiled layer would read parameters the model does not have)")
    return config
