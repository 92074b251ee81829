"""Global data-layout selection: candidates, an analytic cost model, an exact solve, plans.

The layout of a tensor is the order of its dimension letters from outermost to innermost (the last
has stride 1; DESIGN.md section 5). This pass chooses the layouts of every tensor of a layer's
forward *and* backward graph together:

* **Candidates.** A contraction (TC) can use a layout combination iff it maps to one strided-batched
  GEMM call (what :func:`substation.backends.cpu.codegen.plan_contraction` accepts): its index groups (rows ``m``,
  columns ``n``, contracted ``k``; batch letters are free) are each dense and in the same order in
  every operand, and each operand has unit stride at the innermost letter of one of its two groups.
  Such a combination is described by a *GEMM mode* ``(m order, n order, k order, unit group of C,
  of A, of B)`` plus, per operand, any layout compatible with the mode. A row kernel (EW/SN, fused
  or not) accepts every permutation of every operand; its mode is the *vectorized* letter (the
  innermost loop; for a normalization it must be one of the reduced letters). Anything else is
  reached through an explicit ``transpose`` operator, itself costed.
* **Costs** (seconds, :class:`CostModel`): memory-bound kernels move each operand's bytes once at unit
  stride, up to a cache line per element at non-unit stride; a GEMM costs its flop at the machine's
  GEMM rate (slightly more when operands are transposed) plus a penalty for operands whose matrices
  are not contiguous; a transpose reads and writes its tensor once. ``substation tune`` replaces the
  model by measurements for a short list (:mod:`substation.perf.tune`).
* **Exact solve** (:func:`solve`): a 0/1 integer program over the whole forward+backward graph,
  solved to optimality by HiGHS (``scipy.optimize.milp``). Variables: the stored layout of each
  tensor, the layout in which each operator accesses each operand, each operator's mode, and the
  transposes (a copy of a tensor in another layout per graph that reads it; a conversion after the
  single writer of a tensor). Constraints: one stored layout per tensor; an operator reads a tensor in
  its stored layout or in a transposed copy made in the same graph; writes go to the stored layout
  (or, for a single writer, through a conversion); parameter = gradient, X = Y = dX = dY layouts
  (layers chain); PyTorch's layouts at the module boundary (``boundary="pytorch"``); user pins.
  Products of choices (operator mode x operand layout, stored layout x copy layout) are linearised
  with transportation constraints, which are exact for 0/1 choices. The result reports the optimum
  and the lower bound where every operator takes its own best candidate.
* **Plans** (:class:`LayoutPlan`): JSON files recording the layout per tensor, per-kernel options
  (``vector``) and the transposes; :func:`apply_plan` rewrites the graphs (SDFG array strides,
  inserted ``transpose`` operators, kernel options) and code generation honours them.

The pass runs after fusion (see ``docs/layouts.md`` for why).
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import time
import warnings
from typing import Callable, Iterable, Mapping

from ..ir.graph import GraphBuilder, LayerGraph, Operator, access_letters
from ..resources import bundled_file

__all__ = [
    "PLAN_FORMAT", "LayoutError", "LayoutInfeasible", "PlanError", "CostModel", "Mode", "Candidate",
    "TensorVar", "OpVar", "LayoutProblem", "Solution", "LayoutPlan", "build_problem", "solve",
    "lower_bound", "default_solution", "apply_plan", "load_plan",
    "plan_from_solution", "op_candidates", "gemm_modes", "make_problem",
]

PLAN_FORMAT = "substation-layout-plan/1"

from ..backends.cpu.codegen import LayoutError  # noqa: E402  (re-exported: a contraction that needs a transpose)
from ..files import atomic_write_text


class LayoutInfeasible(ValueError):
    """No layout assignment satisfies the requested constraints; the message names them."""


class PlanError(ValueError):
    """A plan file is malformed or does not fit the graphs it is applied to; the message says why."""


# -- small helpers ---------------------------------------------------------------------------------
#: Generic distinct sizes used to test adjacency of strides (K = J, as codegen compares them).
_GENERIC = {"B": 7, "J": 11, "K": 11, "H": 13, "P": 17, "I": 19, "U": 23, "T": 3}


def _perms(dims: str) -> list[str]:
    return ["".join(p) for p in itertools.permutations(dims)]


def _strides(dims: str, layout: str, size: Mapping[str, int]) -> dict[str, int]:
    """Element stride of every dimension letter of a dense tensor stored in ``layout``."""
    st, acc = {}, 1
    for d in reversed(layout):
        st[d] = acc
        acc *= size[d]
    return st


def _access_strides(dims: str, layout: str, access: str, size: Mapping[str, int]) -> dict[str, int]:
    """Access letter -> element stride (digits, fixed indices, are left out)."""
    st = _strides(dims, layout, size)
    return {c: st[d] for c, d in zip(access, dims) if not c.isdigit()}


def _closeness(layout: str, dims: str) -> int:
    """Number of letter pairs whose order differs from ``dims`` (0 for the PyTorch layout)."""
    pos = {d: i for i, d in enumerate(layout)}
    return sum(1 for a, b in itertools.combinations(dims, 2) if pos[a] > pos[b])


# -- the cost model --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CostModel:
    """The analytic cost model (all results in seconds).

    Attributes:
        bandwidth: sustained memory bandwidth in bytes/s (read + write counted).
        gemm_flops: GEMM rate in flop/s.
        line_bytes: cache-line size in bytes; an element at non-unit stride moves up to one line.
        kernel_seconds: fixed cost of launching one kernel (a parallel region) in seconds.
        call_seconds: fixed cost of one BLAS call (per batch entry) in seconds.
        trans_penalty: relative GEMM slowdown per transposed operand (a fraction).
        ld_penalty: extra traffic, a fraction of an operand's bytes, when its matrix is not contiguous.
        itemsize: bytes per element.
    """

    bandwidth: float = 10e9
    gemm_flops: float = 60e9
    line_bytes: int = 64
    kernel_seconds: float = 5e-6
    call_seconds: float = 1e-6
    trans_penalty: float = 0.03
    ld_penalty: float = 0.25
    itemsize: int = 4

    def to_dict(self) -> dict:
        """The parameters as plain data (recorded in plans)."""
        return dataclasses.asdict(self)

    def stride_factor(self, stride: int | None) -> float:
        """Bytes moved per useful byte for an access at element ``stride`` (None: broadcast, 1)."""
        if not stride:
            return 1.0
        return min(stride * self.itemsize, self.line_bytes) / self.itemsize

    def copy_seconds(self, nbytes: int, write_stride: int) -> float:
        """A transpose of ``nbytes``: read at unit stride, write at ``write_stride``."""
        return self.kernel_seconds + nbytes * (1.0 + self.stride_factor(write_stride)) / self.bandwidth


# -- the problem -----------------------------------------------------------------------------------
@dataclasses.dataclass
class Mode:
    """One mode of an operator: a GEMM mapping or a vectorized letter.

    Attributes:
        name: a readable name (``v=K``; ``m=BJ n=THP k=I C:n A:k B:k``).
        base: seconds independent of the operand layouts.
        operand: tensor -> {layout: extra seconds} for the layouts compatible with this mode
            (a tensor missing here accepts no layout; every operand of the operator is listed).
        options: the per-kernel options recorded in a plan (``{"vector": "K"}`` or the GEMM mapping).
    """

    name: str
    base: float
    operand: dict
    options: dict


@dataclasses.dataclass
class Candidate:
    """A complete candidate of an operator: a layout per operand tensor and a cost in seconds.

    Attributes:
        layouts: tensor -> layout. seconds: its cost. options: per-kernel options.
        measured: True when ``seconds`` was measured on this machine.
    """

    layouts: dict
    seconds: float
    options: dict
    measured: bool = False


@dataclasses.dataclass
class TensorVar:
    """A tensor of the layer whose layout is chosen.

    Attributes:
        name, dims: the tensor and its logical dimension letters.
        role: its role (in the forward graph when it appears in both).
        domain: candidate layouts (all permutations of ``dims``).
        nbytes: size in bytes at the problem's sizes.
        writers: keys of the operators writing it. reader_graphs: graphs holding a reader.
        sizes: letter -> size (for strides).
    """

    name: str
    dims: str
    role: str
    domain: list
    nbytes: int
    sizes: dict
    writers: list = dataclasses.field(default_factory=list)
    reader_graphs: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class OpVar:
    """An operator whose candidate is chosen.

    Attributes:
        key: ``graph/label``. graph: ``forward`` or ``backward``. label: the operator label.
        kind: ``gemm``, ``row`` or ``synthetic``.
        reads, writes: tensors it reads and writes.
        modes: separable candidates (:class:`Mode`); their costs are multiplied by ``scale``.
        candidates: explicit candidates (:class:`Candidate`), e.g. measured ones.
        default: the candidate the operator uses with PyTorch's layouts (None if not applicable).
        scale: calibration of the mode costs (measured / analytic), 1 when not tuned.
    """

    key: str
    graph: str
    label: str
    kind: str
    reads: list
    writes: list
    modes: list = dataclasses.field(default_factory=list)
    candidates: list = dataclasses.field(default_factory=list)
    default: Candidate | None = None
    scale: float = 1.0


@dataclasses.dataclass
class LayoutProblem:
    """Everything the exact solve needs.

    Attributes:
        tensors: name -> :class:`TensorVar`. ops: key -> :class:`OpVar` (in execution order).
        pins: tensor -> (layout, reason): layouts that must be stored.
        ties: (tensor, tensor, reason): pairs that must share a stored layout.
        allow_transpose: whether explicit transposes may be inserted.
        copy_cost: (tensor, innermost letter of the source layout, destination layout) -> seconds.
        transpose_scale: calibration of ``copy_cost`` (measured / analytic).
        meta: free-form facts carried into the plan (config name, sizes, dtype, ...).
    """

    tensors: dict
    ops: dict
    pins: dict
    ties: list
    allow_transpose: bool
    copy_cost: Callable
    transpose_scale: float = 1.0
    meta: dict = dataclasses.field(default_factory=dict)


# -- GEMM modes --------------------------------------------------------------------------------------
def _gemm_groups(c_access: str, a_access: str, b_access: str):
    la, lb, lc = set(access_letters(a_access)), set(access_letters(b_access)), set(access_letters(c_access))
    batch = [x for x in access_letters(c_access) if x in la and x in lb]
    m = [x for x in access_letters(c_access) if x in la and x not in lb]
    n = [x for x in access_letters(c_access) if x in lb and x not in la]
    k = [x for x in access_letters(a_access) if x in lb and x not in lc]
    return batch, m, n, k


def _dense(st: dict, order: Iterable[str], size: Mapping[str, int]) -> bool:
    """Whether the letters ``order`` are adjacent in memory, outermost first, in ``st``."""
    order = list(order)
    if sorted(order, key=lambda c: -st[c]) != order:
        return False
    return all(st[o] == st[i] * size[i] for o, i in zip(order, order[1:]))


def _role_ok(st: dict, groups: tuple, unit: int) -> bool:
    """Both index groups dense in their orders; the ``unit`` group's innermost letter at stride 1."""
    g1, g2 = groups
    return _dense(st, g1, _GENERIC) and _dense(st, g2, _GENERIC) and st[groups[unit][-1]] == 1


