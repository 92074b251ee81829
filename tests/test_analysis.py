"""Flop and data-movement analysis: closed forms, hand counts, fused kernels, the report and the CLI."""
import functools
import json
import math
import os

import dace
import pytest
import sympy

from substation import pipeline
from substation.perf import analysis, report
from substation.perf.analysis import analyze, count_graph, kind_flop
from substation.cli import main
from substation.config import load_config
from substation.ir.graph import GraphBuilder


@pytest.fixture(autouse=True, scope="module")
def _no_lineinfo():
    """DaCe records a Python stack trace for every node it adds (``compiler.lineinfo: inspect``), which
    makes building graphs slow under pytest's deep stacks; the counts do not need it."""
    old = dace.Config.get("compiler", "lineinfo")
    dace.Config.set("compiler", "lineinfo", value="none")
    yield
    dace.Config.set("compiler", "lineinfo", value=old)


@functools.lru_cache(maxsize=None)
def _analysis(name):
    return analyze(name)


@functools.lru_cache(maxsize=None)
def _graphs(name):
    return pipeline.compile_graphs(load_config(name))


# -- contraction flop: the closed forms of DESIGN.md section 3 ---------------------------------------
@pytest.mark.parametrize("name,phase,digits,gflop", [
    ("bert-large-b8-l512", "forward", 2, 111.67),
    ("bert-large-b8-l512", "total", 1, 335.0),
    ("bert-large-b96-l128", "total", 1, 947.0),
    ("bert-base", "total", 2, 44.69),
])
def test_contraction_flop_closed_forms(name, phase, digits, gflop):
    a = _analysis(name)
    assert round(a.contraction_flop()[phase] / 1e9, digits) == gflop


def test_contraction_flop_exact_per_operator():
    B, J, K, H, P, I, U = (analysis.SYMBOLS[d] for d in "BJKHPIU")
    want = {"qkv": 2 * B * J * 3 * H * P * I, "scores": 2 * B * H * J * K * P, "context": 2 * B * H * J * K * P,
            "out_proj": 2 * B * J * I * H * P, "linear1": 2 * B * J * U * I, "linear2": 2 * B * J * U * I}
    a = _analysis("bert-large-b8-l512")
    s = a.sizes
    fwd = {o.name: o for o in a.select("forward", "TC")}
    assert set(fwd) == set(want)
    for name, expr in want.items():
        assert sympy.simplify(fwd[name].flop_expr - expr) == 0, name
        assert fwd[name].flop == int(expr.subs({analysis.SYMBOLS[d]: s[d] for d in "BJKHPIU"}))
    bwd = {o.name: o.flop for o in a.select("backward", "TC")}
    for name in want:  # a data and a weight gradient per forward contraction, each as big as it
        grads = [v for k, v in bwd.items() if k.startswith(name + "_d")]
        assert grads == [fwd[name].flop] * 2, name
    assert a.total("backward", "TC")["flop"] == 2 * a.total("forward", "TC")["flop"]


