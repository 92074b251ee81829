"""Reverse-mode differentiation of a forward :class:`~substation.ir.graph.LayerGraph`.

The backward graph is derived operator by operator, in reverse topological order, from one
vector-Jacobian rule per operator kind, so every encoder variant gets its backward pass without
code of its own. Rules (y is the operator's output, dy its gradient):

* contraction ``y = alpha * einsum(a, b)``: ``da = alpha * einsum(dy, b)``, ``db = alpha * einsum(a, dy)``
  (two TC operators; every TC of the forward gives a data and a weight gradient).
* bias ``y = x + b``: ``dx = dy`` (no operator), ``db = sum of dy over the broadcast dimensions`` (SN).
* add (residual) and mask: the gradient passes through to each summand (no operator).
* dropout: ``dx = dy * keep / (1 - p)`` with the forward's mask regenerated from the same
  counter-based random stream (EW); nothing is saved.
* activation: ``dx = dy * f'(x)`` (EW, needs x).
* softmax over K: ``dx = y * (dy - sum_K(y * dy))`` (SN, needs y).
* layer norm over I: ``dx`` from x, mean, 1/std and gamma (SN) and ``dgamma, dbeta`` (SN); RMSNorm:
  ``dx`` from x, 1/rms and gamma (SN) and ``dgamma`` (SN).

Gradients reaching one tensor from several consumers are summed by one ``add`` operator; gradients of
disjoint views (Q, K, V of the stacked QKV tensor) are written straight into one tensor. Forward
tensors the backward graph reads become ``saved`` in the forward graph.

Dtypes (mixed-precision graphs, :mod:`substation.passes.precision`): a gradient has the dtype of its
tensor and a low-precision parameter's gradient is float32 (autocast's master gradients); a gradient
passing through to a narrower tensor (the float32 dR2 into the bfloat16 F2 of a residual add) goes
through a ``cast``, as autograd casts a gradient to its input's dtype.
"""
from __future__ import annotations

import dataclasses

from ..ir.graph import GraphBuilder, LayerGraph, TensorInfo, parameters
from ..ops import op_kind
from .precision import WIDTH

__all__ = ["build_backward"]


def build_backward(fwd: LayerGraph) -> tuple[LayerGraph, LayerGraph]:
    """Derive the backward graph of ``fwd``.

    Inputs of the backward graph: ``dY[B, J, I]``, the parameters and the forward tensors it needs
    (role ``saved``). Outputs: ``dX[B, J, I]`` and ``d<parameter>`` for every parameter, in the
    parameter's dims.

    Returns:
        (forward graph with the tensors backward reads marked ``saved``, backward graph).
    """
    return _Differentiator(fwd).run()


def _grad_dtype(info: TensorInfo) -> str | None:
    """The dtype of the gradient of ``info``: its own, float32 for low-precision parameters."""
    if info.role == "param" and info.dtype is not None and WIDTH[info.dtype] < WIDTH["float32"]:
        return "float32"
    return info.dtype


