"""Global layout selection: exact solve on known cost tables, infeasibility, plans, numerics under a
non-default plan, and the tuner's resumable cache."""
import dataclasses
import itertools
import json
import os
import random
import time

import pytest
import torch

import substation
from conftest import NO_DROPOUT, reference_for
from substation.ir.operands import LayoutError, plan_contraction, resolve_operand
from substation.config import load_config
from substation.passes import layout as L
from substation.pipeline import compile_graphs, compile_layer

TINY = load_config("tiny")

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


# -- synthetic cost tables -------------------------------------------------------------------------
def brute_force(problem: L.LayoutProblem) -> float:
    """The optimum by enumeration, with the solver's semantics: a stored layout per tensor; an operator
    reads a tensor in its stored layout or from a copy made once per (tensor, graph, layout); a single
    writer may write another layout followed by one conversion."""
    names = list(problem.tensors)
    keys = list(problem.ops)
    best = float("inf")
    for stored in itertools.product(*(problem.tensors[n].domain for n in names)):
        lay = dict(zip(names, stored))
        if any(lay[t] != l for t, (l, _) in problem.pins.items()):
            continue
        if any(lay[a] != lay[b] for a, b, _ in problem.ties):
            continue
        for choice in itertools.product(*(problem.ops[k].candidates for k in keys)):
            total, copies, ok = 0.0, set(), True
            for k, c in zip(keys, choice):
                ov = problem.ops[k]
                total += c.seconds
                for t in ov.reads:
                    if c.layouts[t] != lay[t]:
                        copies.add(("r", t, ov.graph, c.layouts[t]))
                for t in ov.writes:
                    if c.layouts[t] != lay[t]:
                        if len(problem.tensors[t].writers) != 1:
                            ok = False
                        copies.add(("w", t, c.layouts[t]))
            if not ok or (copies and not problem.allow_transpose):
                continue
            for cp in copies:
                tv = problem.tensors[cp[1]]
                if cp[0] == "r":
                    total += problem.copy_cost(tv, lay[cp[1]][-1], cp[3])
                else:
                    total += problem.copy_cost(tv, cp[2][-1], lay[cp[1]])
            best = min(best, total)
    return best


def test_synthetic_optimum_needs_a_transpose():
    # P writes T and is fast only in BJ; Q reads T and is fast only in JB; a transpose costs 10.
    problem = L.make_problem(
        {"T": "BJ", "U": "BJ"},
        [("forward/P", [], ["T"], [({"T": "BJ"}, 1.0), ({"T": "JB"}, 100.0)]),
         ("forward/Q", ["T"], ["U"], [({"T": "BJ", "U": "BJ"}, 100.0), ({"T": "JB", "U": "BJ"}, 1.0)])],
        copy_cost=lambda t, src_inner, dst: 10.0)
    sol = L.solve(problem)
    assert sol.objective == pytest.approx(12.0)
    assert len(sol.transposes) == 1 and sol.transposes[0]["tensor"] == "T"
    assert sol.lower_bound == pytest.approx(2.0)
    assert sol.access["forward/P"]["T"] == "BJ" and sol.access["forward/Q"]["T"] == "JB"
    # Without transposes the best is 101 (one operator in its slow layout).
    problem.allow_transpose = False
    assert L.solve(problem).objective == pytest.approx(101.0)


def test_synthetic_copy_shared_by_readers_of_one_graph():
    # Two backward readers want T in JB: one copy serves both; a forward reader has its own copy.
    ops = [("forward/P", [], ["T"], [({"T": "BJ"}, 1.0)]),
           ("backward/Q1", ["T"], [], [({"T": "BJ"}, 20.0), ({"T": "JB"}, 1.0)]),
           ("backward/Q2", ["T"], [], [({"T": "BJ"}, 20.0), ({"T": "JB"}, 1.0)]),
           ("forward/Q3", ["T"], [], [({"T": "BJ"}, 20.0), ({"T": "JB"}, 1.0)])]
    problem = L.make_problem({"T": "BJ"}, ops, copy_cost=lambda t, s, d: 12.0)
    sol = L.solve(problem)
    # stored JB: the writer converts (1 + 12), every reader is fast (3): 16; stored BJ: 1 + 2 copies 24 + 3.
    assert sol.objective == pytest.approx(16.0) == brute_force(problem)