# -- bytes: a hand count of every operator of the tiny config -----------------------------------------
def _hand_counts(s):
    """(elements read, elements written) of every operator, written out by hand from the layer's
    definition (DESIGN.md section 3 and autodiff.py's rules)."""
    B, J, K, H, P, I, U, T = (s[d] for d in "BJKHPIUT")
    BJI, BJU, BJHP, BKHP = B * J * I, B * J * U, B * J * H * P, B * K * H * P
    BHJK, BJ3 = B * H * J * K, B * J * T * H * P
    forward = {
        "qkv": (BJI + T * H * P * I, BJ3),
        "input_bias": (BJ3 + T * H * P, BJ3),
        "scores": (BJHP + BKHP, BHJK),            # Q and K: two slices of QKV
        "mask": (BHJK + B * K, BHJK),
        "softmax": (BHJK, BHJK),
        "attention_dropout": (BHJK, BHJK),         # the mask is regenerated: no mask bytes
        "context": (BHJK + BKHP, BJHP),
        "out_proj": (BJHP + I * H * P, BJI),
        "out_bias": (BJI + I, BJI),
        "out_dropout": (BJI, BJI),
        "residual1": (2 * BJI, BJI),
        "layer_norm1": (BJI + 2 * I, BJI + 2 * B * J),   # y, mean, rstd
        "linear1": (BJI + U * I, BJU),
        "linear1_bias": (BJU + U, BJU),
        "activation": (BJU, BJU),
        "linear2": (BJU + I * U, BJI),
        "linear2_bias": (BJI + I, BJI),
        "ffn_dropout": (BJI, BJI),
        "residual2": (2 * BJI, BJI),
        "layer_norm2": (BJI + 2 * I, BJI + 2 * B * J),
    }
    backward = {
        "layer_norm2_dparams": (2 * BJI + 2 * B * J, 2 * I),      # dy, x, mean, rstd -> dgamma, dbeta
        "layer_norm2_dx": (2 * BJI + 2 * B * J + I, BJI),         # dy, x, mean, rstd, gamma
        "ffn_dropout_grad": (BJI, BJI),
        "linear2_bias_grad": (BJI, I),
        "linear2_dx": (BJI + I * U, BJU),
        "linear2_dw": (BJI + BJU, I * U),
        "activation_grad": (2 * BJU, BJU),
        "linear1_bias_grad": (BJU, U),
        "linear1_dx": (BJU + U * I, BJI),
        "linear1_dw": (BJU + BJI, U * I),
        "N1_grad_sum": (2 * BJI, BJI),
        "layer_norm1_dparams": (2 * BJI + 2 * B * J, 2 * I),
        "layer_norm1_dx": (2 * BJI + 2 * B * J + I, BJI),
        "out_dropout_grad": (BJI, BJI),
        "out_bias_grad": (BJI, I),
        "out_proj_dx": (BJI + I * H * P, BJHP),
        "out_proj_dw": (BJI + BJHP, I * H * P),
        "context_dattn": (BJHP + BKHP, BHJK),
        "context_dv": (BJHP + BHJK, BKHP),
        "attention_dropout_grad": (BHJK, BHJK),
        "softmax_grad": (2 * BHJK, BHJK),
        "scores_dq": (BHJK + BKHP, BJHP),
        "scores_dk": (BHJK + BJHP, BKHP),
        "input_bias_grad": (BJ3, T * H * P),
        "qkv_dx": (BJ3 + T * H * P * I, BJI),
        "qkv_dw": (BJ3 + BJI, T * H * P * I),
        "X_grad_sum": (2 * BJI, BJI),
    }
    return {"forward": forward, "backward": backward}


def test_tiny_bytes_equal_hand_count():
    a = _analysis("tiny")
    assert a.config.dtype == "float64"
    item = 8
    want = _hand_counts(a.sizes)
    for phase in ("forward", "backward"):
        got = {o.name: (o.bytes_read, o.bytes_written) for o in a.select(phase)}
        assert list(got) == list(want[phase]), phase  # every operator, in execution order
        for name, (r, w) in want[phase].items():
            assert got[name] == (item * r, item * w), (phase, name, got[name], (item * r, item * w))


def test_symbolic_counts_evaluate_to_the_values():
    for name in ("tiny", "bert-large-b8-l512"):
        a = _analysis(name)
        sub = {analysis.SYMBOLS[d]: a.sizes[d] for d in "BJKHPIU"}
        for o in a.operators:
            assert int(o.flop_expr.subs(sub)) == o.flop, o.name
            assert int(o.read_expr.subs(sub)) == o.bytes_read, o.name
            assert int(o.written_expr.subs(sub)) == o.bytes_written, o.name
            assert o.flop_expr.free_symbols <= set(analysis.SYMBOLS.values())


