"""The compiled layer as PyTorch custom operators (``torch.library``): ``substation::layer_forward`` and
``substation::layer_backward``, opaque to ``torch.compile``, ``torch.export`` and ``torch.jit.trace``, with
fake implementations for shapes and a registered backward; :func:`run_layer` checks a call and runs it.

Dimension letters: B batch, J query positions, K key positions (J = K), I hidden size.
"""
from __future__ import annotations

import threading
import warnings
from typing import Optional

import torch
import torch.autograd.forward_ad as fwAD
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from ..config import EncoderConfig
from ..ir.graph import size_symbol
from ..ir.operands import STACK_LETTER
from ..passes.precision import boundary_dtype
from .library import ALL_TORCH_DTYPES, DTYPE_NAMES, MEMO_ENTRIES, CompiledLayer, pin_layer, registered_layer
from .masks import check_mask, key_mask
from .packing import computed_queries, pack_cu_seqlens, pack_key_mask, real_tokens, run_packed

__all__ = ["run_layer", "run_layer_varlen"]


def _mask_dtype(compiled: CompiledLayer) -> torch.dtype:
    return compiled.forward.dtypes.get("mask", compiled.forward.dtype)


def _chosen_build(key: str, bf16_autocast: bool, training: bool, forward_only: bool) -> CompiledLayer:
    # Chosen inside the operators (opaque to torch.compile): the first call compiles or loads the build.
    compiled = registered_layer(key)
    if torch.compiler.is_exporting():  # fake tensors: the exported program names the layer by key only
        pin_layer(compiled)
    if forward_only:  # under autocast without compiling the bfloat16 training build
        return compiled.for_autocast(forward_only=True) if bf16_autocast else compiled.forward_only()
    if bf16_autocast:
        compiled = compiled.for_autocast()
    return compiled if training else compiled.without_dropout()


def _cast_names(compiled: CompiledLayer, params: list) -> list[str]:
    """The parameters (in :func:`~substation.runtime.parameter_names` order; a parameter in parts: a
    tuple) whose dtype differs from the build's: float32 master weights of a half-precision build, cast
    inside the operator."""
    dtypes = compiled.forward.dtypes
    return [n for n, p in zip(compiled.parameter_names, params)
            if any(q.dtype != dtypes[n] for q in (p if isinstance(p, tuple) else (p,)))]


def _grouped(params: list[torch.Tensor], parts: list[int]) -> list:
    """``params`` regrouped by ``parts`` (tensors per parameter): a tensor, or a tuple of its parts."""
    out, i = [], 0
    for n in parts:
        out.append(params[i] if n == 1 else tuple(params[i:i + n]))
        i += n
    return out


_LAST_PACKING = threading.local()


def _inference_packing(mask: torch.Tensor | None, attend_marks_true: bool, batch: int, seq: int, dtype: torch.dtype,
                       config: EncoderConfig, forward_only: bool, on_cpu: bool):
    """(additive key mask [B, K], real positions [B, K] bool or None, :class:`PackedBatch` or None) of a
    call: :func:`key_mask`, for a ``forward_only`` call :func:`real_tokens`, and on the CPU also
    :func:`pack_key_mask`. The layers of a model all get the same mask: the last result of this thread
    is reused when the mask holds the same values (compared in full: [B, K] elements), the same kind and
    shape, for the same dtype and config.

    Raises:
        ValueError: as :func:`key_mask`.
    """
    if mask is None:
        return None, None, None
    signature = (mask.shape, mask.dtype, mask.device, attend_marks_true, batch, seq, dtype, config, forward_only, on_cpu)
    last = getattr(_LAST_PACKING, "entry", None)
    if last is not None and last[0] == signature and torch.equal(last[1], mask):
        return last[2]
    m = key_mask(mask, attend_marks_true, batch, seq, dtype)
    if m.untyped_storage().data_ptr() == mask.untyped_storage().data_ptr():
        m = m.clone()  # kept for later calls: never the caller's tensor, which may change (or be reused)
    real = real_tokens(m) if forward_only else None
    result = (m, real, pack_key_mask(real, config) if real is not None and on_cpu else None)
    _LAST_PACKING.entry = (signature, mask.clone(), result)
    return result