@pytest.mark.parametrize("seed", range(6))
def test_synthetic_random_tables_match_brute_force(seed):
    rng = random.Random(seed)
    tensors = {"A": "BJ", "C": "BJ", "D": "BJ", "E": "BJI"}
    domains = {"E": ["BJI", "JBI", "IBJ"]}
    dom = {t: domains.get(t) or ["BJ", "JB"] for t in tensors}
    specs = [("forward/w", [], ["A", "E"]), ("forward/x", ["A"], ["C"]), ("backward/y", ["A", "E"], ["D"]),
             ("backward/z", ["C", "D"], []), ("backward/v", ["E"], [])]
    ops = []
    for key, reads, writes in specs:
        ts = reads + writes
        combos = list(itertools.product(*(dom[t] for t in ts)))
        picked = rng.sample(combos, min(len(combos), rng.randint(1, 3)))
        ops.append((key, reads, writes, [(dict(zip(ts, c)), round(rng.uniform(1, 20), 3)) for c in picked]))
    costs = {(t, s, d): round(rng.uniform(0.5, 8), 3) for t in tensors for s in "BJI" for d in dom[t]}
    problem = L.make_problem(tensors, ops, lambda t, s, d: costs[t.name, s, d], domains=domains,
                             pins={"D": "BJ"} if seed % 2 else None, ties=[("A", "C")] if seed % 3 == 0 else ())
    want = brute_force(problem)
    sol = L.solve(problem)
    assert sol.objective == pytest.approx(want, abs=1e-9)
    assert sol.lower_bound <= sol.objective + 1e-12


# -- infeasible requests ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_graphs():
    return compile_graphs(load_config("tiny").replace(dropout=NO_DROPOUT), fuse_ops=True)


def test_pin_no_gemm_can_write_fails_naming_it(tiny_graphs):
    # BJHTP orders the columns H, T, P, the weights T, H, P, and without T the columns H, P are not
    # adjacent: the qkv GEMM cannot write it (not even one GEMM per T), and with transposes off nothing helps.
    problem = L.build_problem(*tiny_graphs, pins={"QKV_raw": "BJHTP"}, allow_transpose=False)
    with pytest.raises(L.LayoutInfeasible, match=r"qkv \(forward\).*QKV_raw=BJHTP.*transposes are disabled"):
        L.solve(problem)
    # With transposes allowed the writer converts, and the plan is still exact and feasible.
    problem = L.build_problem(*tiny_graphs, pins={"QKV_raw": "BJHTP"})
    sol = L.solve(problem)
    assert sol.layouts["QKV_raw"] == "BJHTP"
    assert any(t["tensor"] == "QKV_raw" and t["direction"] == "write" for t in sol.transposes)


def test_conflicting_pins_and_tie_are_named(tiny_graphs):
    problem = L.build_problem(*tiny_graphs, boundary="free", pins={"X": "JBI", "Y": "BJI"})
    with pytest.raises(L.LayoutInfeasible) as e:
        L.solve(problem)
    msg = str(e.value)
    assert "pin X=JBI" in msg and "pin Y=BJI" in msg and "tie X~Y" in msg and "layers chain" in msg


def test_bad_pins_are_rejected(tiny_graphs):
    with pytest.raises(ValueError, match="not a tensor"):
        L.build_problem(*tiny_graphs, pins={"nope": "BJ"})
    with pytest.raises(ValueError, match="not a permutation"):
        L.build_problem(*tiny_graphs, pins={"S": "BHJ"})


# -- candidates ------------------------------------------------------------------------------------
def test_gemm_modes_agree_with_plan_contraction(tiny_graphs):
    """A layout combination has a compatible GEMM mode iff codegen's plan_contraction accepts it."""
    rng = random.Random(0)
    fwd, bwd = tiny_graphs
    problem = L.build_problem(fwd, bwd)
    checked = 0
    for g in (fwd, bwd):
        for op in g.operators():
            if op.kind != "contraction":
                continue
            ov = problem.ops[f"{g.phase}/{op.label}"]
            tensors = list(dict.fromkeys(ov.reads + ov.writes))
            combos = list(itertools.product(*(problem.tensors[t].domain for t in tensors)))
            for combo in rng.sample(combos, min(len(combos), 60)):
                lay = dict(zip(tensors, combo))
                ours = any(all(lay[t] in m.operand[t] for t in tensors) for m in ov.modes)
                info = {t: g.tensors[t] for t in tensors}
                for t in tensors:
                    g.tensors[t] = dataclasses.replace(info[t], layout=lay[t])
                try:
                    ops = {c: resolve_operand(g, t, a) for c, (t, a) in g.operands(op).items()}
                    out = ops.pop("y")
                    plan_contraction(*ops.values(), out, op.label)
                    theirs = True
                except LayoutError:
                    theirs = False
                finally:
                    g.tensors.update(info)
                assert ours == theirs, (op.label, lay)
                checked += 1
    assert checked > 500


