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
from .library import ALL_TORCH_DTYPES, DTYPE_NAMES, CompiledLayer, pin_layer, registered_layer
from .packing import computed_queries, pack_cu_seqlens, pack_key_mask, real_tokens, run_packed

__all__ = ["check_mask", "check_mask_values", "key_mask", "mask_differs", "run_layer", "run_layer_varlen"]


def _mask_dtype(compiled: CompiledLayer) -> torch.dtype:
    return compiled.forward.dtypes.get("mask", compiled.forward.dtype)


def _differs_along(mask: torch.Tensor, dim: int) -> bool:
    """Whether ``mask`` holds different values along ``dim`` (a NaN counts as different): its maximum
    and minimum along ``dim`` disagree somewhere. Two reductions, no [B, H, J, K] temporary (a
    comparison with the first row took 3x the time on Hugging Face's [B, 1, J, K] masks)."""
    if mask.shape[dim] == 1 or mask.stride(dim) == 0 or mask.numel() == 0:
        return False
    return not bool((mask.amax(dim) == mask.amin(dim)).all())


def queries_differ(mask: torch.Tensor) -> bool:
    """Whether a ``[B, H, J, K]`` mask's rows differ between queries j (reads the data)."""
    return _differs_along(mask, 2)


def heads_differ(mask: torch.Tensor) -> bool:
    """Whether a ``[B, H, J, K]`` mask differs between heads h (reads the data)."""
    return _differs_along(mask, 1)


def mask_differs(mask: torch.Tensor) -> str | None:
    """What a ``[B, H, J, K]`` mask differs between, ``"heads"`` or ``"queries"``, or None when it is a key
    mask (every head and query row equal; reads the data)."""
    for differs, what in ((heads_differ, "heads"), (queries_differ, "queries")):
        if differs(mask):
            return what
    return None


def check_mask_values(mask: torch.Tensor) -> None:
    """Refuse a float (additive) mask holding NaN or +inf, and an integer mask holding other values than
    0 and 1 (reads the data).

    Raises:
        ValueError: NaN or +inf in a float ``mask`` (every score it touches would be NaN); an integer
            value other than 0 or 1 (an additive mask stored as integers would be read as keys to attend).
    """
    if not mask.numel() or mask.dtype == torch.bool:
        return
    if mask.is_floating_point():
        if not bool(mask.max() < float("inf")):  # NaN if any: max propagates it
            raise ValueError("the float (additive) attention mask holds NaN or +inf; masked keys take -inf or a "
                             "large negative value, attended keys 0")
        return
    low, high = (int(v) for v in torch.aminmax(mask))
    if low < 0 or high > 1:
        raise ValueError(f"the integer attention mask holds values from {low} to {high}; integer and bool masks "
                         f"hold 1 (attend) and 0 (masked) only; pass an additive mask (0 = attend, -inf or a "
                         f"large negative value = masked) as a float tensor")


def key_mask(mask: torch.Tensor | None, attend_marks_true: bool, batch: int, seq: int,
             dtype: torch.dtype) -> torch.Tensor | None:
    """The additive key mask ``[B, K]`` of ``dtype`` (0 = attend, -inf or the given value = masked) that
    the compiled code reads, from a mask whose shape :func:`check_mask` accepted.

    A bool or integer mask marks keys to attend (``attend_marks_true``, Hugging Face) or padding
    (PyTorch's ``key_padding_mask``); a float mask is additive, its finite values clamped to the range
    of ``dtype`` (float32's minimum, Hugging Face's mask value, stays finite in bfloat16, so a row
    masked with it everywhere still attends uniformly, as in PyTorch). A 4-D ``[B, H, J, K]`` mask must be
    the same for every head h and query j; it is reduced to its first row (checked here, on the data:
    this runs inside the custom operator, so it is no data-dependent branch for ``torch.compile``).

    Raises:
        ValueError: a ``[B, H, J, K]`` mask that differs between heads or queries; a float mask holding
        NaN or +inf (every score it touches would be NaN).
    """
    if mask is None:
        return None
    check_mask_values(mask)
    if mask.dim() == 4:
        what = mask_differs(mask)
        if what is not None:
            raise ValueError(f"attention_mask [B, H, J, K] differs between {what}; Substation's layer takes "
                             f"key masks only (and mask: causal in the config); a Hugging Face drop-in "
                             f"falls back to its own forward for such masks in eager mode, not under "
                             f"torch.compile")
        mask = mask[:, 0, 0, :]
    mask = mask.expand(batch, seq)
    if mask.dtype == torch.bool or not mask.is_floating_point():
        attend = mask.bool() if attend_marks_true else ~mask.bool()
        return torch.zeros(batch, seq, dtype=dtype, device=mask.device).masked_fill_(~attend, float("-inf"))
    if mask.dtype != dtype and torch.finfo(dtype).max < torch.finfo(mask.dtype).max:
        low = torch.finfo(dtype)
        mask = torch.where(mask.isinf(), mask, mask.clamp(low.min, low.max))
    return mask.to(dtype).contiguous()


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


def _library_params(graph, names: list[str], params: list) -> dict:
    """Parameters by name as ``graph`` takes them: parts kept where it takes them apart
    (:attr:`~substation.runtime.CompiledGraph.split`), concatenated elsewhere."""
    return {n: torch.cat(p) if isinstance(p, tuple) and n not in graph.split else p for n, p in zip(names, params)}


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


