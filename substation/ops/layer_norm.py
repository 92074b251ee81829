"""Kinds ``layer_norm`` (SN over ``attrs["axis"]`` with ``attrs["eps"]``: ``y = (x - mean) * rstd * gamma
+ beta``, also writing the per-row ``mean`` and ``rstd``), ``layer_norm_grad`` (SN, ``dx = rstd * (g*dy
- mean(g*dy) - xhat * mean(g*dy*xhat))``) and ``layer_norm_param_grad`` (SN, column reductions
``dgamma = sum(dy * xhat)``, ``dbeta = sum(dy)``). Flop: docs/analysis.md."""
from __future__ import annotations

import torch

from .kind import OpKind, align, elementwise_flop, reduce_to, register

#: Connectors of the per-row statistics (mean and 1/std over the axis), shape [B, J].
STATISTICS = ("mean", "rstd")


def _row_stats(ins, target):
    """(mean, rstd) of the gradient kinds' inputs, aligned to ``target``."""
    return align(*ins["mean"], target), align(*ins["rstd"], target)


def _layer_norm_reference(ins, outs, attrs):
    target = outs["y"]
    x = align(*ins["x"], target)
    dim = target.index(attrs["axis"])
    mean = x.mean(dim, keepdim=True)
    rstd = 1.0 / torch.sqrt(((x - mean) ** 2).mean(dim, keepdim=True) + attrs["eps"])
    y = (x - mean) * rstd * align(*ins["gamma"], target) + align(*ins["beta"], target)
    stat = target.replace(attrs["axis"], "")
    return {"y": y, "mean": reduce_to(mean.squeeze(dim), stat, outs["mean"]),
            "rstd": reduce_to(rstd.squeeze(dim), stat, outs["rstd"])}


def _layer_norm_grad_reference(ins, outs, attrs):
    target = outs["y"]
    dy, x, g = (align(*ins[c], target) for c in ("dy", "x", "gamma"))
    mean, rstd = _row_stats(ins, target)
    dim = target.index(attrs["axis"])
    xhat, gd = (x - mean) * rstd, g * dy
    return {"y": rstd * (gd - gd.mean(dim, keepdim=True) - xhat * (gd * xhat).mean(dim, keepdim=True))}


def _layer_norm_param_grad_reference(ins, outs, attrs):
    dy, ldy = ins["dy"]
    x = align(*ins["x"], ldy)
    mean, rstd = _row_stats(ins, ldy)
    return {"dgamma": reduce_to(dy * (x - mean) * rstd, ldy, outs["dgamma"]),
            "dbeta": reduce_to(dy, ldy, outs["dbeta"])}


def _layer_norm_vjp(d, op, ins, outs, dy, y_acc):
    x, a = ins["x"]
    stats = {"x": d.use(x, a), "mean": d.use(outs["mean"][0]), "rstd": d.use(outs["rstd"][0])}
    d.g.op(f"{op.label}_dparams", "layer_norm_param_grad", "SN", {"dy": f"{dy}[{y_acc}]", **stats},
           {"dgamma": d.grad_target(ins["gamma"][0], ins["gamma"][1], op.label),
            "dbeta": d.grad_target(ins["beta"][0], ins["beta"][1], op.label)}, **op.attrs)
    d.g.op(f"{op.label}_dx", "layer_norm_grad", "SN",
           {"dy": f"{dy}[{y_acc}]", **stats, "gamma": d.use(ins["gamma"][0])},
           {"y": d.grad_target(x, a, op.label)}, **op.attrs)


def _layer_norm_cpu(k, m, attrs):
    x = k.read(*m["inputs"]["x"])
    g, b = k.read(*m["inputs"]["gamma"]), k.read(*m["inputs"]["beta"])
    (y, ya), (mt, ma), (rt, ra) = m["outputs"]["y"], m["outputs"]["mean"], m["outputs"]["rstd"]
    T = k.T
    sm, mu, v2, r = k.names("s", "mu", "v2", "r")
    k.pre(f"double {sm} = 0;")
    k.inner([f"{sm} += {x};"], f"+:{sm}")
    k.stmt(f"const double {mu} = {sm} / nn_;")
    xhat = k.split_statistics(mu, r, rstd_known=False)
    k.pre(f"{T} {v2} = 0;")
    k.inner([f"const {T} d_ = {xhat(x, scaled=False)};", f"{v2} += d_ * d_;"], f"+:{v2}")
    k.stmt(f"const double {r} = 1.0 / std::sqrt((double){v2} / nn_ + {attrs['eps']!r});")
    k.stmt(f"const {T} {r}t_ = ({T}){r};")
    for line in k.put(mt, ma, mu) + k.put(rt, ra, r):
        k.stmt(line)
    k.inner([f"const {T} v_ = {xhat(x)} * {g} + {b};"] + k.put(y, ya, "v_"))