def gemm_modes(c_access: str, a_access: str, b_access: str) -> list[dict]:
    """Every GEMM mapping of ``C[c_access] = A[a_access] x B[b_access]``: dicts with ``m``, ``n``, ``k``
    (letter orders, outermost first), ``batch`` and the unit-stride group of each operand (``uc`` in
    {m, n}, ``ua`` in {m, k}, ``ub`` in {n, k}) and the resulting BLAS flags (``swap``, ``trans_a``,
    ``trans_b``, as :func:`substation.backends.cpu.codegen.plan_contraction` derives them).

    Raises:
        LayoutError: an empty index group or a letter in only one operand (no layout maps to a GEMM).
    """
    batch, m, n, k = _gemm_groups(c_access, a_access, b_access)
    letters = set(access_letters(c_access)) | set(access_letters(a_access)) | set(access_letters(b_access))
    if not m or not n or not k or letters - set(batch) - set(m) - set(n) - set(k):
        raise LayoutError(f"{c_access} = {a_access} x {b_access} does not map to a GEMM in any layout")
    res = []
    for mo, no, ko in itertools.product(itertools.permutations(m), itertools.permutations(n),
                                        itertools.permutations(k)):
        for uc, ua, ub in itertools.product("mn", "mk", "nk"):
            if uc == "n":
                swap, ta, tb = False, ua == "m", ub == "k"
            else:  # C^T = B^T A^T
                swap, ta, tb = True, ub == "n", ua == "k"
            res.append({"m": "".join(mo), "n": "".join(no), "k": "".join(ko), "batch": "".join(batch),
                        "uc": uc, "ua": ua, "ub": ub, "swap": swap, "trans_a": ta, "trans_b": tb})
    return res


def _gemm_roles(mode: dict) -> dict:
    """role -> ((group, group), index of the unit group)."""
    m, n, k = mode["m"], mode["n"], mode["k"]
    return {"C": ((m, n), 0 if mode["uc"] == "m" else 1),
            "A": ((m, k), 0 if mode["ua"] == "m" else 1),
            "B": ((n, k), 0 if mode["ub"] == "n" else 1)}


def gemm_compatible(mode: dict, dims: str, layout: str, roles: list[tuple[str, str]]) -> bool:
    """Whether a tensor of ``dims`` stored in ``layout`` can play every (role, access) of ``roles``
    (role in A, B, C) in the GEMM ``mode``."""
    spec = _gemm_roles(mode)
    for role, access in roles:
        st = _access_strides(dims, layout, access, _GENERIC)
        groups, unit = spec[role]
        if not _role_ok(st, groups, unit):
            return False
    return True