def test_a_t_major_output_is_one_gemm_per_stack_entry_with_its_bias():
    """The bf16 QKV GEMM writes QKV T-major ([T, B, J, H, P]) with its bias in the epilogue: T, not
    adjacent to H and P in C, becomes a loop with A (X) shared and the bias strided by H*P along it;
    the layout problem offers the same mapping."""
    import sympy
    from substation.ir.operands import plan_bias
    fwd, _ = compile_graphs(load_config("tiny").replace(dtype="bfloat16"), fuse_ops=True)
    qkv = fwd.find("qkv")
    ops = {c: resolve_operand(fwd, t, a) for c, (t, a) in fwd.operands(qkv).items()}
    assert fwd.tensors["QKV"].layout == "TBJHP"
    plan = plan_contraction(ops["x"], ops["w"], ops["y"], "qkv")
    H, P, I, B, J = (sympy.Symbol(d) for d in "HPIBJ")
    assert [(x, sympy.simplify(sa), sympy.simplify(sb - H * P * I), sympy.simplify(sc - B * J * H * P))
            for x, sa, sb, sc in plan.batch] == [("T", 0, 0, 0)]
    assert (plan.m_letters, plan.n_letters) == (("B", "J"), ("H", "P"))
    bias = plan_bias(plan, ops["bias"], "qkv")
    assert (bias.m, bias.n, [sympy.simplify(s - H * P) for s in bias.batch]) == (0, 1, [0])
    modes = L.gemm_modes("TBJHP", "BJI", "THPI")
    assert any(m["batch"] == "T" and m["n"] == "HP" for m in modes)
    # a bias with only part of C's column letters does not broadcast onto one GEMM
    part = dataclasses.replace(ops["bias"], strides={"P": 1}, access="P")
    with pytest.raises(LayoutError, match=r"bias in_proj_bias has only P of the columns HP"):
        plan_bias(plan, part, "qkv")


def test_bf16_attention_gradients_write_a_t_major_copy_moved_once():
    """The bf16 plan's write transpose of dQKV: the three attention products that each write one of
    its Q, K, V slices write the T-major copy (dense [B, J, H, P] blocks, which oneDNN's brgemm takes),
    one transpose after the last of them fills the token-major dQKV the QKV GEMMs read, and the
    analysis counts that copy: dQKV read and written once at 2 bytes."""
    from substation.perf.analysis import analyze
    cfg = load_config("tiny").replace(dtype="bfloat16")
    _, bwd = compile_graphs(cfg, fuse_ops=True)
    order = [op.label for op in bwd.operators()]
    writers = [op.label for op in bwd.operators() if any(t == "dQKV__TBJHP" for t, _ in bwd.outputs_of(op).values())]
    assert sorted(writers) == ["context_dv", "scores_dk", "scores_dq"]
    moves = [op for op in bwd.operators() if op.kind == "transpose"]
    assert [(op.label, bwd.inputs_of(op)["x"][0], bwd.outputs_of(op)["y"][0]) for op in moves] == \
        [("transpose_dQKV_TBJHP", "dQKV__TBJHP", "dQKV")]
    assert order.index(moves[0].label) == max(order.index(w) for w in writers) + 1
    assert bwd.tensors["dQKV__TBJHP"].layout == "TBJHP" and bwd.tensors["dQKV"].layout == "BJTHP"
    readers = {op.label for op in bwd.operators() if any(t == "dQKV" for t, _ in bwd.inputs_of(op).values())}
    assert readers == {"input_bias_grad", "qkv_dx", "qkv_dw"}
    s = cfg.sizes()
    elements = s["B"] * s["J"] * 3 * s["H"] * s["P"]
    move = {o.name: o for o in analyze(cfg, optimized=True).select("backward")}["transpose_dQKV_TBJHP"]
    assert (move.bytes_read, move.bytes_written, move.flop) == (2 * elements, 2 * elements, 0)


