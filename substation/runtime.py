"""The PyTorch binding: compiled forward/backward libraries behind ``torch.autograd.Function`` and
:class:`EncoderLayer`, an ``nn.Module`` with PyTorch's parameter shapes."""
from __future__ import annotations

import copy
import ctypes
import os
import dataclasses
import threading

import torch
from torch import nn

from .config import EncoderConfig
from .graph import LayerGraph, TensorInfo
from .reference import init_parameters

__all__ = ["CompiledGraph", "CompiledLayer", "EncoderLayer", "normalize_mask", "TORCH_DTYPES"]

TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64}
#: Every config dtype, including target cuda's half precisions (TORCH_DTYPES: the CPU's).
ALL_TORCH_DTYPES = {**TORCH_DTYPES, "float16": torch.float16, "bfloat16": torch.bfloat16}


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
        #: dtype of each argument tensor (CUDA builds keep layer-norm statistics in float32).
        if self.target == "cpu":
            from .codegen import tensor_dtypes
        else:
            from .codegen_cuda import tensor_dtypes
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

    @property
    def saved_names(self) -> list[str]:
        """Tensors the backward graph reads besides dY: forward tensors and parameters."""
        return [t.name for t in self.backward.args if t.role in ("saved", "param")]


def normalize_mask(attention_mask, key_padding_mask, batch: int, seq: int, dtype: torch.dtype,
                   config: EncoderConfig, device: "torch.device | str | None" = None) -> torch.Tensor | None:
    """Turn a user mask into the additive key mask ``[B, K]`` of ``dtype`` the compiled code reads.

    ``attention_mask`` follows Hugging Face: a float tensor is additive (``[B, K]``, the extended
    ``[B, 1, 1, K]`` or a ``[B, 1, J, K]`` whose rows are equal); a bool or integer tensor marks keys
    to attend with True/1. ``key_padding_mask`` follows PyTorch: bool ``[B, K]``, True marks padding.
    Boolean masks become 0 / -inf. The mask must be on ``device``'s type (default the CPU; a CUDA
    layer passes its input's device) and the result is on ``device``.

    Raises:
        ValueError: wrong shape, a mask given to a layer compiled with ``mask: none``, both masks
            given, or a per-query mask whose rows differ.
        TypeError: a mask of an unsupported dtype.
    """
    if attention_mask is None and key_padding_mask is None:
        return None
    if config.mask == "none":
        raise ValueError("this layer was compiled with mask: none; compile with mask: padding to pass a mask")
    if attention_mask is not None and key_padding_mask is not None:
        raise ValueError("pass either attention_mask or key_padding_mask, not both")
    if key_padding_mask is not None:
        if key_padding_mask.dtype != torch.bool:
            raise TypeError(f"key_padding_mask must be a bool tensor [B, K] (True = padding), "
                            f"got {key_padding_mask.dtype}")
        m, keep = key_padding_mask, False
    else:
        m, keep = attention_mask, True
    want = torch.device("cpu" if device is None else device)
    if m.device.type != want.type:
        raise ValueError(f"the mask must be on the {'CPU' if want.type == 'cpu' else want.type.upper()}, "
                         f"got device {m.device}")
    m = m.to(want)
    if m.dim() == 4:
        if m.shape[1] != 1 or m.shape[2] not in (1, seq):
            raise ValueError(f"a 4-D attention_mask must be [B, 1, 1, K] or [B, 1, J, K]; got {tuple(m.shape)}")
        if m.shape[2] > 1:
            if not bool((m == m[:, :, :1, :]).all()):
                raise ValueError("attention_mask [B, 1, J, K] differs between queries; only key masks "
                                 "(and mask: causal in the config) are supported")
        m = m[:, 0, 0, :]
    if tuple(m.shape) != (batch, seq):
        raise ValueError(f"mask must have shape [B, K] = [{batch}, {seq}] (or [B, 1, 1, K]); got {tuple(m.shape)}")
    if m.dtype == torch.bool or not m.is_floating_point():
        if m.dtype not in (torch.bool, torch.int64, torch.int32, torch.int8, torch.uint8):
            raise TypeError(f"unsupported mask dtype {m.dtype}")
        attend = m.bool() if keep else ~m.bool()
        return torch.zeros(batch, seq, dtype=dtype, device=m.device).masked_fill_(~attend, float("-inf"))
    return m.to(dtype).contiguous()


