"""What both code generators derive alike from a graph besides the row-kernel model
(:mod:`substation.backends.rowkernel`): the normalization-statistics tensors and the workspace slots."""
from __future__ import annotations

from ..ir.graph import LayerGraph
from ..ops import op_kind
from .rowkernel import kernel_members

__all__ = ["stat_tensors", "workspace_slots"]


def stat_tensors(graph: LayerGraph) -> set[str]:
    """Names of the per-row statistics tensors of ``graph`` (the operands of each member's
    ``statistics`` connectors: layer norm's ``mean``/``rstd``, RMSNorm's ``rstd``), shape [B, J]."""
    names = set()
    for op in graph.operators():
        if op.op_class == "TC":
            continue
        for m in kernel_members(graph, op):
            stats = op_kind(m["kind"]).statistics
            names.update(t for c, (t, _) in (*m["inputs"].items(), *m["outputs"].items()) if c in stats)
    return names & set(graph.tensors)


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
