"""Converting Hugging Face and PyTorch encoder layers: :func:`optimize` (in place, weights shared),
:func:`from_hf` and :func:`from_torch` (a standalone :class:`~substation.EncoderLayer`, weights copied).

Dimension letters: B batch, J query positions, K key positions (J = K), H heads, P = I / H head size,
I hidden size, U feed-forward size. ``transformers`` is imported lazily.
"""
from __future__ import annotations

import dataclasses
import warnings

import torch
from torch import nn

from ..config import DTYPES, DropoutConfig, EncoderConfig
from ..pipeline import cached_compile
from ..runtime import DTYPE_NAMES, PARAMETER_NAMES, EncoderLayer
from .families import NotConvertible, activation_name, family_of, layer_config
from .layers import SubstationLayer, replace_with_drop_in

__all__ = ["OptimizeSummary", "drop_in", "from_hf", "from_torch", "layer_config", "optimize"]

def drop_in(hf_layer: nn.Module, **config_overrides) -> nn.Module:
    """The drop-in replacement of one Hugging Face encoder layer (what :func:`optimize` puts in its
    place): it shares ``hf_layer``'s submodules and parameters and runs Substation's compiled code.

    Raises:
        ValueError (:class:`~substation.interop.families.NotConvertible`): a layer Substation cannot
            convert. ConfigError: a bad override. ToolchainError, BuildError: compilation failed.
    """
    family = family_of(hf_layer)
    config = layer_config(hf_layer, family, **config_overrides)
    return replace_with_drop_in(hf_layer, family, cached_compile(config), config_overrides)


def from_hf(hf_layer: nn.Module, **config_overrides) -> EncoderLayer:
    """Compile a standalone :class:`~substation.EncoderLayer` equivalent to a Hugging Face encoder layer
    (any family :func:`optimize` converts: BERT, RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA, DistilBERT,
    ViT, DeiT) and copy its weights into it (Substation's parameter names: ``in_proj_weight`` [3I, I] =
    Q, K, V stacked; a missing Q/K/V bias becomes zeros). The source is not modified; the new layer is
    in the source's train/eval mode and its parameters require grad where the source's did.

    See :func:`layer_config` for what is read from the layer; compiled builds are shared per process
    by config.

    Returns:
        An :class:`~substation.EncoderLayer`; ``forward(hidden_states [B, J, I], attention_mask)``.

    Raises:
        ValueError (:class:`~substation.interop.families.NotConvertible`): a layer Substation cannot
            convert; the message says why. ConfigError: a bad override. ToolchainError, BuildError:
            compilation failed.
    """
    config = layer_config(hf_layer, **config_overrides)
    family = family_of(hf_layer)
    new = EncoderLayer(cached_compile(config))
    with torch.no_grad():
        sources = family.tensors(hf_layer)
        for name, src in zip(PARAMETER_NAMES, sources):
            dst = getattr(new, name)
            if tuple(src.shape) != tuple(dst.shape):
                raise NotConvertible(f"{name}: source shape {tuple(src.shape)} does not match {tuple(dst.shape)}")
            dst.copy_(src.detach().to(dst.device, dst.dtype))
            dst.requires_grad_(src.requires_grad or src.grad_fn is not None)
    new.train(hf_layer.training)
    return new


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
    if not isinstance(layer, nn.TransformerEncoderLayer):
        raise ValueError(f"expected a torch.nn.TransformerEncoderLayer, got {type(layer).__name__}")
    sa = layer.self_attn
    if not getattr(sa, "batch_first", False):
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
    for name, ln in (("norm1", layer.norm1), ("norm2", layer.norm2)):
        if tuple(ln.normalized_shape) != (i,):
            raise ValueError(f"{name} normalizes over {tuple(ln.normalized_shape)}, not the hidden size ({i},)")
    if layer.norm1.eps != layer.norm2.eps:
        raise ValueError(f"norm1.eps={layer.norm1.eps} and norm2.eps={layer.norm2.eps} differ; Substation uses one")
    p1, p2 = float(layer.dropout1.p), float(layer.dropout2.p)
    if p1 != p2:
        raise ValueError(f"dropout1.p={p1} and dropout2.p={p2} differ; Substation uses one hidden dropout probability")
    dtypes = {p.dtype for p in layer.parameters()}
    if len(dtypes) != 1 or DTYPE_NAMES.get(next(iter(dtypes))) not in DTYPES:
        raise TypeError(f"TransformerEncoderLayer has parameter dtypes {sorted(map(str, dtypes))}; Substation "
                        f"compiles float32 or float64 layers (convert it with .float() or .double() first)")
    config = EncoderConfig(
        batch_size=1, max_seq_len=512, hidden_size=i, num_heads=h, ffn_size=layer.linear1.out_features,
        activation=activation_name(layer.activation), layer_norm="pre" if layer.norm_first else "post",
        dropout=DropoutConfig(attention=float(sa.dropout), hidden=p1, activation=float(layer.dropout.p)),
        layer_norm_eps=float(layer.norm1.eps), dtype=DTYPE_NAMES[next(iter(dtypes))], mask="padding",
        target="cpu", name="torch-encoder-layer").replace(**config_overrides)
    new = EncoderLayer(cached_compile(config))
    sources = {"in_proj_weight": sa.in_proj_weight, "in_proj_bias": sa.in_proj_bias,
               "out_proj_weight": sa.out_proj.weight, "out_proj_bias": sa.out_proj.bias,
               **{f"{m}_{p}": getattr(getattr(layer, m), p) for m in ("linear1", "linear2", "norm1", "norm2")
                  for p in ("weight", "bias")}}
    with torch.no_grad():
        for name in PARAMETER_NAMES:
            dst, src = getattr(new, name), sources[name]
            dst.copy_(src.detach())
            dst.requires_grad_(src.requires_grad)
    new.train(layer.training)
    return new