def test_elementwise_flop_rules():
    B, J, K, H, I, U = (analysis.SYMBOLS[d] for d in "BJKHIU")
    a = _analysis("bert-base")
    f = {(o.phase, o.name): sympy.expand(o.flop_expr) for o in a.operators}
    assert f["forward", "softmax"] == sympy.expand(5 * B * H * J * K + B * H * J)
    assert f["forward", "layer_norm1"] == sympy.expand(8 * B * J * I + 5 * B * J)
    assert f["forward", "activation"] == 5 * B * J * U                     # GELU (erf form)
    assert f["forward", "attention_dropout"] == B * H * J * K              # one multiply, RNG not counted
    assert f["forward", "residual1"] == B * J * I                          # two summands: one add
    assert f["backward", "activation_grad"] == 11 * B * J * U
    assert f["backward", "softmax_grad"] == 4 * B * H * J * K
    assert f["backward", "layer_norm1_dx"] == sympy.expand(10 * B * J * I + 2 * B * J)
    assert f["backward", "layer_norm1_dparams"] == 5 * B * J * I
    assert f["backward", "linear1_bias_grad"] == B * J * U
    with pytest.raises(ValueError, match=r"unknown operator kind .teleport. \(known: activation,"):
        kind_flop("teleport", {}, {"x": "BJI"}, {"y": "BJI"})
    with pytest.raises(ValueError, match="activation function"):
        kind_flop("activation", {"function": "swish"}, {"x": "BJI"}, {"y": "BJI"})


def test_class_summary_bert_large():
    a = _analysis("bert-large-b8-l512")
    assert a.kernels()["forward"] == {"TC": 6, "SN": 3, "EW": 11, "all": 20}
    assert a.kernels()["backward"] == {"TC": 12, "SN": 9, "EW": 6, "all": 27}
    sh = a.shares()
    for p in ("forward", "backward", "total"):
        assert math.isclose(sum(sh[p][c]["flop_pct"] for c in ("TC", "SN", "EW")), 100.0)
        assert math.isclose(sum(sh[p][c]["bytes_pct"] for c in ("TC", "SN", "EW")), 100.0)
    assert sh["total"]["TC"]["flop_pct"] > 99.0                       # the paper's claim holds
    assert sh["total"]["SN"]["bytes_pct"] + sh["total"]["EW"]["bytes_pct"] > 50.0   # and SN+EW move most bytes
    t = a.totals()
    assert t["total"]["all"]["bytes"] == t["forward"]["all"]["bytes"] + t["backward"]["all"]["bytes"]
    assert t["total"]["TC"]["flop"] == a.contraction_flop()["total"]


# -- fused kernels -------------------------------------------------------------------------------------
def _refuse(graph, group, label):
    """Rebuild ``graph`` with the operators named in ``group`` (contiguous in execution order) replaced
    by one ``fused`` operator that reads what the group reads from outside and writes what is used
    outside the group or kept (non-temporary)."""
    ops = graph.operators()
    members = [op for op in ops if op.label in group]
    assert len(members) == len(group)
    produced = {t for op in members for t, _ in graph.outputs_of(op).values()}
    read_outside = {t for op in ops if op not in members for t, _ in graph.inputs_of(op).values()}
    ins, outs = [], []
    for op in members:
        for t, acc in graph.inputs_of(op).values():
            if t not in produced and (t, acc) not in ins:
                ins.append((t, acc))
        for t, acc in graph.outputs_of(op).values():
            if t in read_outside or graph.tensors[t].role != "temp":
                outs.append((t, acc))
    g = GraphBuilder(graph.sdfg.name + "_fused", graph.config, graph.phase)
    for t in graph.tensors.values():
        g.tensor(t.name, t.dims, t.role, t.layout)
    for op in ops:
        if op is members[0]:
            spec = [{"name": m.label, "kind": m.kind, "op_class": m.op_class,
                     "inputs": {c: list(v) for c, v in graph.inputs_of(m).items()},
                     "outputs": {c: list(v) for c, v in graph.outputs_of(m).items()}, "attrs": m.attrs}
                    for m in members]
            cls = "SN" if any(m.op_class == "SN" for m in members) else "EW"
            g.op(label, "fused", cls, {f"in{i}": f"{t}[{a}]" for i, (t, a) in enumerate(ins)},
                 {f"out{i}": f"{t}[{a}]" for i, (t, a) in enumerate(outs)}, ops=spec)
        elif op not in members:
            g.op(op.label, op.kind, op.op_class,
                 {c: f"{t}[{a}]" for c, (t, a) in graph.inputs_of(op).items()},
                 {c: f"{t}[{a}]" for c, (t, a) in graph.outputs_of(op).items()}, **op.attrs)
    return g.finish()