# -- building the problem from graphs ----------------------------------------------------------------
def _row_space(graph: LayerGraph, op: Operator):
    """(records, full letters, fixed inner letters or None, main tensor, main access) as codegen sees them."""
    from .fusion import op_space
    if op.kind == "fused":
        records = op.attrs["ops"]
    else:
        records = [{"name": op.label, "kind": op.kind, "attrs": op.attrs,
                    "inputs": graph.inputs_of(op), "outputs": graph.outputs_of(op)}]
    spaces = [op_space(m["kind"], m["inputs"], m["outputs"], m["attrs"]) for m in records]
    full = spaces[0][0]
    inner = next((nn for _, nn in spaces if nn is not None), None)
    main, main_access = next((t, a) for m in records for t, a in list(m["inputs"].values()) + list(m["outputs"].values())
                             if t in graph.tensors and set(access_letters(a)) == set(full))
    return records, full, inner, main, main_access


def _default_vector(graph: LayerGraph, op: Operator, layouts: Mapping[str, str] | None = None) -> str:
    """The letter codegen runs innermost for a row kernel when the plan does not say (the main
    tensor's innermost letter among the allowed ones)."""
    _, full, inner, main, access = _row_space(graph, op)
    info = graph.tensors[main]
    layout = (layouts or {}).get(main, info.layout)
    st = _access_strides(info.dims, layout, access, _GENERIC)
    order = sorted(full, key=lambda c: -st[c])
    allowed = [c for c in order if inner is None or c in inner]
    return allowed[-1]


def _op_operands(graph: LayerGraph, op: Operator):
    """(reads: tensor -> [accesses], writes: tensor -> [accesses]) of an operator."""
    reads, writes = {}, {}
    for t, a in graph.inputs_of(op).values():
        reads.setdefault(t, []).append(a)
    for t, a in graph.outputs_of(op).values():
        writes.setdefault(t, []).append(a)
    return reads, writes


def _elements(access: str, size: Mapping[str, int]) -> int:
    n = 1
    for c in access_letters(access):
        n *= size[c]
    return n


def _row_op(graph, op, key, tensors, sizes, model: CostModel) -> OpVar:
    records, full, inner, main, _ = _row_space(graph, op)
    reads, writes = _op_operands(graph, op)
    allowed = sorted(full) if inner is None else sorted(inner)
    nfull = 1
    for c in full:
        nfull *= sizes[c]
    modes = []
    for v in allowed:
        operand = {}
        for t, accs in list(reads.items()) + list(writes.items()):
            tv = tensors[t]
            costs = operand.setdefault(t, {})
            for layout in tv.domain:
                s = 0.0
                for a in accs:
                    st = _access_strides(tv.dims, layout, a, sizes)
                    s += _elements(a, sizes) * model.itemsize * model.stride_factor(st.get(v)) / model.bandwidth
                costs[layout] = costs.get(layout, 0.0) + s
        # Short innermost loops cost loop overhead (about one ns per started inner loop).
        base = model.kernel_seconds + nfull / max(sizes[v], 1) * 1e-9
        modes.append(Mode(f"v={v}", base, operand, {"vector": v}))
    vec = _default_vector(graph, op)
    mode = next(m for m in modes if m.options["vector"] == vec)
    layouts = {t: tensors[t].dims for t in list(reads) + list(writes)}
    default = Candidate(layouts, mode.base + sum(mode.operand[t][layouts[t]] for t in layouts), dict(mode.options))
    return OpVar(key, graph.phase, op.label, "row", list(reads), list(writes), modes, [], default)


def _gemm_op(graph, op, key, tensors, sizes, model: CostModel) -> OpVar:
    ops = graph.operands(op)
    c_t, c_acc = ops.pop("y")
    (a_t, a_acc), (b_t, b_acc) = ops.values()
    reads, writes = _op_operands(graph, op)
    roles: dict[str, list] = {}
    for role, t, acc in (("A", a_t, a_acc), ("B", b_t, b_acc), ("C", c_t, c_acc)):
        roles.setdefault(t, []).append((role, acc))
    batch, m, n, k = _gemm_groups(c_acc, a_acc, b_acc)
    flops = 2 * _elements("".join(batch + m + n + k), sizes)
    nbatch = _elements("".join(batch), sizes)
    modes = []
    for gm in gemm_modes(c_acc, a_acc, b_acc):
        spec = _gemm_roles(gm)
        operand = {}
        for t, rl in roles.items():
            tv = tensors[t]
            ok = {}
            for layout in tv.domain:
                if not gemm_compatible(gm, tv.dims, layout, rl):
                    continue
                extra = 0.0
                for role, acc in rl:
                    (g1, g2), unit = spec[role]
                    st = _access_strides(tv.dims, layout, acc, sizes)
                    unit_g, other_g = (g1, g2) if unit == 0 else (g2, g1)
                    if st[other_g[-1]] != _elements(unit_g, sizes):  # matrix rows not back to back
                        extra += model.ld_penalty * _elements(acc, sizes) * model.itemsize / model.bandwidth
                ok[layout] = extra
            if not ok:
                break
            operand[t] = ok
        else:
            base = (model.kernel_seconds + nbatch * model.call_seconds
                    + flops / model.gemm_flops * (1 + model.trans_penalty * (gm["trans_a"] + gm["trans_b"])))
            name = f"m={gm['m']} n={gm['n']} k={gm['k']} C:{gm['uc']} A:{gm['ua']} B:{gm['ub']}"
            opts = {"gemm": {x: gm[x] for x in ("m", "n", "k", "batch", "swap", "trans_a", "trans_b")}}
            modes.append(Mode(name, base, operand, opts))
    if not modes:
        raise LayoutError(f"{key}: no layout maps this contraction to one GEMM")
    layouts = {t: tensors[t].dims for t in roles}
    default = None
    for md in modes:
        if all(layouts[t] in md.operand[t] for t in layouts):
            default = Candidate(layouts, md.base + sum(md.operand[t][layouts[t]] for t in layouts), dict(md.options))
            break
    return OpVar(key, graph.phase, op.label, "gemm", list(reads), list(writes), modes, [], default)


BOUNDARY_MODES = ("pytorch", "free")
#: Seconds added per letter pair a stored layout inverts relative to PyTorch's layout: among equally
#: cheap assignments the solve prefers PyTorch-like layouts (at most ~1e-7 s over a whole layer).
TIE_BREAK = 1e-10