def _remember(memo: "dict | set", key, value=None) -> None:
    """Put ``key`` (-> ``value`` in a dict) into a :class:`CompiledLayer` memo, emptied when full."""
    if len(memo) >= MEMO_ENTRIES:
        memo.clear()
    if isinstance(memo, set):
        memo.add(key)
    else:
        memo[key] = value


def _library_value(graph, name: str, p):
    """Parameter ``p`` (a tensor, or a tuple of its parts) as ``graph`` takes it: in its dtype (a float32
    master cast), parts concatenated where it does not take them apart."""
    dtype = graph.dtypes[name]
    if not isinstance(p, tuple):
        return p.to(dtype)
    p = tuple(q.to(dtype) for q in p)
    return p if name in graph.split else torch.cat(p)


def _bind_parameters(compiled: CompiledLayer, params: list) -> tuple:
    """(:class:`~substation.runtime.library.BoundParameters` of the parameters the forward library reads
    as given, the names of those it needs anew on every call: cast copies, concatenated parts)."""
    graph = compiled.forward
    cast = set(_cast_names(compiled, params))
    anew = tuple(n for n, p in zip(compiled.parameter_names, params)
                 if n in cast or (isinstance(p, tuple) and n not in graph.split))
    return graph.bind({n: p for n, p in zip(compiled.parameter_names, params) if n not in anew}), anew


def _forward_only(key: str, x: torch.Tensor, mask: Optional[torch.Tensor], attend_marks_true: bool,
                  params: list[torch.Tensor], bf16_autocast: bool, param_parts: list[int],
                  memo_key: tuple | None) -> torch.Tensor:
    """Y [B, J, I] of the forward-only build (nothing saved, no dropout; :func:`run_layer`'s arguments).
    ``memo_key``: what :func:`run_layer` checked of the parameters; their binding to the library is kept
    under it (None: bound for this call only)."""
    compiled = _chosen_build(key, bf16_autocast, False, True)
    graph = compiled.forward
    b, j, _ = x.shape
    entry = None if memo_key is None else compiled.bound_parameters.get(memo_key)
    if entry is None:
        entry = _bind_parameters(compiled, _grouped(params, param_parts))  # parts: the Q, K, V weights apart
        if memo_key is not None:
            _remember(compiled.bound_parameters, memo_key, entry)
    bound, anew = entry
    given = {n: _library_value(graph, n, p) for n, p in zip(compiled.parameter_names, _grouped(params, param_parts))
             if n in anew} if anew else {}
    real = None
    if compiled.config.mask != "none":
        # With a padding mask: padded positions are zeros (but left padding's position 0:
        # computed_queries), and padded tokens are not computed where packing saves work (CPU).
        m, real, packed = _inference_packing(mask, attend_marks_true, b, j, _mask_dtype(compiled), compiled.config,
                                             True, x.device.type == "cpu")
        if packed is not None:
            return run_packed(graph, given, x.view(b * j, -1), packed, bound).view(x.shape)
        given["mask"] = m if m is not None else torch.zeros(b, j, dtype=_mask_dtype(compiled), device=x.device)
    y = graph({"X": x, **given}, b, j, bound=bound)["Y"]
    return y if real is None else y.masked_fill_(~computed_queries(real).unsqueeze(-1), 0)


def _layer_forward_impl(key: str, x: torch.Tensor, mask: Optional[torch.Tensor], attend_marks_true: bool,
                   params: list[torch.Tensor], seed: torch.Tensor, training: bool,
                   forward_only: bool, bf16_autocast: bool, param_parts: list[int]) -> list[torch.Tensor]:
    if forward_only:  # without gradients the inference build writes Y alone
        return [_forward_only(key, x, mask, attend_marks_true, params, bf16_autocast, param_parts, None)]
    # with gradients and training=False, no dropout
    compiled = _chosen_build(key, bf16_autocast, training, False)
    b, j, _ = x.shape
    names = compiled.parameter_names
    # float32 master weights of a half-precision build: cast once per call, kept for backward
    cast_names = _cast_names(compiled, params)
    dtypes = compiled.forward.dtypes
    casts = {n: p.to(dtypes[n]) for n, p in zip(names, params) if n in cast_names}
    given = {"X": x, **{n: casts.get(n, p) for n, p in zip(names, params)}}  # stacked: run_layer concatenated
    if compiled.config.mask != "none":
        m, _, _ = _inference_packing(mask, attend_marks_true, b, j, _mask_dtype(compiled), compiled.config, False,
                                     x.device.type == "cpu")
        given["mask"] = m if m is not None else torch.zeros(b, j, dtype=_mask_dtype(compiled), device=x.device)
    out = compiled.forward(given, b, j, int(seed.item()), training)
    return [out[n] for n in compiled.produced_names] + [casts[n] for n in names if n in casts]