@dataclasses.dataclass
class OptimizeSummary:
    """What :func:`optimize` did, kept as ``model.substation_summary``; ``print()`` it.

    Attributes:
        replaced: replaced layer class name -> count.
        kept: (module name, class name, one-line reason) of each encoder layer left as it was.
        configs: the distinct :class:`~substation.EncoderConfig` compiled.
        already: layers that were Substation drop-ins before this call (an ``optimize`` run twice).
    """

    replaced: dict = dataclasses.field(default_factory=dict)
    already: int = 0
    kept: list = dataclasses.field(default_factory=list)
    configs: list = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"substation.optimize: replaced {sum(self.replaced.values())} layer(s)"
                 + ("".join(f"\n  {n} x {cls}" for cls, n in self.replaced.items()))]
        if self.already:
            lines.append(f"{self.already} layer(s) were Substation layers already")
        if self.kept:
            lines.append(f"kept {len(self.kept)} layer(s) as they were:")
            lines += [f"  {name} ({cls}): {reason}" for name, cls, reason in self.kept]
        return "\n".join(lines)


def _encoder_layer_candidates(model: nn.Module):
    """(name, module, family or None) of each module that is a supported family's layer, a Substation
    drop-in layer, or another transformers ``GradientCheckpointingLayer`` (an encoder or decoder layer
    of some model); a module reachable under several names is listed under each."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # pragma: no cover - older transformers
        GradientCheckpointingLayer = ()
    inside: list[str] = []
    for name, module in model.named_modules(remove_duplicate=False):
        if any(name.startswith(p + ".") for p in inside):
            continue
        family = family_of(module)
        if family is not None or (GradientCheckpointingLayer and isinstance(module, GradientCheckpointingLayer)):
            inside.append(name)
            yield name, module, family


def optimize(model: nn.Module, strict: bool = False, **config_overrides) -> nn.Module:
    """Replace, in place, every encoder layer of a supported Hugging Face family inside ``model`` with
    a drop-in layer running Substation's compiled code, and return ``model``.

    Families: BERT, RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA, DistilBERT (post-LN) and ViT, DeiT
    (pre-LN), inside any ``nn.Module`` (``BertModel``, ``*ForSequenceClassification``, a
    sentence-transformers ``SentenceTransformer``, ...). Each drop-in layer keeps the replaced layer's
    submodules and parameter objects, so ``state_dict()`` keys, shapes and dtypes stay those of the
    unoptimized model, ``save_pretrained`` writes a plain Hugging Face checkpoint, and optimizers made
    before or after stay valid. Layers of equal configs share one compiled build. Layers that cannot
    be converted (decoders, cross-attention, relative position scores, unsupported activations, other
    layer classes) stay as they were, each with a one-line reason in ``model.substation_summary``
    (an :class:`OptimizeSummary`; ``print`` it). A model on the meta device (before its weights are
    loaded) is converted; its layers run once the weights are there.

    Args:
        model: the model, modified in place.
        strict: raise instead of keeping layers that cannot be converted.
        **config_overrides: :class:`~substation.EncoderConfig` fields applied to every layer's config.

    Returns:
        ``model``.

    Raises:
        ValueError: ``strict`` and some layer cannot be converted (all are listed; nothing is
            replaced), or ``model`` is itself a layer.
        ConfigError: a bad override. RuntimeError: ``transformers`` older than 5.0.
        ImportError: ``transformers`` is not installed. ToolchainError, BuildError: compilation failed.
    """
    import transformers

    major = int(str(transformers.__version__).split(".")[0])
    if major < 5:
        raise RuntimeError(f"optimize() needs transformers >= 5 (layers return tensors and models pass 4-D masks "
                           f"from 5.0 on); found {transformers.__version__}")
    summary = OptimizeSummary()
    planned, already = [], 0
    for name, module, family in _encoder_layer_candidates(model):
        if name == "":
            raise ValueError("optimize() replaces the layers inside a model; for a single layer use "
                             "substation.interop.from_hf(layer)")
        if isinstance(module, SubstationLayer):
            already += 1
            continue
        try:
            if family is None:
                raise NotConvertible("no Substation conversion for this layer class")
            planned.append((name, module, family, layer_config(module, family, **config_overrides)))
        except NotConvertible as e:
            summary.kept.append((name, type(module).__name__, str(e)))
    if strict and summary.kept:
        raise ValueError("optimize(strict=True): these layers cannot be converted:\n"
                         + "\n".join(f"  {n} ({c}): {r}" for n, c, r in summary.kept))
    converted: dict = {}    # id(layer) -> its drop-in: a layer reachable under several names is converted once
    for _, module, family, config in planned:
        if id(module) not in converted:
            converted[id(module)] = replace_with_drop_in(module, family, cached_compile(config), config_overrides)
    for name, module, _, config in planned:
        new = converted[id(module)]
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        cls = type(module).__name__
        summary.replaced[cls] = summary.replaced.get(cls, 0) + 1
        if config not in summary.configs:
            summary.configs.append(config)
    summary.already = already
    if not planned and not already:
        what = (f"{len(summary.kept)} layer(s) cannot be converted (see model.substation_summary)" if summary.kept
                else f"no layer of a supported family inside {type(model).__name__}")
        warnings.warn(f"optimize(): nothing replaced: {what}", stacklevel=2)
    model.substation_summary = summary
    return model
