"""The compiled encoder layer as an ``nn.Module``: :class:`EncoderLayer`.

Dimension letters: B batch, J query positions, K key positions (J = K), H heads, P = I / H head size,
I hidden size, U feed-forward size.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from .config import DTYPES, DropoutConfig, EncoderConfig
from .interop.families import NotConvertible, activation_name, family_of, layer_config
from .backends.cpu.gemm_libraries import check_fp32_gemm
from .pipeline import build_after_apply, cached_compile, compiled_from_state, compiled_state
from .reference import init_parameters
from .runtime import ALL_TORCH_DTYPES, DTYPE_NAMES, PARAMETER_NAMES, CompiledLayer, run_layer, run_layer_varlen

__all__ = ["EncoderLayer"]


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
        """The layer's parameter names in the order the compiled code takes them
        (:func:`~substation.runtime.parameter_names`)."""
        return self.compiled.parameter_names

    def _apply(self, fn, recurse=True):
        compiled = build_after_apply(self.compiled, fn, self.in_proj_weight.dtype)
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
    def from_hf(cls, hf_layer: nn.Module, fp32_gemm: str = "auto", **config_overrides) -> "EncoderLayer":
        """Compile a standalone :class:`~substation.EncoderLayer` equivalent to a Hugging Face encoder layer
        (any family :func:`optimize` converts: BERT, RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA, DistilBERT,
        ViT, DeiT) and copy its weights into it (Substation's parameter names: ``in_proj_weight`` [3I, I] =
        Q, K, V stacked; a missing Q/K/V bias becomes zeros). The source is not modified; the new layer is
        in the source's train/eval mode and its parameters require grad where the source's did.

        See :func:`layer_config` for what is read from the layer; compiled builds are shared per process
        by config. ``fp32_gemm``: the library of a float32 build's token-wise GEMMs, ``"auto"`` (default),
        ``"mkl"`` or ``"onednn"`` (:class:`~substation.pipeline.PipelineOptions`; other dtypes ignore it).

        Returns:
            An :class:`~substation.EncoderLayer`; ``forward(hidden_states [B, J, I], attention_mask)``.

        Raises:
            ValueError (:class:`~substation.interop.families.NotConvertible`): a layer Substation cannot
                convert; the message says why; an unknown ``fp32_gemm``. ConfigError: a bad override.
                ToolchainError, BuildError: compilation failed.
        """
        check_fp32_gemm(fp32_gemm)  # before anything compiles
        config = layer_config(hf_layer, **config_overrides)
        family = family_of(hf_layer)
        new = cls(cached_compile(config, fp32_gemm=fp32_gemm))
        sources = [torch.cat(t) if isinstance(t, tuple) else t for t in family.tensors(hf_layer)]  # keeps requires_grad
        with torch.no_grad():
            for name, src in zip(PARAMETER_NAMES, sources):
                dst = getattr(new, name)
                if tuple(src.shape) != tuple(dst.shape):
                    raise NotConvertible(f"{name}: source shape {tuple(src.shape)} does not match {tuple(dst.shape)}")
                dst.copy_(src.detach().to(dst.device, dst.dtype))
                dst.requires_grad_(src.requires_grad or src.grad_fn is not None)
        new.train(hf_layer.training)
        return new

    @classmethod
    def from_torch(cls, layer: nn.TransformerEncoderLayer, fp32_gemm: str = "auto",
                   **config_overrides) -> "EncoderLayer":
        """Compile an :class:`~substation.EncoderLayer` equivalent to ``torch.nn.TransformerEncoderLayer``
        and copy its weights.

        Read from the layer: I (``self_attn.embed_dim``), H (``self_attn.num_heads``), P = I / H, U
        (``linear1.out_features``); the activation (``layer.activation``: ``F.relu`` / ``nn.ReLU`` ->
        ``relu``, ``F.gelu`` / ``nn.GELU()`` -> ``gelu``, ``nn.GELU(approximate="tanh")`` -> ``gelu_tanh``);
        ``norm_first`` -> ``layer_norm: pre`` (else ``post``); dropout probabilities (``self_attn.dropout``
        -> attention, ``dropout1.p`` = ``dropout2.p`` -> hidden, ``dropout.p`` -> activation); the LayerNorm
        eps; the dtype of the weights. Nominal B = 1, L = 512, ``mask: padding``; ``config_overrides`` are
        applied last with :meth:`EncoderConfig.replace`. ``fp32_gemm``: as :meth:`from_hf`.

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
            TypeError: weights that are not float32, float64 or bfloat16, or of mixed dtypes.
            ConfigError: an invalid override. ToolchainError, BuildError: compilation failed. ValueError:
                also an unknown ``fp32_gemm``.
        """
        check_fp32_gemm(fp32_gemm)  # before anything compiles
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
                            f"compiles float32, float64 or bfloat16 layers (convert it with .float() first)")
        config = EncoderConfig(
            batch_size=1, max_seq_len=512, hidden_size=i, num_heads=h, ffn_size=layer.linear1.out_features,
            activation=activation_name(layer.activation), layer_norm="pre" if layer.norm_first else "post",
            dropout=DropoutConfig(attention=float(sa.dropout), hidden=p1, activation=float(layer.dropout.p)),
            layer_norm_eps=float(layer.norm1.eps), dtype=DTYPE_NAMES[next(iter(dtypes))], mask="padding",
            target="cpu", name="torch-encoder-layer").replace(**config_overrides)
        new = cls(cached_compile(config, fp32_gemm=fp32_gemm))
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
            probabilities (their attention output is the output bias alone). A call that runs the
            forward-only build (no gradient needed, no dropout) with a padding mask computes the real
            tokens only (packed, :mod:`substation.runtime.packing`): rows of padded positions are zeros,
            as in PyTorch's nested-tensor fast path, except position 0 of a left-padded sequence (computed,
            as poolers read it: :func:`~substation.runtime.packing.computed_queries`), and a sequence
            without real tokens is all zeros.

        Raises:
            TypeError, ValueError: see :func:`run_layer`.
        """
        return run_layer(self.compiled, hidden_states, [getattr(self, n) for n in self.parameter_names], self.training,
                         attention_mask, key_padding_mask)

    def forward_varlen(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Run the layer on packed variable-length sequences (FlashAttention's varlen convention).

        Args:
            hidden_states: [N, I], the config's dtype; sequence b is rows ``cu_seqlens[b]:cu_seqlens[b+1]``.
            cu_seqlens: integer [B + 1] offsets starting at 0 and ending at N (``torch.int32`` as
                FlashAttention's, or any integer dtype).

        Returns:
            [N, I]: each token's output, attending only to the tokens of its own sequence.

        Raises:
            TypeError, ValueError: see :func:`~substation.runtime.run_layer_varlen`.
        """
        return run_layer_varlen(self.compiled, hidden_states, cu_seqlens,
                                [getattr(self, n) for n in self.parameter_names], self.training)
