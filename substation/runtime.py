"""The PyTorch binding: compiled forward/backward libraries behind the ``substation::layer_forward`` /
``layer_backward`` custom operators and :class:`EncoderLayer`, an ``nn.Module`` with PyTorch's parameter
shapes."""
from __future__ import annotations

import copy
import ctypes
import dataclasses
import os
import threading
from typing import Optional

import torch
from torch import nn

from .config import CUDA_DTYPES, DTYPES, EncoderConfig
from .ir.graph import LayerGraph, TensorInfo, parameters
from .reference import init_parameters

__all__ = ["CompiledGraph", "CompiledLayer", "EncoderLayer", "PARAMETER_NAMES", "TORCH_DTYPES", "check_mask", "key_mask",
           "parameter_names", "run_layer"]

TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64}
#: Every config dtype, including target cuda's half precisions (TORCH_DTYPES: the CPU's).
ALL_TORCH_DTYPES = {**TORCH_DTYPES, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: torch dtype -> config dtype name.
DTYPE_NAMES = {v: k for k, v in ALL_TORCH_DTYPES.items()}


def parameter_names(config: EncoderConfig) -> tuple[str, ...]:
    """The layer's parameters in the order the operators take them (names of torch.nn.TransformerEncoderLayer;
    ``norm_type: rms_norm`` has no ``norm1_bias`` / ``norm2_bias``): :func:`substation.ir.graph.parameters`."""
    return tuple(parameters(config))


#: :func:`parameter_names` of a layer-norm layer (the default ``norm_type``).
PARAMETER_NAMES = parameter_names(EncoderConfig())

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory instead of returning it to the OS (process-wide).

    The tensors a layer saves for backward are freed after every step; when glibc unmaps them, the
    next step page-faults on fresh pages (about 2,900 faults per BERT-base step here, 300 with this
    setting). Called once when the first :class:`CompiledGraph` loads, unless the environment sets
    ``SUBSTATION_MALLOC_TUNING=0``; it affects PyTorch eager in the same process alike.

    Returns:
        True if the settings were applied (glibc found and tuning not disabled).
    """
    if os.environ.get("SUBSTATION_MALLOC_TUNING", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30) and libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1))


class CompiledGraph:
    """One loaded library of a :class:`LayerGraph`, callable on torch tensors.

    Raises:
        RuntimeError: the library's argument signature does not match the graph (a stale or foreign build).
    """

    _malloc_tuned = False

    def __init__(self, graph: LayerGraph, path: str):
        if not CompiledGraph._malloc_tuned:
            CompiledGraph._malloc_tuned = True
            keep_freed_memory()
        self.graph = graph
        self.path = path
        self.lib = ctypes.CDLL(path)
        self.args: list[TensorInfo] = [t for t in graph.tensors.values() if t.role != "temp"]
        self.lib.substation_signature.restype = ctypes.c_char_p
        sig = self.lib.substation_signature().decode()
        if sig != ",".join(t.name for t in self.args):
            raise RuntimeError(f"library {path} does not match the {graph.phase} graph (signature {sig!r})")
        target = getattr(self.lib, "substation_target", None)
        if target is not None:
            target.restype = ctypes.c_char_p
        #: ``cpu``, ``cuda`` (codegen_cuda) or ``cuda-emulated`` (CUDA code built to run on the CPU, for tests).
        self.target = target().decode() if target is not None else "cpu"
        #: Device type of the tensors the library reads and writes.
        self.device_type = "cuda" if self.target == "cuda" else "cpu"
        self._stream_arg = () if self.target == "cpu" else (None,)
        self._run = self.lib.substation_run
        self._run.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int64), ctypes.c_void_p,
                              ctypes.c_uint64, ctypes.c_int32] + ([ctypes.c_void_p] if self._stream_arg else [])
        self._run.restype = ctypes.c_int
        self._ws = self.lib.substation_workspace_bytes
        self._ws.argtypes = [ctypes.POINTER(ctypes.c_int64)]
        self._ws.restype = ctypes.c_int64
        self.dtype = ALL_TORCH_DTYPES[graph.config.dtype]
        #: dtype of each argument tensor (normalization statistics: float64 on the CPU, the compute type in CUDA).
        if self.target == "cpu":
            from .backends.cpu.codegen import tensor_dtypes
        else:
            from .backends.cuda.codegen import tensor_dtypes
        dtypes = tensor_dtypes(graph)
        self.dtypes = {t.name: ALL_TORCH_DTYPES[dtypes[t.name]] for t in self.args}
        # Temporaries live only during a call: one workspace is reused (fresh pages would fault
        # on every call); a concurrent call from another thread gets its own.
        self._workspace = torch.empty(0, dtype=torch.uint8)
        self._workspace_lock = threading.Lock()
        self.instrumented = hasattr(self.lib, "substation_op_names")
        if self.instrumented:
            self.lib.substation_op_names.restype = ctypes.c_char_p
            self.op_names = self.lib.substation_op_names().decode().split(",")
        self.produced = [t for t in self.args if t.role in ("output", "saved") and t.name in self._written()]

    def op_seconds(self, reset: bool = True) -> dict[str, float]:
        """Seconds spent in each operator since the last reset (instrumented builds only).

        Raises:
            RuntimeError: the library was built without ``instrument=True``.
        """
        if not self.instrumented:
            raise RuntimeError("this library was built without per-operator timers (instrument=True)")
        out = (ctypes.c_double * len(self.op_names))()
        self.lib.substation_op_seconds(out, int(reset))
        return dict(zip(self.op_names, out))

    def _written(self) -> set[str]:
        names = set()
        for op in self.graph.operators():
            names.update(t for t, _ in self.graph.outputs_of(op).values())
        return names

    def __call__(self, given: dict[str, torch.Tensor], batch: int, seq: int, seed: int = 0,
                 training: bool = False) -> dict[str, torch.Tensor]:
        """Run the graph. ``given`` maps every input, parameter and (backward) saved tensor name to a
        contiguous tensor of the graph's dtype (:attr:`dtypes`) on :attr:`device_type` (CUDA: all on
        one device); returns the tensors the graph writes (outputs and forward-saved tensors), freshly
        allocated. A CUDA library queues its work on PyTorch's current stream of that device.

        Raises:
            ValueError: CUDA tensors on different devices. RuntimeError: the library failed."""
        sizes = self.graph.config.sizes(batch, seq)
        device = torch.device("cpu")
        if self.device_type == "cuda":
            device = next(iter(given.values())).device
            bad = sorted(n for n, v in given.items() if v.device != device)
            if bad:
                raise ValueError(f"tensors {', '.join(bad)} are not on {device}")
        produced = {t.name: torch.empty(t.shape(sizes), dtype=self.dtypes[t.name], device=device)
                    for t in self.produced}
        tensors = {**given, **produced}
        ptrs = (ctypes.c_void_p * len(self.args))(*(tensors[t.name].data_ptr() for t in self.args))
        dims = (ctypes.c_int64 * 3)(batch, seq, seq)
        need = self._ws(dims)
        if self.device_type == "cuda":
            # A fresh workspace from PyTorch's caching allocator: stream-ordered, safe across streams.
            with torch.cuda.device(device):
                ws = torch.empty(max(need, 1), dtype=torch.uint8, device=device)
                stream = torch.cuda.current_stream(device).cuda_stream
                rc = self._run(ptrs, dims, ws.data_ptr(), seed & 0xFFFFFFFFFFFFFFFF, int(training), stream)
        elif self._workspace_lock.acquire(blocking=False):
            try:
                if self._workspace.numel() < need:
                    self._workspace = torch.empty(need, dtype=torch.uint8)
                rc = self._run(ptrs, dims, self._workspace.data_ptr(), seed & 0xFFFFFFFFFFFFFFFF, int(training),
                               *self._stream_arg)
            finally:
                self._workspace_lock.release()
        else:
            ws = torch.empty(need, dtype=torch.uint8)
            rc = self._run(ptrs, dims, ws.data_ptr(), seed & 0xFFFFFFFFFFFFFFFF, int(training), *self._stream_arg)
        if rc != 0:
            detail = ""
            if hasattr(self.lib, "substation_last_error"):
                self.lib.substation_last_error.restype = ctypes.c_char_p
                detail = ": " + self.lib.substation_last_error().decode(errors="replace")
            raise RuntimeError(f"{self.graph.phase} library returned error code {rc}{detail}")
        return produced


@dataclasses.dataclass
class CompiledLayer:
    """The compiled forward and backward graphs of one config plus build facts.

    Attributes:
        config: the encoder config.
        forward, backward: the loaded graphs.
        build_seconds: compile time of each library (0 when it came from the cache).
        sources: generated C++ source of each graph.
        options: the keyword arguments of :func:`substation.pipeline.compile_layer` that produced it
            (``fuse``, ``layout``, ``instrument``), so it can be rebuilt (e.g. after unpickling).
    """

    config: EncoderConfig
    forward: CompiledGraph
    backward: CompiledGraph
    build_seconds: dict
    sources: dict
    options: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.key = _register(self)

    @property
    def saved_names(self) -> list[str]:
        """Tensors the backward graph reads besides dY: forward tensors and parameters."""
        return [t.name for t in self.backward.args if t.role in ("saved", "param")]

    @property
    def produced_names(self) -> list[str]:
        """Tensors the forward library writes: ``Y`` first, then those saved for backward."""
        names = [t.name for t in self.forward.produced]
        return ["Y"] + [n for n in names if n != "Y"]



# ----------------------------------------------------------------------------------------------------------------
# The compiled layer as a PyTorch custom operator (torch.library): opaque to torch.compile, torch.export and
# torch.jit.trace, with a fake implementation for shapes and a registered backward. Operators reach their
# libraries through a per-process registry key (a string), since an operator takes no Python objects.

_REGISTRY: dict[str, CompiledLayer] = {}
_REGISTRY_LOCK = threading.Lock()


def _register(compiled: CompiledLayer) -> str:
    with _REGISTRY_LOCK:
        key = f"{compiled.config.name}#{len(_REGISTRY)}"
        _REGISTRY[key] = compiled
    return key


def _mask_dtype(compiled: CompiledLayer) -> torch.dtype:
    return compiled.forward.dtypes.get("mask", compiled.forward.dtype)


def key_mask(mask: torch.Tensor | None, attend_marks_true: bool, batch: int, seq: int,
             dtype: torch.dtype) -> torch.Tensor | None:
    """The additive key mask ``[B, K]`` of ``dtype`` (0 = attend, -inf or the given value = masked) that
    the compiled code reads, from a mask whose shape :func:`check_mask` accepted.

    A bool or integer mask marks keys to attend (``attend_marks_true``, Hugging Face) or padding
    (PyTorch's ``key_padding_mask``); a float mask is additive. A 4-D ``[B, 1, J, K]`` mask must be
    the same for every query j; it is reduced to its first row (checked here, on the data: this runs
    inside the custom operator, so it is no data-dependent branch for ``torch.compile``).

    Raises:
        ValueError: a ``[B, 1, J, K]`` mask whose rows differ between queries.
    """
    if mask is None:
        return None
    if mask.dim() == 4:
        if mask.shape[2] > 1 and mask.stride(2) != 0 and not bool((mask == mask[:, :, :1, :]).all()):
            raise ValueError("attention_mask [B, 1, J, K] differs between queries; only key masks "
                             "(and mask: causal in the config) are supported")
        mask = mask[:, 0, 0, :]
    mask = mask.expand(batch, seq)
    if mask.dtype == torch.bool or not mask.is_floating_point():
        attend = mask.bool() if attend_marks_true else ~mask.bool()
        return torch.zeros(batch, seq, dtype=dtype, device=mask.device).masked_fill_(~attend, float("-inf"))
    return mask.to(dtype).contiguous()


@torch.library.custom_op("substation::layer_forward", mutates_args=())
def _layer_forward(key: str, x: torch.Tensor, mask: Optional[torch.Tensor], attend_marks_true: bool,
                   params: list[torch.Tensor], seed: torch.Tensor, training: bool) -> list[torch.Tensor]:
    compiled = _REGISTRY[key]
    b, j, _ = x.shape
    given = {"X": x, **dict(zip(parameter_names(compiled.config), params))}
    if compiled.config.mask != "none":
        m = key_mask(mask, attend_marks_true, b, j, _mask_dtype(compiled))
        given["mask"] = m if m is not None else torch.zeros(b, j, dtype=_mask_dtype(compiled), device=x.device)
    out = compiled.forward(given, b, j, int(seed.item()), training)
    return [out[n] for n in compiled.produced_names]


@_layer_forward.register_fake
def _layer_forward_fake(key, x, mask, attend_marks_true, params, seed, training):
    compiled = _REGISTRY[key]
    sizes = compiled.config.sizes(x.shape[0], x.shape[1])
    info = {t.name: t for t in compiled.forward.produced}
    return [x.new_empty(info[n].shape(sizes), dtype=compiled.forward.dtypes[n]) for n in compiled.produced_names]


@torch.library.custom_op("substation::layer_backward", mutates_args=())
def _layer_backward(key: str, dy: torch.Tensor, saved: list[torch.Tensor], seed: torch.Tensor,
                    training: bool) -> list[torch.Tensor]:
    compiled = _REGISTRY[key]
    b, j, _ = dy.shape
    given = dict(zip(compiled.saved_names, saved))
    given["dY"] = dy
    grads = compiled.backward(given, b, j, int(seed.item()), training)
    return [grads["dX"]] + [grads[f"d{n}"] for n in parameter_names(compiled.config)]


@_layer_backward.register_fake
def _layer_backward_fake(key, dy, saved, seed, training):
    compiled = _REGISTRY[key]
    sizes = compiled.config.sizes(dy.shape[0], dy.shape[1])
    info = {t.name: t for t in compiled.backward.args}
    return [torch.empty_like(dy)] + [dy.new_empty(info[f"d{n}"].shape(sizes), dtype=compiled.backward.dtypes[f"d{n}"])
                                     for n in parameter_names(compiled.config)]


def _layer_setup_context(ctx, inputs, output):
    key, x, _, _, params, seed, training = inputs
    compiled = _REGISTRY[key]
    env = {"X": x, **dict(zip(parameter_names(compiled.config), params)), **dict(zip(compiled.produced_names, output))}
    ctx.save_for_backward(seed, *(env[n] for n in compiled.saved_names))
    ctx.key, ctx.training = key, training
    ctx.shapes = (x.shape, [p.shape for p in params], x.dtype)


def _layer_grad(ctx, grads):
    seed, *saved = ctx.saved_tensors
    x_shape, param_shapes, x_dtype = ctx.shapes
    dy = grads[0]
    if dy is None:
        dy = torch.zeros(x_shape, dtype=x_dtype, device=seed.device)
    dx, *dparams = _layer_backward(ctx.key, dy.contiguous().to(x_dtype), saved, seed, ctx.training)
    return None, dx, None, None, [g.view(s) for g, s in zip(dparams, param_shapes)], None, None


torch.library.register_autograd("substation::layer_forward", _layer_grad, setup_context=_layer_setup_context)


def _autocast_casts(device_type: str, dtype: torch.dtype) -> bool:
    """Whether a layer of ``dtype`` casts float32 inputs and parameters to its dtype: autocast is
    enabled for ``device_type`` and the layer is float16 or bfloat16 (it always computes in its
    compiled dtype; a float32 or float64 layer ignores autocast)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return False
    return bool(torch.is_autocast_enabled(device_type))


def check_mask(mask: torch.Tensor, batch: int, seq: int, device: torch.device, config: EncoderConfig,
               what: str) -> None:
    """Check a mask's shape, dtype and device (no data is read, so this traces without a graph break).

    Accepted shapes: ``[B, K]``, ``[B, 1, 1, K]``, ``[B, 1, J, K]`` (B may also be 1, broadcast).

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
    if not (mask.dtype == torch.bool or mask.is_floating_point()
            or mask.dtype in (torch.int64, torch.int32, torch.int8, torch.uint8)):
        raise TypeError(f"unsupported {what} dtype {mask.dtype}")
    shape = tuple(mask.shape)
    ok = (len(shape) == 2 and shape[0] in (1, batch) and shape[1] == seq) or \
         (len(shape) == 4 and shape[0] in (1, batch) and shape[1] == 1 and shape[2] in (1, seq) and shape[3] == seq)
    if not ok:
        raise ValueError(f"{what} must have shape [B, K] = [{batch}, {seq}], [B, 1, 1, K] or [B, 1, J, K]; "
                         f"got {shape}")


def run_layer(compiled: CompiledLayer, hidden_states: torch.Tensor, params: "list[torch.Tensor]",
              training: bool, attention_mask: torch.Tensor | None = None,
              key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Run a compiled layer on ``hidden_states`` [B, J, I] with ``params`` (in :func:`parameter_names`
    order for its config, PyTorch's shapes) through the ``substation::layer_forward`` operator; differentiable in the
    input and every parameter (the backward library runs in ``substation::layer_backward``).

    ``attention_mask`` follows Hugging Face: a float tensor is additive (``[B, K]``, ``[B, 1, 1, K]``
    or ``[B, 1, J, K]`` whose rows are equal); a bool or integer tensor marks keys to attend with
    True/1. ``key_padding_mask`` follows PyTorch: bool ``[B, K]``, True marks padding. Boolean masks
    become 0 / -inf. ``training`` with a dropout probability > 0 draws a fresh seed from PyTorch's
    generator (so ``torch.manual_seed`` and checkpoint recomputation reproduce the dropout masks).

    Raises:
        TypeError: not a tensor, the wrong dtype (input or parameters), parameters on another device.
        ValueError: wrong rank or hidden size, the wrong device type (CPU vs CUDA), an empty batch or
            sequence, the wrong number of parameters, parameters on the meta device (not yet loaded), or a
            bad mask (see :func:`check_mask`).
    """
    config = compiled.config
    x = hidden_states
    dtype = compiled.forward.dtype
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"hidden_states must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3 or x.shape[-1] != config.hidden_size:
        raise ValueError(f"hidden_states must have shape [B, J, I] with I = {config.hidden_size}; got {tuple(x.shape)}")
    device_type = compiled.forward.device_type
    where = "the CPU" if device_type == "cpu" else "CUDA"
    if x.device.type != device_type:
        raise ValueError(f"this layer was compiled for {where}; hidden_states is on {x.device}"
                         + ("" if device_type == "cpu" else " (move the layer and its inputs with .cuda())"))
    cast = _autocast_casts(x.device.type, dtype)
    if x.dtype != dtype:
        if not (cast and x.dtype == torch.float32):
            raise TypeError(f"hidden_states has dtype {x.dtype} but the layer was compiled for {dtype}")
        x = x.to(dtype)
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"hidden_states must have B >= 1 and J >= 1; got {tuple(x.shape)}")
    if cast:
        params = [p.to(dtype) if p.dtype == torch.float32 else p for p in params]
    names = parameter_names(config)
    if len(params) != len(names):
        raise ValueError(f"the layer takes {len(names)} parameters ({', '.join(names)}), got {len(params)}")
    for n, p in zip(names, params):
        if p.is_meta:
            raise ValueError(f"parameter {n} is on the meta device (weights not loaded yet): load the weights "
                             f"before running the layer")
        if p.dtype != dtype or p.device.type != device_type or (device_type != "cpu" and p.device != x.device):
            raise TypeError(f"parameter {n} is {p.dtype} on {p.device}; the layer was compiled for "
                            f"{dtype} on {where}" + ("" if device_type == "cpu" else f" ({x.device})"))
    b, j, _ = x.shape
    if attention_mask is not None and key_padding_mask is not None:
        raise ValueError("pass either attention_mask or key_padding_mask, not both")
    mask, what = (attention_mask, "attention_mask") if key_padding_mask is None else (key_padding_mask, "key_padding_mask")
    if mask is not None:
        check_mask(mask, b, j, x.device, config, what)
        if key_padding_mask is not None and (mask.dtype != torch.bool or mask.dim() != 2):
            raise TypeError(f"key_padding_mask must be a bool tensor [B, K] (True = padding), got {mask.dtype} "
                            f"{tuple(mask.shape)}")
    training = training and any(v > 0 for v in config.dropout.probabilities())
    seed = torch.randint(0, 2 ** 62, (1,)) if training else torch.zeros(1, dtype=torch.int64)
    outputs = _layer_forward(compiled.key, x.contiguous(), mask, key_padding_mask is None,
                             [p if p.is_contiguous() else p.contiguous() for p in params], seed, training)
    return outputs[0]


