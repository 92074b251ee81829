"""Operator fusion: group element-wise (EW) and normalization (SN) operators into row kernels.

A *row kernel* iterates over rows (the letters R of its iteration space F) and, per row, over the
inner letters N. Inside it, EW operators map elements, row reductions (softmax, layer norm and their
gradients) reduce over N per row, and column reductions (bias and layer-norm parameter gradients)
accumulate per N across rows. The pass decides membership from the graph alone:

* every member has the same iteration space F (broadcast operands such as biases are fine);
* members that fix N agree on it: a row reduction fixes N to its axis, a column reduction to the
  letters it keeps;
* the group stays convex (no path leaves it and comes back) and no member reads what a column
  reduction of the same group produces (that is only complete after the last row);
* candidates are the groups that produce one of an operator's inputs (vertical fusion) or already
  read one of them (horizontal fusion); the one that saves the most bytes wins, as PyTorch Inductor
  scores fusions.

A tensor produced and consumed inside one group, and needed by no one else (backward included),
never reaches memory. Contractions (TC) are not fused.
"""
from __future__ import annotations

import dataclasses
import json

import networkx as nx

from ..ir.graph import GraphBuilder, LayerGraph
from ..ops import op_kind, op_space

__all__ = ["FusionOptions", "FuseOperators", "fuse", "kernel_name"]

