"""Global data-layout selection: candidates, an analytic cost model, an exact solve, plans.

The layout of a tensor is the order of its dimension letters from outermost to innermost (the last
has stride 1; DESIGN.md section 5). This pass chooses the layouts of every tensor of a layer's
forward *and* backward graph together:

* **Candidates.** A contraction (TC) can use a layout combination iff it maps to one strided-batched
  GEMM call (what :func:`substation.ir.operands.plan_contraction` accepts): its index groups (rows ``m``,
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

from ...ir.operands import LayoutError
from .plan import (BF16_CPU_PLAN, PLAN_FORMAT, LayoutPlan, PlanError, apply_plan, default_plan, load_plan,
                   plan_from_solution, rename_member_tensors)
from .problem import (Candidate, CostModel, LayoutProblem, Mode, OpVar, TensorVar, build_problem, gemm_modes,
                      graph_signature, make_problem, op_candidates)
from .solve import LayoutInfeasible, Solution, default_solution, lower_bound, solve

__all__ = [
    "BF16_CPU_PLAN", "PLAN_FORMAT", "LayoutError", "default_plan", "LayoutInfeasible", "PlanError", "CostModel", "Mode", "Candidate",
    "TensorVar", "OpVar", "LayoutProblem", "Solution", "LayoutPlan", "build_problem", "solve",
    "lower_bound", "default_solution", "apply_plan", "load_plan",
    "plan_from_solution", "op_candidates", "gemm_modes", "make_problem", "graph_signature", "rename_member_tensors",
]