def build_problem(fwd: LayerGraph, bwd: LayerGraph, model: CostModel | None = None, boundary: str = "pytorch",
                  pins: Mapping[str, str] | None = None, allow_transpose: bool = True,
                  sizes: Mapping[str, int] | None = None) -> LayoutProblem:
    """The layout problem of a layer's (forward, backward) graphs, costed by the analytic ``model``.

    Args:
        fwd, bwd: the graphs (fused or not) with PyTorch's layouts.
        model: the analytic cost model (default: :class:`CostModel` with the graphs' itemsize).
        boundary: ``pytorch`` pins X, Y, dX, dY, the mask, every parameter and parameter gradient to
            PyTorch's layouts (the runtime passes contiguous torch tensors); ``free`` only ties
            X = Y = dX = dY and parameter = gradient (layers chained inside one module).
        pins: tensor -> layout the user requires.
        allow_transpose: whether explicit transposes may be inserted.
        sizes: dimension sizes (default: the config's B, J = K, H, P, I, U).

    Raises:
        ValueError: an unknown boundary mode, pinned tensor or pinned layout.
        LayoutError: a contraction that maps to no GEMM in any layout.
    """
    if boundary not in BOUNDARY_MODES:
        raise ValueError(f"boundary must be one of {BOUNDARY_MODES}, got {boundary!r}")
    config = fwd.config
    itemsize = config.itemsize
    model = model or CostModel(itemsize=itemsize)
    if model.itemsize != itemsize:
        model = dataclasses.replace(model, itemsize=itemsize)
    sizes = dict(sizes or config.sizes())
    tensors: dict[str, TensorVar] = {}
    for g in (fwd, bwd):
        for name, info in g.tensors.items():
            if name in tensors:
                if tensors[name].dims != info.dims:
                    raise ValueError(f"tensor {name} has dims {tensors[name].dims} in forward but {info.dims} in backward")
                continue
            nbytes = itemsize * _elements(info.dims, sizes)
            tensors[name] = TensorVar(name, info.dims, info.role, _perms(info.dims), nbytes, sizes)
    ops: dict[str, OpVar] = {}
    for g in (fwd, bwd):
        for op in g.operators():
            key = f"{g.phase}/{op.label}"
            if op.kind == "contraction":
                ov = _gemm_op(g, op, key, tensors, sizes, model)
            else:
                ov = _row_op(g, op, key, tensors, sizes, model)
            ops[key] = ov
            for t in ov.writes:
                tensors[t].writers.append(key)
            for t in ov.reads:
                if g.phase not in tensors[t].reader_graphs:
                    tensors[t].reader_graphs.append(g.phase)
    all_pins: dict[str, tuple[str, str]] = {}
    ties: list[tuple[str, str, str]] = []
    boundary_tensors = [n for n in ("X", "Y", "dX", "dY") if n in tensors]
    for a, b in zip(boundary_tensors, boundary_tensors[1:]):
        ties.append((a, b, "layer input/output and their gradients share a layout (layers chain)"))
    for name, t in tensors.items():
        if t.role == "param" and f"d{name}" in tensors:
            ties.append((name, f"d{name}", "a parameter and its gradient share a layout"))
    if boundary == "pytorch":
        for g in (fwd, bwd):
            for name, info in g.tensors.items():
                if info.role in ("input", "param", "output"):
                    all_pins[name] = (info.dims, "PyTorch's layout at the module boundary")
    for name, layout in (pins or {}).items():
        if name not in tensors:
            raise ValueError(f"pinned tensor {name!r} is not a tensor of these graphs")
        if sorted(layout) != sorted(tensors[name].dims):
            raise ValueError(f"pinned layout {layout!r} of {name} is not a permutation of its dims {tensors[name].dims!r}")
        all_pins[name] = (layout, "pinned by the user")

    def copy_cost(t: TensorVar, src_inner: str, dst: str) -> float:
        st = _strides(t.dims, dst, t.sizes)
        return model.copy_seconds(t.nbytes, st[src_inner])
    meta = {"config": config.name, "sizes": {k: v for k, v in sizes.items() if k != "T"}, "dtype": config.dtype,
            "boundary": boundary, "fused": any(op.kind == "fused" for g in (fwd, bwd) for op in g.operators()),
            "model": model.to_dict(), "graphs": graph_signature(fwd, bwd)}
    return LayoutProblem(tensors, ops, all_pins, ties, allow_transpose, copy_cost, 1.0, meta)


def make_problem(tensors: Mapping[str, str], ops: Iterable[tuple], copy_cost: Callable[[TensorVar, str, str], float],
                 pins: Mapping[str, str] | None = None, ties: Iterable[tuple[str, str]] = (),
                 allow_transpose: bool = True, domains: Mapping[str, list] | None = None) -> LayoutProblem:
    """A layout problem from explicit cost tables (synthetic problems, tests, other graphs).

    Args:
        tensors: name -> dims letters (domain: every permutation, or ``domains[name]``).
        ops: (key ``graph/label``, reads, writes, [(layouts {tensor: layout}, seconds), ...]) per
            operator, in execution order.
        copy_cost: (tensor, innermost letter of the source layout, destination layout) -> seconds.
        pins: tensor -> layout. ties: pairs sharing a stored layout.

    Raises:
        ValueError: a candidate names a tensor the operator does not access, or a layout outside the
            tensor's domain.
    """
    tv = {n: TensorVar(n, d, "temp", list((domains or {}).get(n) or _perms(d)), 0, {}) for n, d in tensors.items()}
    ov = {}
    for key, reads, writes, cands in ops:
        graph, label = key.split("/", 1)
        cs = []
        for layouts, secs in cands:
            if set(layouts) != set(reads) | set(writes):
                raise ValueError(f"{key}: a candidate must give a layout for each of {sorted(set(reads) | set(writes))}")
            for t, l in layouts.items():
                if l not in tv[t].domain:
                    raise ValueError(f"{key}: layout {l!r} is not in the domain of {t}")
            cs.append(Candidate(dict(layouts), float(secs), {}))
        ov[key] = OpVar(key, graph, label, "synthetic", list(reads), list(writes), [], cs, None)
        for t in writes:
            tv[t].writers.append(key)
        for t in reads:
            if graph not in tv[t].reader_graphs:
                tv[t].reader_graphs.append(graph)
    return LayoutProblem(tv, ov, {t: (l, "pinned by the user") for t, l in (pins or {}).items()},
                         [(a, b, "tied") for a, b in ties], allow_transpose, copy_cost)


def graph_signature(fwd: LayerGraph, bwd: LayerGraph) -> str:
    """A short hash of the graphs' operators and tensors (what a plan was made for)."""
    h = hashlib.sha256()
    for g in (fwd, bwd):
        for name, t in g.tensors.items():
            h.update(f"{g.phase}:{name}:{t.dims}:{t.role};".encode())
        for op in g.operators():
            h.update(f"{g.phase}:{op.label}:{sorted(g.operands(op).items())};".encode())
    return h.hexdigest()[:16]


# -- candidates for tuning -------------------------------------------------------------------------
def _mode_best(ov: OpVar, mode: Mode, tensors) -> Candidate:
    layouts, cost = {}, mode.base * ov.scale
    for t, costs in mode.operand.items():
        dims = tensors[t].dims
        best = min(costs, key=lambda l: (costs[l], _closeness(l, dims), l))
        layouts[t] = best
        cost += costs[best] * ov.scale
    return Candidate(layouts, cost, dict(mode.options))


def op_candidates(problem: LayoutProblem, key: str, limit: int = 4) -> list[Candidate]:
    """The best-ranked complete candidates of operator ``key`` by the analytic model: per mode the
    cheapest layout of every operand (ties go to the layout closest to PyTorch's), best ``limit``
    modes, with the operator's default candidate always included first."""
    ov = problem.ops[key]
    ranked = sorted((_mode_best(ov, m, problem.tensors) for m in ov.modes), key=lambda c: c.seconds)
    res: list[Candidate] = []
    if ov.default is not None:
        res.append(ov.default)
    for c in ranked:
        if len(res) >= limit + (ov.default is not None):
            break
        if not any(c.layouts == r.layouts and c.options == r.options for r in res):
            res.append(c)
    return res