def rebuild_for(compiled: CompiledLayer, dtype: torch.dtype, device: torch.device) -> CompiledLayer:
    """The compiled layer of ``compiled``'s config for another parameter dtype and device, through the
    build cache (``compiled`` itself when nothing changes). Used by ``.to()``, ``.double()`` etc. A
    float16/bfloat16 layer given float32 parameters keeps its build: those are master weights, cast
    under ``torch.autocast``.

    Raises:
        TypeError: a dtype or device the config's target does not compile (the message names what does).
    """
    config = compiled.config
    names = DTYPE_NAMES
    allowed = CUDA_DTYPES if config.target == "cuda" else DTYPES
    runs_on = compiled.forward.device_type
    if device.type != runs_on:
        hint = f" (compile with target: {device.type} instead)" if device.type in ("cpu", "cuda") else ""
        raise TypeError(f"Substation's layers of this build run on {'the CPU' if runs_on == 'cpu' else 'CUDA'} only; "
                        f"moving them to {device} is not supported{hint}")
    if names.get(dtype) not in allowed:
        raise TypeError(f"Substation's target {config.target} compiles {', '.join(allowed)} layers; converting "
                        f"them to {dtype} is not supported")
    if names[dtype] == config.dtype or (dtype == torch.float32 and config.dtype in ("float16", "bfloat16")):
        return compiled
    from .pipeline import cached_compile
    return cached_compile(config.replace(dtype=names[dtype]), **compiled.options)