_layer_forward = torch.library.custom_op("substation::layer_forward", mutates_args=())(_layer_forward_impl)


def _plain_eager(x: torch.Tensor) -> bool:
    """Whether nothing traces or intercepts this call: eager, a plain tensor (no subclass, no
    ``torch.func`` wrapper), no torch function or dispatch mode, no profiler, no ``torch.compile``,
    ``torch.export`` or ``torch.jit.trace``."""
    return (not torch.compiler.is_compiling() and type(x) is torch.Tensor  # first: dynamo cannot trace the rest
            and not torch._C._functorch.is_functorch_wrapped_tensor(x) and not torch.jit.is_tracing()
            and not torch._C._is_torch_function_mode_enabled() and not is_in_torch_dispatch_mode()
            and not torch._C._autograd._profiler_enabled())


@_layer_forward.register_fake
def _layer_forward_fake(key, x, mask, attend_marks_true, params, seed, training, forward_only, bf16_autocast,
                        param_parts):
    if forward_only:  # shapes without loading the inference build (no tensors may be made here)
        return [x.new_empty(x.shape, dtype=_chosen_build(key, bf16_autocast, True, False).forward.dtypes["Y"])]
    compiled = _chosen_build(key, bf16_autocast, training, False)
    sizes = compiled.config.sizes(x.shape[0], x.shape[1])
    info = {t.name: t for t in compiled.forward.produced}
    dtypes = compiled.forward.dtypes
    cast_names = _cast_names(compiled, params)
    casts = [p.new_empty(p.shape, dtype=dtypes[n]) for n, p in zip(compiled.parameter_names, params)
             if n in cast_names]
    return [x.new_empty(info[n].shape(sizes), dtype=dtypes[n]) for n in compiled.produced_names] + casts


@torch.library.custom_op("substation::layer_backward", mutates_args=())
def _layer_backward(key: str, dy: torch.Tensor, saved: list[torch.Tensor], seed: torch.Tensor,
                    training: bool) -> list[torch.Tensor]:
    compiled = registered_layer(key)
    b, j, _ = dy.shape
    given = dict(zip(compiled.saved_names, saved))
    given["dY"] = dy
    grads = compiled.backward(given, b, j, int(seed.item()), training)
    return [grads["dX"]] + [grads[f"d{n}"] for n in compiled.parameter_names]


@_layer_backward.register_fake
def _layer_backward_fake(key, dy, saved, seed, training):
    compiled = registered_layer(key)
    sizes = compiled.config.sizes(dy.shape[0], dy.shape[1])
    info = {t.name: t for t in compiled.backward.args}
    return [torch.empty_like(dy)] + [dy.new_empty(info[f"d{n}"].shape(sizes), dtype=compiled.backward.dtypes[f"d{n}"])
                                     for n in compiled.parameter_names]


def _layer_setup_context(ctx, inputs, output):
    key, x, _, _, params, seed, training, forward_only, bf16_autocast, _ = inputs
    ctx.forward_only = forward_only
    # only Y's gradient is used: autograd would otherwise fill a zero gradient for every saved output
    ctx.set_materialize_grads(False)
    if forward_only:
        return
    compiled = _chosen_build(key, bf16_autocast, training, False)
    names = compiled.parameter_names
    produced = compiled.produced_names
    cast_names = _cast_names(compiled, params)
    env = {"X": x, **dict(zip(names, params)), **dict(zip(produced, output)),
           **dict(zip(cast_names, output[len(produced):]))}
    ctx.save_for_backward(seed, *(env[n] for n in compiled.saved_names))
    ctx.key, ctx.training = compiled.key, training
    ctx.compiled = compiled  # the registry holds layers weakly: keep this one until backward has run
    ctx.shapes = (x.shape, [p.shape for p in params], x.dtype)


