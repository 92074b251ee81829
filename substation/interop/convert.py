"""Converting Hugging Face models in place: :func:`optimize` and :func:`drop_in` (weights shared).
Standalone layers with copied weights: :meth:`substation.EncoderLayer.from_hf` and ``from_torch``.

Dimension letters: B batch, J query positions, K key positions (J = K), H heads, P = I / H head size,
I hidden size, U feed-forward size. ``transformers`` is imported lazily.
"""
from __future__ import annotations

import dataclasses
import warnings

from torch import nn

from ..config import ConfigError, EncoderConfig
from ..backends.cpu.gemm_libraries import check_fp32_gemm
from ..pipeline import cached_compile
from .families import NotConvertible, family_of, layer_config
from .layers import SubstationLayer, replace_with_drop_in

__all__ = ["DROP_IN_OVERRIDES", "OptimizeSummary", "drop_in", "layer_config", "optimize"]

#: The :class:`~substation.EncoderConfig` fields a drop-in conversion may override, with the values
#: allowed (None: any). Everything else (sizes, activation, eps, dropout, layer-norm placement,
#: dtype, target) is the model's: its weights, modules and device define it, and another value would
#: compute another function or fail at the first call.
DROP_IN_OVERRIDES = {"batch_size": None, "max_seq_len": None, "name": None, "cuda_arch": None,
                     "mask": ("padding", "none")}


def _check_overrides(overrides: dict, what: str) -> None:
    """Refuse, at the conversion, an override of a field the model defines (:data:`DROP_IN_OVERRIDES`).

    Raises:
        ConfigError: names the field and says where its value comes from.
    """
    fields = {f.name for f in dataclasses.fields(EncoderConfig)}
    for key, value in overrides.items():
        if key not in fields:
            raise ConfigError(f"{what}: {key!r} is not an EncoderConfig field; the fields a conversion may set are "
                              f"{', '.join(sorted(DROP_IN_OVERRIDES))}")
        allowed = DROP_IN_OVERRIDES.get(key, ())
        if key in DROP_IN_OVERRIDES and (allowed is None or value in allowed):
            continue
        if key == "target":
            hint = "the target follows the weights' device: move the model (model.cuda()) before converting it"
        elif key == "dtype":
            hint = "the dtype follows the weights' dtype: convert the model first (model.double(), ...), or run " \
                   "bfloat16 under torch.autocast"
        elif key in DROP_IN_OVERRIDES:
            hint = f"{key} may be {' or '.join(map(repr, allowed))} (a Hugging Face encoder attends to every token)"
        else:
            hint = "the model's weights and modules define it (change the module, e.g. its dropout p, instead)"
        raise ConfigError(f"{what}: {key}={value!r} cannot override the model's layers: {hint}; the fields "
                          f"a conversion may set are {', '.join(sorted(DROP_IN_OVERRIDES))}")

def drop_in(hf_layer: nn.Module, fp32_gemm: str = "auto", **config_overrides) -> nn.Module:
    """The drop-in replacement of one Hugging Face encoder layer (what :func:`optimize` puts in its
    place): it shares ``hf_layer``'s submodules and parameters and runs Substation's compiled code.
    ``fp32_gemm``: as :func:`optimize`.

    Raises:
        ValueError (:class:`~substation.interop.families.NotConvertible`): a layer Substation cannot
            convert; an unknown ``fp32_gemm``. ConfigError: a bad override, or one of a field the model
            defines (see :func:`optimize`). ToolchainError, BuildError: compilation failed.
    """
    _check_overrides(config_overrides, "drop_in()")
    check_fp32_gemm(fp32_gemm)  # before anything compiles
    family = family_of(hf_layer)
    config = layer_config(hf_layer, family, **config_overrides)
    return replace_with_drop_in(hf_layer, family, cached_compile(config, fp32_gemm=fp32_gemm), config_overrides)


@dataclasses.dataclass
class OptimizeSummary:
    """What :func:`optimize` did, kept as ``model.substation_summary``; ``print()`` it.

    Attributes:
        replaced: replaced layer class name -> count of distinct layers (one reachable under several
            names, shared, counts once and stays shared).
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


def optimize(model: nn.Module, strict: bool = False, fp32_gemm: str = "auto", **config_overrides) -> nn.Module:
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
        fp32_gemm: the library of float32 layers' token-wise GEMMs: ``"auto"`` (default: inference
            builds take the library measured faster on this machine, training builds MKL), ``"mkl"`` or
            ``"onednn"`` (:class:`~substation.pipeline.PipelineOptions`, docs/toolchain.md); float64 and
            bfloat16 layers ignore it.
        **config_overrides: :class:`~substation.EncoderConfig` fields applied to every layer's config:
            only those of :data:`DROP_IN_OVERRIDES` (nominal sizes, the name, the CUDA architecture,
            ``mask: none``); the rest is the model's.

    Returns:
        ``model``.

    Raises:
        ValueError: ``strict`` and some layer cannot be converted (all are listed; nothing is
            replaced), ``model`` is itself a layer, or an unknown ``fp32_gemm``.
        ConfigError: a bad override, or one of a field the model defines. RuntimeError: ``transformers`` older than 5.0. TypeError: not an ``nn.Module``.
        ImportError: ``transformers`` is not installed. ToolchainError, BuildError: compilation failed.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize() takes a torch.nn.Module (a Hugging Face model), got {type(model).__name__}")
    _check_overrides(config_overrides, "optimize()")
    check_fp32_gemm(fp32_gemm)  # before anything compiles
    import transformers

    major = int(str(transformers.__version__).split(".")[0])
    if major < 5:
        raise RuntimeError(f"optimize() needs transformers >= 5 (layers return tensors and models pass 4-D masks "
                           f"from 5.0 on); found {transformers.__version__}")
    summary = OptimizeSummary()
    planned, already, other_gemm = [], 0, set()
    for name, module, family in _encoder_layer_candidates(model):
        if name == "":
            raise ValueError("optimize() replaces the layers inside a model; for a single layer use "
                             "substation.EncoderLayer.from_hf(layer)")
        if isinstance(module, SubstationLayer):
            already += 1
            kept = module.substation_compiled.options["fp32_gemm"]
            if module.substation_compiled.config.dtype == "float32" and kept != fp32_gemm:
                other_gemm.add(kept)
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
            converted[id(module)] = replace_with_drop_in(module, family, cached_compile(config, fp32_gemm=fp32_gemm),
                                                       config_overrides)
            cls = type(module).__name__
            summary.replaced[cls] = summary.replaced.get(cls, 0) + 1
            if config not in summary.configs:
                summary.configs.append(config)
    for name, module, _, _ in planned:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, converted[id(module)])
    summary.already = already
    if other_gemm:
        warnings.warn(f"optimize(fp32_gemm={fp32_gemm!r}): layers that were Substation layers already keep their "
                      f"builds (fp32_gemm={', '.join(map(repr, sorted(other_gemm)))}); convert an unoptimized "
                      f"model to choose another library", stacklevel=2)
    if not planned and not already:
        what = (f"{len(summary.kept)} layer(s) cannot be converted (see model.substation_summary)" if summary.kept
                else f"no layer of a supported family inside {type(model).__name__}")
        warnings.warn(f"optimize(): nothing replaced: {what}", stacklevel=2)
    model.substation_summary = summary
    return model
