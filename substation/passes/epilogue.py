"""GEMM epilogues: a ``bias`` operator that only finishes a contraction's output moves into that
contraction (its ``bias`` input), so the GEMM library adds the bias to the float32 accumulators before
the result is rounded and stored; an ``activation`` that only finishes the (biased) product then moves
there too (the contraction's ``activation`` attribute: oneDNN's ``eltwise_gelu_erf``,
``eltwise_gelu_tanh`` or ``eltwise_relu`` post-op). That happens where the product is not kept for
backward: in inference builds (training keeps the activation's input for its gradient).

Each move saves bytes (scored as the fusion pass scores fusions, :func:`bytes_saved`): the raw product
is neither written nor read again, the bias is read as before. A bias qualifies when the raw product has
no other reader and is not kept (saved for backward, an output), and the contraction has no scale
(``alpha``: oneDNN applies a scale after the bias). Only for builds whose GEMM call takes a bias
(:func:`applies_to`: oneDNN's matmul, in bfloat16 CPU builds, where it also saves one bf16 rounding of
the raw product, and in float32 CPU builds on oneDNN's GEMMs, ``fp32_gemm`` resolved to ``"onednn"``);
MKL's SGEMM has no epilogue. (A float32 call of fewer than 256 rows, which ``ss::matmul`` hands to MKL,
adds the bias and applies the activation after it, in one pass over the product while it is in cache.)

In inference builds a contraction that reads a layer parameter also gets the ``packed_parameter``
attribute (:func:`pack_parameters`): the GEMM then reads the parameter from a copy in oneDNN's blocked
layout, made once per distinct content (substation_packed.h), instead of oneDNN packing the plain
matrix itself on every call; each call reads the parameter once more for the digest of its content, so
only GEMMs of at least :data:`~substation.backends.cpu.contraction.PACKED_PARAMETER_ROWS` rows do it.
Under autocast the parameters are float32 master weights (``float32_masters``): those a GEMM reads from
a packed copy then stay float32 in the graph, and are rounded to bf16 as they are packed (one reorder
per content, found again by the digest of the float32 bytes), at every size: the digest reads 4 bytes
per weight where a cast before each call read 4 and wrote 2 and the GEMM read those 2 again.
Training builds do not: their parameters change every step. float32 inference builds on oneDNN's
GEMMs do (each chunk of 512 along k its own copy): oneDNN read a PyTorch-layout weight with k = 1536
at 160-170 GFLOP/s unpacked, 220 packed (all-MiniLM-L6-v2's linear2, 3584 rows, 2 threads, AMD Zen 4).
(float32 builds on MKL do not: ``cblas_sgemm_pack`` saved 50-110 us per MiniLM GEMM with one layer's
weights in cache, but in a whole model at 1 x 24 tokens the digest's second pass over weights that no
longer fit in cache made it 20% slower; below 256 rows oneDNN's calls go to MKL unpacked.)
"""
from __future__ import annotations

from ..backends.cpu.gemm_libraries import links_onednn
from ..config import EncoderConfig
from ..ir.graph import GraphBuilder, LayerGraph
from ..ops.contraction import EPILOGUE_BIAS

__all__ = ["activation_candidates", "applies_to", "epilogue_candidates", "float32_master", "fuse_epilogues",
           "pack_parameters"]


def applies_to(config: EncoderConfig, fp32_gemm: str | None = None) -> bool:
    """Whether builds of ``config`` run their token-wise contractions on a GEMM call with a bias
    epilogue, oneDNN's (``ss::matmul``): the mixed-precision (bfloat16 CPU) builds, and float32 CPU
    builds whose float32 GEMM library (``fp32_gemm``, resolved: ``"mkl"`` or ``"onednn"``) is oneDNN."""
    return config.target == "cpu" and links_onednn(config.dtype, fp32_gemm)


def _finishing(graph: LayerGraph, kind: str, protected: set[str]):
    """(contraction, operator) pairs where an operator of ``kind`` is the only reader of the
    contraction's output, reads it as it is written, and the output is a temporary nobody keeps."""
    keep = {n for n, t in graph.tensors.items() if t.role != "temp"} | set(protected)
    ops = graph.operators()
    producer = {t: op for op in ops for t, _ in graph.outputs_of(op).values()}
    readers: dict[str, list] = {}
    for op in ops:
        for t, _ in graph.inputs_of(op).values():
            readers.setdefault(t, []).append(op)
    for op in ops:
        if op.kind != kind:
            continue
        raw, raw_access = graph.inputs_of(op)["x"]
        gemm = producer.get(raw)
        if gemm is None or gemm.kind != "contraction" or raw in keep or len(readers[raw]) != 1:
            continue
        if graph.outputs_of(gemm)["y"][1] == raw_access:
            yield gemm, op