BDRLN = ("linear2_bias", "ffn_dropout", "residual2", "layer_norm2")


def test_fused_operator_counts_members_flop_and_own_bytes():
    config = load_config("tiny")
    fwd, _ = _graphs("tiny")
    s = config.sizes()
    B, J, I = s["B"], s["J"], s["I"]
    fused = _refuse(fwd, BDRLN, "bdrln2")
    unfused = {o.name: o for o in count_graph(fwd)}
    got = {o.name: o for o in count_graph(fused)}
    assert set(got) == (set(unfused) - set(BDRLN)) | {"bdrln2"}
    k = got["bdrln2"]
    assert (k.kind, k.op_class, k.members) == ("fused", "SN", BDRLN)
    # flop: the members' own flop, summed (bias 1 + dropout 1 + add 1 + layer norm 8 per element, 5 per row)
    assert k.flop == sum(unfused[n].flop for n in BDRLN) == 11 * B * J * I + 5 * B * J
    # bytes: only the fused kernel's connectors: F2_raw, linear2_bias, N1, gamma, beta in; R2 (saved), Y,
    # mean, rstd out. F2 and F2_drop never reach memory and R2 is not read back.
    assert k.bytes_read == 8 * (2 * B * J * I + 3 * I)
    assert k.bytes_written == 8 * (2 * B * J * I + 2 * B * J)
    assert sum(unfused[n].bytes for n in BDRLN) - k.bytes == 8 * 5 * B * J * I
    # the same rule for a member dict and an operator
    m = {"kind": "layer_norm", "attrs": {"axis": "I"}, "inputs": {"x": ["R2", "BJI"]}, "outputs": {"y": ["Y", "BJI"]}}
    assert kind_flop(m["kind"], m["attrs"], m["inputs"], m["outputs"], s) == unfused["layer_norm2"].flop
    assert k.flop_expr == sympy.expand(sum(unfused[n].flop_expr for n in BDRLN))