def _layer_grad(ctx, grads):
    if ctx.forward_only:
        raise RuntimeError("this layer call ran forward-only (no gradient was needed when it ran); "
                           "run it with gradients enabled to differentiate it")
    seed, *saved = ctx.saved_tensors
    x_shape, param_shapes, x_dtype = ctx.shapes
    dy = grads[0]
    if dy is None:
        dy = torch.zeros(x_shape, dtype=x_dtype, device=seed.device)
    dx, *dparams = _layer_backward(ctx.key, dy.contiguous().to(x_dtype), saved, seed, ctx.training)
    return None, dx, None, None, [g.view(s) for g, s in zip(dparams, param_shapes)], None, None, None, None, None


torch.library.register_autograd("substation::layer_forward", _layer_grad, setup_context=_layer_setup_context)


def _second_order(ctx, grads):
    raise NotImplementedError("second-order gradients through Substation's layers (backward of a gradient "
                              "taken with create_graph=True, e.g. a gradient penalty or torch.autograd.functional."
                              "hessian) are not implemented; first-order .backward() and torch.autograd.grad work")


torch.library.register_autograd("substation::layer_backward", _second_order,
                                setup_context=lambda ctx, inputs, output: None)


def _autocast_casts(device_type: str, dtype: torch.dtype) -> bool:
    """Whether a layer of ``dtype`` casts float32 inputs and parameters to its dtype: autocast is
    enabled for ``device_type`` and the layer is float16 or bfloat16 (it always computes in its
    compiled dtype)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return False
    return bool(torch.is_autocast_enabled(device_type))


_WARNED: set = set()
#: The seed of calls that draw no dropout (read, never written).
_NO_SEED = torch.zeros(1, dtype=torch.int64)


def _runs_bf16_autocast(compiled: CompiledLayer) -> bool:
    """Whether a call of ``compiled`` runs its bfloat16 build: a float32 CPU build under CPU bf16 autocast
    whose CPU runs bfloat16 builds (else a warning, once per config, says why it stays float32)."""
    if not (compiled.forward.device_type == "cpu" and compiled.config.dtype == "float32"
            and torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16):
        return False
    if compiled.autocast_build is None:
        if compiled.autocast_note and compiled.config.name not in _WARNED:
            _WARNED.add(compiled.config.name)
            warnings.warn(f"torch.autocast(bfloat16) is ignored by Substation's {compiled.config.name} layer: "
                          f"{compiled.autocast_note}", RuntimeWarning, stacklevel=4)
        return False
    return True


def _pieces_with_shapes(compiled: CompiledLayer, params: list) -> list:
    """(name, tensor, the shape it must have) of every parameter and part; a part is named
    ``in_proj_weight part k``. Only a stacked parameter (``in_proj_*``) may come in parts, T of them.

    Raises:
        ValueError: a tuple for another parameter, or not T parts.
    """
    shapes = compiled.parameter_shapes
    stack = int(size_symbol(STACK_LETTER))
    out = []  # a list, not a generator: torch.compile traces this without a graph break
    for n, p in zip(compiled.parameter_names, params):
        if not isinstance(p, tuple):
            out.append((n, p, shapes[n]))
            continue
        stacked = n in compiled.stacked_parameters
        if not stacked or len(p) != stack:
            takes = f" or {stack} parts (Q, K, V)" if stacked else ""
            raise ValueError(f"parameter {n} given as {len(p)} parts; it takes one tensor {list(shapes[n])}{takes}")
        part = (shapes[n][0] // stack, *shapes[n][1:])
        out += [(f"{n} part {k}", q, part) for k, q in enumerate(p)]
    return out


def _parameter_signature(flat: list) -> tuple | None:
    """What :func:`run_layer` checks of each parameter tensor and its library reads: address, dtype,
    shape, device; None if one is no tensor with storage (the full checks then name it), is not
    contiguous or is a lazy negation (``torch._neg_view``): a copy is passed, new on every call."""
    try:
        signature = tuple((p.data_ptr(), p.dtype, p.shape, p.device) for p in flat)
    except (AttributeError, RuntimeError):
        return None
    return signature if all(p.is_contiguous() and not p.is_neg() for p in flat) else None


def _check_parameters(compiled: CompiledLayer, params: list, dtype: torch.dtype, cast: bool, x: torch.Tensor) -> None:
    """:func:`run_layer`'s checks of the parameters (``cast``: float32 masters of a half-precision build
    are accepted, cast inside the operator once per call).

    Raises:
        TypeError, ValueError: as :func:`run_layer` (a parameter named)."""
    device_type = compiled.forward.device_type
    where = "the CPU" if device_type == "cpu" else "CUDA"
    for n, p, shape in _pieces_with_shapes(compiled, params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parameter {n} must be a tensor (or a tuple of its parts), got {type(p).__name__}")
        if p.is_meta:
            raise ValueError(f"parameter {n} is on the meta device (weights not loaded yet): load the weights "
                             f"before running the layer")
        master = cast and p.dtype == torch.float32
        if (p.dtype != dtype and not master) or p.device.type != device_type \
                or (device_type != "cpu" and p.device != x.device):
            raise TypeError(f"parameter {n} is {p.dtype} on {p.device}; the layer was compiled for "
                            f"{dtype} on {where}" + ("" if device_type == "cpu" else f" ({x.device})"))
        if tuple(p.shape) != shape:
            raise ValueError(f"parameter {n} has shape {tuple(p.shape)}; this layer takes {list(shape)}")


def run_layer(compiled: CompiledLayer, hidden_states: torch.Tensor, params: "list[torch.Tensor]",
              training: bool, attention_mask: torch.Tensor | None = None,
              key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Run a compiled layer on ``hidden_states`` [B, J, I] with ``params`` (in
    :func:`~substation.runtime.parameter_names` order for its config, PyTorch's shapes) through the
    ``substation::layer_forward`` operator; differentiable in the input and every parameter (the backward
    library runs in ``substation::layer_backward``). A stacked parameter may be given as a tuple of its
    parts along dim 0 (``in_proj_weight`` as the Q, K, V weights [I, I] each, as a Hugging Face layer
    holds them): a call that needs no gradient hands them to the inference library apart (no copy); any
    other call concatenates them (differentiably).

    ``attention_mask`` follows Hugging Face: a float tensor is additive (``[B, K]``, ``[B, 1, 1, K]``
    or ``[B, 1, J, K]`` whose rows are equal); a bool or integer tensor marks keys to attend with
    True/1. ``key_padding_mask`` follows PyTorch: bool ``[B, K]``, True marks padding. Boolean masks
    become 0 / -inf. ``training`` with a dropout probability > 0 draws a fresh seed from PyTorch's
    generator (so ``torch.manual_seed`` and checkpoint recomputation reproduce the dropout masks).
    A call that needs no gradient (``torch.no_grad``, ``torch.inference_mode``, or neither the input
    nor a parameter requires grad) and draws no dropout runs the forward-only inference build
    (:meth:`~substation.runtime.CompiledLayer.forward_only`: nothing saved, no dropout kernels).
    The parameters' checks, and in such a call their binding to the library, are done once per set of
    tensors (each one's address, dtype, shape and device;
    :attr:`~substation.runtime.CompiledLayer.checked_parameters`): a parameter replaced or re-typed is
    checked again, one changed in place is read as it is now.

    Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` a float32 CPU layer runs its bfloat16 build
    (:meth:`~substation.runtime.CompiledLayer.for_autocast`); a half-precision layer under autocast takes
    float32 inputs and float32 (master) parameters, cast inside the operator once per call (the copies
    are kept for backward; parameter gradients reach the float32 parameters). Under autocast a CPU layer
    returns the input's dtype (float32 or bfloat16) and a CUDA one float32 when its parameters are
    float32, as Hugging Face's ``BertLayer`` does there. An empty batch or sequence (B = 0 or J = 0)
    returns an empty [B, J, I] output (after the same checks) and gives the parameters zero gradients.

    Raises:
        TypeError: not a tensor, the wrong dtype (input or parameters), parameters on another device.
        ValueError: wrong rank or hidden size, the wrong device type (CPU vs CUDA), the wrong number of
            parameters, the input or parameters on the meta device (not yet loaded), or a bad mask (see
            :func:`check_mask`).
        NotImplementedError: forward-mode AD (a tangent on the input, a mask or a parameter); a mask
            that requires grad.
    """
    x = hidden_states
    if torch.jit.is_tracing():  # the traced module names the layer by key only and may outlive it
        pin_layer(compiled)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"hidden_states must be a torch.Tensor, got {type(x).__name__}")
    masks = (attention_mask, key_padding_mask)
    if fwAD._current_level >= 0 and any(
            isinstance(t, torch.Tensor) and fwAD.unpack_dual(t).tangent is not None
            for t in (x, *masks, *(q for p in params for q in (p if isinstance(p, tuple) else (p,))))):
        raise NotImplementedError("forward-mode AD (torch.func.jvp, jacfwd, torch.autograd.forward_ad) is not "
                                  "implemented for Substation's layers; use reverse mode (.backward(), "
                                  "torch.autograd.grad)")
    if torch.is_grad_enabled() and any(isinstance(m, torch.Tensor) and m.requires_grad for m in masks):
        raise NotImplementedError("the attention mask requires grad; Substation's layers differentiate with "
                                  "respect to the input and the parameters only (pass mask.detach())")
    bf16_autocast = _runs_bf16_autocast(compiled)
    config = compiled.config
    dtype = torch.bfloat16 if bf16_autocast else compiled.forward.dtype
    if x.dim() != 3 or x.shape[-1] != config.hidden_size:
        one = " (one sequence: pass hidden_states[None])" if x.dim() == 2 else ""
        raise ValueError(f"hidden_states must have shape [B, J, I] with I = {config.hidden_size}; "
                         f"got {tuple(x.shape)}{one}")
    device_type = compiled.forward.device_type
    where = "the CPU" if device_type == "cpu" else "CUDA"
    if x.device.type != device_type:
        if x.is_meta:
            raise ValueError("hidden_states is on the meta device: the model's weights are not loaded yet "
                             "(a model made under torch.device('meta') runs once they are, e.g. after "
                             "load_state_dict(..., assign=True))")
        if device_type == "cuda" and not torch.cuda.is_available():
            hint = ("; this process has no CUDA device (torch.cuda.is_available() is False): compile for "
                    "target cpu to run here")
        else:
            hint = "" if device_type == "cpu" else " (move the layer and its inputs with .cuda())"
        raise ValueError(f"this layer was compiled for {where}; hidden_states is on {x.device}{hint}")
    cast = bf16_autocast or _autocast_casts(x.device.type, dtype)
    if x.dtype != dtype:
        if not (cast and x.dtype == torch.float32):
            if bf16_autocast:
                raise TypeError(f"hidden_states has dtype {x.dtype}; under bf16 autocast this float32 layer runs its "
                                f"bfloat16 build, which takes float32 or bfloat16 input")
            raise TypeError(f"hidden_states has dtype {x.dtype} but the layer was compiled for {dtype}")
    input_dtype = x.dtype
    # Mixed-precision builds take X in float32 (their residual stream, as autocast keeps it).
    x = x.to(ALL_TORCH_DTYPES[boundary_dtype(DTYPE_NAMES[dtype], config.target)])
    names = compiled.parameter_names
    if len(params) != len(names):
        raise ValueError(f"the layer takes {len(names)} parameters ({', '.join(names)}), got {len(params)}")
    parts = [len(p) if isinstance(p, tuple) else 1 for p in params]
    flat = [q for p in params for q in (p if isinstance(p, tuple) else (p,))]
    # The same parameter tensors come call after call: what is checked of them is remembered.
    # (not while torch.compile traces this: its guards would then follow the memo, which every call changes)
    memo_key = None if torch.compiler.is_compiling() else _parameter_signature(flat)
    if memo_key is not None:
        memo_key = (memo_key, tuple(parts), dtype, cast, x.device)
    if memo_key is None or memo_key not in compiled.checked_parameters:
        _check_parameters(compiled, params, dtype, cast, x)
        if memo_key is not None:
            _remember(compiled.checked_parameters, memo_key)
    b, j, _ = x.shape
    if attention_mask is not None and key_padding_mask is not None:
        raise ValueError("pass either attention_mask or key_padding_mask, not both")
    mask, what = (attention_mask, "attention_mask") if key_padding_mask is None else (key_padding_mask, "key_padding_mask")
    if mask is not None:
        check_mask(mask, b, j, x.device, config, what, padding_only=key_padding_mask is not None)
    # Under autocast the output has the dtype Hugging Face's layer gives there: on the CPU the input's
    # (CPU autocast leaves the residual add and layer norm in their inputs' dtype), on CUDA float32 when
    # the parameters are float32 masters (CUDA autocast runs layer norm in float32).
    out_dtype = dtype
    if cast:
        out_dtype = input_dtype if device_type == "cpu" else (
            torch.float32 if flat and all(p.dtype == torch.float32 for p in flat) else dtype)
    if b == 0 or j == 0:  # nothing to compute: an empty output; the parameters get zero gradients, as in PyTorch
        return sum((p.flatten()[:0].sum() for p in flat), x.to(out_dtype).clone())
    training = training and any(v > 0 for v in config.dropout.probabilities())
    seed = torch.randint(0, 2 ** 62, (1,)) if training else _NO_SEED
    # torch.jit.trace records the choice as a constant and checks it under no_grad: a traced call
    # always runs the training build (correct with or without gradients).
    needs_grad = torch.jit.is_tracing() or (
        torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in flat)))
    forward_only = not needs_grad and not training
    if not forward_only and max(parts, default=1) > 1:  # autograd sees one stacked parameter
        flat = [torch.cat(p) if isinstance(p, tuple) else p for p in params]
        parts = [1] * len(params)
    if memo_key is None:  # else every parameter is contiguous, without a lazy negation
        flat = [(p if p.is_contiguous() else p.contiguous()).resolve_neg() for p in flat]
    x = x.contiguous().resolve_neg()  # the library reads the bytes
    if forward_only and _plain_eager(x):
        # An eager call that needs no gradient skips the operator's dispatch (about 50 us, 5% of a 1 x 24
        # MiniLM forward): nothing records it and autograd has nothing to do. Its parameters' binding to
        # the library is remembered.
        return _forward_only(compiled.key, x, mask, key_padding_mask is None, flat, bf16_autocast, parts,
                             memo_key).to(out_dtype)
    outputs = _layer_forward(compiled.key, x, mask, key_padding_mask is None, flat, seed, training, forward_only,
                             bf16_autocast, parts)
    return outputs[0].to(out_dtype)