def _autocast_casts(device_type: str, dtype: torch.dtype) -> bool:
    """Whether a layer of ``dtype`` casts float32 inputs and parameters to its dtype: autocast is
    enabled for ``device_type`` and the layer is float16 or bfloat16 (it always computes in its
    compiled dtype; a float32 or float64 layer ignores autocast)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        return bool(torch.is_autocast_enabled(device_type))
    except TypeError:  # torch < 2.4: no device argument
        return device_type == "cuda" and bool(torch.is_autocast_enabled())


class _EncoderFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layer: "EncoderLayer", x: torch.Tensor, mask, seed: int, training: bool, *params):
        compiled = layer.compiled
        b, j, _ = x.shape
        given = {"X": x, **dict(zip(layer.parameter_names, params))}
        if compiled.config.mask != "none":
            given["mask"] = mask if mask is not None else torch.zeros(b, j, dtype=x.dtype, device=x.device)
        out = compiled.forward(given, b, j, seed, training)
        saved_env = {**given, **out}
        names = compiled.saved_names
        ctx.save_for_backward(*(saved_env[n] for n in names))
        ctx.names, ctx.layer, ctx.seed, ctx.training, ctx.shape = names, layer, seed, training, (b, j)
        return out["Y"]

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        layer = ctx.layer
        given = dict(zip(ctx.names, ctx.saved_tensors))
        given["dY"] = dy.contiguous().to(layer.torch_dtype)
        grads = layer.compiled.backward(given, *ctx.shape, ctx.seed, ctx.training)
        pgrads = [grads[f"d{n}"].view(getattr(layer, n).shape) if ctx.needs_input_grad[5 + i] else None
                  for i, n in enumerate(layer.parameter_names)]
        return (None, grads["dX"] if ctx.needs_input_grad[1] else None, None, None, None, *pgrads)


class EncoderLayer(nn.Module):
    """A compiled transformer encoder layer (forward and backward run generated code).

    Parameters have the names and shapes of ``torch.nn.TransformerEncoderLayer``: ``in_proj_weight``
    [3I, I] (Q, K, V stacked), ``in_proj_bias`` [3I], ``out_proj_weight`` [I, I], ``out_proj_bias`` [I],
    ``linear1_weight`` [U, I], ``linear1_bias`` [U], ``linear2_weight`` [I, U], ``linear2_bias`` [I],
    ``norm1_weight``, ``norm1_bias``, ``norm2_weight``, ``norm2_bias`` [I], all of the config's dtype.

    Build one with :func:`substation.compile`, :meth:`from_hf` or :meth:`from_torch`.
    """

    parameter_names = ("in_proj_weight", "in_proj_bias", "out_proj_weight", "out_proj_bias",
                       "linear1_weight", "linear1_bias", "linear2_weight", "linear2_bias",
                       "norm1_weight", "norm1_bias", "norm2_weight", "norm2_bias")

    def __init__(self, compiled: CompiledLayer):
        super().__init__()
        self.compiled = compiled
        self.config = compiled.config
        self.torch_dtype = ALL_TORCH_DTYPES[self.config.dtype]
        init_parameters(self, self.config, self.torch_dtype)
        if compiled.forward.device_type == "cuda" and torch.cuda.is_available():
            self.to("cuda")  # CUDA layers keep their parameters on the (current) GPU

    def __deepcopy__(self, memo):
        # Copies share the loaded libraries (read-only); parameters and buffers are copied.
        memo[id(self.compiled)] = self.compiled
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo)
        return new

    def __getstate__(self):
        # Libraries do not pickle: keep what rebuilds them (from the build cache when present).
        state = self.__dict__.copy()
        state["compiled"] = (self.compiled.config, self.compiled.options)
        return state

    def __setstate__(self, state):
        from .pipeline import compile_layer
        config, options = state["compiled"]
        state["compiled"] = compile_layer(config, **options)
        self.__dict__.update(state)

    @classmethod
    def from_hf(cls, bert_layer, **config_overrides) -> "EncoderLayer":
        """Compile a layer equivalent to a Hugging Face ``transformers`` ``BertLayer`` and copy its
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
                f"layer_norm={c.layer_norm}, dtype={c.dtype}, mask={c.mask}")

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run the layer.

        Args:
            hidden_states: [B, J, I], the config's dtype, on the CPU (target ``cuda``: on the GPU holding
                the parameters); a non-contiguous tensor is copied. Under ``torch.autocast`` for the
                input's device type, a float16/bfloat16 layer also takes float32 input and float32
                parameters, cast to its dtype (differentiably: gradients reach float32 parameters).
            attention_mask: Hugging Face convention, see :func:`normalize_mask`.
            key_padding_mask: PyTorch convention, bool [B, K], True = padding.

        Returns:
            [B, J, I]. Rows of a query whose keys are all masked with -inf get zero attention
            probabilities (their attention output is the output bias alone).

        Raises:
            TypeError: not a tensor, or the wrong dtype (input or parameters), or parameters on
                another device.
            ValueError: wrong rank or hidden size, the wrong device type (CPU vs CUDA), an empty batch
                or sequence, or a bad mask.
        """
        x = hidden_states
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"hidden_states must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != self.config.hidden_size:
            raise ValueError(f"hidden_states must have shape [B, J, I] with I = {self.config.hidden_size}; "
                             f"got {tuple(x.shape)}")
        device_type = self.compiled.forward.device_type
        where = "the CPU" if device_type == "cpu" else "CUDA"
        if x.device.type != device_type:
            raise ValueError(f"this layer was compiled for {where}; hidden_states is on {x.device}"
                             + ("" if device_type == "cpu" else " (move the layer and its inputs with .cuda())"))
        cast = _autocast_casts(x.device.type, self.torch_dtype)
        if x.dtype != self.torch_dtype:
            if not (cast and x.dtype == torch.float32):
                raise TypeError(f"hidden_states has dtype {x.dtype} but the layer was compiled for {self.torch_dtype}")
            x = x.to(self.torch_dtype)
        if x.shape[0] == 0 or x.shape[1] == 0:
            raise ValueError(f"hidden_states must have B >= 1 and J >= 1; got {tuple(x.shape)}")
        params = [getattr(self, n) for n in self.parameter_names]
        if cast:
            params = [p.to(self.torch_dtype) if p.dtype == torch.float32 else p for p in params]
        for n, p in zip(self.parameter_names, params):
            if p.dtype != self.torch_dtype or p.device.type != device_type or (device_type != "cpu" and p.device != x.device):
                raise TypeError(f"parameter {n} is {p.dtype} on {p.device}; the layer was compiled for "
                                f"{self.torch_dtype} on {where}" + ("" if device_type == "cpu" else f" ({x.device})"))
        b, j, _ = x.shape
        mask = normalize_mask(attention_mask, key_padding_mask, b, j, self.torch_dtype, self.config,
                              None if device_type == "cpu" else x.device)
        training = self.training and any(v > 0 for v in dataclasses.astuple(self.config.dropout))
        seed = int(torch.randint(0, 2 ** 62, (1,)).item()) if training else 0
        return _EncoderFunction.apply(self, x.contiguous(), mask, seed, training,
                                      *(p if p.is_contiguous() else p.contiguous() for p in params))
