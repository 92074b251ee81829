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


def _rms_norm_cpu(k, m, attrs):
    x, g = k.read(*m["inputs"]["x"]), k.read(*m["inputs"]["gamma"])
    (y, ya), (rt, ra) = m["outputs"]["y"], m["outputs"]["rstd"]
    T = k.T
    ss, r = k.names("ss", "r")
    # The sum of squares in double, as layer norm's mean: one pass, no cancellation to fear, but
    # a float sum over a long row would cost rstd digits that every element of the row inherits.
    k.pre(f"double {ss} = 0;")
    k.inner([f"const double d_ = {x};", f"{ss} += d_ * d_;"], f"+:{ss}")
    k.stmt(f"const double {r} = 1.0 / std::sqrt({ss} / nn_ + {attrs['eps']!r});")
    k.stmt(f"const {T} {r}t_ = ({T}){r};")
    for line in k.put(rt, ra, r):
        k.stmt(line)
    k.inner([f"const {T} v_ = {x} * {r}t_ * {g};"] + k.put(y, ya, "v_"))


def _rms_norm_cuda(k, m, attrs):
    xt = m["inputs"]["x"]
    (y, ya), (rt, ra) = m["outputs"]["y"], m["outputs"]["rstd"]
    ss, r = k.fresh("ss"), k.fresh("r")
    k.open_loop().pre.append(f"comp_t {ss} = 0;")
    x = k.val(*xt)
    k.lane([f"{ss} += {x} * {x};"])
    k.reduce(ss, "sum")
    k.rows.append(f"const comp_t {r} = sscuda::rsqrt_({ss} / (comp_t)nn_ + (comp_t){attrs['eps']!r});")
    k.put_row(rt, ra, r)
    x, g = k.val(*xt), k.val(*m["inputs"]["gamma"])
    k.lane([], [(y, ya, f"({x} * {r}) * {g}")])


def _rms_norm_grad_cpu(k, m, attrs):
    dy, x, g, r_in = (k.read(*m["inputs"][c]) for c in ("dy", "x", "gamma", "rstd"))
    t, a = m["outputs"]["y"]
    T = k.T
    r, s = k.names("r", "s")
    k.pre(f"const {T} {r} = ({T}){r_in};")
    k.pre(f"{T} {s} = 0;")
    k.inner([f"{s} += {g} * {dy} * ({x} * {r});"], f"+:{s}")
    k.stmt(f"{s} /= nn_;")
    k.inner([f"const {T} v_ = {r} * ({g} * {dy} - ({x} * {r}) * {s});"] + k.put(t, a, "v_"))


def _rms_norm_grad_cuda(k, m, attrs):
    ins = m["inputs"]
    t, a = m["outputs"]["y"]
    r = k.row_val(*ins["rstd"])
    s = k.fresh("s")
    k.open_loop().pre.append(f"comp_t {s} = 0;")
    dy, x, g = k.val(*ins["dy"]), k.val(*ins["x"]), k.val(*ins["gamma"])
    k.lane([f"{s} += ({g} * {dy}) * ({x} * {r});"])
    k.reduce(s, "sum")
    k.rows.append(f"{s} /= (comp_t)nn_;")
    dy, x, g = k.val(*ins["dy"]), k.val(*ins["x"]), k.val(*ins["gamma"])
    k.lane([], [(t, a, f"{r} * ({g} * {dy} - ({x} * {r}) * {s})")])


def _rms_norm_param_grad_cpu(k, m, attrs):
    dy, x, r_in = (k.read(*m["inputs"][c]) for c in ("dy", "x", "rstd"))
    dg = m["outputs"]["dgamma"][0]
    r, = k.names("r")
    k.pre(f"const {k.T} {r} = ({k.T}){r_in};")
    k.inner([f"{k.acc[dg]}[n_] += {dy} * ({x} * {r});"])


def _rms_norm_param_grad_cuda(k, m, attrs):
    ins = m["inputs"]
    r = k.row_val(*ins["rstd"])
    dy, x = k.val(*ins["dy"]), k.val(*ins["x"])
    dg = m["outputs"]["dgamma"][0]
    k.lane([f"acc_{dg}[n0_ + l_] += {dy} * ({x} * {r});"])


RMS_NORM = register(OpKind("rms_norm", "SN", flop=elementwise_flop(4, 4), reference=_rms_norm_reference,
                           vjp=_rms_norm_vjp, cpu=_rms_norm_cpu, cuda=_rms_norm_cuda, reduction="row",
                           letter="RN", statistics=STATISTICS))
RMS_NORM_GRAD = register(OpKind("rms_norm_grad", "SN", flop=elementwise_flop(7, 1), reference=_rms_norm_grad_reference,
                                cpu=_rms_norm_grad_cpu, cuda=_rms_norm_grad_cuda, reduction="row", letter="RN",
                                statistics=STATISTICS))
RMS_NORM_PARAM_GRAD = register(OpKind("rms_norm_param_grad", "SN", flop=elementwise_flop(3, main="dy"),
                                      reference=_rms_norm_param_grad_reference, cpu=_rms_norm_param_grad_cpu,
                                      cuda=_rms_norm_param_grad_cuda, reduction="column", letter="G",
                                      statistics=STATISTICS))
