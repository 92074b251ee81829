"""The forward and backward SDFGs: operator names and classes, symbolic sizes, saved tensors, BLAS."""
import re

import dace
import pytest

from substation.backends.cpu.codegen import generate_cpu
from substation.ir.graph import Operator
from substation.pipeline import compile_graphs

FORWARD_POST = [("qkv", "TC"), ("input_bias", "EW"), ("scores", "TC"), ("mask", "EW"), ("softmax", "SN"),
                ("attention_dropout", "EW"), ("context", "TC"), ("out_proj", "TC"), ("out_bias", "EW"),
                ("out_dropout", "EW"), ("residual1", "EW"), ("layer_norm1", "SN"), ("linear1", "TC"),
                ("linear1_bias", "EW"), ("activation", "EW"), ("linear2", "TC"), ("linear2_bias", "EW"),
                ("ffn_dropout", "EW"), ("residual2", "EW"), ("layer_norm2", "SN")]


def test_forward_operators_post_ln(tiny):
    fwd, _ = compile_graphs(tiny)
    assert [(o.label, o.op_class) for o in fwd.operators()] == FORWARD_POST


def test_forward_operators_pre_ln_and_dropout_free(tiny):
    fwd, _ = compile_graphs(tiny.replace(layer_norm="pre", mask="none", dropout={"attention": 0.0}))
    names = [o.label for o in fwd.operators()]
    assert names[:2] == ["layer_norm1", "qkv"] and "mask" not in names and "attention_dropout" not in names
    assert names.index("layer_norm2") == names.index("residual1") + 1 and names[-1] == "residual2"


@pytest.mark.parametrize("placement", ["post", "pre"])
def test_backward_mirrors_forward(tiny, placement):
    fwd, bwd = compile_graphs(tiny.replace(layer_norm=placement))
    ops = bwd.operators()
    tc = [o.label for o in ops if o.op_class == "TC"]
    fwd_tc = [o.label for o in fwd.operators() if o.op_class == "TC"]
    assert len(tc) == 2 * len(fwd_tc) == 12
    for name in fwd_tc:  # a data and a weight (or second operand) gradient per contraction
        assert sum(t.startswith(name + "_d") for t in tc) == 2
    assert all(o.phase == "backward" for o in ops)
    grads = {t.name for t in bwd.tensors.values() if t.role == "output"}
    assert grads == {"dX"} | {f"d{p}" for p in ("in_proj_weight", "in_proj_bias", "out_proj_weight",
                                                "out_proj_bias", "linear1_weight", "linear1_bias",
                                                "linear2_weight", "linear2_bias", "norm1_weight", "norm1_bias",
                                                "norm2_weight", "norm2_bias")}
    # backward reads only what forward saved (or the layer inputs and parameters)
    saved_fwd = {t.name for t in fwd.tensors.values() if t.role in ("saved", "input", "param")}
    read = {t.name for t in bwd.tensors.values() if t.role in ("saved", "param")}
    assert read <= saved_fwd
    assert {"mask", "S", "S_masked", "O", "O_raw", "QKV_raw"}.isdisjoint(read)


def test_symbolic_shapes_and_save_load(tiny, tmp_path):
    fwd, bwd = compile_graphs(tiny)
    arr = fwd.sdfg.arrays["S"]
    assert [str(s) for s in arr.shape] == ["B", "H", "J", "K"]
    assert {"B", "J", "K", "H", "P", "I", "U"} <= set(map(str, fwd.sdfg.free_symbols)) | set(fwd.sdfg.symbols)
    path = tmp_path / "f.sdfg"
    bwd.save(str(path))
    loaded = dace.SDFG.from_file(str(path))
    ops = [n for n in loaded.nodes()[0].nodes() if isinstance(n, Operator)]
    assert sorted(o.label for o in ops) == sorted(o.label for o in bwd.operators())
    assert {o.label: o.op_class for o in ops} == {o.label: o.op_class for o in bwd.operators()}
    # the same graph gives the same bytes (DaCe's element ids are random otherwise), its ids still unique
    compile_graphs(tiny)[1].save(str(tmp_path / "again.sdfg"))
    text = path.read_text()
    assert text == (tmp_path / "again.sdfg").read_text()
    guids = re.findall(r'"guid":"([^"]+)"', text)
    assert len(guids) > 50 and len(set(guids)) == len(guids)


def test_contractions_are_blas_calls(tiny):
    fwd, bwd = compile_graphs(tiny.replace(dtype="float32"))
    for graph, n in ((fwd, 6), (bwd, 12)):
        src = generate_cpu(graph)
        blocks = re.split(r"\n  // ", src)
        tc_blocks = [b for b in blocks if re.match(r"\w+ \[TC\]", b)]
        assert len(tc_blocks) == n
        for b in tc_blocks:  # every contraction is a GEMM call, never a loop over its reduction
            assert "ss::gemm<float>(" in b and "+=" not in b
        assert src.count("ss::gemm<float>(") >= n and "ss::gemm<double>" not in src