def test_optimized_reduction_with_a_fusion_pass(monkeypatch, tmp_path):
    fused = _refuse(_graphs("tiny")[0], BDRLN, "bdrln2"), _graphs("tiny")[1]
    monkeypatch.setattr(analysis, "optimized_graphs", lambda config, mode, fp32_gemm: fused)
    a = analyze("tiny", optimized=True)
    plain = _analysis("tiny")
    s = a.sizes
    saved = 8 * 5 * s["B"] * s["J"] * s["I"]
    assert a.unfused_bytes == plain.total()["bytes"]
    assert a.total()["bytes"] == plain.total()["bytes"] - saved
    assert math.isclose(a.data_movement_reduction_pct, 100.0 * saved / plain.total()["bytes"])
    assert a.kernels()["forward"] == {"TC": 6, "SN": 3, "EW": 8, "all": 17}
    assert a.total()["flop"] == plain.total()["flop"]
    out = tmp_path / "opt.json"
    assert main(["report", "tiny", "--optimized", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert math.isclose(data["data_movement_reduction_pct"], a.data_movement_reduction_pct)
    assert [o["name"] for o in data["operators"] if o["class"] == "SN" and o["pass"] == "forward"][-1] == "bdrln2"


# -- the report and the CLI ----------------------------------------------------------------------------
def test_cli_report_json_and_plot(tmp_path, capsys):
    js, png = tmp_path / "out" / "r.json", tmp_path / "out" / "r.png"
    assert main(["report", "bert-large-b8-l512", "--json", str(js), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "forward+backward 335.01 GFLOP" in text and "paper" in text
    data = json.loads(js.read_text())
    assert {"operators", "totals", "kernels"} <= set(data)
    assert "data_movement_reduction_pct" not in data
    op = data["operators"][0]
    assert {"name", "pass", "class", "flop", "bytes_read", "bytes_written"} <= set(op)
    assert (op["name"], op["pass"], op["class"]) == ("qkv", "forward", "TC")
    assert set(data["totals"]) == {"forward", "backward", "total"}
    assert set(data["totals"]["forward"]) == {"TC", "SN", "EW", "all"}
    assert {"flop", "bytes_read", "bytes_written", "bytes"} <= set(data["totals"]["total"]["TC"])
    assert data["kernels"]["forward"]["TC"] == 6 and data["kernels"]["backward"]["TC"] == 12
    assert round(data["totals"]["forward"]["TC"]["flop"] / 1e9, 2) == 111.67
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(tmp_path / "out")) == ["r.json", "r.png"]  # no temporary files left


def test_measure_tiny(tmp_path):
    a = _analysis("tiny")
    m = analysis.measure("tiny", repeats=2, warmup=1, copy_bytes=16 << 20)
    assert m.copy_bandwidth > 1e8 and m.copy_buffer_bytes == 16 << 20
    a = a.with_measurement(m)
    assert all(o.seconds is not None and o.seconds > 0 for o in a.operators)
    t = a.total()
    assert t["seconds"] > 0 and t["bandwidth"] > 0 and t["efficiency"] > 0
    assert math.isclose(sum(a.shares()["total"][c]["time_pct"] for c in ("TC", "SN", "EW")), 100.0)
    o = a.operators[0]
    assert math.isclose(o.efficiency(m.copy_bandwidth), o.bytes / (o.seconds * m.copy_bandwidth))
    text = report.format_report(a)
    assert "copy bandwidth" in text and "eff %" in text
    path = tmp_path / "m.json"
    report.write_json(a, str(path))
    data = json.loads(path.read_text())
    assert data["measured"]["copy_bandwidth"] == m.copy_bandwidth
    assert data["measured"]["fp32_gemm"] is None and "float32 GEMMs" not in text  # tiny is float64
    assert all(op["seconds"] > 0 for op in data["operators"])
    assert {"seconds", "bandwidth", "efficiency"} <= set(data["totals"]["total"]["all"])
    report.plot_report(a, str(tmp_path / "m.png"))
    assert (tmp_path / "m.png").stat().st_size > 10_000


def test_pipeline_optimization_conserves_flop_and_moves_less():
    """Whatever the pipeline's fusion does, it must not change the arithmetic, and may only remove bytes."""
    for name in ("tiny", "bert-large-b8-l512"):
        plain, opt = _analysis(name), analyze(name, optimized=True)
        for p in ("forward", "backward"):
            assert opt.total(p)["flop"] == plain.total(p)["flop"], (name, p)
            assert opt.total(p)["bytes"] <= plain.total(p)["bytes"], (name, p)
            assert opt.kernels()[p]["TC"] == plain.kernels()[p]["TC"]
        assert 0.0 <= opt.data_movement_reduction_pct < 100.0
        for o in opt.operators:
            if o.kind == "fused":
                assert o.members and o.op_class in ("SN", "EW")


def test_measured_float32_inference_names_its_gemm_library():
    from substation.config import load_config
    config = load_config("tiny").replace(dtype="float32", name="tiny-f32")
    m = analysis.measure(config, repeats=1, warmup=0, mode="eval", copy_bytes=8 << 20)
    assert m.fp32_gemm == os.environ["SUBSTATION_FP32_GEMM"]  # what "auto" means in the suite (conftest)
    text = report.format_report(analysis.analyze(config, mode="eval").with_measurement(m))
    assert f"float32 GEMMs: {m.fp32_gemm}" in text
