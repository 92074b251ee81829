"""What both code generators derive alike from a graph: the member records of an operator, the
normalization-statistics tensors and the iteration space of a row kernel."""
from __future__ import annotations

from ..ir.graph import STATIC_DIMENSIONS, LayerGraph, Operator
from ..ir.operands import resolve_operand, stride_order
from ..ops import op_kind, op_space

__all__ = ["member_records", "stat_tensors", "row_kernel_space", "workspace_slots"]


def member_records(graph: LayerGraph, op: Operator) -> list[dict]:
    """The operators a kernel runs, as records ``{name, kind, attrs, inputs, outputs}``: a fused
    operator's members, else the operator itself (``inputs``/``outputs``: connector -> (tensor, access))."""
    if op.kind == "fused":
        return op.attrs["ops"]
    return [{"name": op.label, "kind": op.kind, "attrs": op.attrs, "inputs": graph.inputs_of(op),
             "outputs": graph.outputs_of(op)}]


def stat_tensors(graph: LayerGraph) -> set[str]:
    """Names of the per-row statistics tensors of ``graph`` (the operands of each member's
    ``statistics`` connectors: layer norm's ``mean``/``rstd``, RMSNorm's ``rstd``), shape [B, J]."""
    names = set()
    for op in graph.operators():
        if op.op_class == "TC":
            continue
        for m in member_records(graph, op):
            stats = op_kind(m["kind"]).statistics
            names.update(t for c, (t, _) in (*m["inputs"].items(), *m["outputs"].items()) if c in stats)
    return names & set(graph.tensors)


def row_kernel_space(graph: LayerGraph, members: list[dict], vector: str | None = None):
    """(F, N, R) of a row kernel: its iteration letters, the inner letters (ordered, innermost last)
    and the row letters (outermost first), following the layout of its first full-width tensor in
    memory. Row and column reductions fix N; element-wise kernels take the trailing run of static
    letters; ``vector`` (a layout plan's vectorized letter) is moved innermost."""
    spaces = [op_space(m["kind"], m["inputs"], m["outputs"], m["attrs"]) for m in members]
    full = spaces[0][0]
    inner = next((n for _, n in spaces if n is not None), None)
    refs = [ta for m in members for ta in list(m["inputs"].values()) + list(m["outputs"].values())]
    main, main_access = next((t, a) for t, a in refs
                             if t in graph.tensors and {c for c in a if not c.isdigit()} == full)
    order = stride_order(resolve_operand(graph, main, main_access), sorted(full))
    if vector in order and (inner is None or vector in inner):
        order = [c for c in order if c != vector] + [vector]
    if inner is None:
        k = len(order) - 1
        while k > 0 and order[k - 1] in STATIC_DIMENSIONS + ("T",):
            k -= 1
        inner = frozenset(order[k:])
    return full, [c for c in order if c in inner], [c for c in order if c not in inner]


def workspace_slots(graph: LayerGraph, dtypes: dict[str, str]) -> list[list[str]]:
    """The temporaries of ``graph`` grouped into workspace slots: each slot is one buffer, shared by
    temporaries of one dtype and one element count (the same dimension letters) whose lifetimes do not
    overlap in operator order (a temporary is live from its first writer to its last reader, and a
    slot is reused only by a temporary first written after the previous one's last read). Slots are in
    order of first use; ``dtypes`` maps each tensor to its dtype name.

    In a training build most intermediates are saved for backward, so few temporaries share; in an
    inference build (nothing saved) this is what keeps the workspace to a few buffers.
    """
    first, last = {}, {}
    for i, op in enumerate(graph.operators()):
        for t, _ in graph.inputs_of(op).values():
            last[t] = i
        for t, _ in graph.outputs_of(op).values():
            first.setdefault(t, i)
            last[t] = max(last.get(t, i), i)
    temps = sorted((t for t, info in graph.tensors.items() if info.role == "temp" and t in first),
                   key=lambda t: (first[t], t))
    slots: list[list[str]] = []
    for t in temps:
        kind = (dtypes[t], "".join(sorted(graph.tensors[t].dims)))
        for slot in slots:
            prev = slot[-1]
            if (dtypes[prev], "".join(sorted(graph.tensors[prev].dims))) == kind and last[prev] < first[t]:
                slot.append(t)
                break
        else:
            slots.append([t])
    unused = [t for t, info in graph.tensors.items() if info.role == "temp" and t not in first]
    return slots + [[t] for t in unused]