# -- the exact solve -------------------------------------------------------------------------------
class _Model:
    """A 0/1 linear program assembled row by row (objective in microseconds)."""

    def __init__(self):
        self.cost, self.integral, self.upper = [], [], []
        self.rows: list[dict] = []
        self.lo, self.hi, self.tags = [], [], []

    def var(self, seconds: float = 0.0, integral: bool = True, upper: float = 1.0) -> int:
        self.cost.append(seconds * 1e6)
        self.integral.append(1 if integral else 0)
        self.upper.append(upper)
        return len(self.cost) - 1

    def row(self, coeffs: dict, lo: float, hi: float, tag=None) -> None:
        self.rows.append(coeffs)
        self.lo.append(lo)
        self.hi.append(hi)
        self.tags.append(tag)

    def solve(self, time_limit: float, disabled=frozenset(), objective: bool = True):
        import numpy as np
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix
        keep = [i for i, t in enumerate(self.tags) if t is None or t not in disabled]
        r, c, v = [], [], []
        for new, i in enumerate(keep):
            for j, x in self.rows[i].items():
                r.append(new)
                c.append(j)
                v.append(x)
        n = len(self.cost)
        a = coo_matrix((v, (r, c)), shape=(len(keep), n)).tocsr()
        cons = [LinearConstraint(a, np.array([self.lo[i] for i in keep]), np.array([self.hi[i] for i in keep]))]
        cost = np.array(self.cost) if objective else np.zeros(n)
        return milp(cost, constraints=cons, integrality=np.array(self.integral),
                    bounds=Bounds(np.zeros(n), np.array(self.upper)),
                    options={"time_limit": time_limit, "mip_rel_gap": 0.0, "disp": False})


@dataclasses.dataclass
class Solution:
    """An optimal layout assignment.

    Attributes:
        layouts: tensor -> stored layout.
        access: op key -> {tensor: layout it reads/writes the tensor in}.
        options: op key -> per-kernel options of the chosen mode or candidate.
        choice: op key -> name of the chosen mode (or ``candidate <i>``; ``measured`` when measured).
        op_seconds: op key -> cost of the chosen candidate in seconds.
        transposes: dicts {graph, tensor, layout, direction (read|write), ops, seconds}.
        objective: total cost in seconds (operators + transposes).
        lower_bound: sum over operators of their own best candidate, in seconds.
        default_seconds: the cost of PyTorch's layouts everywhere (None if infeasible), seconds.
        solve_seconds: wall time of the solve. variables, constraints: size of the integer program.
    """

    layouts: dict
    access: dict
    options: dict
    choice: dict
    op_seconds: dict
    transposes: list
    objective: float
    lower_bound: float
    default_seconds: float | None
    solve_seconds: float
    variables: int = 0
    constraints: int = 0


def lower_bound(problem: LayoutProblem) -> float:
    """Seconds: every operator takes its own best candidate, ignoring all consistency constraints."""
    total = 0.0
    for ov in problem.ops.values():
        best = math.inf
        for m in ov.modes:
            best = min(best, (m.base + sum(min(c.values()) for c in m.operand.values())) * ov.scale)
        for c in ov.candidates:
            best = min(best, c.seconds)
        total += best
    return total


def _op_options(ov: OpVar):
    """(mode or candidate, is_candidate) pairs of an operator."""
    return [(m, False) for m in ov.modes] + [(c, True) for c in ov.candidates]


def default_solution_seconds(problem: LayoutProblem) -> float:
    """Seconds with PyTorch's layouts everywhere and each operator's default candidate."""
    total = 0.0
    for ov in problem.ops.values():
        if ov.default is None:
            return math.inf
        meas = [c for c in ov.candidates if c.layouts == ov.default.layouts and c.options == ov.default.options]
        total += meas[0].seconds if meas else ov.default.seconds * ov.scale
    return total


