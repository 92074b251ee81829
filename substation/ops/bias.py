"""Kinds ``bias`` (EW, ``y = x + b``, b broadcast over the letters it lacks) and ``bias_grad`` (SN, a
column reduction: ``db = sum of dy over the broadcast letters``)."""
from __future__ import annotations

from .kind import OpKind, align, elementwise_flop, reduce_to, register


def _bias_vjp(d, op, ins, outs, dy, y_acc):
    x, _ = ins["x"]
    b, b_acc = ins["b"]
    d.pass_through(x, dy)
    d.g.op(f"{op.label}_grad", "bias_grad", "SN", {"dy": f"{dy}[{y_acc}]"},
           {"y": d.grad_target(b, b_acc, op.label)})


def _bias_cpu(k, m, attrs):
    k.ew(m, "v_x + v_b")


def _bias_cuda(k, m, attrs):
    k.ew(m, "{x} + {b}")


def _bias_grad_cpu(k, m, attrs):
    dy = k.read(*m["inputs"]["dy"])
    (t, _), = m["outputs"].values()
    k.inner([f"{k.acc[t]}[n_] += {dy};"])


def _bias_grad_cuda(k, m, attrs):
    dy = k.val(*m["inputs"]["dy"])
    (t, _), = m["outputs"].values()
    k.lane([f"acc_{t}[n0_ + l_] += {dy};"])


def _bias_reference(ins, outs, attrs):
    (x, lx), (b, lb) = ins["x"], ins["b"]
    return {"y": align(x, lx, outs["y"]) + align(b, lb, outs["y"])}


def _bias_grad_reference(ins, outs, attrs):
    dy, ly = ins["dy"]
    return {"y": reduce_to(dy, ly, outs["y"])}


BIAS = register(OpKind("bias", "EW", flop=elementwise_flop(1), reference=_bias_reference, vjp=_bias_vjp,
                       cpu=_bias_cpu, cuda=_bias_cuda, letter="B"))
BIAS_GRAD = register(OpKind("bias_grad", "SN", flop=elementwise_flop(1, main="dy"), reference=_bias_grad_reference,
                            cpu=_bias_grad_cpu, cuda=_bias_grad_cuda, reduction="column", letter="B"))