@pytest.mark.parametrize("entry, message", [
    ({"ops": ["scores_dq"]}, r"must name all of its writers \(context_dv, scores_dk, scores_dq\); "
                             r"missing: context_dv, scores_dk, not writers of dQKV: -"),
    ({"ops": ["backward/scores_dq", "scores_dk", "BDS"]}, r"missing: context_dv, not writers of dQKV: BDS"),
    ({"ops": ["forward/scores_dq"]}, r"names operators of another graph: forward/scores_dq"),
    ({"ops": []}, r"'ops' must be a non-empty list"),
    ({"ops": "scores_dq"}, r"'ops' must be a non-empty list of operator labels, got 'scores_dq'"),
    ({"graph": "middle"}, r"graph 'middle' is neither 'forward' nor 'backward'"),
    ({"layout": list("TBJHP")}, r"tensor and layout must be strings"),
])
def test_malformed_write_transposes_are_refused(entry, message):
    """A write copy replaces the tensor for its writers, and the transpose after the last of them
    overwrites all of it: a plan naming only some writers (or other operators) would drop what the
    others wrote (wrong gradients, no error), so it is refused, as are entries of unknown graphs and
    malformed fields."""
    good = {"graph": "backward", "tensor": "dQKV", "layout": "TBJHP", "direction": "write",
            "ops": ["context_dv", "scores_dq", "scores_dk"]}
    plan = {"format": L.PLAN_FORMAT, "transposes": [{**good, **entry}]}
    with pytest.raises(L.PlanError, match=message):
        compile_graphs(TINY, fuse_ops=True, layout=L.LayoutPlan.from_dict(plan))
    split = {"format": L.PLAN_FORMAT, "transposes": [{**good, "ops": ["scores_dq", "scores_dk"]},
                                                     {**good, "layout": "BTHJP", "ops": ["context_dv"]}]}
    with pytest.raises(L.PlanError, match=r"must name all of its writers"):
        compile_graphs(TINY, fuse_ops=True, layout=L.LayoutPlan.from_dict(split))
    compile_graphs(TINY, fuse_ops=True, layout=L.LayoutPlan.from_dict({"format": L.PLAN_FORMAT, "transposes": [good]}))


def test_contradictory_copies_are_refused():
    good = {"graph": "backward", "tensor": "dQKV", "layout": "TBJHP", "direction": "write",
            "ops": ["context_dv", "scores_dq", "scores_dk"]}
    cases = [([good, {**good, "direction": "read", "ops": ["qkv_dw"]}], r"both reads and writes backward/dQKV"),
             ([good, {**good, "layout": "BTHJP"}], r"two write copies of dQKV \(TBJHP and BTHJP\)"),
             ([{"graph": "forward", "tensor": "QKV", "layout": "BTHJP", "direction": "read", "ops": ["linear1"]}],
              r"read copy of forward/QKV names operators that do not read it: linear1")]
    for transposes, message in cases:
        with pytest.raises(L.PlanError, match=message):
            compile_graphs(TINY, layout=L.LayoutPlan.from_dict({"format": L.PLAN_FORMAT, "transposes": transposes}))