def solve(problem: LayoutProblem, time_limit: float = 60.0) -> Solution:
    """Solve the layout problem exactly (0/1 integer program, HiGHS through ``scipy.optimize.milp``).

    Returns:
        the optimal :class:`Solution` (objective and lower bound in seconds).

    Raises:
        LayoutInfeasible: no assignment satisfies the pins, ties and operator candidates (with
            transposes disabled, or pins that no candidate can honour); the message names them.
        RuntimeError: the solver stopped before proving optimality (time limit).
    """
    t0 = time.perf_counter()
    _check_local(problem)
    mdl = _Model()
    T, ops = problem.tensors, problem.ops
    x = {}   # (tensor, layout) -> stored layout
    for name, tv in T.items():
        # Ties go to the layout closest to PyTorch's: TIE_BREAK seconds per inverted letter pair.
        idx = {l: mdl.var(TIE_BREAK * _closeness(l, tv.dims)) for l in tv.domain}
        for l, i in idx.items():
            x[name, l] = i
        mdl.row({i: 1.0 for i in idx.values()}, 1, 1)
    xin = {}  # (tensor, innermost letter) -> {var: 1}
    for (name, l), i in x.items():
        xin.setdefault((name, l[-1]), {})[i] = 1.0
    tsc = problem.transpose_scale
    y, w = {}, {}
    if problem.allow_transpose:
        for name, tv in T.items():
            # read copies: per graph holding a reader, one per layout
            for g in tv.reader_graphs:
                for l in tv.domain:
                    y[name, g, l] = mdl.var()
                # pairs (source innermost letter d, copy layout l): r <= [inner(stored) = d], sum_d r = y
                for l in tv.domain:
                    row = {y[name, g, l]: -1.0}
                    for d in tv.dims:
                        r = mdl.var(problem.copy_cost(tv, d, l) * tsc, integral=False)
                        row[r] = 1.0
                        bound = {r: 1.0}
                        for i in xin.get((name, d), {}):
                            bound[i] = -1.0
                        mdl.row(bound, -math.inf, 0)
                    mdl.row(row, 0, 0)
            if len(tv.writers) == 1:
                # write conversion: the writer writes layout l, a transpose fills the stored layout
                for l in tv.domain:
                    w[name, l] = mdl.var()
                mdl.row({w[name, l]: 1.0 for l in tv.domain}, 0, 1)
                for d in tv.dims:
                    win = {w[name, l]: 1.0 for l in tv.domain if l[-1] == d}
                    row = {k: -v for k, v in win.items()}
                    for L in tv.domain:
                        s = mdl.var(problem.copy_cost(tv, d, L) * tsc, integral=False)
                        row[s] = 1.0
                        mdl.row({s: 1.0, x[name, L]: -1.0}, -math.inf, 0)
                    mdl.row(row, 0, 0)
    a = {}
    zvars = {}
    for key, ov in ops.items():
        z = {}
        opts = _op_options(ov)
        for i, (o, is_cand) in enumerate(opts):
            if is_cand:
                z[i] = mdl.var(o.seconds)
            else:
                z[i] = mdl.var(o.base * ov.scale)
        zvars[key] = z
        mdl.row({v: 1.0 for v in z.values()}, 1, 1)
        for t in dict.fromkeys(ov.reads + ov.writes):
            tv = T[t]
            acc = {l: mdl.var() for l in tv.domain}
            for l, v in acc.items():
                a[key, t, l] = v
            mdl.row({v: 1.0 for v in acc.values()}, 1, 1)
            # a[t, l] = sum over modes of q[mode, t, l] + sum over candidates with layout l
            link = {l: {acc[l]: -1.0} for l in tv.domain}
            for i, (o, is_cand) in enumerate(opts):
                if is_cand:
                    link[o.layouts[t]][z[i]] = 1.0
                    continue
                compat = o.operand[t]
                row = {z[i]: -1.0}
                for l, extra in compat.items():
                    q = mdl.var(extra * ov.scale, integral=False)
                    row[q] = 1.0
                    link[l][q] = 1.0
                mdl.row(row, 0, 0)
            for l in tv.domain:
                mdl.row(link[l], 0, 0)
            # availability: stored layout, a copy in this graph (reads), a conversion (single writer)
            for l in tv.domain:
                row = {acc[l]: 1.0, x[t, l]: -1.0}
                if t in ov.reads and (t, ov.graph, l) in y:
                    row[y[t, ov.graph, l]] = -1.0
                if t in ov.writes and (t, l) in w:
                    row[w[t, l]] = -1.0
                mdl.row(row, -math.inf, 0)
                if t in ov.writes and (t, l) in w:
                    mdl.row({w[t, l]: 1.0, acc[l]: -1.0}, -math.inf, 0)  # convert only what is written
    for (t1, t2, why) in problem.ties:
        for l in set(T[t1].domain) | set(T[t2].domain):
            row = {}
            if (t1, l) in x:
                row[x[t1, l]] = 1.0
            if (t2, l) in x:
                row[x[t2, l]] = -1.0
            mdl.row(row, 0, 0, tag=("tie", t1, t2))
    for t, (l, why) in problem.pins.items():
        mdl.row({x[t, l]: 1.0}, 1, 1, tag=("pin", t))
    res = mdl.solve(time_limit)
    if res.status == 2:
        raise LayoutInfeasible(_diagnose(problem, mdl, time_limit))
    if res.status != 0 or res.x is None:
        raise RuntimeError(f"layout solve did not prove optimality: {res.message}")
    sol = res.x
    on = lambda v: sol[v] > 0.5  # noqa: E731
    layouts = {t: l for (t, l), v in x.items() if on(v)}
    access, options, choice, op_seconds = {}, {}, {}, {}
    for key, ov in ops.items():
        opts = _op_options(ov)
        i = next(i for i, v in zvars[key].items() if on(v))
        o, is_cand = opts[i]
        access[key] = {t: next(l for l in T[t].domain if on(a[key, t, l])) for t in dict.fromkeys(ov.reads + ov.writes)}
        options[key] = dict(o.options)
        if is_cand:
            choice[key] = "measured" if o.measured else f"candidate {i - len(ov.modes)}"
            op_seconds[key] = o.seconds
        else:
            choice[key] = o.name
            op_seconds[key] = (o.base + sum(o.operand[t][access[key][t]] for t in access[key])) * ov.scale
    transposes = []
    for (t, g, l), v in y.items():
        if on(v):
            readers = [k for k, ov in ops.items() if ov.graph == g and t in ov.reads and access[k][t] == l]
            secs = problem.copy_cost(T[t], layouts[t][-1], l) * tsc
            transposes.append({"graph": g, "tensor": t, "layout": l, "direction": "read", "ops": readers,
                               "seconds": secs})
    for (t, l), v in w.items():
        if on(v):
            writer = T[t].writers[0]
            secs = problem.copy_cost(T[t], l[-1], layouts[t]) * tsc
            transposes.append({"graph": writer.split("/")[0], "tensor": t, "layout": l, "direction": "write",
                               "ops": [writer], "seconds": secs})
    objective = sum(op_seconds.values()) + sum(tr["seconds"] for tr in transposes)
    return Solution(layouts, access, options, choice, op_seconds, transposes, objective, lower_bound(problem),
                    default_solution_seconds(problem), time.perf_counter() - t0, len(mdl.cost), len(mdl.rows))


def _check_local(problem: LayoutProblem) -> None:
    """Fail early, naming the pin and the operator, when a pinned layout cannot be used by an operator
    that cannot reach it through a transpose."""
    for key, ov in problem.ops.items():
        fixed = {}
        for t in dict.fromkeys(ov.reads + ov.writes):
            if t not in problem.pins:
                continue
            via_copy = problem.allow_transpose and (t in ov.reads or len(problem.tensors[t].writers) == 1)
            if not via_copy:
                fixed[t] = problem.pins[t][0]
        if not fixed:
            continue
        ok = any(all(l in m.operand[t] for t, l in fixed.items()) for m in ov.modes) or \
            any(all(c.layouts.get(t) == l for t, l in fixed.items()) for c in ov.candidates)
        if not ok:
            what = ", ".join(f"{t}={l} ({problem.pins[t][1]})" for t, l in fixed.items())
            how = "one GEMM call" if ov.kind == "gemm" else "any of its candidates"
            tr = ("transposes are disabled" if not problem.allow_transpose
                  else "a tensor with several writers cannot be converted after the fact")
            raise LayoutInfeasible(f"operator {ov.label} ({ov.graph}) cannot access pinned layout(s) {what} "
                                   f"as {how}, and {tr}")


def _diagnose(problem: LayoutProblem, mdl: _Model, time_limit: float) -> str:
    """A message naming a minimal set of pins and ties that make the problem infeasible."""
    groups = list(dict.fromkeys(t for t in mdl.tags if t is not None))
    if mdl.solve(time_limit, frozenset(groups), objective=False).status == 2:
        tr = "" if problem.allow_transpose else " with transposes disabled"
        return f"no layout assignment exists even without pins and ties{tr}: an operator has no usable candidate"
    # Deletion filter: drop each group in turn; it stays out if the rest is still infeasible. What
    # remains is an irreducible infeasible set of pins and ties.
    active = list(groups)
    for gr in groups:
        trial = [g for g in active if g != gr]
        if mdl.solve(time_limit, frozenset(set(groups) - set(trial)), objective=False).status == 2:
            active = trial
    needed = active
    parts = []
    for gr in needed:
        if gr[0] == "pin":
            l, why = problem.pins[gr[1]]
            parts.append(f"pin {gr[1]}={l} ({why})")
        else:
            why = next(w for a, b, w in problem.ties if (a, b) == gr[1:])
            parts.append(f"tie {gr[1]}~{gr[2]} ({why})")
    tr = "" if problem.allow_transpose else " with transposes disabled"
    return "no layout assignment satisfies " + "; ".join(parts or ["the constraints"]) + tr


