"""A plain PyTorch encoder layer with Substation's parameters (the numerical reference and the eager
baseline), and :func:`run_graph`, which interprets a layer graph operator by operator with each
kind's float64 reference semantics.

Same parameter names and shapes as :class:`substation.EncoderLayer` (those of
``torch.nn.TransformerEncoderLayer``), same mask semantics; dropout uses ``torch.nn.functional.dropout``
(so masks differ from Substation's counter-based ones; compare with dropout off or in eval mode).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import EncoderConfig
from .ir.graph import LayerGraph, access_letters, parameters
from .ops import op_kind

__all__ = ["ReferenceEncoderLayer", "init_parameters", "run_graph"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def init_parameters(module: nn.Module, config: EncoderConfig, dtype: torch.dtype | None = None) -> None:
    """Create the layer's parameters on ``module`` with PyTorch's default initialisation.

    Linear weights and biases as ``nn.Linear`` (Kaiming-uniform, a = sqrt(5)); ``in_proj_weight`` as
    ``nn.MultiheadAttention`` (Xavier-uniform, zero bias); norm weights 1, biases 0. Registered in
    :func:`substation.ir.graph.parameters` order. Shapes: in_proj_weight [3I, I], in_proj_bias [3I],
    out_proj_weight [I, I], out_proj_bias [I], linear1_weight [U, I], linear1_bias [U], linear2_weight
    [I, U], linear2_bias [I], norm{1,2}_weight [I], norm{1,2}_bias [I] (``norm_type: layer_norm`` only).
    """
    dtype = dtype or _DTYPES[config.dtype]
    i, u = config.hidden_size, config.ffn_size
    norm_biases = [n for n in ("norm1", "norm2") if f"{n}_bias" in parameters(config)]

    def p(*shape):
        return nn.Parameter(torch.empty(*shape, dtype=dtype))
    module.in_proj_weight, module.in_proj_bias = p(3 * i, i), p(3 * i)
    module.out_proj_weight, module.out_proj_bias = p(i, i), p(i)
    module.linear1_weight, module.linear1_bias = p(u, i), p(u)
    module.linear2_weight, module.linear2_bias = p(i, u), p(i)
    for n in ("norm1", "norm2"):
        setattr(module, f"{n}_weight", p(i))
        if n in norm_biases:
            setattr(module, f"{n}_bias", p(i))
    with torch.no_grad():
        nn.init.xavier_uniform_(module.in_proj_weight)
        module.in_proj_bias.zero_()
        for w, b, fan_in in ((module.out_proj_weight, module.out_proj_bias, i),
                             (module.linear1_weight, module.linear1_bias, i),
                             (module.linear2_weight, module.linear2_bias, u)):
            nn.init.kaiming_uniform_(w, a=math.sqrt(5))
            bound = 1 / math.sqrt(fan_in)
            nn.init.uniform_(b, -bound, bound)
        for n in ("norm1", "norm2"):
            getattr(module, f"{n}_weight").fill_(1.0)
            if n in norm_biases:
                getattr(module, f"{n}_bias").zero_()


class ReferenceEncoderLayer(nn.Module):
    """The encoder layer in PyTorch eager operations (``F.layer_norm`` or, with ``norm_type: rms_norm``,
    ``F.rms_norm``).

    ``forward(x[B, J, I], mask[B, K] | None)``: ``mask`` is additive (0 keeps a key, -inf or a large
    negative value masks it); a query whose keys are all masked with -inf gets zero attention
    probabilities (the documented Substation behaviour) instead of NaN.
    """

    def __init__(self, config: EncoderConfig, dtype: torch.dtype | None = None):
        super().__init__()
        self.config = config
        init_parameters(self, config, dtype)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        c = self.config
        b, j, i = x.shape
        h, p = c.num_heads, c.head_size
        train = self.training

        def ln(t, n):
            if c.norm_type == "rms_norm":
                return F.rms_norm(t, (i,), getattr(self, f"{n}_weight"), c.layer_norm_eps)
            return F.layer_norm(t, (i,), getattr(self, f"{n}_weight"), getattr(self, f"{n}_bias"), c.layer_norm_eps)

        attn_in = x if c.layer_norm == "post" else ln(x, "norm1")
        qkv = F.linear(attn_in, self.in_proj_weight, self.in_proj_bias).view(b, j, 3, h, p)
        q, k, v = (qkv[:, :, t].transpose(1, 2) for t in range(3))  # [B, H, J, P]
        s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(p)
        if mask is not None:
            s = s + mask[:, None, None, :]
        if c.mask == "causal":
            s = s.masked_fill(torch.ones(j, j, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        dead = s.amax(-1, keepdim=True) == float("-inf")  # every key masked: probabilities 0
        a = torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
        a = F.dropout(a, c.dropout.attention, train)
        ctx = torch.matmul(a, v).transpose(1, 2).reshape(b, j, i)
        o = F.dropout(F.linear(ctx, self.out_proj_weight, self.out_proj_bias), c.dropout.probability("attention_output"), train)
        r1 = o + x
        h1 = ln(r1, "norm1") if c.layer_norm == "post" else r1
        ffn_in = h1 if c.layer_norm == "post" else ln(r1, "norm2")
        f = F.linear(ffn_in, self.linear1_weight, self.linear1_bias)
        act = {"gelu": F.gelu, "relu": F.relu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}
        f = F.dropout(act[c.activation](f), c.dropout.activation, train)
        f = F.dropout(F.linear(f, self.linear2_weight, self.linear2_bias), c.dropout.hidden, train)
        r2 = f + h1
        return ln(r2, "norm2") if c.layer_norm == "post" else r2


def _index(dims: str, access: str) -> tuple:
    """The tensor index of ``access`` into a tensor of logical ``dims`` (a digit fixes that dimension)."""
    if len(access) != len(dims):
        raise ValueError(f"access {access!r} does not match the dims {dims!r}")
    return tuple(int(c) if c.isdigit() else slice(None) for c in access)


def run_graph(graph: LayerGraph, given: dict, seed: int = 0, training: bool = False) -> dict:
    """Interpret ``graph`` (fused or not, any layout) operator by operator with each kind's reference
    semantics (:attr:`substation.ops.kind.OpKind.reference`), in the dtype of the given tensors.

    Args:
        graph: a forward or backward :class:`~substation.ir.graph.LayerGraph`.
        given: every input, parameter and (backward) saved tensor by name, in its logical dims
            (``TensorInfo.dims``: ``X`` [B, J, I], ``in_proj_weight`` as [T, H, P, I], ...).
        seed, training: dropout as in the compiled code (the same Philox masks); eval mode is the identity.
        The tensors may be on any one device (the masks are computed on the CPU and moved there).

    Returns:
        Every tensor of the graph by name (the given ones and all that the operators write).

    Raises:
        KeyError: a tensor the graph reads that is neither given nor written before.
        ValueError: an unknown kind or a malformed access.
    """
    env = dict(given)
    first = next(t for t in given.values())
    b, j = next(given[n].shape[:2] for n in ("X", "dY") if n in given)
    sizes = graph.config.sizes(b, j)

    def dims_of(t: str, access: str) -> str:
        # a tensor a fused kernel keeps to itself is not in the graph: its accesses are whole
        return graph.tensors[t].dims if t in graph.tensors else access

    for op in graph.operators():
        members = op.attrs["ops"] if op.kind == "fused" else [
            {"kind": op.kind, "attrs": op.attrs, "inputs": graph.inputs_of(op), "outputs": graph.outputs_of(op)}]
        for m in members:
            ins = {c: (env[t][_index(dims_of(t, a), a)], access_letters(a)) for c, (t, a) in m["inputs"].items()}
            outs = {c: access_letters(a) for c, (_, a) in m["outputs"].items()}
            attrs = {**m["attrs"], "training": training, "seed": seed}
            result = op_kind(m["kind"]).reference(ins, outs, attrs)
            for c, (t, a) in m["outputs"].items():
                dims = dims_of(t, a)
                if t not in env:
                    env[t] = torch.zeros([sizes[d] for d in dims], dtype=first.dtype, device=first.device)
                env[t][_index(dims, a)] = result[c].expand(env[t][_index(dims, a)].shape)
    return env
