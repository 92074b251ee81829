"""Drop-in Hugging Face layers whose forward and backward run Substation's compiled code.

``SubstationBERTLayer`` and its siblings (one per :data:`~substation.interop.families.FAMILIES`
entry, made on first use) subclass the ``transformers`` layer class they replace and take over the
replaced layer's submodules, parameters, buffers and hooks unchanged. So a converted model keeps its
``state_dict`` keys, shapes and parameter objects (checkpoints, optimizers and ``from_pretrained``
of the saved folder work without Substation), ``isinstance(layer, BertLayer)`` holds (Hugging Face's
``output_hidden_states`` capture and ``gradient_checkpointing_enable()`` find the layer), and the
classes pickle by name. Calls the compiled code does not implement (``output_attentions``, a KV
cache, a mask that differs between queries, a flex-attention ``BlockMask``) run the original
Hugging Face forward on the same parameters, with a one-time warning.
"""
from __future__ import annotations

import sys
import warnings
from typing import Any

import torch
from torch import nn

from ..runtime import CompiledLayer, apply_probe, compiled_from_state, compiled_state, rebuild_for, run_layer
from .families import FAMILIES, Family

__all__ = ["SubstationLayer", "drop_in_class", "replace_with_drop_in"]

_WARNED: set = set()


def _attentions_requested() -> bool:
    """Whether a transformers 5.x ``capture_outputs`` collector is recording attentions now."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # pragma: no cover - other transformers versions
        return False
    if torch.compiler.is_compiling() and not getattr(_active_collector, "compiling", False):
        return False  # no collector was set inside the traced region
    collected = _active_collector.get()
    return isinstance(collected, dict) and ("attentions" in collected or "cross_attentions" in collected)


class SubstationLayer:
    """Mixin of the drop-in layer classes (placed before the ``transformers`` layer class in the MRO).

    Attributes (class): ``substation_replaces``, the ``transformers`` class; ``substation_family``, its
    :class:`~substation.interop.families.Family`.
    Attributes (instance): ``substation_compiled``, the :class:`~substation.runtime.CompiledLayer`.

    ``forward(hidden_states [B, J, I], attention_mask=None, ...)`` returns [B, J, I] like the replaced
    layer (a tensor, transformers 5.x). ``attention_mask`` is what the model passes its layers: None,
    a bool [B, 1, J, K] mask (True = attend; ``sdpa``), an additive float [B, 1, J, K] mask (``eager``),
    or a 2-D [B, K] mask. A sequence that is entirely padding gets uniform attention probabilities with
    an additive ``finfo.min`` mask and zero probabilities with a bool mask, as the replaced layer.

    ``.to(dtype)``, ``.double()``, ``.float()`` switch to the build of that dtype through the build
    cache; other dtypes and devices raise ``TypeError`` at that call.
    """

    substation_replaces: type
    substation_family: Family
    substation_compiled: CompiledLayer

    def _substation_fallback(self, attention_mask, kwargs: dict) -> str | None:
        """Why this call must run the replaced layer's own forward, or None."""
        if kwargs.get("output_attentions") or _attentions_requested():
            return "output_attentions=True (the compiled layer does not materialise attention probabilities)"
        for name in ("cache", "past_key_values", "layer_past", "head_mask"):
            if kwargs.get(name) is not None:
                return f"{name} is given"
        if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
            return f"the attention mask is a {type(attention_mask).__name__}, not a tensor"
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4 and attention_mask.shape[2] > 1 \
                and attention_mask.stride(2) != 0 and not torch.compiler.is_compiling() \
                and not bool((attention_mask == attention_mask[:, :, :1, :]).all()):
            return "the attention mask differs between queries (not a key padding mask)"
        return None

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, *args: Any,
                **kwargs: Any) -> torch.Tensor:
        """Run the compiled layer (see the class docstring); [B, J, I] -> [B, J, I].

        Raises:
            TypeError, ValueError: from :func:`substation.runtime.run_layer` (dtype, device, shape,
                weights still on the meta device).
        """
        reason = self._substation_fallback(attention_mask, kwargs)
        if reason is not None:
            key = (type(self).__name__, reason)
            if key not in _WARNED:
                _WARNED.add(key)
                warnings.warn(f"{type(self).__name__}: {reason}; running the Hugging Face forward for this call",
                              stacklevel=2)
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        return run_layer(self.substation_compiled, hidden_states, self.substation_family.tensors(self),
                         self.training, attention_mask=attention_mask)

    def _apply(self, fn, recurse=True):
        dtype, device = apply_probe(fn)
        compiled = self.substation_compiled
        if dtype.is_floating_point:
            compiled = rebuild_for(compiled, dtype, device)  # raises before anything is converted
        out = super()._apply(fn, recurse)
        self.substation_compiled = compiled
        return out

    def __getstate__(self):
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        state = dict(state)
        state["substation_compiled"] = compiled_state(self.substation_compiled)
        return state

    def __setstate__(self, state):
        state = dict(state)
        state["substation_compiled"] = compiled_from_state(state["substation_compiled"])
        super().__setstate__(state)

    def extra_repr(self) -> str:
        c = self.substation_compiled.config
        return (f"compiled by Substation: I={c.hidden_size}, H={c.num_heads}, U={c.ffn_size}, "
                f"activation={c.activation}, layer_norm={c.layer_norm}, dtype={c.dtype}")


def _class_name(family: Family) -> str:
    return "Substation" + family.name.replace("-", "") + "Layer"


_CLASSES: dict[str, type] = {}


def drop_in_class(family: Family) -> type:
    """The drop-in class for ``family`` (``SubstationBERTLayer`` for BERT, ...), made once and kept as an
    attribute of this module so that pickles find it by name.

    Raises:
        ImportError: this ``transformers`` has no such layer class.
    """
    name = _class_name(family)
    cls = _CLASSES.get(name)
    if cls is None:
        base = family.layer_class
        if base is None:
            raise ImportError(f"transformers has no {family.module}.{family.class_name}")
        cls = type(name, (SubstationLayer, base), {
            "__module__": __name__, "__qualname__": name, "substation_replaces": base, "substation_family": family,
            "__doc__": f"{family.class_name} ({family.name}) running Substation's compiled layer; see SubstationLayer."})
        _CLASSES[name] = cls
        setattr(sys.modules[__name__], name, cls)
    return cls


def __getattr__(name: str) -> type:
    # Unpickling a drop-in layer looks its class up here before any was made in this process.
    for family in FAMILIES:
        if _class_name(family) == name:
            return drop_in_class(family)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_MODULE_STATE = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_forward_hooks",
                 "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
                 "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
                 "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def replace_with_drop_in(layer: nn.Module, family: Family, compiled: CompiledLayer) -> nn.Module:
    """A drop-in layer that takes over ``layer``'s submodules, parameters (the same objects), buffers,
    hooks, attributes and train/eval mode, and runs ``compiled``; ``layer`` itself is left unchanged
    (its containers are copied, their contents shared)."""
    cls = drop_in_class(family)
    new = cls.__new__(cls)
    state = dict(layer.__dict__)
    for key in _MODULE_STATE:
        if key in state:
            state[key] = type(state[key])(state[key])
    new.__dict__.update(state)
    new.substation_compiled = compiled
    return new
