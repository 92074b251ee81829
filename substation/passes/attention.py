"""Attention fusion for forward-only CPU builds: ``scores -> [mask] -> softmax -> context`` becomes one
``attention`` operator (:mod:`substation.ops.attention`), so the [B, H, J, K] scores and probabilities
never reach memory.

The rewrite applies where the graph allows it (the chain's intermediates are temporaries read by the
chain alone, the operands carry the letters B, J/K, H, P) and it saves bytes: the unfused chain writes
and reads the scores, the masked scores and the probabilities, 2 x (2 or 3) x B H J K elements, which
the fused kernel keeps in a cache-sized block per thread. Where Q, K and V come from a bias add that
only the chain reads (a float GEMM has no bias epilogue), the kernel adds the bias as it loads them
(``bq``, ``bk``, ``bv``), and the biased QKV, 2 x B J 3 H P more elements, never reaches memory either.
It is for builds without backward (the probabilities are not kept): float and double builds (the
products on AVX-512 micro-kernels or BLAS) and bfloat16 builds. There the chain is the mixed precision
pass's: float32 scores, the probabilities cast to bfloat16 for the context product (the cast disappears
with them), and Q, K, V come biased from the QKV GEMM's epilogue; the kernel runs the two products on
AMX tiles (``ss::attention_forward_amx``) where the CPU has them, else on AVX512-BF16 dot products
(``ss::attention_forward_dp``; on AMD Zen 4 half the time of the unfused chain on oneDNN's matmul,
docs/toolchain.md).
"""
from __future__ import annotations

from ..ir.graph import GraphBuilder, LayerGraph, access_letters

__all__ = ["AttentionChain", "applies_to", "find_attention", "fuse_attention"]

_Q, _KV, _Y, _SCORES = frozenset("BJHP"), frozenset("BKHP"), frozenset("BJHP"), frozenset("BHJK")


class AttentionChain:
    """The operators of one attention chain and what fusing them saves.

    Attributes:
        scores, mask, softmax, context: the operators (``mask`` None without a mask).
        cast: the ``cast`` of the probabilities to bfloat16 between softmax and context (mixed
            precision builds), or None.
        intermediates: the temporaries that disappear (``S``, ``S_masked``, ``A``, ``A_bf16`` with a
            cast, and the biased ``QKV`` when ``bias`` is set).
        bias: the ``bias`` operator whose output Q, K and V are and that only the chain reads, or None.
    """

    def __init__(self, scores, mask, softmax, context, intermediates, bias=None, cast=None):
        self.scores, self.mask, self.softmax, self.context = scores, mask, softmax, context
        self.intermediates = intermediates
        self.bias, self.cast = bias, cast

    def bytes_saved(self, graph: LayerGraph, sizes: dict[str, int], itemsize: int) -> int:
        """Bytes the fused kernel does not move at ``sizes``: each intermediate written once and read once.

        Args:
            graph: the graph. sizes: dimension sizes by letter. itemsize: bytes per element.
        """
        total = 0
        for t in self.intermediates:
            n = 1
            for d in graph.tensors[t].dims:
                n *= sizes[d]
            total += 2 * n * itemsize
        return total


def applies_to(graph: LayerGraph, has_backward: bool) -> bool:
    """Whether the rewrite is for this build: target ``cpu``, no backward graph, float32, float64 or
    bfloat16."""
    cfg = graph.config
    return cfg.target == "cpu" and not has_backward and cfg.dtype in ("float32", "float64", "bfloat16")


def find_attention(graph: LayerGraph) -> AttentionChain | None:
    """The unfused graph's attention chain, or None when the graph has none that can be fused."""
    ops = graph.operators()
    readers: dict[str, list] = {}
    for op in ops:
        for t, _ in graph.inputs_of(op).values():
            readers.setdefault(t, []).append(op)

    def only_reader(tensor):
        found = readers.get(tensor, [])
        info = graph.tensors.get(tensor)
        return found[0] if len(found) == 1 and info is not None and info.role == "temp" else None

    for scores in ops:
        if scores.kind != "contraction" or set(graph.inputs_of(scores)) != {"q", "k"}:
            continue
        (s_name, s_acc), = graph.outputs_of(scores).values()
        nxt, mask, chain = only_reader(s_name), None, [s_name]
        if nxt is not None and nxt.kind == "mask":
            mask, (masked, _) = nxt, graph.outputs_of(nxt)["y"]
            chain.append(masked)
            nxt = only_reader(masked)
        if nxt is None or nxt.kind != "softmax" or nxt.attrs.get("axis") != "K":
            continue
        softmax, (a_name, _) = nxt, graph.outputs_of(nxt)["y"]
        chain.append(a_name)
        context, cast = only_reader(a_name), None
        if context is not None and context.kind == "cast":
            cast, (a_low, _) = context, graph.outputs_of(context)["y"]
            chain.append(a_low)
            context = only_reader(a_low)
        if context is None or context.kind != "contraction" or set(graph.inputs_of(context)) != {"attn", "v"}:
            continue
        ins = graph.inputs_of(scores)
        letters = {c: frozenset(access_letters(a)) for c, (_, a) in
                   (("q", ins["q"]), ("k", ins["k"]), ("v", graph.inputs_of(context)["v"]),
                    ("y", graph.outputs_of(context)["y"]), ("s", (s_name, s_acc)))}
        if (letters["q"], letters["k"], letters["v"], letters["y"], letters["s"]) != (_Q, _KV, _KV, _Y, _SCORES):
            continue
        sources = {ins["q"][0], ins["k"][0], graph.inputs_of(context)["v"][0]}
        # bf16 builds add the QKV bias in the GEMM's epilogue instead
        bias = None if cast is not None else _input_bias(graph, sources, readers, {scores.label, context.label})
        return AttentionChain(scores, mask, softmax, context, chain + sorted(sources if bias else ()), bias, cast)
    return None


