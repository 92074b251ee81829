"""``norm_type: rms_norm``: the config key, the parameter list without norm biases, the compiled CPU
layer and the emulated CUDA build against a float64 PyTorch RMSNorm layer (pre-LN and post-LN, with a
padding mask), the float64 interpreter of its graphs, fusion into as many row kernels as layer norm,
and the flop and byte counts."""
import pytest
import torch
import torch.nn.functional as F

from conftest import NO_DROPOUT, additive, make_layer, reference_for, rel, run
from test_cuda import TOLERANCE, emulated_layer, errors_vs_reference, needs_emulation
from substation.perf.analysis import analyze
from substation.backends.common import stat_tensors
from substation.backends.cpu.codegen import tensor_dtypes
from substation.config import ConfigError, EncoderConfig, load_config
from substation.ir.graph import parameters
from substation.passes.fusion import kernel_name
from substation.pipeline import compile_graphs
from substation.reference import run_graph
from substation.runtime import PARAMETER_NAMES, parameter_names

RMS = load_config("tiny").replace(norm_type="rms_norm")
PLACEMENTS = ("post", "pre")


def rms_config(placement="post", **changes):
    return RMS.replace(layer_norm=placement, dropout=NO_DROPOUT, **changes)


def test_config_key_and_its_error(tmp_path):
    assert EncoderConfig().norm_type == "layer_norm" and RMS.norm_type == "rms_norm"
    with pytest.raises(ConfigError, match="norm_type: must be one of layer_norm, rms_norm; got 'batch_norm'"):
        RMS.replace(norm_type="batch_norm")
    with pytest.raises(ConfigError, match="norm_type: must be one of layer_norm, rms_norm; got 1"):
        EncoderConfig.from_dict({"norm_type": 1})
    f = tmp_path / "rms.yaml"
    f.write_text("norm_type: rms_norm\nhidden_size: 64\nnum_heads: 4\n")
    c = load_config(f)
    assert c.norm_type == "rms_norm" and EncoderConfig.from_dict(c.to_dict()) == c


def test_parameters_follow_the_norm_type():
    linear = ("in_proj_weight", "in_proj_bias", "out_proj_weight", "out_proj_bias",
              "linear1_weight", "linear1_bias", "linear2_weight", "linear2_bias")
    assert PARAMETER_NAMES == parameter_names(load_config("bert-base")) == \
        linear + ("norm1_weight", "norm1_bias", "norm2_weight", "norm2_bias")
    assert parameter_names(RMS) == linear + ("norm1_weight", "norm2_weight")
    assert parameters(RMS)["norm1_weight"] == "I"
    layer = make_layer(rms_config())
    assert layer.parameter_names == parameter_names(RMS)
    assert tuple(n for n, _ in layer.named_parameters()) == parameter_names(RMS)
    assert tuple(n for n, _ in reference_for(layer).named_parameters()) == parameter_names(RMS)
    fwd, bwd = compile_graphs(RMS)
    assert tuple(n for n, t in fwd.tensors.items() if t.role == "param") == parameter_names(RMS)
    assert {n for n, t in bwd.tensors.items() if t.role == "output"} == {"dX"} | {f"d{n}" for n in parameter_names(RMS)}


