"""Kinds ``rms_norm`` (SN over ``attrs["axis"]`` with ``attrs["eps"]``: ``y = x * rstd * gamma`` with
``rstd = 1 / sqrt(mean(x^2) + eps)``, also writing the per-row ``rstd``), ``rms_norm_grad`` (SN,
``dx = rstd * (g*dy - xhat * mean(g*dy*xhat))``, ``xhat = x * rstd``) and ``rms_norm_param_grad`` (SN,
the column reduction ``dgamma = sum(dy * xhat)``). Flop: docs/analysis.md."""
from __future__ import annotations

import torch

from .kind import OpKind, align, elementwise_flop, reduce_to, register

#: Connector of the per-row statistic (1 / root mean square over the axis), shape [B, J].
STATISTICS = ("rstd",)


def _rms_norm_reference(ins, outs, attrs):
    target = outs["y"]
    x = align(*ins["x"], target)
    dim = target.index(attrs["axis"])
    rstd = 1.0 / torch.sqrt((x * x).mean(dim, keepdim=True) + attrs["eps"])
    y = x * rstd * align(*ins["gamma"], target)
    return {"y": y, "rstd": reduce_to(rstd.squeeze(dim), target.replace(attrs["axis"], ""), outs["rstd"])}


def _rms_norm_grad_reference(ins, outs, attrs):
    target = outs["y"]
    dy, x, g, rstd = (align(*ins[c], target) for c in ("dy", "x", "gamma", "rstd"))
    xhat, gd = x * rstd, g * dy
    return {"y": rstd * (gd - xhat * (gd * xhat).mean(target.index(attrs["axis"]), keepdim=True))}


def _rms_norm_param_grad_reference(ins, outs, attrs):
    dy, ldy = ins["dy"]
    x, rstd = align(*ins["x"], ldy), align(*ins["rstd"], ldy)
    return {"dgamma": reduce_to(dy * x * rstd, ldy, outs["dgamma"])}


def _rms_norm_vjp(d, op, ins, outs, dy, y_acc):
    x, a = ins["x"]
    stats = {"x": d.use(x, a), "rstd": d.use(outs["rstd"][0])}
    d.g.op(f"{op.label}_dparams", "rms_norm_param_grad", "SN", {"dy": f"{dy}[{y_acc}]", **stats},
           {"dgamma": d.grad_target(ins["gamma"][0], ins["gamma"][1], op.label)}, **op.attrs)
    d.g.op(f"{op.label}_dx", "rms_norm_grad", "SN", {"dy": f"{dy}[{y_acc}]", **stats, "gamma": d.use(ins["gamma"][0])},
           {"y": d.grad_target(x, a, op.label)}, **op.attrs)


def _rms_norm_row(k, attrs):
    # The sum of squares in the statistics type S (double on the CPU), as layer norm's mean: one
    # pass, no cancellation to fear, but a float sum over a long row would cost rstd digits that
    # every element of the row inherits.
    ss = k.accumulator("ss", "sum", k.S)
    with k.sweep() as e:
        d = e.let("d_", e["x"], k.S)
        e.reduce(ss, f"{d} * {d}")
    r = k.let_row("r", k.fn("rsqrt_", f"{ss} / {k.row_length} + {k.lit(attrs['eps'], k.S)}"), k.S)
    k.row_output("rstd", r)
    rt = k.narrow(r)
    with k.sweep() as e:
        e.store("y", f"{e['x']} * {rt} * {e['gamma']}")


def _rms_norm_grad_row(k, attrs):
    r = k.row_input("rstd")
    s = k.accumulator("s", "sum")
    with k.sweep() as e:
        e.reduce(s, f"{e['gamma']} * {e['dy']} * ({e['x']} * {r})")
    k.row(f"{s} /= {k.row_length};")
    with k.sweep() as e:
        e.store("y", f"{r} * ({e['gamma']} * {e['dy']} - ({e['x']} * {r}) * {s})")


def _rms_norm_param_grad_row(k, attrs):
    r = k.row_input("rstd")
    with k.sweep() as e:
        e.add_to_column("dgamma", f"{e['dy']} * ({e['x']} * {r})")


RMS_NORM = register(OpKind("rms_norm", "SN", flop=elementwise_flop(4, 4), reference=_rms_norm_reference,
                           vjp=_rms_norm_vjp, row=_rms_norm_row, reduction="row",
                           letter="RN", statistics=STATISTICS, autocast="fp32"))
RMS_NORM_GRAD = register(OpKind("rms_norm_grad", "SN", flop=elementwise_flop(7, 1), reference=_rms_norm_grad_reference,
                                row=_rms_norm_grad_row, reduction="row", letter="RN",
                                statistics=STATISTICS))
RMS_NORM_PARAM_GRAD = register(OpKind("rms_norm_param_grad", "SN", flop=elementwise_flop(3, main="dy"),
                                      reference=_rms_norm_param_grad_reference,
                                      row=_rms_norm_param_grad_row, reduction="column", letter="G",
                                      statistics=STATISTICS))
