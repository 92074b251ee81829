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

import numbers
import sys
import warnings
from typing import Any

import torch
from torch import nn

from ..pipeline import build_after_apply, cached_compile, compiled_from_state, compiled_state, rebuild_for
from ..runtime import CompiledLayer, run_layer
from ..runtime.masks import cast_additive_mask, check_mask, check_mask_dtype, check_mask_values, mask_differs
from .families import FAMILIES, Family, NotConvertible, layer_config

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


@torch.compiler.assume_constant_result
def _traced_sync(layer) -> str | None:
    """``layer._substation_sync()`` evaluated when torch.compile traces the layer, its result a constant
    of the graph (dynamo does not trace the module walk it makes)."""
    return layer._substation_sync()


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning raised in the calling function at the first frame outside
    Substation, PyTorch, transformers, sentence-transformers and PEFT (the user's call of the model or
    layer)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_globals.get("__name__", "").partition(".")[0] in (
            "substation", "torch", "transformers", "sentence_transformers", "peft"):
        frame, level = frame.f_back, level + 1
    return level


@torch.compiler.assume_constant_result
def _warn_fallback(layer_class: str, reason: str) -> bool:
    """Warn once per (class, reason) that a call runs the Hugging Face forward; traced, at trace time
    (dynamo cannot trace ``warnings.warn``). Returns True."""
    if (layer_class, reason) not in _WARNED:
        _WARNED.add((layer_class, reason))
        warnings.warn(f"{layer_class}: {reason}; running the Hugging Face forward for this call",
                      stacklevel=_caller_stacklevel())
    return True


def _attention_implementation(layer: nn.Module) -> str | None:
    """The ``config._attn_implementation`` of ``layer``'s attention (``"sdpa"``, ``"eager"``, ...), or None."""
    for module in layer.modules():
        implementation = getattr(getattr(module, "config", None), "_attn_implementation", None)
        if implementation is not None:
            return implementation
    return None


def _mask_for_hf(attention_mask: Any, hidden_states: torch.Tensor, implementation: str | None) -> Any:
    """The mask to hand a Hugging Face layer's own forward when a drop-in call falls back to it: the
    kind its model makes for ``implementation``. The model's own masks pass unchanged: a bool
    [B, 1, J, K] one (True = attend) under ``sdpa``, an additive one of the hidden states' dtype under
    ``eager``. The masks the drop-in layer takes besides are converted: a 2-D [B, K] mask (to
    [B, 1, 1, K]), an integer mask (1 = attend; to bool, or to additive 0 / ``finfo.min``), a float
    mask of another dtype (:func:`~substation.runtime.masks.cast_additive_mask`: finite values kept
    finite); under ``eager`` -inf becomes ``finfo.min``, as the model makes it (a row of -inf would give
    NaN there). Other implementations and non-tensors pass unchanged.

    Args:
        attention_mask: None, a tensor the drop-in layer accepted (:func:`~substation.runtime.masks.check_mask`),
            or another object. hidden_states: [B, J, I], of the dtype the layer computes in.
        implementation: the model's ``attn_implementation``.
    """
    if not isinstance(attention_mask, torch.Tensor) or implementation not in ("sdpa", "eager"):
        return attention_mask
    mask = attention_mask[:, None, None, :] if attention_mask.dim() == 2 else attention_mask
    dtype = hidden_states.dtype
    if not mask.is_floating_point():
        attend = mask.bool()
        if implementation == "sdpa":
            return attend
        additive = torch.zeros(attend.shape, dtype=dtype, device=attend.device)
        return additive.masked_fill_(~attend, torch.finfo(dtype).min)
    if implementation == "eager":  # its softmax gives NaN for a row of -inf: the model's finfo.min instead
        return mask.to(dtype).clamp(min=torch.finfo(dtype).min)
    return cast_additive_mask(mask, dtype)


