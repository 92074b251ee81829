"""Layout plans: the JSON format, conversion from a solution, and applying a plan to the graphs."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from typing import Mapping

from ...backends.rowkernel import is_row_kernel, kernel_members
from ...files import atomic_write_text
from ...ir.graph import GraphBuilder, LayerGraph
from ...ir.operands import plan_bias, plan_contraction, resolve_operand
from ...ops.contraction import EPILOGUE_BIAS, factors
from ...ops.kind import op_space
from ..precision import applies_to as mixed_precision
from ...resources import bundled_file, bundled_names
from .problem import LayoutProblem
from .solve import Solution

#: The ``format`` field of a plan file.
PLAN_FORMAT = "substation-layout-plan/1"


class PlanError(ValueError):
    """A plan file is malformed or does not fit the graphs it is applied to; the message says why."""


# -- plans -----------------------------------------------------------------------------------------
@dataclasses.dataclass
class LayoutPlan:
    """A layout plan: what :func:`apply_plan` changes in the graphs (a human-readable JSON file).

    Attributes:
        tensors: tensor -> layout (outermost first); tensors not listed keep PyTorch's layout.
        kernels: ``graph/label`` -> per-kernel options (``vector``: the innermost loop letter of a row
            kernel; ``gemm``: the GEMM mapping, informational).
        transposes: explicit transposes: dicts with ``graph``, ``tensor``, ``layout`` and
            ``direction`` ``read`` (a copy for the operators in ``ops``) or ``write`` (the writers in
            ``ops`` write ``layout``; one transpose after the last of them fills the stored tensor).
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
            missing = {"graph", "tensor", "layout", "direction", "ops"} - set(tr) if isinstance(tr, Mapping) else {1}
            if missing or tr["direction"] not in ("read", "write"):
                raise PlanError(f"malformed transpose entry {tr!r} (needs graph, tensor, layout, "
                                f"direction read|write, ops)")
            if tr["graph"] not in ("forward", "backward"):
                raise PlanError(f"transpose entry of {tr['tensor']!r}: graph {tr['graph']!r} is neither "
                                f"'forward' nor 'backward'")
            if not isinstance(tr["layout"], str) or not isinstance(tr["tensor"], str):
                raise PlanError(f"transpose entry {tr!r}: tensor and layout must be strings (layout: "
                                f"letters outermost first, e.g. \"TBJHP\")")
            ops = tr["ops"]
            if not isinstance(ops, list) or not ops or not all(isinstance(o, str) for o in ops):
                raise PlanError(f"transpose entry of {tr['tensor']!r}: 'ops' must be a non-empty list of "
                                f"operator labels, got {ops!r}")
            wrong = [o for o in ops if "/" in o and o.split("/", 1)[0] != tr["graph"]]
            if wrong:
                raise PlanError(f"transpose entry of {tr['tensor']!r} in the {tr['graph']} graph names "
                                f"operators of another graph: {', '.join(wrong)}")
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
        """Raises FileNotFoundError, PermissionError; PlanError (naming ``path``): a folder, not text, or
        a malformed plan."""
        try:
            with open(path) as f:
                return cls.from_json(f.read())
        except IsADirectoryError:
            raise PlanError(f"layout plan {os.fspath(path)!r} is a folder; give a plan JSON file "
                            f"(written by substation tune)") from None
        except UnicodeDecodeError:
            raise PlanError(f"layout plan {os.fspath(path)!r} is not a text (JSON) file") from None
        except PlanError as e:
            raise PlanError(f"layout plan {os.fspath(path)!r}: {e}") from None


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
        path = bundled_file(path, ".plan.json") if os.path.sep not in path else None
        if path is None:
            raise FileNotFoundError(f"no layout plan {os.fspath(plan)!r}: no such file, nor a bundled plan "
                                    f"({', '.join(bundled_names('.plan.json'))})")
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
def rename_member_tensors(records: list, rename: Mapping[str, str]) -> list:
    """Copies of a fused operator's member records with tensors renamed by ``rename`` (old -> new
    name; others kept): how a transposed copy replaces a tensor inside a fused kernel."""
    out = []
    for m in records:
        m = dict(m)
        m["inputs"] = {c: [rename.get(t, t), a] for c, (t, a) in m["inputs"].items()}
        m["outputs"] = {c: [rename.get(t, t), a] for c, (t, a) in m["outputs"].items()}
        out.append(m)
    return out