def run_layer_varlen(compiled: CompiledLayer, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
                     params: "list[torch.Tensor]", training: bool) -> torch.Tensor:
    """Run a compiled layer on packed variable-length sequences (FlashAttention's varlen convention):
    ``hidden_states`` [N, I] holds sequence b in rows ``cu_seqlens[b]:cu_seqlens[b+1]``; each sequence
    attends only to its own tokens.

    The sequences run in groups of similar length (:func:`substation.runtime.packing.plan_groups`), each
    group one :func:`run_layer` call on an [n, L] block (shorter sequences padded there with masked keys;
    a layer compiled with ``mask: none`` groups equal lengths only). Differentiable in the input and every
    parameter; dropout, autocast and the forward-only build as in :func:`run_layer`.

    Args:
        compiled: the layer. hidden_states: [N, I] of the layer's dtype. cu_seqlens: integer [B + 1]
            offsets (0, ..., N), on the CPU or the input's device. params: as for :func:`run_layer`.
        training: the module's training flag.

    Returns:
        [N, I], the output of every token.

    Raises:
        TypeError: not a tensor, a float cu_seqlens. ValueError: hidden_states not [N, I] with the
            layer's I, or bad offsets (see :func:`~substation.runtime.packing.pack_cu_seqlens`); the
            checks of :func:`run_layer`.
    """
    x = hidden_states
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"hidden_states must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2 or x.shape[1] != compiled.config.hidden_size:
        raise ValueError(f"packed hidden_states must have shape [N, I] with I = {compiled.config.hidden_size}; "
                         f"got {tuple(x.shape)}")
    packed = pack_cu_seqlens(cu_seqlens, x.shape[0], compiled.config)
    if not packed.groups:  # N = 0: run_layer's checks, an empty output, zero parameter gradients
        return run_layer(compiled, x.view(1, 0, x.shape[1]), params, training).flatten(0, 1)
    gather = packed.gather.to(x.device)
    outputs = []
    for g in packed.groups:
        rows = gather[g.start:g.start + g.batch * g.seq]
        xg = x.index_select(0, rows).view(g.batch, g.seq, -1)
        mask = g.key_mask(_mask_dtype(compiled)).to(x.device) if g.padded else None
        outputs.append(run_layer(compiled, xg, params, training, attention_mask=mask).flatten(0, 1))
    real = packed.destination >= 0  # every row is a real token; padding slots are not read back
    slot_of = torch.empty(packed.rows, dtype=torch.int64)
    slot_of[packed.destination[real]] = torch.nonzero(real).flatten()
    return torch.cat(outputs).index_select(0, slot_of.to(x.device))