def build_after_apply(compiled: CompiledLayer, fn) -> CompiledLayer:
    """The build a layer needs after ``nn.Module._apply(fn)`` (``.to()``, ``.double()``, ...): ``fn`` is
    probed on a float32 CPU tensor and :func:`rebuild_for` picks the build of the resulting dtype and
    device, raising before any parameter is converted.

    Raises:
        TypeError: as :func:`rebuild_for`.
    """
    probe = fn(torch.zeros(1))
    return rebuild_for(compiled, probe.dtype, probe.device) if probe.dtype.is_floating_point else compiled


class EncoderLayer(nn.Module):
    """A compiled transformer encoder layer (forward and backward run generated code).

    Parameters have the names and shapes of ``torch.nn.TransformerEncoderLayer``: ``in_proj_weight``
    [3I, I] (Q, K, V stacked), ``in_proj_bias`` [3I], ``out_proj_weight`` [I, I], ``out_proj_bias`` [I],
    ``linear1_weight`` [U, I], ``linear1_bias`` [U], ``linear2_weight`` [I, U], ``linear2_bias`` [I],
    ``norm1_weight``, ``norm1_bias``, ``norm2_weight``, ``norm2_bias`` [I] (``norm_type: rms_norm``: the
    weights only), all of the config's dtype; :attr:`parameter_names` lists them in order.

    ``.double()`` / ``.float()`` / ``.to(dtype)`` switch to the build of that dtype (through the build
    cache); a dtype or device the target does not compile raises ``TypeError`` at that call.
    Pickling and ``copy.deepcopy`` work; an unpickled layer reloads its libraries from the build cache.

    Build one with :func:`substation.compile`, :meth:`from_hf` or :meth:`from_torch`.
    """

    def __init__(self, compiled: CompiledLayer):
        super().__init__()
        self.compiled = compiled
        self.config = compiled.config
        self.torch_dtype = ALL_TORCH_DTYPES[self.config.dtype]
        init_parameters(self, self.config, self.torch_dtype)
        if compiled.forward.device_type == "cuda" and torch.cuda.is_available():
            self.to("cuda")  # CUDA layers keep their parameters on the (current) GPU

    @property
    def parameter_names(self) -> tuple[str, ...]:
        """The layer's parameter names in the order the compiled code takes them (:func:`parameter_names`)."""
        return parameter_names(self.config)

    def _apply(self, fn, recurse=True):
        compiled = build_after_apply(self.compiled, fn)
        out = super()._apply(fn, recurse)
        self.compiled, self.config, self.torch_dtype = compiled, compiled.config, compiled.forward.dtype
        return out

    def __deepcopy__(self, memo):
        # Copies share the loaded libraries (read-only); parameters and buffers are copied.
        memo[id(self.compiled)] = self.compiled
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo)
        return new

    def __getstate__(self):
        state = self.__dict__.copy()
        state["compiled"] = compiled_state(self.compiled)
        return state

    def __setstate__(self, state):
        state["compiled"] = compiled_from_state(state["compiled"])
        self.__dict__.update(state)

    @classmethod
    def from_hf(cls, bert_layer, **config_overrides) -> "EncoderLayer":
        """Compile a layer equivalent to a Hugging Face ``transformers`` encoder layer and copy its
        weights; see :func:`substation.interop.from_hf`."""
        from .interop import from_hf
        return from_hf(bert_layer, **config_overrides)

    @classmethod
    def from_torch(cls, layer, **config_overrides) -> "EncoderLayer":
        """Compile a layer equivalent to a ``torch.nn.TransformerEncoderLayer`` and copy its weights;
        see :func:`substation.interop.from_torch`."""
        from .interop import from_torch
        return from_torch(layer, **config_overrides)

    def extra_repr(self) -> str:
        c = self.config
        return (f"I={c.hidden_size}, H={c.num_heads}, U={c.ffn_size}, activation={c.activation}, "
                f"layer_norm={c.layer_norm}, norm_type={c.norm_type}, dtype={c.dtype}, mask={c.mask}")

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run the layer.

        Args:
            hidden_states: [B, J, I], the config's dtype, on the CPU (target ``cuda``: on the GPU holding
                the parameters); a non-contiguous tensor is copied. Under ``torch.autocast`` for the
                input's device type, a float16/bfloat16 layer also takes float32 input and float32
                parameters, cast to its dtype (differentiably: gradients reach float32 parameters).
            attention_mask: Hugging Face convention, see :func:`run_layer`.
            key_padding_mask: PyTorch convention, bool [B, K], True = padding.

        Returns:
            [B, J, I]. Rows of a query whose keys are all masked with -inf get zero attention
            probabilities (their attention output is the output bias alone).

        Raises:
            TypeError, ValueError: see :func:`run_layer`.
        """
        return run_layer(self.compiled, hidden_states, [getattr(self, n) for n in self.parameter_names], self.training,
                         attention_mask, key_padding_mask)


def compiled_state(compiled: CompiledLayer) -> tuple:
    """What rebuilds ``compiled`` in another process (its config and build options): libraries do not pickle."""
    return compiled.config, compiled.options


def compiled_from_state(state: tuple) -> CompiledLayer:
    """The inverse of :func:`compiled_state`: the layer's libraries, from the build cache when present."""
    from .pipeline import cached_compile
    config, options = state
    return cached_compile(config, **options)