def _input_bias(graph: LayerGraph, sources: set[str], readers: dict, chain_labels: set[str]):
    """The ``bias`` operator that writes the one tensor Q, K and V are read from, when only the chain's
    products read that tensor and it is a temporary; else None."""
    if len(sources) != 1:
        return None
    (qkv,), ops = sources, graph.operators()
    writer = next((op for op in ops if any(t == qkv for t, _ in graph.outputs_of(op).values())), None)
    if writer is None or writer.kind != "bias" or graph.tensors[qkv].role != "temp":
        return None
    if {op.label for op in readers.get(qkv, [])} != chain_labels:
        return None
    return writer


def _through_bias(bias_op, graph: LayerGraph, access: str) -> tuple[str, str, str]:
    """(input tensor, its access, bias access) that a read of ``bias_op``'s output at ``access`` becomes:
    the output's letters renamed as ``access`` renames them (``BJTHP`` read as ``BK1HP``: J -> K,
    T -> 1)."""
    (_, out_access), = graph.outputs_of(bias_op).values()
    rename = dict(zip(out_access, access))
    x, x_access = graph.inputs_of(bias_op)["x"]
    b, b_access = graph.inputs_of(bias_op)["b"]
    return x, "".join(rename[c] for c in x_access), "".join(rename[c] for c in b_access)


def fuse_attention(graph: LayerGraph) -> LayerGraph:
    """``graph`` with its attention chain (:func:`find_attention`) replaced by one ``attention``
    operator named ``attention`` (with the bias add of Q, K and V, where the chain has one); the graph
    itself when it has no such chain (or fusing saves nothing).

    Args:
        graph: an unfused forward graph (the layout pass has not run: tensors have their logical
            layouts, P innermost).

    Returns:
        A new :class:`LayerGraph`, or ``graph``.
    """
    chain = find_attention(graph)
    if chain is None or chain.bytes_saved(graph, graph.config.sizes(), graph.config.itemsize) <= 0:
        return graph
    dropped = {chain.scores.label, chain.softmax.label} | ({chain.mask.label} if chain.mask is not None else set()) \
        | {op.label for op in (chain.bias, chain.cast) if op is not None}
    b = GraphBuilder(graph.sdfg.name, graph.config, graph.phase)
    for name, info in graph.tensors.items():
        if name not in chain.intermediates:
            b.copy_tensor(info)
    for op in graph.operators():
        if op.label in dropped:
            continue
        if op is chain.context:
            ins = {"q": graph.inputs_of(chain.scores)["q"], "k": graph.inputs_of(chain.scores)["k"],
                   "v": graph.inputs_of(op)["v"]}
            if chain.bias is not None:
                for c in ("q", "k", "v"):
                    x, x_access, b_access = _through_bias(chain.bias, graph, ins[c][1])
                    ins[c], ins[f"b{c}"] = (x, x_access), (graph.inputs_of(chain.bias)["b"][0], b_access)
            attrs = {"alpha": chain.scores.attrs.get("alpha", 1.0), "causal": False}
            if chain.mask is not None:
                ins["m"] = graph.inputs_of(chain.mask)["m"]
                attrs["causal"] = bool(chain.mask.attrs.get("causal", False))
            b.op("attention", "attention", "TC", {c: f"{t}[{a}]" for c, (t, a) in ins.items()},
                 {c: f"{t}[{a}]" for c, (t, a) in graph.outputs_of(op).items()}, **attrs)
            continue
        b.op(op.label, op.kind, op.op_class, {c: f"{t}[{a}]" for c, (t, a) in graph.inputs_of(op).items()},
             {c: f"{t}[{a}]" for c, (t, a) in graph.outputs_of(op).items()}, **op.attrs)
    return b.finish()