def epilogue_candidates(graph: LayerGraph, protected: set[str] = frozenset()) -> dict[str, str]:
    """Contraction label -> label of the ``bias`` operator that may become its epilogue (see the module
    docstring); ``protected`` names tensors that must stay in memory besides the graph's own kept ones."""
    return {gemm.label: op.label for gemm, op in _finishing(graph, "bias", protected)
            if EPILOGUE_BIAS not in graph.inputs_of(gemm) and "activation" not in gemm.attrs
            and gemm.attrs.get("alpha", 1.0) == 1.0}


def activation_candidates(graph: LayerGraph, protected: set[str] = frozenset()) -> dict[str, str]:
    """Contraction label -> label of the ``activation`` operator that may become its epilogue (run after
    the biases have moved: the activation then reads the biased product the contraction writes)."""
    return {gemm.label: op.label for gemm, op in _finishing(graph, "activation", protected)
            if "activation" not in gemm.attrs}


def fuse_epilogues(graph: LayerGraph, protected: set[str] = frozenset()) -> LayerGraph:
    """``graph`` with every :func:`epilogue_candidates` bias, then every :func:`activation_candidates`
    activation, moved into its contraction (which then writes the moved operator's output); ``graph``
    itself when there is none. Run on unfused graphs.

    Raises:
        ValueError: ``graph`` already has fused row kernels.
    """
    if any(op.kind == "fused" for op in graph.operators()):
        raise ValueError("epilogues are placed before row-kernel fusion")
    graph = _absorb(graph, epilogue_candidates(graph, protected))
    return _absorb(graph, activation_candidates(graph, protected))


def _absorb(graph: LayerGraph, pairs: dict[str, str]) -> LayerGraph:
    """``graph`` with each contraction of ``pairs`` taking over its operator: a bias as the ``bias``
    input, an activation as the ``activation`` attribute; the product in between disappears."""
    if not pairs:
        return graph
    moved = {m: g for g, m in pairs.items()}
    dropped = {graph.inputs_of(graph.find(m))["x"][0] for m in moved}
    b = GraphBuilder(graph.sdfg.name, graph.config, graph.phase)
    for name, info in graph.tensors.items():
        if name not in dropped:
            b.copy_tensor(info)
    for op in graph.operators():
        if op.label in moved:
            continue
        ins = {c: f"{t}[{a}]" for c, (t, a) in graph.inputs_of(op).items()}
        outs = {c: f"{t}[{a}]" for c, (t, a) in graph.outputs_of(op).items()}
        attrs = dict(op.attrs)
        if op.label in pairs:
            finish = graph.find(pairs[op.label])
            if finish.kind == "bias":
                bt, ba = graph.inputs_of(finish)["b"]
                ins[EPILOGUE_BIAS] = f"{bt}[{ba}]"
            else:
                attrs["activation"] = finish.attrs["function"]
            outs = {c: f"{t}[{a}]" for c, (t, a) in graph.outputs_of(finish).items()}
        b.op(op.label, op.kind, op.op_class, ins, outs, **attrs)
    return b.finish()


def float32_master(graph: LayerGraph, name: str) -> bool:
    """Whether parameter ``name`` of ``graph`` is a float32 master weight that its GEMM packs into bf16
    (:func:`pack_parameters` with ``float32_masters``): a float32 parameter of a bfloat16 graph."""
    return graph.config.dtype == "bfloat16" and graph.tensors[name].dtype == "float32"


def pack_parameters(graph: LayerGraph, float32_masters: bool = False) -> LayerGraph:
    """``graph`` (a forward-only graph) with each contraction that reads a parameter marked
    ``packed_parameter`` = that parameter's name (see the module docstring); ``graph`` itself when
    none does. With ``float32_masters`` those parameters are float32 (master weights, rounded to bf16
    as they are packed).

    Raises:
        ValueError: ``graph`` saves tensors for backward (a training forward: its parameters change
        every step, so packed copies would be made once per step and never found again).
    """
    if not graph.forward_only:
        raise ValueError("parameters are packed in forward-only (inference) graphs only")
    marks = {}
    for op in graph.operators():
        if op.kind == "contraction":
            params = [t for c, (t, _) in graph.inputs_of(op).items()
                      if c != EPILOGUE_BIAS and graph.tensors[t].role == "param"]
            if len(params) == 1:
                marks[op.label] = params[0]
    if not marks:
        return graph
    b = GraphBuilder(graph.sdfg.name, graph.config, graph.phase)
    packed = set(marks.values())
    for info in graph.tensors.values():
        b.copy_tensor(info, dtype="float32" if float32_masters and info.name in packed else None)
    for op in graph.operators():
        attrs = dict(op.attrs, **({"packed_parameter": marks[op.label]} if op.label in marks else {}))
        b.op(op.label, op.kind, op.op_class, {c: f"{t}[{a}]" for c, (t, a) in graph.inputs_of(op).items()},
             {c: f"{t}[{a}]" for c, (t, a) in graph.outputs_of(op).items()}, **attrs)
    return b.finish()
