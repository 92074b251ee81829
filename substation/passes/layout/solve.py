"""The exact solve of a layout problem: a 0/1 integer program (HiGHS through ``scipy.optimize.milp``),
its diagnosis when infeasible, and the default (PyTorch layouts) solution."""
from __future__ import annotations

import dataclasses
import math
import time

from .problem import TIE_BREAK, LayoutProblem, OpVar, closeness


class LayoutInfeasible(ValueError):
    """No layout assignment satisfies the requested constraints; the message names them."""


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
        idx = {l: mdl.var(TIE_BREAK * closeness(l, tv.dims)) for l in tv.domain}
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
