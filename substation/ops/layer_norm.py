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


def _layer_norm_row(k, attrs):
    # Mean and rstd in the statistics type S (double on the CPU): a float sum over a long row would
    # cost digits every element of the row inherits.
    s = k.accumulator("s", "sum", k.S)
    with k.sweep() as e:
        e.reduce(s, e["x"])
    mu = k.let_row("mu", f"{s} / {k.row_length}", k.S)
    center = k.centered(mu)
    v2 = k.accumulator("v2", "sum")
    with k.sweep() as e:
        d = e.let("d_", center(e["x"]))
        e.reduce(v2, f"{d} * {d}")
    r = k.let_row("r", k.fn("rsqrt_", f"{k.cast(v2, k.S)} / {k.row_length} + {k.lit(attrs['eps'], k.S)}"), k.S)
    k.row_output("mean", mu)
    k.row_output("rstd", r)
    rt = k.narrow(r)
    with k.sweep() as e:
        e.store("y", f"{center(e['x'])} * {rt} * {e['gamma']} + {e['beta']}")


def _input_statistics(k):
    """(x -> xhat, rstd in the compute type) from the gradient kinds' ``mean`` and ``rstd`` inputs."""
    center, rt = k.centered(k.row_input("mean", k.S)), k.narrow(k.row_input("rstd", k.S))
    return (lambda x: f"{center(x)} * {rt}"), rt


def _layer_norm_grad_row(k, attrs):
    xhat, rt = _input_statistics(k)
    s1, s2 = k.accumulator("s1", "sum"), k.accumulator("s2", "sum")
    with k.sweep() as e:
        gd = e.let("gd_", f"{e['gamma']} * {e['dy']}")
        e.reduce(s1, gd)
        e.reduce(s2, f"{gd} * {xhat(e['x'])}")
    k.row(f"{s1} /= {k.row_length}; {s2} /= {k.row_length};")
    with k.sweep() as e:
        e.store("y", f"{rt} * ({e['gamma']} * {e['dy']} - {s1} - {xhat(e['x'])} * {s2})")


def _layer_norm_param_grad_row(k, attrs):
    xhat, _ = _input_statistics(k)
    with k.sweep() as e:
        e.add_to_column("dgamma", f"{e['dy']} * {xhat(e['x'])}")
        e.add_to_column("dbeta", e["dy"])


LAYER_NORM = register(OpKind("layer_norm", "SN", flop=elementwise_flop(8, 5), reference=_layer_norm_reference,
                             vjp=_layer_norm_vjp, row=_layer_norm_row, reduction="row",
                             letter="LN", statistics=STATISTICS, autocast="fp32"))
LAYER_NORM_GRAD = register(OpKind("layer_norm_grad", "SN", flop=elementwise_flop(10, 2),
                                  reference=_layer_norm_grad_reference, row=_layer_norm_grad_row,
                                  reduction="row", letter="LN", statistics=STATISTICS))
LAYER_NORM_PARAM_GRAD = register(OpKind("layer_norm_param_grad", "SN", flop=elementwise_flop(5, main="dy"),
                                        reference=_layer_norm_param_grad_reference,
                                        row=_layer_norm_param_grad_row, reduction="column", letter="SB",
                                        statistics=STATISTICS))
