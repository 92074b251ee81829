"""Mixed precision: the dtype of every tensor of a bfloat16 CPU build, as ``torch.autocast`` gives it.

PyTorch's CPU autocast runs a BERT layer with linear layers (and attention's products) in bfloat16 and
layer norm in float32, and adds in the widest dtype of their operands, so the residual stream (the
layer input X, R1, N1, R2, Y and their gradients) stays float32 while every other activation is
bfloat16. This pass gives the forward graph that semantics, from each kind's registered rule
(:attr:`~substation.ops.OpKind.autocast`) in topological order:

* ``lower_precision_fp`` (contractions): the output is bfloat16; an input that is not bfloat16 is
  read through a ``cast`` operator (one per tensor, shared by its readers), which fusion folds into the
  row kernel that produces the tensor where that saves bytes;
* ``fp32`` (layer norm, RMSNorm): outputs and statistics float32;
* ``promote`` (every element-wise kind, softmax): the widest dtype of the inputs.

One exception follows what the layer's attention runs under autocast: PyTorch's
``scaled_dot_product_attention`` takes its fused CPU kernel when no dropout acts on the probabilities
(eval, or attention dropout 0) and that kernel keeps the scores in float32 up to the softmax (its math
path, taken with dropout, rounds them to bfloat16 like any autocast matmul). So a contraction whose
output only goes through the mask to a softmax whose probabilities only contractions read keeps a
float32 output; the probabilities are then rounded to bfloat16 for the product with V (a cast that
fusion folds into the softmax's row kernel).

Inputs: X float32, the mask bfloat16. Parameters: float32 where a ``fp32`` operator reads them (the
norms' weights and biases, as autocast keeps them), bfloat16 copies of the float32 master weights
elsewhere. Autodiff (:mod:`substation.passes.autodiff`) then gives each gradient its tensor's dtype and
parameter gradients float32.
"""
from __future__ import annotations

from ..ir.graph import GraphBuilder, LayerGraph
from ..ops import op_kind
from .attention import find_attention

__all__ = ["LOW_PRECISION", "WIDTH", "applies_to", "boundary_dtype", "cast_backward_contraction_inputs",
           "mixed_precision", "tensor_precisions"]

#: The low-precision dtype of a mixed-precision CPU build.
LOW_PRECISION = "bfloat16"
#: Dtype name -> bytes per element, for "widest".
WIDTH = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


def applies_to(dtype: str, target: str) -> bool:
    """Whether builds of config ``dtype`` for ``target`` are mixed precision: bfloat16 on the CPU
    (CUDA's float16 / bfloat16 builds keep one dtype per build, docs/cuda.md)."""
    return dtype == LOW_PRECISION and target == "cpu"


def boundary_dtype(dtype: str, target: str) -> str:
    """The dtype of a build's X, Y, dY and dX: float32 in mixed-precision builds, else ``dtype``."""
    return "float32" if applies_to(dtype, target) else dtype


def tensor_precisions(graph: LayerGraph) -> dict[str, str]:
    """Tensor name -> dtype name of every tensor of the forward ``graph`` under autocast's rules (see
    the module docstring), before casts are inserted.

    Raises:
        ValueError: ``graph`` is not a forward graph.
    """
    if graph.phase != "forward":
        raise ValueError(f"mixed precision is chosen on the forward graph (autodiff follows it), got {graph.phase}")
    ops = graph.operators()
    fp32_params = {t for op in ops if op_kind(op.kind).autocast == "fp32"
                   for t, _ in graph.inputs_of(op).values() if graph.tensors[t].role == "param"}
    float_scores = _fused_attention_scores(graph)
    dtypes = {}
    for name, info in graph.tensors.items():
        if info.role == "input":
            dtypes[name] = "float32" if name == "X" else LOW_PRECISION
        elif info.role == "param":
            dtypes[name] = "float32" if name in fp32_params else LOW_PRECISION
    for op in ops:
        rule = op_kind(op.kind).autocast
        if rule == "lower_precision_fp":
            out = "float32" if op.label in float_scores else LOW_PRECISION
        elif rule == "fp32":
            out = "float32"
        else:
            out = max((dtypes[t] for t, _ in graph.inputs_of(op).values()), key=WIDTH.__getitem__)
        for t, _ in graph.outputs_of(op).values():
            dtypes[t] = out
    return dtypes


def _fused_attention_scores(graph: LayerGraph) -> set[str]:
    """Labels of the contractions that compute scores whose probabilities go straight to the context
    product (no dropout between): the chain :func:`~substation.passes.attention.find_attention` fuses."""
    chain = find_attention(graph)
    return set() if chain is None else {chain.scores.label}


def mixed_precision(graph: LayerGraph) -> LayerGraph:
    """The forward ``graph`` of a bfloat16 CPU build with autocast's dtype on every tensor and a ``cast``
    operator (``<tensor>_cast``, writing ``<tensor>_bf16``) before each contraction input that is not
    bfloat16; ``graph`` itself where :func:`applies_to` is False.

    Raises:
        ValueError: ``graph`` is not an unfused forward graph.
    """
    if not applies_to(graph.config.dtype, graph.config.target):
        return graph
    if any(op.kind == "fused" for op in graph.operators()):
        raise ValueError("mixed precision runs before fusion (on the unfused forward graph)")
    return _cast_contraction_inputs(graph, tensor_precisions(graph))


def cast_backward_contraction_inputs(graph: LayerGraph) -> LayerGraph:
    """The backward ``graph`` of a bfloat16 CPU build with a ``cast`` before each contraction input that
    is not bfloat16 (the float32 score gradients of an attention whose scores are float32: PyTorch's
    fused attention rounds them for its GEMMs too); ``graph`` itself where there is none."""
    if not applies_to(graph.config.dtype, graph.config.target):
        return graph
    return _cast_contraction_inputs(graph, {n: t.dtype for n, t in graph.tensors.items()})


def _cast_contraction_inputs(graph: LayerGraph, dtypes: dict[str, str]) -> LayerGraph:
    """``graph`` with ``dtypes`` on its tensors and one shared ``<tensor>_cast`` operator before the
    contractions that read a tensor that is not bfloat16."""
    wide = {t for op in graph.operators() if op_kind(op.kind).autocast == "lower_precision_fp"
            for t, _ in graph.inputs_of(op).values() if dtypes[t] != LOW_PRECISION}
    if not wide and all(info.dtype == dtypes[n] for n, info in graph.tensors.items()):
        return graph
    b = GraphBuilder(graph.sdfg.name, graph.config, graph.phase)
    for name, info in graph.tensors.items():
        if info.dtype == dtypes[name]:
            b.copy_tensor(info)
        else:
            b.tensor(name, info.dims, info.role, info.layout, dtypes[name])
    low: dict[str, str] = {}  # float32 tensor -> its bfloat16 copy
    for op in graph.operators():
        ins = {}
        for conn, (t, a) in graph.inputs_of(op).items():
            if op_kind(op.kind).autocast == "lower_precision_fp" and dtypes[t] != LOW_PRECISION:
                if t not in low:
                    info = graph.tensors[t]
                    low[t] = b.tensor(f"{t}_bf16", info.dims, "temp", info.layout, LOW_PRECISION)
                    b.op(f"{t}_cast", "cast", "EW", {"x": t}, {"y": low[t]})
                t = low[t]
            ins[conn] = f"{t}[{a}]"
        b.op(op.label, op.kind, op.op_class, ins, {c: f"{t}[{a}]" for c, (t, a) in graph.outputs_of(op).items()},
             **op.attrs)
    return b.finish()