def _layer_norm_cuda(k, m, attrs):
    xt = m["inputs"]["x"]
    (y, ya), (mt, ma), (rt, ra) = m["outputs"]["y"], m["outputs"]["mean"], m["outputs"]["rstd"]
    s, mu, v2, r = k.fresh("s"), k.fresh("mu"), k.fresh("v"), k.fresh("r")
    k.open_loop().pre.append(f"comp_t {s} = 0;")
    x = k.val(*xt)
    k.lane([f"{s} += {x};"])
    k.reduce(s, "sum")
    k.rows.append(f"const comp_t {mu} = {s} / (comp_t)nn_;")
    k.open_loop().pre.append(f"comp_t {v2} = 0;")
    x = k.val(*xt)
    k.lane([f"const comp_t d_ = {x} - {mu};", f"{v2} += d_ * d_;"])
    k.reduce(v2, "sum")
    k.rows.append(f"const comp_t {r} = sscuda::rsqrt_({v2} / (comp_t)nn_ + (comp_t){attrs['eps']!r});")
    k.put_row(mt, ma, mu)
    k.put_row(rt, ra, r)
    x = k.val(*xt)
    g, b = k.val(*m["inputs"]["gamma"]), k.val(*m["inputs"]["beta"])
    k.lane([], [(y, ya, f"(({x} - {mu}) * {r}) * {g} + {b}")])


def _layer_norm_grad_cpu(k, m, attrs):
    dy, x, g = (k.read(*m["inputs"][c]) for c in ("dy", "x", "gamma"))
    mu_in, r_in = k.read(*m["inputs"]["mean"]), k.read(*m["inputs"]["rstd"])
    t, a = m["outputs"]["y"]
    T = k.T
    mu, r, s1, s2 = k.names("mu", "r", "s1", "s2")
    k.pre(f"const double {mu} = {mu_in}, {r} = {r_in};")
    xhat = k.split_statistics(mu, r)
    k.pre(f"{T} {s1} = 0, {s2} = 0;")
    k.inner([f"const {T} gd_ = {g} * {dy};", f"{s1} += gd_;", f"{s2} += gd_ * {xhat(x)};"], f"+:{s1},{s2}")
    k.stmt(f"{s1} /= nn_; {s2} /= nn_;")
    k.inner([f"const {T} v_ = {r}t_ * ({g} * {dy} - {s1} - {xhat(x)} * {s2});"] + k.put(t, a, "v_"))


def _layer_norm_grad_cuda(k, m, attrs):
    ins = m["inputs"]
    t, a = m["outputs"]["y"]
    mu, r = k.row_val(*ins["mean"]), k.row_val(*ins["rstd"])
    s1, s2 = k.fresh("s1"), k.fresh("s2")
    lp = k.open_loop()
    lp.pre += [f"comp_t {s1} = 0;", f"comp_t {s2} = 0;"]
    dy, x, g = k.val(*ins["dy"]), k.val(*ins["x"]), k.val(*ins["gamma"])
    k.lane([f"const comp_t gd_ = {g} * {dy};", f"{s1} += gd_;", f"{s2} += gd_ * (({x} - {mu}) * {r});"])
    k.reduce(s1, "sum")
    k.rows.append(f"{s2} = sscuda::group_sum<WARP>({s2}, red_);")
    k.rows.append(f"{s1} /= (comp_t)nn_; {s2} /= (comp_t)nn_;")
    dy, x, g = k.val(*ins["dy"]), k.val(*ins["x"]), k.val(*ins["gamma"])
    k.lane([], [(t, a, f"{r} * ({g} * {dy} - {s1} - (({x} - {mu}) * {r}) * {s2})")])


def _layer_norm_param_grad_cpu(k, m, attrs):
    dy, x = k.read(*m["inputs"]["dy"]), k.read(*m["inputs"]["x"])
    mu_in, r_in = k.read(*m["inputs"]["mean"]), k.read(*m["inputs"]["rstd"])
    dg, db = m["outputs"]["dgamma"][0], m["outputs"]["dbeta"][0]
    mu, r = k.names("mu", "r")
    k.pre(f"const double {mu} = {mu_in}, {r} = {r_in};")
    xhat = k.split_statistics(mu, r)
    k.inner([f"{k.acc[dg]}[n_] += {dy} * {xhat(x)};", f"{k.acc[db]}[n_] += {dy};"])


def _layer_norm_param_grad_cuda(k, m, attrs):
    ins = m["inputs"]
    mu, r = k.row_val(*ins["mean"]), k.row_val(*ins["rstd"])
    dy, x = k.val(*ins["dy"]), k.val(*ins["x"])
    dg, db = m["outputs"]["dgamma"][0], m["outputs"]["dbeta"][0]
    k.lane([f"acc_{dg}[n0_ + l_] += {dy} * (({x} - {mu}) * {r});", f"acc_{db}[n0_ + l_] += {dy};"])


LAYER_NORM = register(OpKind("layer_norm", "SN", flop=elementwise_flop(8, 5), reference=_layer_norm_reference,
                             vjp=_layer_norm_vjp, cpu=_layer_norm_cpu, cuda=_layer_norm_cuda, reduction="row",
                             letter="LN", statistics=STATISTICS))
LAYER_NORM_GRAD = register(OpKind("layer_norm_grad", "SN", flop=elementwise_flop(10, 2),
                                  reference=_layer_norm_grad_reference, cpu=_layer_norm_grad_cpu,
                                  cuda=_layer_norm_grad_cuda, reduction="row", letter="LN", statistics=STATISTICS))
LAYER_NORM_PARAM_GRAD = register(OpKind("layer_norm_param_grad", "SN", flop=elementwise_flop(5, main="dy"),
                                        reference=_layer_norm_param_grad_reference, cpu=_layer_norm_param_grad_cpu,
                                        cuda=_layer_norm_param_grad_cuda, reduction="column", letter="SB",
                                        statistics=STATISTICS))