def default_solution(problem: LayoutProblem) -> Solution:
    """The solution that keeps PyTorch's layouts everywhere (each operator's default candidate)."""
    layouts = {t: tv.dims for t, tv in problem.tensors.items()}
    access, options, choice, secs = {}, {}, {}, {}
    for key, ov in problem.ops.items():
        access[key] = {t: problem.tensors[t].dims for t in dict.fromkeys(ov.reads + ov.writes)}
        options[key] = dict(ov.default.options) if ov.default else {}
        choice[key] = "default"
        secs[key] = ov.default.seconds * ov.scale if ov.default else math.inf
    total = default_solution_seconds(problem)
    return Solution(layouts, access, options, choice, secs, [], total, lower_bound(problem), total, 0.0)


# -- plans -----------------------------------------------------------------------------------------
@dataclasses.dataclass
class LayoutPlan:
    """A layout plan: what :func:`apply_plan` changes in the graphs (a human-readable JSON file).

    Attributes:
        tensors: tensor -> layout (outermost first); tensors not listed keep PyTorch's layout.
        kernels: ``graph/label`` -> per-kernel options (``vector``: the innermost loop letter of a row
            kernel; ``gemm``: the GEMM mapping, informational).
        transposes: explicit transposes: dicts with ``graph``, ``tensor``, ``layout`` and
            ``direction`` ``read`` (a copy for the operators in ``ops``) or ``write`` (the writer in
            ``ops`` writes ``layout``, a transpose fills the stored tensor).
        meta: provenance and figures (config, sizes, dtype, objective/lower bound/default seconds, ...).
    """

    tensors: dict = dataclasses.field(default_factory=dict)
    kernels: dict = dataclasses.field(default_factory=dict)
    transposes: list = dataclasses.field(default_factory=list)
    meta: dict = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        """The plan as plain data (the JSON file's content)."""
        return {"format": PLAN_FORMAT, **self.meta, "tensors": self.tensors, "kernels": self.kernels,
                "transposes": self.transposes}

    def to_json(self) -> str:
        """Human-readable JSON (one tensor / kernel per line)."""
        d = self.to_dict()
        lines = ["{"]
        items = list(d.items())
        for n, (k, v) in enumerate(items):
            comma = "," if n < len(items) - 1 else ""
            if isinstance(v, dict) and v and k in ("tensors", "kernels"):
                lines.append(f"  {json.dumps(k)}: {{")
                sub = list(v.items())
                for m, (kk, vv) in enumerate(sub):
                    lines.append(f"    {json.dumps(kk)}: {json.dumps(vv, sort_keys=True)}"
                                 + ("," if m < len(sub) - 1 else ""))
                lines.append("  }" + comma)
            elif isinstance(v, list) and v:
                lines.append(f"  {json.dumps(k)}: [")
                for m, vv in enumerate(v):
                    lines.append(f"    {json.dumps(vv, sort_keys=True)}" + ("," if m < len(v) - 1 else ""))
                lines.append("  ]" + comma)
            else:
                lines.append(f"  {json.dumps(k)}: {json.dumps(v, sort_keys=True)}{comma}")
        lines.append("}")
        return "\n".join(lines) + "\n"

    @classmethod
    def from_dict(cls, d: Mapping) -> "LayoutPlan":
        """Raises PlanError: not a plan of this format or a malformed entry."""
        if not isinstance(d, Mapping) or d.get("format") != PLAN_FORMAT:
            raise PlanError(f"not a layout plan (expected \"format\": \"{PLAN_FORMAT}\")")
        tensors, kernels, transposes = d.get("tensors", {}), d.get("kernels", {}), d.get("transposes", [])
        if not isinstance(tensors, Mapping) or not all(isinstance(v, str) for v in tensors.values()):
            raise PlanError("plan 'tensors' must map tensor names to layout strings")
        if not isinstance(kernels, Mapping) or not all(isinstance(v, Mapping) for v in kernels.values()):
            raise PlanError("plan 'kernels' must map 'graph/label' to option objects")
        if not isinstance(transposes, list):
            raise PlanError("plan 'transposes' must be a list")
        for tr in transposes:
            missing = {"graph", "tensor", "layout", "direction", "ops"} - set(tr)
            if missing or tr["direction"] not in ("read", "write"):
                raise PlanError(f"malformed transpose entry {tr!r} (needs graph, tensor, layout, "
                                f"direction read|write, ops)")
        meta = {k: v for k, v in d.items() if k not in ("format", "tensors", "kernels", "transposes")}
        return cls(dict(tensors), {k: dict(v) for k, v in kernels.items()}, [dict(t) for t in transposes], meta)

    @classmethod
    def from_json(cls, text: str) -> "LayoutPlan":
        """Raises PlanError: not JSON, or not a plan (see :meth:`from_dict`)."""
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as e:
            raise PlanError(f"plan is not valid JSON: {e}") from None

    def save(self, path: str) -> None:
        """Write the plan atomically (temporary file + rename)."""
        atomic_write_text(path, self.to_json())

    @classmethod
    def load(cls, path: str) -> "LayoutPlan":
        """Raises FileNotFoundError, PlanError."""
        with open(path) as f:
            return cls.from_json(f.read())


def load_plan(plan) -> LayoutPlan | None:
    """A plan from ``None``/``"default"`` (None: change nothing), a :class:`LayoutPlan`, a mapping,
    a path to a plan JSON file, or a bundled plan name (``configs/<name>.plan.json``).

    Raises:
        FileNotFoundError: no such plan file. PlanError: a malformed plan.
    """
    if plan is None or (isinstance(plan, str) and plan == "default"):
        return None
    if isinstance(plan, LayoutPlan):
        return plan
    if isinstance(plan, Mapping):
        return LayoutPlan.from_dict(plan)
    path = os.fspath(plan)
    if not os.path.exists(path):
        path = bundled_file(path, ".plan.json")
        if path is None:
            raise FileNotFoundError(f"no layout plan {plan!r} (neither a file nor configs/{plan}.plan.json)")
    return LayoutPlan.load(path)


def plan_from_solution(problem: LayoutProblem, sol: Solution, costs: str = "analytic", **meta) -> LayoutPlan:
    """The plan recording ``sol``: the stored layout of every tensor, each kernel's options, the
    transposes, and the figures (objective, lower bound, default, in seconds)."""
    tensors = {t: sol.layouts[t] for t in problem.tensors}
    kernels = {}
    for key, ov in problem.ops.items():
        opts = dict(sol.options.get(key, {}))
        if ov.kind == "gemm" and "gemm" in opts:
            g = opts["gemm"]
            opts = {"gemm": f"m={g['m']} n={g['n']} k={g['k']} batch={g['batch'] or '-'} "
                            f"{'swap ' if g['swap'] else ''}{'T' if g['trans_a'] else 'N'}{'T' if g['trans_b'] else 'N'}"}
        opts["seconds"] = round(sol.op_seconds[key], 9)
        kernels[key] = opts
    transposes = [{k: (round(v, 9) if k == "seconds" else v) for k, v in tr.items()} for tr in sol.transposes]
    info = dict(problem.meta)
    info.update({"costs": costs, "objective_seconds": round(sol.objective, 9),
                 "lower_bound_seconds": round(sol.lower_bound, 9),
                 "default_seconds": None if sol.default_seconds is None or math.isinf(sol.default_seconds)
                 else round(sol.default_seconds, 9),
                 "solve_seconds": round(sol.solve_seconds, 3)})
    info.update(meta)
    return LayoutPlan(tensors, kernels, transposes, info)


