"""GEMM epilogues: a ``bias`` operator that only finishes a contraction's output moves into that
contraction (its ``bias`` input), so the GEMM library adds the bias to the float32 accumulators before
the result is rounded and stored.

Each move saves bytes (scored as the fusion pass scores fusions, :func:`bytes_saved`): the raw product
is neither written nor read again, the bias is read as before. A bias qualifies when the raw product has
no other reader and is not kept (saved for backward, an output), and the contraction has no scale
(``alpha``: oneDNN applies a scale after the bias). Only for back ends whose GEMM call takes a
bias (:func:`applies_to`: oneDNN's matmul in bfloat16 CPU builds, where it also saves one bf16
rounding of the raw product); the float32 CPU build's BLAS has no epilogue.
"""
from __future__ import annotations

from ..config import EncoderConfig
from ..ir.graph import GraphBuilder, LayerGraph
from ..ops.contraction import EPILOGUE_BIAS
from .precision import applies_to as mixed_precision

__all__ = ["applies_to", "epilogue_candidates", "fuse_epilogues"]


def applies_to(config: EncoderConfig) -> bool:
    """Whether builds of ``config`` run their contractions on a GEMM call with a bias epilogue: the
    mixed-precision (bfloat16 CPU) builds, whose GEMMs are oneDNN's (``ss::matmul_bf16``)."""
    return mixed_precision(config.dtype, config.target)


def epilogue_candidates(graph: LayerGraph, protected: set[str] = frozenset()) -> dict[str, str]:
    """Contraction label -> label of the ``bias`` operator that may become its epilogue (see the module
    docstring); ``protected`` names tensors that must stay in memory besides the graph's own kept ones."""
    keep = {n for n, t in graph.tensors.items() if t.role != "temp"} | set(protected)
    ops = graph.operators()
    producer = {t: op for op in ops for t, _ in graph.outputs_of(op).values()}
    readers: dict[str, list] = {}
    for op in ops:
        for t, _ in graph.inputs_of(op).values():
            readers.setdefault(t, []).append(op)
    found = {}
    for op in ops:
        if op.kind != "bias":
            continue
        raw, raw_access = graph.inputs_of(op)["x"]
        gemm = producer.get(raw)
        if (gemm is None or gemm.kind != "contraction" or EPILOGUE_BIAS in graph.inputs_of(gemm)
                or gemm.attrs.get("alpha", 1.0) != 1.0 or raw in keep or len(readers[raw]) != 1):
            continue
        if graph.outputs_of(gemm)["y"][1] != raw_access:  # the bias reads the product as it is written
            continue
        found[gemm.label] = op.label
    return found


def fuse_epilogues(graph: LayerGraph, protected: set[str] = frozenset()) -> LayerGraph:
    """``graph`` with every :func:`epilogue_candidates` bias moved into its contraction (which then
    writes the bias operator's output); ``graph`` itself when there is none. Run on unfused graphs.

    Raises:
        ValueError: ``graph`` already has fused row kernels.
    """
    if any(op.kind == "fused" for op in graph.operators()):
        raise ValueError("epilogues are placed before row-kernel fusion")
    pairs = epilogue_candidates(graph, protected)
    if not pairs:
        return graph
    biases = {b: g for g, b in pairs.items()}
    dropped = {graph.inputs_of(graph.find(b))["x"][0] for b in biases}
    b = GraphBuilder(graph.sdfg.name, graph.config, graph.phase)
    for name, info in graph.tensors.items():
        if name not in dropped:
            b.copy_tensor(info)
    for op in graph.operators():
        if op.label in biases:
            continue
        ins = {c: f"{t}[{a}]" for c, (t, a) in graph.inputs_of(op).items()}
        outs = {c: f"{t}[{a}]" for c, (t, a) in graph.outputs_of(op).items()}
        if op.label in pairs:
            bias = graph.find(pairs[op.label])
            bt, ba = graph.inputs_of(bias)["b"]
            ins[EPILOGUE_BIAS] = f"{bt}[{ba}]"
            outs = {c: f"{t}[{a}]" for c, (t, a) in graph.outputs_of(bias).items()}
        b.op(op.label, op.kind, op.op_class, ins, outs, **op.attrs)
    return b.finish()
