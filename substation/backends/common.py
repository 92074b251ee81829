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


def _element_count(dims: str, static: dict) -> tuple[int, int, int]:
    """A tensor's element count as ``coefficient * B**b * J**j`` (K counts as J): (coefficient, b, j)."""
    coefficient, b, j = 1, 0, 0
    for d in dims:
        if d == "B":
            b += 1
        elif d in ("J", "K"):
            j += 1
        else:
            coefficient *= static[d]
    return coefficient, b, j


def workspace_slots(graph: LayerGraph, dtypes: dict[str, str]) -> list[list[str]]:
    """The temporaries of ``graph`` grouped into workspace slots: each slot is one buffer, the size of
    its first temporary, reused by later temporaries of the same dtype whose element count it bounds
    at every B, J (``c * B**b * J**j`` against the slot's: no larger coefficient or exponent) once the
    previous occupant is dead (a temporary lives from its first writer to its last reader in operator
    order; the next one must be first written after that). Best fit: the smallest such slot. Slots
    are in order of first use; ``dtypes`` maps each tensor to its dtype name.

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
    static = {**graph.config.sizes(), "T": 3}
    count = {t: _element_count(info.dims, static) for t, info in graph.tensors.items()}
    temps = sorted((t for t, info in graph.tensors.items() if info.role == "temp" and t in first),
                   key=lambda t: (first[t], t))
    slots: list[list[str]] = []
    for t in temps:
        c = count[t]
        fits = [slot for slot in slots if dtypes[slot[0]] == dtypes[t] and last[slot[-1]] < first[t]
                and all(x >= y for x, y in zip(count[slot[0]], c))]
        if fits:
            min(fits, key=lambda slot: count[slot[0]]).append(t)
        else:
            slots.append([t])
    unused = [t for t, info in graph.tensors.items() if info.role == "temp" and t not in first]
    return slots + [[t] for t in unused]
