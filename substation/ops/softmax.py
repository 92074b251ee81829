"""Kinds ``softmax`` (SN, over ``attrs["axis"]``: max, subtract, exp, sum, scale; a row whose entries
are all -inf gives zeros) and ``softmax_grad`` (SN, ``dx = y * (dy - sum_axis(y * dy))``)."""
from __future__ import annotations

import torch

from .kind import OpKind, align, elementwise_flop, register


def _softmax_reference(ins, outs, attrs):
    x, lx = ins["x"]
    x = align(x, lx, outs["y"])
    dim = outs["y"].index(attrs["axis"])
    dead = x.amax(dim, keepdim=True) == float("-inf")
    return {"y": torch.softmax(x.masked_fill(dead, 0.0), dim).masked_fill(dead, 0.0)}


def _softmax_grad_reference(ins, outs, attrs):
    target = outs["y"]
    dy, pr = (align(t, lt, target) for t, lt in (ins["dy"], ins["probs"]))
    dim = target.index(attrs["axis"])
    return {"y": pr * (dy - (dy * pr).sum(dim, keepdim=True))}


def _softmax_vjp(d, op, ins, outs, dy, y_acc):
    x, a = ins["x"]
    y, _ = outs["y"]
    d.g.op(f"{op.label}_grad", "softmax_grad", "SN", {"dy": f"{dy}[{y_acc}]", "probs": d.use(y, y_acc)},
           {"y": d.grad_target(x, a, op.label)}, **op.attrs)


def _softmax_cpu(k, m, attrs):
    xt, xa = m["inputs"]["x"]
    x = k.read(xt, xa)
    y, ya = m["outputs"]["y"]
    T = k.T
    mx, sm, inv = k.names("mx", "s", "inv")
    k.pre(f"{T} {mx} = ({T})(-INFINITY);")
    k.inner([f"{mx} = std::max({mx}, ({T}){x});"], f"max:{mx}")
    # Every key masked (max -inf): exp gives 0 everywhere and the probabilities are 0, without a
    # branch, so the normalizing loop merges with what follows.
    k.stmt(f"if ({mx} == ({T})(-INFINITY)) {mx} = 0;")
    row = k.row_start(xt, xa, x) if T == "float" else None
    if row:  # a contiguous row: one vector routine
        k.stmt(f"{T} {sm} = ss::exp_shifted_row({row}, &buf_{y}[0], nn_, {mx});")
    else:
        k.pre(f"{T} {sm} = 0;")
        k.inner([f"const {T} e_ = ss::exp_(({T}){x} - {mx});", f"buf_{y}[n_] = e_;", f"{sm} += e_;"], f"+:{sm}")
    k.stmt(f"const {T} {inv} = {sm} == 0 ? ({T})0 : ({T})(1.0 / {sm});")  # a NaN sum stays NaN
    k.inner([f"const {T} v_ = buf_{y}[n_] * {inv};"] + k.put(y, ya, "v_"))


def _softmax_cuda(k, m, attrs):
    xt = m["inputs"]["x"]
    y, ya = m["outputs"]["y"]
    mx, s, inv, dead = k.fresh("mx"), k.fresh("s"), k.fresh("inv"), k.fresh("dead")
    k.open_loop().pre.append(f"comp_t {mx} = (comp_t)(-INFINITY);")
    x = k.val(*xt)
    k.lane([f"{mx} = sscuda::max_({mx}, {x});"])
    k.reduce(mx, "max")
    # Every key masked (-inf): probabilities 0 (the documented behaviour), not NaN.
    k.rows.append(f"const bool {dead} = {mx} == (comp_t)(-INFINITY);")
    k.open_loop().pre.append(f"comp_t {s} = 0;")
    x = k.val(*xt)
    k.lane([f"{s} += {dead} ? (comp_t)0 : sscuda::exp_({x} - {mx});"])
    k.reduce(s, "sum")
    k.rows.append(f"const comp_t {inv} = (comp_t)1 / {s};")
    x = k.val(*xt)
    k.lane([], [(y, ya, f"{dead} ? (comp_t)0 : sscuda::exp_({x} - {mx}) * {inv}")])


def _softmax_grad_cpu(k, m, attrs):
    dy, pr = k.read(*m["inputs"]["dy"]), k.read(*m["inputs"]["probs"])
    t, a = m["outputs"]["y"]
    dot, = k.names("dot")
    k.pre(f"{k.T} {dot} = 0;")
    k.inner([f"{dot} += {dy} * {pr};"], f"+:{dot}")
    k.flush()
    k.inner([f"const {k.T} v_ = {pr} * ({dy} - {dot});"] + k.put(t, a, "v_"))


def _softmax_grad_cuda(k, m, attrs):
    dyt, prt = m["inputs"]["dy"], m["inputs"]["probs"]
    t, a = m["outputs"]["y"]
    dot = k.fresh("dot")
    k.open_loop().pre.append(f"comp_t {dot} = 0;")
    dy, pr = k.val(*dyt), k.val(*prt)
    k.lane([f"{dot} += {dy} * {pr};"])
    k.reduce(dot, "sum")
    dy, pr = k.val(*dyt), k.val(*prt)
    k.lane([], [(t, a, f"{pr} * ({dy} - {dot})")])


SOFTMAX = register(OpKind("softmax", "SN", flop=elementwise_flop(5, 1), reference=_softmax_reference,
                          vjp=_softmax_vjp, cpu=_softmax_cpu, cuda=_softmax_cuda, reduction="row", letter="S"))
SOFTMAX_GRAD = register(OpKind("softmax_grad", "SN", flop=elementwise_flop(4), reference=_softmax_grad_reference,
                               cpu=_softmax_grad_cpu, cuda=_softmax_grad_cuda, reduction="row", letter="S"))