class SubstationLayer:
    """Mixin of the drop-in layer classes (placed before the ``transformers`` layer class in the MRO).

    Attributes (class): ``substation_replaces``, the ``transformers`` class; ``substation_family``, its
    :class:`~substation.interop.families.Family`.
    Attributes (instance): ``substation_compiled``, the :class:`~substation.runtime.CompiledLayer`.

    ``forward(hidden_states [B, J, I], attention_mask=None, ...)`` returns [B, J, I] like the replaced
    layer (a tensor, transformers 5.x). ``attention_mask`` is what the model passes its layers: None,
    a bool [B, 1, J, K] mask (True = attend; ``sdpa``), an additive float [B, 1, J, K] mask (``eager``),
    a [B, H, J, K] mask, or a 2-D [B, K] mask, bool, integer (1 = attend) or float (additive) of any of
    :data:`~substation.runtime.masks.MASK_DTYPES` (a 4-D mask whose rows or heads differ runs the
    Hugging Face forward, handed the mask in the form its model makes). Forward-only calls (inference)
    compute the real tokens alone and return zeros at padded positions (docs/usage.md), so a sequence
    that is entirely padding is all zeros there; calls that need gradients compute every position, and
    such a sequence gets uniform attention probabilities with an additive ``finfo.min`` mask and zero
    probabilities with a bool mask, as the replaced layer.

    ``.to(dtype)``, ``.double()``, ``.float()`` switch to the build of that dtype through the build
    cache; a dtype or device the target does not compile (float16 or a GPU for a CPU build) converts the
    layer all the same, and it runs the Hugging Face forward there, with a warning naming what the
    target compiles, until it is converted back. Settings changed after the
    conversion (dropout probabilities, LayerNorm eps, the activation module) switch to the build of
    the new config at the next call; a submodule replaced by another class (a LoRA adapter) or a
    forward hook on a submodule makes the layer run the Hugging Face forward, with a warning.
    """

    substation_replaces: type
    substation_family: Family
    substation_compiled: CompiledLayer
    substation_overrides: dict

    def _substation_fingerprint(self) -> tuple:
        # what the full check below reads, cheaply: each submodule's identity and class, hooks, dropout p,
        # eps and GELU's approximate (a walk of _modules: named_modules() costs several times more per call)
        out, todo = [], [self]
        while todo:
            m = todo.pop()
            d = m.__dict__
            out.append((id(m), type(m), len(m._forward_hooks), len(m._forward_pre_hooks), d.get("p"), d.get("eps"),
                        d.get("approximate"), m.training))
            todo.extend(c for c in m._modules.values() if c is not None)
        return tuple(out)

    def _substation_sync(self) -> str | None:
        """:meth:`_substation_check` when the layer's submodules or settings changed since the last call
        (its result is kept otherwise, with the modules that hold the parameters); first, for a layer
        converted to a dtype or device without a build, whether its parameters have one now (loaded
        with ``assign=True``, say) or why not."""
        if self.__dict__.get("_substation_unbuilt"):  # nothing is kept in _substation_seen meanwhile
            weight = next(self.parameters(), None)
            try:
                if weight is not None:
                    self.substation_compiled = rebuild_for(self.substation_compiled, weight.dtype, weight.device)
            except TypeError as e:
                return str(e)
            self._substation_unbuilt = False
        fingerprint = self._substation_fingerprint()
        seen = self.__dict__.get("_substation_seen")
        if seen is None or seen[0] != fingerprint:
            reason = self._substation_check()
            seen = self._substation_seen = (fingerprint, reason,
                                            None if reason else self.substation_family.owners(self))
        return seen[1]

    def _substation_check(self) -> str | None:
        """Follow changes made to the layer since it was converted: why the compiled code cannot run it
        now (a submodule replaced by another class, e.g. a LoRA adapter; a forward hook on a
        submodule; a setting Substation does not implement), or None after switching to the build of
        the layer's current config (dropout probabilities, eps, activation) through the build cache."""
        for name, module in self.named_modules():
            hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
            if name and any("output_capturing_hook" not in getattr(h, "__qualname__", "") for h in hooks):
                return f"a forward hook on submodule {name}"
        family = self.substation_family
        for paths in family.paths.values():
            for path in paths:
                owner = self.get_submodule(path.rpartition(".")[0])
                if type(owner) not in (nn.Linear, nn.LayerNorm):
                    return (f"{path.rpartition('.')[0]} is a {type(owner).__module__}.{type(owner).__qualname__}, "
                            f"not an nn.Linear or nn.LayerNorm")
        try:
            config = layer_config(self, family, **self.substation_overrides)
        except NotConvertible as e:
            return str(e)
        if config != self.substation_compiled.config:
            self.substation_compiled = cached_compile(config, **self.substation_compiled.options)
        return None

    def _substation_fallback(self, attention_mask, kwargs: dict, synced: str | None) -> str | None:
        """Why this call must run the replaced layer's own forward, or None; ``synced``: what
        :meth:`_substation_sync` said for this call."""
        if synced is not None:
            return synced
        if kwargs.get("output_attentions") or _attentions_requested():
            return "output_attentions=True (the compiled layer does not materialise attention probabilities)"
        for name in ("cache", "past_key_values", "layer_past", "head_mask"):
            if kwargs.get(name) is not None:
                return f"{name} is given"
        if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
            return f"the attention mask is a {type(attention_mask).__name__}, not a tensor"
        if isinstance(attention_mask, torch.Tensor) and attention_mask.requires_grad and torch.is_grad_enabled():
            return "the attention mask requires grad (the compiled layer does not differentiate the mask)"
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4 and not torch.compiler.is_compiling():
            # under torch.compile the operator checks the data and refuses such a mask (no graph break)
            what = mask_differs(attention_mask)
            if what is not None:
                return f"the attention mask differs between {what} (not a key padding mask)"
        return None

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, *args: Any,
                **kwargs: Any) -> torch.Tensor:
        """Run the compiled layer (see the class docstring); [B, J, I] -> [B, J, I].

        Raises:
            TypeError, ValueError: from :func:`substation.runtime.run_layer` (dtype, device, shape,
                weights still on the meta device) and :func:`~substation.runtime.masks.check_mask` (the
                mask's shape, dtype, device; a list, array, number or string instead of a tensor); a mask
                holding NaN or +inf, or integers other than 0 and 1, also where an eager call runs the
                Hugging Face forward.
        """
        if not isinstance(attention_mask, torch.Tensor) and (
                isinstance(attention_mask, (list, tuple, str, numbers.Number)) or hasattr(attention_mask, "__array__")):
            raise TypeError(f"attention_mask must be a tensor or None, got a {type(attention_mask).__name__}; "
                            f"convert it with torch.as_tensor")
        # first, before anything reads substation_compiled (it may switch builds). Traced: run at trace
        # time, its result a constant (the graph is specialised to the layer as traced; a layer changed
        # later needs a new torch.compile, docs/huggingface.md)
        synced = _traced_sync(self) if torch.compiler.is_compiling() else self._substation_sync()
        mask_checked = isinstance(attention_mask, torch.Tensor) and isinstance(hidden_states, torch.Tensor) \
            and hidden_states.dim() == 3 and self.substation_compiled.config.mask != "none"
        if mask_checked:  # a bad mask is named here, not handed to Hugging Face's forward
            check_mask(attention_mask, hidden_states.shape[0], hidden_states.shape[1], hidden_states.device,
                       self.substation_compiled.config, "attention_mask")
        reason = self._substation_fallback(attention_mask, kwargs, synced)
        if reason is not None:
            if isinstance(attention_mask, torch.Tensor) and isinstance(hidden_states, torch.Tensor):
                if not mask_checked:  # mask: none, or not [B, J, I]: Hugging Face reads it
                    check_mask_dtype(attention_mask, "attention_mask")
                if not torch.compiler.is_compiling():  # a data-dependent check would break the traced graph
                    check_mask_values(attention_mask)  # bad input is refused, not handed to Hugging Face's forward
                attention_mask = _mask_for_hf(attention_mask, hidden_states, _attention_implementation(self))
            _warn_fallback(type(self).__name__, reason)
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4 \
                and not torch.compiler.is_compiling():
            attention_mask = attention_mask[:, :1, :1, :]  # heads and rows were found equal: not checked again
        seen = None if torch.compiler.is_compiling() else self.__dict__.get("_substation_seen")
        params = self.substation_family.tensors(self, seen[2] if seen else None)
        return run_layer(self.substation_compiled, hidden_states, params, self.training, attention_mask=attention_mask)

    def _apply(self, fn, recurse=True):
        weight = next(self.parameters(), None)
        dtype = weight.dtype if weight is not None else self.substation_compiled.forward.dtype
        try:
            compiled, unbuilt = build_after_apply(self.substation_compiled, fn, dtype), False
        except TypeError:  # no build there: converted all the same (as the rest of the model is)
            compiled, unbuilt = self.substation_compiled, True
        out = super()._apply(fn, recurse)
        self.substation_compiled, self._substation_unbuilt = compiled, unbuilt
        self.__dict__.pop("_substation_seen", None)  # the checks read the parameters' dtype: run them again
        return out

    def __getstate__(self):
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        state = dict(state)
        state["substation_compiled"] = compiled_state(self.substation_compiled)
        state.pop("_substation_seen", None)
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


def replace_with_drop_in(layer: nn.Module, family: Family, compiled: CompiledLayer,
                         overrides: dict | None = None) -> nn.Module:
    """A drop-in layer that takes over ``layer``'s submodules, parameters (the same objects), buffers,
    hooks, attributes and train/eval mode, and runs ``compiled`` (built from ``layer``'s config with
    the :class:`~substation.EncoderConfig` ``overrides``, reapplied when the layer's settings change);
    ``layer`` itself is left unchanged (its containers are copied, their contents shared)."""
    cls = drop_in_class(family)
    new = cls.__new__(cls)
    state = dict(layer.__dict__)
    for key in _MODULE_STATE:
        if key in state:
            state[key] = type(state[key])(state[key])
    new.__dict__.update(state)
    new.substation_compiled = compiled
    new.substation_overrides = dict(overrides or {})
    return new