def _layer_forward_impl(key: str, x: torch.Tensor, mask: Optional[torch.Tensor], attend_marks_true: bool,
                   params: list[torch.Tensor], seed: torch.Tensor, training: bool,
                   forward_only: bool, bf16_autocast: bool, param_parts: list[int]) -> list[torch.Tensor]:
    # without gradients the inference build writes Y alone; with them and training=False, no dropout
    compiled = _chosen_build(key, bf16_autocast, training, forward_only)
    b, j, _ = x.shape
    names = compiled.parameter_names
    params = _grouped(params, param_parts)  # parts (forward-only calls only): the Q, K, V weights apart
    # float32 master weights of a half-precision build: cast once per call, kept for backward
    cast_names = _cast_names(compiled, params)
    dtypes = compiled.forward.dtypes
    casts = {n: tuple(q.to(dtypes[n]) for q in p) if isinstance(p, tuple) else p.to(dtypes[n])
             for n, p in zip(names, params) if n in cast_names}
    given = {"X": x, **_library_params(compiled.forward, names, [casts.get(n, p) for n, p in zip(names, params)])}
    real = None
    if compiled.config.mask != "none":
        # Inference with a padding mask: padded positions are zeros (but left padding's position 0:
        # computed_queries), and padded tokens are not computed where packing saves work (CPU).
        m, real, packed = _inference_packing(mask, attend_marks_true, b, j, _mask_dtype(compiled), compiled.config,
                                             forward_only, x.device.type == "cpu")
        if packed is not None:
            given.pop("X")
            return [run_packed(compiled.forward, given, x.view(b * j, -1), packed).view(x.shape)]
        given["mask"] = m if m is not None else torch.zeros(b, j, dtype=_mask_dtype(compiled), device=x.device)
    out = compiled.forward(given, b, j, int(seed.item()), training)
    if forward_only:
        return [out["Y"] if real is None else out["Y"].masked_fill_(~computed_queries(real).unsqueeze(-1), 0)]
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


def check_mask(mask: torch.Tensor, batch: int, seq: int, device: torch.device, config: EncoderConfig,
               what: str, padding_only: bool = False) -> None:
    """Check a mask's shape, dtype and device (no data is read, so this traces without a graph break).

    Accepted shapes: ``[B, K]`` and 4-D ``[B, H, J, K]`` (B, H and J may also be 1, broadcast; the
    operator reduces a 4-D mask to its key mask after checking that its heads and rows agree). With
    ``padding_only`` (PyTorch's ``key_padding_mask``): a bool ``[B, K]`` mask only (B may be 1).

    Raises:
        ValueError: a layer compiled with ``mask: none``, the wrong device type, the wrong shape.
        TypeError: not a tensor, or an unsupported dtype.
    """
    if config.mask == "none":
        raise ValueError("this layer was compiled with mask: none; compile with mask: padding to pass a mask")
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{what} must be None or a tensor, got {type(mask).__name__}")
    if mask.device.type != device.type:
        raise ValueError(f"the mask must be on the {'CPU' if device.type == 'cpu' else device.type.upper()} "
                         f"like hidden_states, got device {mask.device}")
    shape = tuple(mask.shape)
    if padding_only:
        if mask.dtype != torch.bool:
            raise TypeError(f"{what} must be a bool tensor [B, K] (True = padding), got {mask.dtype}")
        if len(shape) != 2 or shape[0] not in (1, batch) or shape[1] != seq:
            raise ValueError(f"{what} must have shape [B, K] = [{batch}, {seq}] (or [1, K]), got {shape}")
        return
    if mask.is_complex() or mask.is_quantized:
        raise TypeError(f"{what} has dtype {mask.dtype}; give a bool or integer mask (1 or True = attend) or "
                        f"a floating additive one (0 = attend, -inf = masked)")
    heads = config.num_heads
    ok = (len(shape) == 2 and shape[0] in (1, batch) and shape[1] == seq) or \
         (len(shape) == 4 and shape[0] in (1, batch) and shape[1] in (1, heads) and shape[2] in (1, seq)
          and shape[3] == seq)
    if not ok:
        raise ValueError(f"{what} must have shape [B, K] = [{batch}, {seq}], [B, 1, 1, K], [B, 1, J, K] or "
                         f"[B, H, J, K] with H = {heads}; got {shape}")


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
        raise ValueError(f"hidden_states must have shape [B, J, I] with I = {config.hidden_size}; got {tuple(x.shape)}")
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
    for n, p, shape in _pieces_with_shapes(compiled, params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parameter {n} must be a tensor (or a tuple of its parts), got {type(p).__name__}")
        if p.is_meta:
            raise ValueError(f"parameter {n} is on the meta device (weights not loaded yet): load the weights "
                             f"before running the layer")
        master = cast and p.dtype == torch.float32  # cast inside the operator, once per call
        if (p.dtype != dtype and not master) or p.device.type != device_type \
                or (device_type != "cpu" and p.device != x.device):
            raise TypeError(f"parameter {n} is {p.dtype} on {p.device}; the layer was compiled for "
                            f"{dtype} on {where}" + ("" if device_type == "cpu" else f" ({x.device})"))
        if tuple(p.shape) != shape:
            raise ValueError(f"parameter {n} has shape {tuple(p.shape)}; this layer takes {list(shape)}")
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
    # An eager call that needs no gradient skips the operator's dispatch (about 50 us, 5% of a 1 x 24
    # MiniLM forward): nothing records it and autograd has nothing to do.
    op = _layer_forward_impl if forward_only and _plain_eager(x) else _layer_forward
    outputs = op(compiled.key, x.contiguous(), mask, key_padding_mask is None,
                             [p if p.is_contiguous() else p.contiguous() for p in flat], seed, training,
                             forward_only, bf16_autocast, parts)
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
