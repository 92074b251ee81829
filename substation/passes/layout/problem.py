"""The layout problem: candidate layouts and GEMM modes per operator, the analytic cost model, and the
problem of a layer's forward and backward graphs (see :mod:`substation.passes.layout`)."""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
from typing import Callable, Iterable, Mapping

from ...ir.graph import LayerGraph, Operator, access_letters
from ...ir.operands import LayoutError, gemm_groups
from ...ops import op_space
from ...ops.contraction import factors


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


def closeness(layout: str, dims: str) -> int:
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
    ``trans_b``, as :func:`substation.ir.operands.plan_contraction` derives them).

    Modes that loop over the stack letter T (one GEMM per T, as ``plan_contraction`` falls back to) are
    included.

    Raises:
        LayoutError: an empty index group or a letter in only one operand (no layout maps to a GEMM).
    """
    batch, m, n, k = gemm_groups(c_access, a_access, b_access)
    letters = set(access_letters(c_access)) | set(access_letters(a_access)) | set(access_letters(b_access))
    if not m or not n or not k or letters - set(batch) - set(m) - set(n) - set(k):
        raise LayoutError(f"{c_access} = {a_access} x {b_access} does not map to a GEMM in any layout")
    res = []
    looped = gemm_groups(c_access, a_access, b_access, loop_stack=True)
    for batch, m, n, k in [(batch, m, n, k)] + ([looped] if looped else []):
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
    (a_t, a_acc), (b_t, b_acc) = factors(ops)  # an epilogue bias is a parameter: PyTorch's layout
    reads, writes = _op_operands(graph, op)
    roles: dict[str, list] = {}
    for role, t, acc in (("A", a_t, a_acc), ("B", b_t, b_acc), ("C", c_t, c_acc)):
        roles.setdefault(t, []).append((role, acc))
    batch, m, n, k = gemm_groups(c_acc, a_acc, b_acc)
    flops = 2 * _elements("".join(batch + m + n + k), sizes)
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
            base = (model.kernel_seconds + _elements(gm["batch"], sizes) * model.call_seconds
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
        best = min(costs, key=lambda l: (costs[l], closeness(l, dims), l))
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