def test_a_float32_plan_does_not_reach_the_autocast_build():
    """The bf16 build a float32 layer runs under autocast takes the bf16 default plan: a float32 plan
    names tensors the bf16 graphs lack (QKV_raw: its bias moved into the GEMM)."""
    plan = L.LayoutPlan(tensors={"QKV_raw": "TBJHP"})
    compiled = compile_layer(TINY.replace(dtype="float32"), layout=plan)
    layer = substation.EncoderLayer(compiled).train()
    x = torch.randn(2, 5, TINY.hidden_size, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.float().sum().backward()
    assert y.dtype == torch.float32 and x.grad is not None and torch.isfinite(x.grad).all()
    bf16 = compiled.autocast_build()
    assert "transpose_dQKV_TBJHP" in {op.label for op in bf16.backward.graph.operators()}


@pytest.mark.parametrize("key, vector, message", [
    ("backward/softmax_grad", "J", r"vector letter 'J'; it can vectorize K"),
    ("forward/softmax", "Z", r"vector letter 'Z'; it can vectorize K"),
    ("forward/qkv", "B", r"forward/qkv \(a GEMM\) a 'vector' option"),
])
def test_impossible_vector_letters_are_refused(key, vector, message):
    plan = L.LayoutPlan.from_dict({"format": L.PLAN_FORMAT, "kernels": {key: {"vector": vector}}})
    with pytest.raises(L.PlanError, match=message):
        compile_graphs(TINY, layout=plan)


def test_row_kernel_candidates_cover_permutations_and_vector_letters(tiny_graphs):
    problem = L.build_problem(*tiny_graphs)
    ov = problem.ops["forward/input_bias"]  # EW: any letter may be vectorized
    assert sorted(m.options["vector"] for m in ov.modes) == sorted("BJTHP")
    assert all(len(m.operand["QKV"]) == 120 for m in ov.modes)
    softmax = next(o for k, o in problem.ops.items() if k.startswith("forward/") and "S" in o.reads)
    assert [m.options["vector"] for m in softmax.modes] == ["K"]  # a normalization over K


def test_bert_large_solve_is_fast_and_bounded():
    config = load_config("bert-large-b8-l512")
    fwd, bwd = compile_graphs(config, fuse_ops=True)
    t0 = time.perf_counter()
    sol = L.solve(L.build_problem(fwd, bwd))
    assert time.perf_counter() - t0 < 60
    assert sol.lower_bound <= sol.objective <= sol.default_seconds + 1e-12


# -- plans -----------------------------------------------------------------------------------------
def non_default_plan(graphs):
    pins = {"QKV": "PBHJT", "S": "BHKJ", "C": "HBPJ", "A": "KBHJ", "N1": "IBJ", "F1_act": "UJB"}
    problem = L.build_problem(*graphs, pins=pins)
    return L.plan_from_solution(problem, L.solve(problem))


def test_plan_round_trip(tmp_path, tiny_graphs):
    plan = non_default_plan(tiny_graphs)
    path = tmp_path / "p.plan.json"
    plan.save(str(path))
    text = path.read_text()
    assert json.loads(text)["format"] == L.PLAN_FORMAT and '"QKV": "PBHJT"' in text
    back = L.LayoutPlan.load(str(path))
    assert back == plan and back.to_json() == text
    assert L.load_plan(str(path)) == plan and L.load_plan("default") is None and L.load_plan(None) is None
    fwd, bwd = L.apply_plan(*tiny_graphs, back)
    assert fwd.tensors["QKV"].layout == "PBHJT"
    assert tuple(fwd.sdfg.arrays["QKV"].strides) != tuple(tiny_graphs[0].sdfg.arrays["QKV"].strides)
    assert any(op.kind == "transpose" for g in (fwd, bwd) for op in g.operators())
    with pytest.raises(L.PlanError, match="not a layout plan"):
        L.LayoutPlan.from_json("{}")
    broken = tmp_path / "broken.plan.json"
    broken.write_text('{"format": 1\n"tensors"')
    with pytest.raises(L.PlanError, match=f"layout plan '{broken}': plan is not valid JSON: Expecting ','"):
        L.load_plan(str(broken))  # the file is named, as a config file's error names the file
    bad = L.LayoutPlan({"X": "JBI"})
    with pytest.raises(L.PlanError, match="exchanges X with PyTorch"):
        L.apply_plan(*tiny_graphs, bad)
    with pytest.raises(L.PlanError, match="nope"):
        L.apply_plan(*tiny_graphs, L.LayoutPlan({"nope": "BJ"}))


def test_bundled_plans_apply():
    from substation.backends.cpu.codegen import generate_cpu
    for name, config in (("default", "tiny"), ("bert-base", "bert-base")):
        plan = L.load_plan(os.path.join(CONFIGS, f"{name}.plan.json"))
        fwd, bwd = compile_graphs(load_config(config), fuse_ops=True, layout=plan)
        assert fwd.operators() and bwd.operators()
        verification = (plan.meta.get("tune") or {}).get("verification") or {}
        if name == "default" or verification.get("adopted") is False:
            # the default plan (and a tuned plan whose verification kept PyTorch's layouts) generates
            # exactly the code of no plan at all
            f0, b0 = compile_graphs(load_config(config), fuse_ops=True)
            assert generate_cpu(fwd) == generate_cpu(f0) and generate_cpu(bwd) == generate_cpu(b0)
    assert L.load_plan("bert-base").meta["config"] == "bert-base"


def test_non_default_plan_matches_fp64_reference(tiny_graphs):
    config = load_config("tiny").replace(dropout=NO_DROPOUT)
    plan = non_default_plan(tiny_graphs)
    assert plan.transposes and any(plan.tensors[t] != d for t, d in (("QKV", "BJTHP"), ("S", "BHJK")))
    torch.manual_seed(0)
    layer = substation.EncoderLayer(compile_layer(config, layout=plan))
    assert "transpose_" in layer.compiled.sources["forward"]
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if name.startswith("norm") and "weight" in name else 0.0))
    ref = reference_for(layer)
    torch.manual_seed(1)
    b, j, i = config.batch_size, config.max_seq_len, config.hidden_size
    x, g = torch.randn(b, j, i, dtype=torch.float64), torch.randn(b, j, i, dtype=torch.float64)
    pad = torch.zeros(b, j, dtype=torch.bool)
    pad[1:, j // 2:] = True

    def run(module, **kw):
        xx = x.clone().requires_grad_()
        module.zero_grad()
        y = module(xx, **kw)
        y.backward(g)
        return {"Y": y.detach(), "dX": xx.grad, **{n: p.grad for n, p in module.named_parameters()}}
    ours = run(layer, key_padding_mask=pad)
    want = run(ref, mask=torch.zeros(b, j, dtype=torch.float64).masked_fill(pad, float("-inf")))
    assert len(want) == 14
    for name in want:
        err = float((ours[name] - want[name]).abs().max() / want[name].abs().max())
        assert err <= 1e-10, (name, err)


# -- tuning ----------------------------------------------------------------------------------------
def test_measurements_are_cached_and_resumable(tmp_path, tiny_graphs):
    from substation.perf import tune as T
    config = load_config("tiny").replace(dropout=NO_DROPOUT)
    fwd, _ = tiny_graphs
    problem = L.build_problem(*tiny_graphs)
    op = fwd.find("input_bias")
    cands = L.op_candidates(problem, "forward/input_bias", limit=2)
    keys = [f"k{i}" for i in range(len(cands))]
    cache = T.TuneCache(str(tmp_path / "cache.json"))
    jobs = [(keys, T._bench_graph(fwd, op, cands))]
    res = T.measure_candidates(jobs, config, config.sizes(), cache, repeats=3, progress=False)
    assert set(res) == set(keys) and all(r["seconds"] > 0 and r["repeats"] >= 3 for r in res.values())
    again = T.TuneCache(str(tmp_path / "cache.json"))  # a new process reads what the first wrote
    assert again.get("k0") == res["k0"]
    t0 = time.perf_counter()
    assert T.measure_candidates(jobs, config, config.sizes(), again, progress=False) == res
    assert time.perf_counter() - t0 < 1.0  # nothing rebuilt or re-measured


def test_a_budget_too_small_to_measure_says_so(tmp_path):
    from substation.perf import tune as T
    lines = []
    result = T.tune("tiny", budget_s=30.0, verify=0, cache_path=str(tmp_path / "cache.json"), progress=False,
                    log=lines.append)
    assert result.report["measured_candidates"] == 0 and result.plan is not None
    assert any("a budget of 30 s leaves no time to measure" in line for line in lines), lines
    assert result.plan.meta["costs"] == "analytic"  # the plan says what its choices rest on


def test_dropout_masks_do_not_depend_on_layouts(tiny_graphs):
    """Train mode with dropout: a non-default plan (layouts, transposes, other vectorized letters)
    draws the same masks, so outputs and gradients agree to rounding."""
    config = load_config("tiny")
    graphs = compile_graphs(config, fuse_ops=True)
    plan = non_default_plan(graphs)
    for key, ov in L.build_problem(*graphs).ops.items():
        if ov.kind == "row" and len(ov.modes) > 1:
            plan.kernels.setdefault(key, {})["vector"] = ov.modes[0].options["vector"]
    a = substation.EncoderLayer(compile_layer(config))
    b = substation.EncoderLayer(compile_layer(config, layout=plan))
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 7, config.hidden_size, dtype=torch.float64)
    out = []
    for m in (a.train(), b.train()):
        torch.manual_seed(5)  # the same dropout seed
        xx = x.clone().requires_grad_()
        y = m(xx)
        y.backward(torch.ones_like(y))
        out.append((y.detach(), xx.grad))
    assert float((out[0][0] - out[1][0]).abs().max()) < 1e-12
    assert float((out[0][1] - out[1][1]).abs().max()) < 1e-12


def test_plan_for_other_sizes_warns():
    """A plan records what it was tuned for; using it on other static sizes or another dtype warns."""
    with pytest.warns(UserWarning, match=r"made for config bert-base applied to bert-large-b8-l512: .*H=12 \(here 16\)"):
        compile_graphs(load_config("bert-large-b8-l512"), fuse_ops=True, layout="bert-base")
    with pytest.warns(UserWarning, match=r"dtype float32 \(here float64\)"):
        compile_graphs(load_config("bert-base").replace(dtype="float64"), fuse_ops=True, layout="bert-base")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # other batch sizes and lengths: no warning
        compile_graphs(load_config("bert-base").replace(batch_size=2, max_seq_len=64), fuse_ops=True,
                       layout="bert-base")