class _Differentiator:
    def __init__(self, fwd: LayerGraph):
        self.fwd = fwd
        name = fwd.sdfg.name.replace("_forward", "") + "_backward"
        self.g = GraphBuilder(name, fwd.config, "backward")
        self.grads: dict[str, list[str]] = {}
        self.view_grads: set[str] = set()
        self.consumers: dict[str, int] = {}
        for op in fwd.operators():
            for t, _ in fwd.inputs_of(op).values():
                self.consumers[t] = self.consumers.get(t, 0) + 1

    # -- tensors ------------------------------------------------------------------------------
    def use(self, name: str, access: str | None = None) -> str:
        """Reference to forward tensor ``name`` inside the backward graph (declared on first use)."""
        if name not in self.g.tensors:
            info = self.fwd.tensors[name]
            role = "param" if info.role == "param" else "saved"
            self.g.copy_tensor(info, role=role)
        return f"{name}[{access}]" if access else name

    def grad_target(self, name: str, access: str, op: str) -> str | None:
        """Where the gradient contribution of ``op`` to forward tensor ``name`` is written."""
        info = self.fwd.tensors[name]
        if info.role == "input" and name != "X":
            return None  # the mask has no gradient
        if info.role == "param":
            gname = f"d{name}"
            self._grad_tensor(gname, info, "output")
            return f"{gname}[{access}]"
        if any(c.isdigit() for c in access):
            gname = f"d{name}"
            if name not in self.view_grads:
                self.view_grads.add(name)
                self._grad_tensor(gname, info, "temp")
                self.grads.setdefault(name, []).append(gname)
            return f"{gname}[{access}]"
        gname = f"d{name}" if self.consumers[name] == 1 else f"d{name}__{op}"
        if name == "X" and self.consumers[name] == 1:
            self._grad_tensor(gname, info, "output")
        elif gname not in self.g.tensors:
            self._grad_tensor(gname, info, "temp")
        self.grads.setdefault(name, []).append(gname)
        return f"{gname}[{access}]"

    def _grad_tensor(self, gname: str, info: TensorInfo, role: str) -> None:
        self.g.tensor(gname, info.dims, role, info.layout, _grad_dtype(info))

    def pass_through(self, name: str, dy: str) -> None:
        """Gradient ``dy`` of an operator's output reaches its input ``name`` unchanged (cast to
        ``name``'s dtype where that is narrower)."""
        info = self.fwd.tensors[name]
        if info.role == "input" and name != "X":
            return
        have = self.g.tensors[dy].dtype
        if info.dtype is not None and have is not None and WIDTH[info.dtype] < WIDTH[have]:
            n = sum(t.startswith(f"d{name}__cast") for t in self.g.tensors)
            gname = f"d{name}__cast{n or ''}"
            self._grad_tensor(gname, info, "temp")
            self.g.op(f"{name}_grad_cast{n or ''}", "cast", "EW", {"x": dy}, {"y": gname})
            dy = gname
        self.grads.setdefault(name, []).append(dy)

    def grad_of(self, name: str) -> str | None:
        """The (summed) gradient tensor of forward tensor ``name``, or None if nothing reaches it."""
        parts = self.grads.get(name)
        if not parts:
            return None
        if len(parts) == 1 and not (name == "X" and parts[0] != "dX"):
            return parts[0]
        info = self.fwd.tensors[name]
        out = f"d{name}"
        if out not in self.g.tensors:
            self._grad_tensor(out, info, "output" if name == "X" else "temp")
        if len(parts) == 1:
            self.g.op(f"{name}_grad_copy", "add", "EW", {"a": parts[0]}, {"y": out})
        else:
            self.g.op(f"{name}_grad_sum", "add", "EW", {f"in{i}": p for i, p in enumerate(parts)}, {"y": out})
        self.grads[name] = [out]
        return out

    # -- the pass ---------------------------------------------------------------------------------
    def run(self) -> tuple[LayerGraph, LayerGraph]:
        g = self.g
        g.tensor("dY", "BJI", "input", dtype=self.fwd.tensors["Y"].dtype)
        self.grads["Y"] = ["dY"]
        for op in reversed(self.fwd.operators()):
            ins = self.fwd.inputs_of(op)
            outs = self.fwd.outputs_of(op)
            y_name, y_acc = outs["y"]
            dy = self.grad_of(y_name)
            if dy is None:
                continue
            vjp = op_kind(op.kind).vjp
            if vjp is None:
                raise ValueError(f"operator {op.label}: kind {op.kind!r} has no vector-Jacobian rule")
            vjp(self, op, ins, outs, dy, y_acc)
        dx = self.grad_of("X")
        assert dx == "dX", dx
        missing = [p for p in parameters(self.fwd.config) if f"d{p}" not in g.tensors]
        if missing:
            raise RuntimeError(f"internal error: no gradient reaches parameters {missing}")
        bwd = g.finish()
        saved = {n for n, t in bwd.tensors.items() if t.role == "saved"}
        tensors = {n: (dataclasses.replace(t, role="saved") if n in saved and t.role == "temp" else t)
                   for n, t in self.fwd.tensors.items()}
        for n in saved:
            self.fwd.sdfg.arrays[n].transient = False
        fwd = dataclasses.replace(self.fwd, tensors=tensors)
        return fwd, bwd