# -- applying a plan -------------------------------------------------------------------------------
def _rename_records(records: list, rename: Mapping[str, str]) -> list:
    out = []
    for m in records:
        m = dict(m)
        m["inputs"] = {c: [rename.get(t, t), a] for c, (t, a) in m["inputs"].items()}
        m["outputs"] = {c: [rename.get(t, t), a] for c, (t, a) in m["outputs"].items()}
        out.append(m)
    return out


def _apply_graph(graph: LayerGraph, plan: LayoutPlan) -> LayerGraph:
    phase = graph.phase
    layouts = {n: plan.tensors.get(n, info.layout) for n, info in graph.tensors.items()}
    reads: dict[str, dict[str, str]] = {}    # op label -> {tensor: copy name}
    writes: dict[str, dict[str, str]] = {}
    copies: dict[str, tuple[str, str]] = {}  # copy name -> (tensor, layout)
    for tr in plan.transposes:
        if tr["graph"] != phase:
            continue
        t, l = tr["tensor"], tr["layout"]
        if t not in graph.tensors:
            raise PlanError(f"plan transposes tensor {t!r}, which the {phase} graph does not have")
        if sorted(l) != sorted(graph.tensors[t].dims):
            raise PlanError(f"plan transpose of {t} to {l!r}: not a permutation of {graph.tensors[t].dims!r}")
        name = f"{t}__{l}"
        copies[name] = (t, l)
        for label in tr["ops"]:
            label = label.split("/", 1)[-1]
            (reads if tr["direction"] == "read" else writes).setdefault(label, {})[t] = name
    b = GraphBuilder(graph.sdfg.name, graph.config, phase)
    for name, info in graph.tensors.items():
        b.tensor(name, info.dims, info.role, layouts[name])
    for name, (t, l) in copies.items():
        b.tensor(name, graph.tensors[t].dims, "temp", l)
    labels = {op.label for op in graph.operators()}
    for table in (reads, writes):
        for label in table:
            if label not in labels:
                raise PlanError(f"plan names operator {phase}/{label}, which the {phase} graph does not have")
    made: set[str] = set()
    for op in graph.operators():
        key = f"{phase}/{op.label}"
        rename_in = reads.get(op.label, {})
        rename_out = writes.get(op.label, {})
        for t, cname in rename_in.items():
            if cname not in made:
                made.add(cname)
                l = copies[cname][1]
                b.op(f"transpose_{t}_{l}", "transpose", "EW", {"x": t}, {"y": cname}, vector=layouts[t][-1])
        ins = {c: f"{rename_in.get(t, t)}[{a}]" for c, (t, a) in graph.inputs_of(op).items()}
        outs = {c: f"{rename_out.get(t, t)}[{a}]" for c, (t, a) in graph.outputs_of(op).items()}
        attrs = op.attrs
        kopts = plan.kernels.get(key, {})
        if op.kind == "fused":
            attrs["ops"] = _rename_records(attrs["ops"], {**rename_in, **rename_out})
        if op.kind != "contraction" and kopts.get("vector"):
            attrs["vector"] = kopts["vector"]
        b.op(op.label, op.kind, op.op_class, ins, outs, **attrs)
        for t, cname in rename_out.items():
            l = copies[cname][1]
            b.op(f"transpose_{t}_{l}", "transpose", "EW", {"x": cname}, {"y": t}, vector=l[-1])
    return b.finish()


def _warn_if_tuned_elsewhere(plan: LayoutPlan, config) -> None:
    """A UserWarning when ``plan`` records a dtype or static sizes (H, P, I, U) other than ``config``'s:
    it still applies (its tensors and kernels exist), but its layouts were chosen for other costs."""
    sizes, want = plan.meta.get("sizes") or {}, config.sizes()
    diff = [f"{k}={sizes[k]} (here {want[k]})" for k in ("H", "P", "I", "U") if k in sizes and sizes[k] != want[k]]
    if plan.meta.get("dtype") not in (None, config.dtype):
        diff.append(f"dtype {plan.meta['dtype']} (here {config.dtype})")
    if diff:
        warnings.warn(f"layout plan made for config {plan.meta.get('config', '?')} applied to {config.name}: "
                      f"it was chosen for {', '.join(diff)}; run `substation tune` for this config",
                      UserWarning, stacklevel=3)


def apply_plan(fwd: LayerGraph, bwd: LayerGraph, plan) -> tuple[LayerGraph, LayerGraph]:
    """Apply a layout plan to a layer's (forward, backward) graphs.

    Every tensor gets the plan's layout (the SDFG array strides change), read copies and write
    conversions become ``transpose`` operators (EW, 0 flop), and row kernels get their ``vector``
    option. ``plan`` is anything :func:`load_plan` accepts; None/``"default"`` returns the graphs
    unchanged.

    Warns (UserWarning) when the plan records a dtype or sizes H, P, I, U other than the graphs'.

    Raises:
        PlanError: the plan names tensors or operators the graphs lack, gives a layout that is not a
            permutation, or changes a tensor the runtime exchanges with PyTorch (X, Y, dX, dY, the
            mask, parameters and their gradients must keep PyTorch's layouts).
        LayoutError: a contraction whose new layouts do not map to one GEMM.
    """
    from ..backends.cpu.codegen import _resolve, plan_contraction
    plan = load_plan(plan)
    if plan is None:
        return fwd, bwd
    _warn_if_tuned_elsewhere(plan, fwd.config)
    known = {n: t for g in (fwd, bwd) for n, t in g.tensors.items()}
    api = {n for g in (fwd, bwd) for n, t in g.tensors.items() if t.role in ("input", "param", "output")}
    for name, layout in plan.tensors.items():
        if name not in known:
            raise PlanError(f"plan gives a layout for tensor {name!r}, which these graphs do not have "
                            f"(made for config {plan.meta.get('config', '?')}, fused={plan.meta.get('fused', '?')})")
        info = known[name]
        if sorted(layout) != sorted(info.dims):
            raise PlanError(f"plan layout {layout!r} of {name} is not a permutation of its dims {info.dims!r}")
        if name in api and layout != info.dims:
            raise PlanError(f"plan stores {name} as {layout!r}, but the runtime exchanges {name} with PyTorch "
                            f"as {info.dims!r}; use a transpose instead")
    ops = {f"{g.phase}/{op.label}" for g in (fwd, bwd) for op in g.operators()}
    for key in plan.kernels:
        if key not in ops:
            raise PlanError(f"plan has options for kernel {key!r}, which these graphs do not have")
    new = tuple(_apply_graph(g, plan) for g in (fwd, bwd))
    for g in new:
        for op in g.operators():
            if op.kind == "contraction":
                o = {c: _resolve(g, t, a) for c, (t, a) in g.operands(op).items()}
                out = o.pop("y")
                plan_contraction(*o.values(), out, op.label)
    return new