def test_reference_norm_is_pytorch_rms_norm():
    """The reference layer's normalization is PyTorch's RMSNorm, which is the formula of the kind."""
    torch.manual_seed(0)
    x, w = torch.randn(3, 5, 16, dtype=torch.float64) * 3 + 1, torch.randn(16, dtype=torch.float64)
    norm = torch.nn.RMSNorm(16, eps=RMS.layer_norm_eps, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.copy_(w)
    by_hand = x / torch.sqrt((x * x).mean(-1, keepdim=True) + RMS.layer_norm_eps) * w
    assert rel(norm(x), by_hand) <= 1e-15
    assert rel(F.rms_norm(x, (16,), w, RMS.layer_norm_eps), by_hand) <= 1e-15


def compare_with_reference(config, seed=1):
    """Relative errors (output, dX, every parameter gradient) of the compiled layer against the
    float64 reference, batch 3 x 7 with a padding mask (one sequence half padded, one wholly)."""
    layer = make_layer(config).eval()
    ref = reference_for(layer).eval()
    torch.manual_seed(seed)
    x = torch.randn(3, 7, config.hidden_size, dtype=torch.float64)
    g = torch.randn_like(x)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[1, 4:] = True
    pad[2, :] = True
    ours = run(layer, x.to(layer.torch_dtype), g, key_padding_mask=pad)
    theirs = run(ref, x, g, mask=additive(pad))
    assert set(ours) == set(theirs) == {"Y", "dX", *parameter_names(config)}
    return {k: rel(ours[k], theirs[k]) for k in ours}


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("dtype, tolerance", [("float64", 1e-10), ("float32", 2e-6)])
def test_compiled_cpu_layer_matches_pytorch_rms_norm(placement, dtype, tolerance):
    """Measured worst over Y, dX and the gradients: below 1e-15 (float64), 3e-7 (float32)."""
    errs = compare_with_reference(rms_config(placement, dtype=dtype))
    worst = max(errs, key=errs.get)
    assert errs[worst] <= tolerance, (worst, errs[worst])


def test_float32_rows_with_a_large_mean_keep_their_digits():
    """Rows of mean 1e3 and spread 1: the double sum of squares keeps rstd exact to float32 rounding."""
    config = rms_config("pre", dtype="float32")
    layer = make_layer(config).eval()
    ref = reference_for(layer).eval()
    torch.manual_seed(4)
    x = 1e3 + torch.randn(2, 5, config.hidden_size, dtype=torch.float64)
    g = torch.randn_like(x)
    ours, theirs = run(layer, x.float(), g), run(ref, x, g)
    assert rel(ours["Y"], theirs["Y"]) <= 2e-6 and rel(ours["dX"], theirs["dX"]) <= 2e-5
    assert rel(ours["norm1_weight"], theirs["norm1_weight"]) <= 2e-6


def interpret(config, fuse, x, g, mask, layer, seed=0, training=False):
    """Forward and backward environments of :func:`run_graph` on ``config``'s graphs."""
    fwd, bwd = compile_graphs(config, fuse_ops=fuse)
    sizes = config.sizes(*x.shape[:2])
    given = {"X": x, "mask": mask,
             **{n: getattr(layer, n).detach().reshape([sizes[d] for d in t.dims])
                for n, t in fwd.tensors.items() if t.role == "param"}}
    env = run_graph(fwd, given, seed, training)
    genv = run_graph(bwd, {**{n: env[n] for n, t in bwd.tensors.items() if t.role in ("saved", "param")},
                           "dY": g}, seed, training)
    return env, genv


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_interpreted_graphs_match_the_reference(placement, fuse):
    config = rms_config(placement)
    layer = make_layer(config).eval()
    ref = reference_for(layer).eval()
    torch.manual_seed(2)
    x = torch.randn(3, 7, config.hidden_size, dtype=torch.float64)
    g = torch.randn_like(x)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[1, 4:] = True
    env, genv = interpret(config, fuse, x, g, additive(pad), layer)
    theirs = run(ref, x, g, mask=additive(pad))
    assert rel(env["Y"], theirs["Y"]) <= 1e-12 and rel(genv["dX"], theirs["dX"]) <= 1e-12
    for n in parameter_names(config):
        assert rel(genv[f"d{n}"].reshape(theirs[n].shape), theirs[n]) <= 1e-12, n
    rms = torch.rsqrt((env["R1" if placement == "post" else "X"] ** 2).mean(-1) + config.layer_norm_eps)
    assert rel(env["layer_norm1_rstd"], rms) <= 1e-14


def test_interpreted_training_dropout_equals_the_compiled_layer():
    """Heavy dropout in training mode: the interpreter (numpy Philox masks) and the compiled CPU
    build agree, so the fused dropout + residual + RMSNorm kernels apply the masks in the right place."""
    config = RMS.replace(dropout={"attention": 0.3, "hidden": 0.25, "activation": 0.2})
    layer = make_layer(config).train()
    torch.manual_seed(3)
    x = torch.randn(2, 7, config.hidden_size, dtype=torch.float64)
    g = torch.randn_like(x)
    mask = torch.zeros(2, 7, dtype=torch.float64)
    seed = 0x5EED_0F_0A11
    env, genv = interpret(config, True, x, g, mask, layer, seed=seed, training=True)
    compiled = layer.compiled
    given = {"X": x, "mask": mask, **{n: getattr(layer, n).detach() for n in layer.parameter_names}}
    out = compiled.forward(given, 2, 7, seed, True)
    assert rel(out["Y"], env["Y"]) <= 1e-12 and float((out["A_drop"] == 0).double().mean()) > 0.25
    grads = compiled.backward({**{n: {**given, **out}[n] for n in compiled.saved_names}, "dY": g}, 2, 7, seed, True)
    assert rel(grads["dX"], genv["dX"]) <= 1e-12
    for n in ("dnorm1_weight", "dnorm2_weight", "dlinear1_weight"):
        assert rel(grads[n].reshape(genv[n].shape), genv[n]) <= 1e-12, n


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_fusion_gives_as_many_row_kernels_as_layer_norm(placement):
    def kernels(config):
        graphs = compile_graphs(config, fuse_ops=True)
        return [[op.label for op in g.operators() if op.op_class != "TC"] for g in graphs]
    rms, ln = kernels(RMS.replace(layer_norm=placement)), kernels(load_config("tiny").replace(layer_norm=placement))
    assert [len(k) for k in rms] == [len(k) for k in ln] == ([5, 6] if placement == "post" else [6, 6])
    fwd, bwd = rms
    if placement == "post":
        assert fwd == ["input_bias", "MSD", "BDRRN", "BA", "BDRRN2"]
        assert bwd[:4] == ["BGRNDB", "BAB", "BRGRNDB", "BDS"]
    assert any("RN" in k for k in fwd) and any("RN" in k for k in bwd)
    members = [{"kind": "bias"}, {"kind": "dropout"}, {"kind": "add"}, {"kind": "rms_norm"}]
    assert kernel_name(members, "forward") == "BDRRN"
    for g in compile_graphs(RMS.replace(dtype="float32"), fuse_ops=True):
        kinds = {m["kind"] for op in g.operators() if op.kind == "fused" for m in op.attrs["ops"]}
        assert not any(k.startswith("layer_norm") for k in kinds)
        assert stat_tensors(g) == {"layer_norm1_rstd", "layer_norm2_rstd"}
        assert {n for n, d in tensor_dtypes(g).items() if d == "float64"} == stat_tensors(g)  # CPU statistics in double


def test_analysis_counts_rms_norm():
    """Forward 4n + 4 rows, dx 7n + 1 row, dgamma 3n flop (docs/analysis.md); bytes from the accesses, each
    tensor at its item size (the rstd statistics are float64 in a float32 CPU build)."""
    config = RMS.replace(dtype="float32")
    s = config.sizes()
    n, rows, item = s["B"] * s["J"] * s["I"], s["B"] * s["J"], 4
    stats = 2 * rows  # rstd [B, J] in float64, counted in float32 elements
    ops = {(o.phase, o.name): o for o in analyze(config).operators}
    fwd = ops["forward", "layer_norm1"]
    assert (fwd.kind, fwd.op_class) == ("rms_norm", "SN")
    assert fwd.flop == 4 * n + 4 * rows
    assert fwd.bytes_read == item * (n + s["I"]) and fwd.bytes_written == item * (n + stats)
    dx, dp = ops["backward", "layer_norm1_dx"], ops["backward", "layer_norm1_dparams"]
    assert dx.flop == 7 * n + rows and dx.bytes_read == item * (2 * n + stats + s["I"]) and dx.bytes_written == item * n
    assert dp.flop == 3 * n and dp.bytes_read == item * (2 * n + stats) and dp.bytes_written == item * s["I"]
    ln = {(o.phase, o.name): o for o in analyze(load_config("tiny").replace(dtype="float32")).operators}
    assert fwd.flop < ln["forward", "layer_norm1"].flop and fwd.bytes < ln["forward", "layer_norm1"].bytes
    fused = analyze(config, optimized=True)
    assert fused.total()["flop"] == analyze(config).total()["flop"] and fused.data_movement_reduction_pct > 0


@needs_emulation
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_emulated_cuda_build_matches_float64(placement, dtype):
    layer = emulated_layer(rms_config(placement, target="cuda", dtype=dtype))
    assert layer.compiled.forward.target == "cuda-emulated"
    assert "layer_norm1_mean" not in layer.compiled.forward.dtypes
    for j in (7, 8):  # scalar rows of keys, then 16-byte vectors in the attention kernels too
        errs = errors_vs_reference(layer, j=j)
        worst = max(errs, key=errs.get)
        assert errs[worst] < TOLERANCE[dtype], (j, worst, errs[worst])


@needs_emulation
def test_emulated_half_statistics_are_float32():
    layer = emulated_layer(rms_config(target="cuda", dtype="bfloat16"))
    assert layer.compiled.forward.dtypes["layer_norm2_rstd"] == torch.float32
    assert layer.compiled.forward.dtypes["Y"] == torch.bfloat16
    errs = errors_vs_reference(layer, j=8)
    assert max(errs.values()) < TOLERANCE["bfloat16"], errs