def _check_vector(graph: LayerGraph, op, vector, key: str) -> None:
    """Raises PlanError unless ``vector`` is a letter the row kernel ``op`` may loop over innermost: one
    of its letters, and of those its reduction keeps inner where it has one."""
    if not is_row_kernel(op):
        raise PlanError(f"plan gives kernel {key} (a GEMM) a 'vector' option; only row kernels take one")
    spaces = [op_space(m["kind"], m["inputs"], m["outputs"], m["attrs"]) for m in kernel_members(graph, op)]
    allowed = next((n for _, n in spaces if n is not None), spaces[0][0])
    if not isinstance(vector, str) or vector not in allowed:
        raise PlanError(f"plan gives kernel {key} vector letter {vector!r}; it can vectorize "
                        f"{', '.join(sorted(allowed))}")


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
        if copies.get(name, (t, l, tr["direction"]))[2] != tr["direction"]:
            raise PlanError(f"plan both reads and writes {phase}/{t} through a {l} copy; use one direction")
        copies[name] = (t, l, tr["direction"])
        table = reads if tr["direction"] == "read" else writes
        for label in tr["ops"]:
            label = label.split("/", 1)[-1]
            if table.get(label, {}).get(t, name) != name:
                raise PlanError(f"plan gives {phase}/{label} two {tr['direction']} copies of {t} "
                                f"({table[label][t].split('__')[-1]} and {l})")
            table.setdefault(label, {})[t] = name
    b = GraphBuilder(graph.sdfg.name, graph.config, phase)
    for name, info in graph.tensors.items():
        b.copy_tensor(info, layout=layouts[name])
    for name, (t, l, _) in copies.items():
        b.copy_tensor(graph.tensors[t], role="temp", layout=l, name=name)
    labels = {op.label for op in graph.operators()}
    for table in (reads, writes):
        for label in table:
            if label not in labels:
                raise PlanError(f"plan names operator {phase}/{label}, which the {phase} graph does not have")
    for cname, (t, _, direction) in copies.items():
        if direction == "read":  # a read copy is for operators that read the tensor
            named = {label for label, table in reads.items() if table.get(t) == cname}
            stray = {op.label for op in graph.operators() if op.label in named
                     and not any(r == t for r, _ in graph.inputs_of(op).values())}
            if stray:
                raise PlanError(f"plan's read copy of {phase}/{t} names operators that do not read it: "
                                f"{', '.join(sorted(stray))}")
            continue
        # a write copy replaces the tensor for every one of its writers
        named = {label for label, table in writes.items() if table.get(t) == cname}
        writers = {op.label for op in graph.operators() if any(w == t for w, _ in graph.outputs_of(op).values())}
        if named != writers:
            raise PlanError(f"plan's write transpose of {phase}/{t} must name all of its writers "
                            f"({', '.join(sorted(writers))}); missing: {', '.join(sorted(writers - named)) or '-'}, "
                            f"not writers of {t}: {', '.join(sorted(named - writers)) or '-'}")
    # A write copy is transposed into the stored tensor once, after the last of its writers (several
    # writers may each fill a slice of it: the Q, K and V gradients of dQKV).
    last_writer = {cname: op.label for op in graph.operators() for cname in writes.get(op.label, {}).values()}
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
            attrs["ops"] = rename_member_tensors(attrs["ops"], {**rename_in, **rename_out})
        if kopts.get("vector") is not None:
            _check_vector(graph, op, kopts["vector"], key)
            attrs["vector"] = kopts["vector"]
        b.op(op.label, op.kind, op.op_class, ins, outs, **attrs)
        for t, cname in rename_out.items():
            if last_writer[cname] == op.label:
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


#: The plan of a bfloat16 CPU build given none: QKV stored T-major ([T, B, J, H, P]), so that Q, K and V
#: are each a dense [B, J, H, P] tensor, whose per-head rows (stride I) oneDNN's brgemm matmul takes;
#: per-head views of the token-major tensor (row stride 3 I) run its slower gemm:jit kernel
#: (docs/toolchain.md). dQKV stays token-major, since backward's QKV GEMMs read it as one [B J, 3 I]
#: matrix, but the attention products that write its Q, K and V slices write a T-major copy, which one
#: transpose after the last of them moves into place (the copy costs less than gemm:jit's slowdown).
BF16_CPU_PLAN = LayoutPlan(tensors={"QKV": "TBJHP"},
                           transposes=[{"graph": "backward", "tensor": "dQKV", "layout": "TBJHP", "direction": "write",
                                        "ops": ["context_dv", "scores_dq", "scores_dk"]}],
                           meta={"description": "bfloat16 CPU builds: Q, K, V (and in backward their gradients) "
                                                "as separate [B, J, H, P] blocks"})


def default_plan(config) -> LayoutPlan | None:
    """The plan a build of ``config`` gets when none is given: :data:`BF16_CPU_PLAN` for bfloat16 CPU
    builds, else None (PyTorch's layouts)."""
    return BF16_CPU_PLAN if mixed_precision(config.dtype, config.target) else None


def apply_plan(fwd: LayerGraph, bwd: LayerGraph | None, plan) -> tuple[LayerGraph, LayerGraph | None]:
    """Apply a layout plan to a layer's (forward, backward) graphs (backward None: an inference build's
    forward graph alone).

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
    plan = load_plan(plan)
    if plan is None:
        return fwd, bwd
    _warn_if_tuned_elsewhere(plan, fwd.config)
    graphs = [g for g in (fwd, bwd) if g is not None]
    known = {n: t for g in graphs for n, t in g.tensors.items()}
    api = {n for g in graphs for n, t in g.tensors.items() if t.role in ("input", "param", "output")}
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
    ops = {f"{g.phase}/{op.label}" for g in graphs for op in g.operators()}
    for key in plan.kernels:
        if key not in ops:
            raise PlanError(f"plan has options for kernel {key!r}, which these graphs do not have")
    new = tuple(_apply_graph(g, plan) if g is not None else None for g in (fwd, bwd))
    for g in (g for g in new if g is not None):
        for op in g.operators():
            if op.kind == "contraction":
                o = {c: resolve_operand(g, t, a) for c, (t, a) in g.operands(op).items()}
                contraction = plan_contraction(*factors(o), o["y"], op.label)
                if EPILOGUE_BIAS in o:
                    plan_bias(contraction, o[EPILOGUE_BIAS], op.label)
    return new