@dataclasses.dataclass(frozen=True)
class FusionOptions:
    """Options of the fusion pass (JSON-serializable).

    Attributes:
        vertical: fuse an operator with the group producing one of its inputs.
        horizontal: fuse an operator with a group that reads one of the same input tensors.
    """

    vertical: bool = True
    horizontal: bool = True

    def to_json(self) -> str:
        """The options as JSON text."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "FusionOptions":
        """Options from :meth:`to_json` text."""
        return cls(**json.loads(text))


@dataclasses.dataclass
class _Op:
    """An operator record detached from the SDFG (what the pass rearranges)."""

    name: str
    kind: str
    op_class: str
    inputs: dict      # conn -> (tensor, access)
    outputs: dict
    attrs: dict

    def to_dict(self) -> dict:
        """The record as plain data (a fused operator's ``attrs['ops']`` entry)."""
        return {"name": self.name, "kind": self.kind, "op_class": self.op_class,
                "inputs": {c: list(v) for c, v in self.inputs.items()},
                "outputs": {c: list(v) for c, v in self.outputs.items()}, "attrs": self.attrs}


class FuseOperators:
    """Transformation: add operator ``op`` to the fusion group ``group``.

    Follows DaCe's contract: :meth:`can_be_applied` is pure; :meth:`apply` changes only the grouping.
    """

    def __init__(self, ops: list[_Op], protected: set[str], options: FusionOptions):
        self.ops = {o.name: o for o in ops}
        self.order = [o.name for o in ops]
        self.protected = protected  # tensors that must reach memory whatever the grouping
        self.options = options
        self.dag = nx.DiGraph()
        self.dag.add_nodes_from(self.order)
        producer = {t: o.name for o in ops for t, _ in o.outputs.values()}
        for o in ops:
            for t, _ in o.inputs.values():
                if t in producer:
                    self.dag.add_edge(producer[t], o.name)
        self.producer = producer

    def space(self, names) -> tuple[frozenset, frozenset | None] | None:
        """The common (F, N) of a set of operators, or None if they disagree."""
        full, inner = None, None
        for n in names:
            o = self.ops[n]
            f, nn = op_space(o.kind, o.inputs, o.outputs, o.attrs)
            if full is None:
                full = f
            elif f != full:
                return None
            if nn is not None:
                if inner is not None and nn != inner:
                    return None
                inner = nn
        return full, inner

    def can_be_applied(self, group: list[str], name: str) -> bool:
        """Whether operator ``name`` may join ``group`` (same space, agreeing inner letters, convex, no
        read of a column reduction of the group). Pure: changes nothing."""
        op = self.ops[name]
        if op.op_class == "TC" or any(self.ops[g].op_class == "TC" for g in group):
            return False
        if self.space(group + [name]) is None:
            return False
        members = set(group)
        col_outputs = {t for g in group if op_kind(self.ops[g].kind).reduction == "column"
                       for t, _ in self.ops[g].outputs.values()}
        if any(t in col_outputs for t, _ in op.inputs.values()):
            return False
        # Convexity: no path from the group to ``name`` through an operator outside the group.
        between = set()
        for g in group:
            between |= nx.descendants(self.dag, g)
        between &= nx.ancestors(self.dag, name)
        return between <= members

    def bytes_saved(self, group: list[str], name: str, nbytes) -> int:
        """Bytes ``name`` no longer moves when run inside ``group``: inputs the group already holds
        (read once, or produced in registers) plus writes of intermediates that become internal."""
        op = self.ops[name]
        held = {t for g in group for t, _ in list(self.ops[g].outputs.values()) + list(self.ops[g].inputs.values())}
        produced = {t for g in group for t, _ in self.ops[g].outputs.values()}
        saved = 0
        for t, a in op.inputs.values():
            if t in held:
                saved += nbytes(a)
                if t in produced and t not in self.protected and self._consumers(t) <= set(group) | {name}:
                    saved += nbytes(a)  # its write disappears as well
        return saved

    def _consumers(self, tensor: str) -> set[str]:
        return {o.name for o in self.ops.values() for t, _ in o.inputs.values() if t == tensor}

    def candidates(self, groups: list[list[str]], name: str) -> list[int]:
        """Indices of the groups that produce an input of ``name`` (vertical) or read one of its inputs
        (horizontal), as the options allow."""
        op = self.ops[name]
        ins = {t for t, _ in op.inputs.values()}
        res = []
        for i, group in enumerate(groups):
            produces = any(self.producer.get(t) in group for t in ins)
            reads = any(t in ins for g in group for t, _ in self.ops[g].inputs.values())
            if (produces and self.options.vertical) or (reads and self.options.horizontal):
                res.append(i)
        return res

    def apply(self, group: list[str], name: str) -> None:
        """Add ``name`` to ``group``."""
        group.append(name)


def kernel_name(members: list[dict], phase: str) -> str:
    """An acronym of the members' kinds, in the paper's naming style (forward: bias, dropout,
    residual, layer norm -> BDRLN; backward kernels are prefixed with B)."""
    parts = []
    for m in members:
        p = op_kind(m["kind"]).letter
        if not parts or parts[-1] != p:
            parts.append(p)
    # A group of letterless kinds alone (casts) is named after them.
    name = "".join(parts) or "_".join(dict.fromkeys(m["kind"] for m in members)).upper()
    return ("B" if phase == "backward" else "") + name


def _records(graph: LayerGraph) -> list[_Op]:
    res = []
    for op in graph.operators():
        if op.kind == "fused":
            raise ValueError(f"graph {graph.sdfg.name} is already fused")
        res.append(_Op(op.label, op.kind, op.op_class, graph.inputs_of(op), graph.outputs_of(op), op.attrs))
    return res


def fuse(graph: LayerGraph, options: FusionOptions = FusionOptions(), protected: set[str] | None = None) -> LayerGraph:
    """Return a new graph in which fusible operators are grouped into ``fused`` operators.

    ``protected`` names tensors that must stay in memory besides the graph's outputs and saved
    tensors (e.g. the tensors the backward graph reads, when fusing the forward graph).
    Each fused operator's ``attrs`` holds ``ops`` (the member records, in execution order), ``inner``
    (the inner letters N) and ``members`` (their names).
    """
    ops = _records(graph)
    keep = {n for n, t in graph.tensors.items() if t.role != "temp"} | set(protected or ())
    xf = FuseOperators(ops, keep, options)
    itemsize = graph.config.itemsize
    sizes = graph.config.sizes()

    def nbytes(access):
        n = 1
        for c in access:
            if not c.isdigit():
                n *= sizes[c]
        return n * itemsize

    groups: list[list[str]] = []
    for o in ops:
        if o.op_class == "TC":
            groups.append([o.name])
            continue
        best, best_score = None, -1
        for i in xf.candidates(groups, o.name):
            if xf.can_be_applied(groups[i], o.name):
                score = xf.bytes_saved(groups[i], o.name, nbytes)
                if score > best_score:
                    best, best_score = i, score
        if best is None:
            groups.append([o.name])
        else:
            xf.apply(groups[best], o.name)
    return _rebuild(graph, ops, groups, keep, xf)


def _rebuild(graph: LayerGraph, ops: list[_Op], groups: list[list[str]], keep: set[str], xf: FuseOperators) -> LayerGraph:
    by_name = {o.name: o for o in ops}
    group_of = {n: i for i, g in enumerate(groups) for n in g}
    external: set[str] = set(keep)
    for o in ops:
        for t, _ in o.inputs.values():
            p = xf.producer.get(t)
            if p is None or group_of[p] != group_of[o.name]:
                external.add(t)
    b = GraphBuilder(graph.sdfg.name, graph.config, graph.phase)
    for name, info in graph.tensors.items():
        if name in external or info.role != "temp":
            b.copy_tensor(info)
    used_names: dict[str, int] = {}
    # Emit groups in the order of their first member (a valid topological order, groups being convex).
    for group in sorted(groups, key=lambda g: min(xf.order.index(n) for n in g)):
        members = [by_name[n] for n in sorted(group, key=xf.order.index)]
        if len(members) == 1:
            o = members[0]
            b.op(o.name, o.kind, o.op_class, {c: f"{t}[{a}]" for c, (t, a) in o.inputs.items()},
                 {c: f"{t}[{a}]" for c, (t, a) in o.outputs.items()}, **o.attrs)
            continue
        produced = {t for m in members for t, _ in m.outputs.values()}
        ins, outs = {}, {}
        for m in members:
            for t, a in m.inputs.values():
                if t not in produced and ins.setdefault(f"in_{t}", f"{t}[{a}]") != f"{t}[{a}]":
                    raise NotImplementedError(f"kernel reads {t} through two different accesses")
            for t, a in m.outputs.values():
                if t in external:
                    outs.setdefault(f"out_{t}", f"{t}[{a}]")
        records = [m.to_dict() for m in members]
        label = kernel_name(records, graph.phase)
        used_names[label] = used_names.get(label, 0) + 1
        if used_names[label] > 1:
            label = f"{label}{used_names[label]}"
        full, inner = xf.space([m.name for m in members])
        op_class = "SN" if any(m.op_class == "SN" for m in members) else "EW"
        b.op(label, "fused", op_class, ins, outs, ops=records, members=[m.name for m in members],
             inner="".join(sorted(inner)) if inner else "")
    return b.finish()
