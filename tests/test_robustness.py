"""Issue 8, robustness: sizes, padding, masks, numerics, gradients, dropout state, builds and errors.

Every numeric check compares against :class:`~substation.reference.ReferenceEncoderLayer` in float64
with the same weights (dropout 0 or eval mode), as max |ours - ref| / max |ref| per tensor. float64
layers must agree within 1e-10; float32 layers within twice PyTorch float32's own error (+1e-6) and below 1e-3.
Sizes are small; configs that share sizes share one build (cached on disk).
"""
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.nn.functional as F

import substation
from conftest import NO_DROPOUT, additive, make_layer, reference_for, rel, run
from substation.backends.cpu.build import BuildError, ToolchainError, toolchain
from substation.config import ConfigError, EncoderConfig, load_config
from substation.pipeline import compile_layer
from substation.reference import ReferenceEncoderLayer
from substation.runtime import CompiledGraph

TINY = load_config("tiny").replace(dropout=NO_DROPOUT)  # I=16, H=4 (P=4), U=24, float64: the tiny_nodrop build
CAUSAL = TINY.replace(mask="causal")
BIG64 = EncoderConfig(name="big64", batch_size=1, max_seq_len=13, hidden_size=1600, num_heads=20, ffn_size=64,
                      layer_norm_eps=1e-5, dtype="float64", dropout=substation.config.DropoutConfig(**NO_DROPOUT))
ODD32 = EncoderConfig(name="odd32", batch_size=1, max_seq_len=77, hidden_size=312, num_heads=12, ffn_size=100,
                      layer_norm_eps=1e-5, dtype="float32", dropout=substation.config.DropoutConfig(**NO_DROPOUT))
PRIME64 = EncoderConfig(name="prime64", batch_size=1, max_seq_len=7, hidden_size=7, num_heads=7, ffn_size=3,
                        layer_norm_eps=1e-5, dtype="float64", activation="gelu_tanh",
                        dropout=substation.config.DropoutConfig(**NO_DROPOUT))
STACK = EncoderConfig(name="stack", batch_size=2, max_seq_len=5, hidden_size=32, num_heads=4, ffn_size=48,
                      layer_norm_eps=1e-5, dtype="float64", dropout=substation.config.DropoutConfig(**NO_DROPOUT))


# -- helpers -----------------------------------------------------------------------------------------
def check_against_reference(layer, x, g, ours_mask: dict, ref_mask, names=None, tol64=1e-10):
    """Compare output and all gradients with the fp64 reference; float32 layers also against PyTorch float32.
    Returns the errors by name."""
    ours = run(layer, x.to(layer.torch_dtype), g, **ours_mask)
    want = run(reference_for(layer), x.double(), g, mask=ref_mask)
    torch32 = None
    if layer.torch_dtype == torch.float32:
        torch32 = run(reference_for(layer, torch.float32), x.float(), g,
                      mask=None if ref_mask is None else ref_mask.float())
    for t in ours.values():
        assert torch.isfinite(t).all()
    errors = {}
    for name in names or want:
        e = rel(ours[name], want[name])
        errors[name] = e
        if torch32 is None:
            assert e <= tol64, (name, e)
        else:
            e_torch = rel(torch32[name], want[name])
            assert e <= 2 * e_torch + 1e-6 and e < 1e-3, (name, e, e_torch)
    return errors


def forward_tensors(layer, x, mask=None, training=False, seed=0):
    """Every tensor the compiled forward writes (Y and the saved ones: QKV, A, R1, N1, F1, ...)."""
    b, j, _ = x.shape
    given = {"X": x.to(layer.torch_dtype).contiguous(),
             **{n: getattr(layer, n).detach() for n in layer.parameter_names}}
    if layer.config.mask != "none":
        given["mask"] = mask if mask is not None else torch.zeros(b, j, dtype=layer.torch_dtype)
    return layer.compiled.forward(given, b, j, seed=seed, training=training)


def randn(*shape, seed=0, scale=1.0):
    torch.manual_seed(seed)
    return scale * torch.randn(*shape, dtype=torch.float64)


# -- 1. sizes ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("b,j", [(2, 1), (2, 7), (2, 50), (1, 77), (2, 129), (1, 513)])
def test_sequence_lengths_not_multiples_of_8(b, j):
    layer = make_layer(TINY)
    x, g = randn(b, j, 16, seed=j), randn(b, j, 16, seed=j + 1)
    pad = torch.zeros(b, j, dtype=torch.bool)
    pad[-1, j // 2 + 1:] = True  # the last sequence padded to about half length (none when j = 1)
    check_against_reference(layer, x, g, {"key_padding_mask": pad}, additive(pad))


@pytest.mark.parametrize("config,b,j", [(BIG64, 1, 13), (BIG64, 2, 9), (ODD32, 1, 77), (ODD32, 3, 17),
                                        (PRIME64, 1, 7), (PRIME64, 2, 50)],
                         ids=["I1600-P80-b1", "I1600-P80-b2", "I312-P26-f32-b1", "I312-P26-f32-b3",
                              "I7-P1-b1", "I7-P1-b2"])
def test_head_and_hidden_sizes_outside_powers_of_two(config, b, j):
    """P = 80 and 26 (outside {32, 64, 128}), P = 1; I = 1600, 312 and 7; U = 64, 100, 3."""
    layer = make_layer(config)
    i = config.hidden_size
    x, g = randn(b, j, i, seed=1), randn(b, j, i, seed=2)
    pad = torch.zeros(b, j, dtype=torch.bool)
    pad[0, j - 2:] = True
    check_against_reference(layer, x, g, {"key_padding_mask": pad}, additive(pad))


def test_sizes_that_cannot_form_a_layer_are_rejected_at_config_time():
    with pytest.raises(ConfigError, match=r"hidden_size: must be divisible by num_heads, got I=1600, H=3"):
        TINY.replace(hidden_size=1600, num_heads=3)
    with pytest.raises(ConfigError, match=r"num_heads: must be >= 1, got 0"):
        TINY.replace(num_heads=0)
    with pytest.raises(ConfigError, match="dropout: must be a DropoutConfig or a mapping with keys attention, hidden, activation; got float"):
        EncoderConfig(dropout=0.1)


# -- 2. padding invariance ---------------------------------------------------------------------------
@pytest.mark.parametrize("config", [TINY, ODD32], ids=["float64", "float32"])
def test_padding_invariance_sweep(config):
    """Real tokens' outputs and gradients do not depend on how far a batch is padded, nor on the (large,
    random) values in the padding. Padded query positions are computed normally: they attend to the
    real keys of their sequence, so they equal the reference there and are finite; their input gradient
    is exactly zero when the loss ignores them."""
    layer = make_layer(config)
    i, dt = config.hidden_size, layer.torch_dtype
    tol = 1e-12 if dt == torch.float64 else 2e-5
    lengths = [5, 3, 1]
    seqs = [randn(n, i, seed=10 + n).to(dt) for n in lengths]
    gs = [randn(n, i, seed=20 + n) for n in lengths]
    alone = [run(layer, s[None], g[None]) for s, g in zip(seqs, gs)]
    ref = reference_for(layer)
    for length in (5, 6, 8, 16, 33, 64):
        x = randn(len(lengths), length, i, seed=length, scale=100.0).to(dt)
        g = torch.zeros(len(lengths), length, i, dtype=torch.float64)
        pad = torch.ones(len(lengths), length, dtype=torch.bool)
        for b, (s, gb) in enumerate(zip(seqs, gs)):
            x[b, :len(s)], g[b, :len(s)], pad[b, :len(s)] = s, gb, False
        out = run(layer, x, g, key_padding_mask=pad)
        for name, t in out.items():
            assert torch.isfinite(t).all(), (name, length)
        for b, n in enumerate(lengths):
            assert rel(out["Y"][b, :n], alone[b]["Y"][0]) <= tol, (length, b)
            assert rel(out["dX"][b, :n], alone[b]["dX"][0]) <= tol, (length, b)
            assert torch.equal(out["dX"][b, n:], torch.zeros_like(out["dX"][b, n:])), (length, b)
        for name in layer.parameter_names:
            total = sum(a[name] for a in alone)
            assert rel(out[name], total) <= tol, (name, length)
        want = ref(x.double(), additive(pad)).detach()
        assert rel(out["Y"], want) <= (1e-10 if dt == torch.float64 else 1e-5), length


# -- 3. masks ----------------------------------------------------------------------------------------
def mask_patterns(b=4, j=9):
    """True = masked key: right padding, left padding, holes, and one fully masked sequence."""
    pad = torch.zeros(b, j, dtype=torch.bool)
    pad[0, 6:] = True
    pad[1, :4] = True
    pad[2, 1::3] = True
    pad[3, :] = True
    return pad


@pytest.mark.parametrize("config", [TINY, ODD32], ids=["float64", "float32"])
@pytest.mark.parametrize("kind", ["minus10000", "dtype_min", "minus_inf", "bool_key_padding", "bool_hf", "int_hf"])
def test_mask_kinds_left_padding_holes_fully_masked(config, kind):
    layer = make_layer(config)
    dt = layer.torch_dtype
    pad = mask_patterns()
    x, g = randn(4, 9, config.hidden_size, seed=3), randn(4, 9, config.hidden_size, seed=4)
    value = {"minus10000": -10000.0, "dtype_min": torch.finfo(dt).min}.get(kind, float("-inf"))
    if kind == "bool_key_padding":
        ours = {"key_padding_mask": pad}
    elif kind == "bool_hf":
        ours = {"attention_mask": ~pad}
    elif kind == "int_hf":
        ours = {"attention_mask": (~pad).to(torch.int32)}
    else:
        ours = {"attention_mask": additive(pad, dt, value)[:, None, None, :]}  # HF's extended form
    # the reference adds the same mask values, rounded to the layer's dtype, in float64
    check_against_reference(layer, x, g, ours, additive(pad, dt, value).double())


@pytest.mark.parametrize("config", [TINY, TINY.replace(mask="none", dtype="float32")], ids=["float64", "float32-nomask"])
def test_nan_input_gives_nan_probability_rows_like_torch(config):
    """A NaN in one token's input makes every attention row of its sequence NaN, as torch.softmax does
    (the row sum is NaN, and so its inverse), and leaves the other sequence as it is when run alone
    (up to the GEMMs' rounding at another batch size)."""
    layer = make_layer(config)
    x = randn(2, 5, 16, seed=8)
    x[0, 2, 3] = float("nan")
    a = forward_tensors(layer, x)["A"]
    assert torch.isnan(a[0]).all() and torch.isfinite(a[1]).all()
    clean = forward_tensors(layer, x[1:])["A"]
    assert (a[1:] - clean).abs().max() <= (1e-6 if config.dtype == "float32" else 1e-14)


def test_fully_masked_sequence_documented_value():
    """All keys masked with -inf: zero attention probabilities, so the attention output is out_proj_bias and
    (post-LN) Y = LN2(h + FFN(h)) with h = LN1(X + out_proj_bias); gradients are finite, those of
    in_proj_weight, in_proj_bias and out_proj_weight exactly zero, and everything matches the reference."""
    layer = make_layer(TINY)
    x, g = randn(1, 5, 16, seed=5), randn(1, 5, 16, seed=6)
    pad = torch.ones(1, 5, dtype=torch.bool)
    ours = run(layer, x, g, key_padding_mask=pad)
    for t in ours.values():
        assert torch.isfinite(t).all()
    assert torch.equal(forward_tensors(layer, x, additive(pad))["A"], torch.zeros(1, 4, 5, 5, dtype=torch.float64))
    p = {n: getattr(layer, n).detach() for n in layer.parameter_names}
    eps = TINY.layer_norm_eps
    h = F.layer_norm(x + p["out_proj_bias"], (16,), p["norm1_weight"], p["norm1_bias"], eps)
    f = F.linear(F.gelu(F.linear(h, p["linear1_weight"], p["linear1_bias"])), p["linear2_weight"], p["linear2_bias"])
    y = F.layer_norm(h + f, (16,), p["norm2_weight"], p["norm2_bias"], eps)
    assert rel(ours["Y"], y) <= 1e-12
    want = run(reference_for(layer), x, g, mask=additive(pad))
    for name in want:
        if name in ("in_proj_weight", "in_proj_bias", "out_proj_weight"):  # A = 0, so C = 0 and no gradient
            assert torch.equal(ours[name], torch.zeros_like(ours[name]))
            assert torch.equal(want[name], torch.zeros_like(want[name]))
        else:
            assert rel(ours[name], want[name]) <= 1e-10, name


def test_reference_gradients_for_fully_masked_rows():
    layer = make_layer(TINY)
    x = randn(2, 5, 16, seed=5).requires_grad_()
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1] = True
    ref = reference_for(layer)
    ref(x, additive(pad)).sum().backward()
    assert torch.isfinite(x.grad).all() and all(torch.isfinite(p.grad).all() for p in ref.parameters())


@pytest.mark.parametrize("value", [float("-inf"), -10000.0])
def test_causal_mask_with_left_padding(value):
    """Causal + left padding: the first queries of a left-padded sequence see only padded keys (fully masked
    with -inf); compare with the reference; and outputs never depend on later tokens."""
    layer = make_layer(CAUSAL)
    pad = torch.zeros(3, 8, dtype=torch.bool)
    pad[1, :3] = True
    pad[2, 2:5] = True
    x, g = randn(3, 8, 16, seed=7), randn(3, 8, 16, seed=8)
    check_against_reference(layer, x, g, {"attention_mask": additive(pad, value=value)}, additive(pad, value=value))
    with torch.no_grad():
        y = layer(x, attention_mask=additive(pad, value=value))
        for t in range(7):
            x2 = x.clone()
            x2[:, t + 1:] += randn(3, 7 - t, 16, seed=t, scale=50.0)
            y2 = layer(x2, attention_mask=additive(pad, value=value))
            assert (y2[:, :t + 1] - y[:, :t + 1]).abs().max() <= 1e-13, t
            assert (y2[:, t + 1:] - y[:, t + 1:]).abs().max() > 1e-3, t


# -- 4. numerics -------------------------------------------------------------------------------------
def max_score(layer, x):
    c = layer.config
    qkv = forward_tensors(layer, x)["QKV"].double()  # [B, J, 3, H, P]
    q, k = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2)
    return float((q @ k.transpose(-1, -2)).abs().max()) / math.sqrt(c.head_size)


@pytest.mark.parametrize("config", [TINY, ODD32], ids=["float64", "float32"])
def test_huge_scores_and_activations(config):
    """Pre-softmax scores above 1e4 (near one-hot softmax) and feed-forward activations above 1e3:
    no overflow, no NaN, and the reference's numbers."""
    layer = make_layer(config)
    with torch.no_grad():
        layer.linear1_weight.mul_(500.0)
    x = randn(2, 9, config.hidden_size, seed=9, scale=100.0).to(layer.torch_dtype)
    g = randn(2, 9, config.hidden_size, seed=10)
    assert max_score(layer, x) > 1e4
    saved = forward_tensors(layer, x)
    assert saved["F1"].abs().max() > 1e3 and saved["R1"].abs().max() > 1e2
    assert saved["A"].max() == 1.0  # a saturated softmax row
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[1, 5:] = True
    check_against_reference(layer, x, g, {"key_padding_mask": pad}, additive(pad))


@pytest.mark.parametrize("config,forward_tol", [(TINY, 1e-9), (ODD32, 1e-6)], ids=["float64", "float32"])
def test_layer_norm_large_mean_tiny_variance(config, forward_tol):
    """Rows with mean 1e4 and standard deviation 1e-2 (ratio 1e6). With the attention projections zeroed,
    R1 = X, so N1 = LN1(X). The exact value comes from float64 on X - 1e4 (an exact shift; layer norm is
    shift invariant). PyTorch float32's F.layer_norm is off by 3e-2 here."""
    layer = make_layer(config)
    with torch.no_grad():
        for n in ("in_proj_weight", "out_proj_weight", "out_proj_bias"):
            getattr(layer, n).zero_()
    i, dt = config.hidden_size, layer.torch_dtype
    x = (1e4 + randn(2, 9, i, seed=11, scale=1e-2)).to(dt)
    g = randn(2, 9, i, seed=12)
    shifted = x.double() - 1e4  # exact
    p = {n: getattr(layer, n).detach().double() for n in layer.parameter_names}
    saved = forward_tensors(layer, x)
    assert torch.equal(saved["R1"], x)
    n1 = F.layer_norm(shifted, (i,), p["norm1_weight"], p["norm1_bias"], config.layer_norm_eps)
    assert rel(saved["N1"], n1) <= forward_tol
    ours = run(layer, x, g)
    ref = reference_for(layer)
    want = run(ref, shifted, g)  # the whole layer is shift invariant in X when the attention projections are 0
    assert rel(ours["Y"], want["Y"]) <= forward_tol
    for name in ("in_proj_weight", "in_proj_bias"):
        assert torch.equal(ours[name], torch.zeros_like(ours[name]))
    torch32 = run(reference_for(layer, torch.float32), x, g) if dt == torch.float32 else None
    for name in ("dX", "out_proj_weight", "out_proj_bias", "linear1_weight", "linear1_bias", "linear2_weight",
                 "linear2_bias", "norm1_weight", "norm1_bias", "norm2_weight", "norm2_bias"):
        e = rel(ours[name], want[name])
        if torch32 is None:
            assert e <= 1e-8, (name, e)
        else:  # backward reads the saved float32 mean: rounding it (~5e-4 at 1e4) shifts x - mean
            assert e <= 2 * rel(torch32[name], want[name]) + 1e-6, (name, e)


def test_layer_norm_large_mean_tiny_variance_float32_gradients_accurate():
    """Layer-norm statistics are kept in float64, so backward recomputes x - mean exactly."""
    layer = make_layer(ODD32)
    with torch.no_grad():
        for n in ("in_proj_weight", "out_proj_weight", "out_proj_bias"):
            getattr(layer, n).zero_()
    x = (1e4 + randn(2, 9, 312, seed=11, scale=1e-2)).float()
    g = randn(2, 9, 312, seed=12)
    ours, want = run(layer, x, g), run(reference_for(layer), x.double() - 1e4, g)
    for name in ("dX", "norm1_weight"):
        assert rel(ours[name], want[name]) <= 1e-4, (name, rel(ours[name], want[name]))


# -- 5. gradients ------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["input_only", "weights_only", "some_weights", "some_weights_and_input"])
def test_only_some_inputs_require_grad_numbers(which):
    layer = make_layer(TINY, seed=3)
    ref = reference_for(layer)
    x, g = randn(2, 7, 16, seed=13), randn(2, 7, 16, seed=14)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 4:] = True
    some = {"in_proj_weight", "norm2_weight", "linear1_bias"}
    wanted = {"input_only": set(), "weights_only": set(layer.parameter_names), "some_weights": some,
              "some_weights_and_input": some}[which]
    x_grad = which in ("input_only", "some_weights_and_input")
    for module in (layer, ref):
        for n, prm in module.named_parameters():
            prm.requires_grad_(n in wanted)
            prm.grad = None
    results = []
    for module, kw in ((layer, {"key_padding_mask": pad}), (ref, {"mask": additive(pad)})):
        xi = x.clone().requires_grad_(x_grad)
        module(xi, **kw).backward(g)
        results.append((xi.grad, {n: prm.grad for n, prm in module.named_parameters()}))
    (dx, grads), (dx_ref, grads_ref) = results
    assert (dx is None) == (not x_grad)
    if x_grad:
        assert rel(dx, dx_ref) <= 1e-10
    for n in layer.parameter_names:
        if n in wanted:
            assert rel(grads[n], grads_ref[n]) <= 1e-10, n
        else:
            assert grads[n] is None, n


def randomized_stack(compiled, n_layers, seed=0):
    torch.manual_seed(seed)
    layers = torch.nn.ModuleList(substation.EncoderLayer(compiled) for _ in range(n_layers))
    with torch.no_grad():
        for layer in layers:
            for name, p in layer.named_parameters():
                if p.dim() == 1:
                    p.copy_(torch.randn_like(p) * 0.2 + (1.0 if name.startswith("norm") and "weight" in name else 0.0))
    return layers


def reference_stack(layers):
    refs = torch.nn.ModuleList(ReferenceEncoderLayer(l.config, torch.float64) for l in layers)
    for r, l in zip(refs, layers):
        r.load_state_dict(l.state_dict())
    return refs


def chain(layers, x, **mask):
    for layer in layers:
        x = layer(x, **mask)
    return x


def test_24_stacked_layers_from_one_build():
    compiled = compile_layer(STACK)
    layers = randomized_stack(compiled, 24)
    refs = reference_stack(layers)
    assert all(l.compiled is compiled for l in layers)
    ptrs = {p.data_ptr() for l in layers for p in l.parameters()}
    assert len(ptrs) == 24 * 12  # every layer owns its parameters
    x, g = randn(2, 5, 32, seed=15), randn(2, 5, 32, seed=16)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, 3:] = True
    xs = [x.clone().requires_grad_() for _ in range(2)]
    y = chain(layers, xs[0], key_padding_mask=pad)
    y_ref = chain(refs, xs[1], mask=additive(pad))
    y.backward(g)
    y_ref.backward(g)
    assert rel(y, y_ref) <= 1e-10 and rel(xs[0].grad, xs[1].grad) <= 1e-10
    for k, (l, r) in enumerate(zip(layers, refs)):
        for (n, p), (_, q) in zip(l.named_parameters(), r.named_parameters()):
            assert rel(p.grad, q.grad) <= 1e-10, (k, n, rel(p.grad, q.grad))
    for k in range(23):
        for n in layers[k].parameter_names:
            a, b = getattr(layers[k], n).grad, getattr(layers[k + 1], n).grad
            assert (a - b).abs().max() > 1e-6 * a.abs().max(), (k, n)


def test_small_training_run_follows_pytorch():
    """20 Adam steps on a regression target, a 2-layer model, padding mask: the loss curve equals the
    reference's within 1e-9 and the parameters stay within 1e-8."""
    compiled = compile_layer(STACK)
    layers = randomized_stack(compiled, 2, seed=1)
    refs = reference_stack(layers)
    x, target = randn(3, 5, 32, seed=17), randn(3, 5, 32, seed=18)
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[2, 2:] = True
    curves = []
    for model, mask in ((layers, {"key_padding_mask": pad}), (refs, {"mask": additive(pad)})):
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(20):
            opt.zero_grad()
            loss = F.mse_loss(chain(model, x, **mask), target)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves.append(losses)
    ours, theirs = curves
    assert ours[-1] < 0.8 * ours[0]
    assert max(abs(a - b) for a, b in zip(ours, theirs)) <= 1e-9, (ours, theirs)
    for l, r in zip(layers, refs):
        for (n, p), (_, q) in zip(l.named_parameters(), r.named_parameters()):
            assert (p - q).abs().max() <= 1e-8, n


# -- 6. dropout state --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dropout_layer():
    return make_layer(load_config("tiny"))  # attention 0.1, hidden 0.1


def test_backward_uses_its_own_forward_mask_out_of_order(dropout_layer):
    """Two forwards draw different masks; running their backwards in reverse order (and interleaved with a
    third forward) gives each exactly the gradients of a run alone with the same seed."""
    layer = dropout_layer.train()
    x, g = randn(2, 7, 16, seed=19), randn(2, 7, 16, seed=20)

    def grads_of(y, xi):
        layer.zero_grad()
        y.backward(g)
        return {"dX": xi.grad.clone(), **{n: p.grad.clone() for n, p in layer.named_parameters()}}

    torch.manual_seed(42)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1 = layer(x1)
    y2 = layer(x2)
    g2 = grads_of(y2, x2)
    layer(x)  # another forward in between draws yet another mask
    g1 = grads_of(y1, x1)
    assert not torch.equal(y1, y2)
    alone = []
    for skip in (0, 1):
        torch.manual_seed(42)
        for _ in range(skip):
            layer(x)
        xa = x.clone().requires_grad_()
        ya = layer(xa)
        alone.append(grads_of(ya, xa))
    for name in g1:
        assert torch.equal(g1[name], alone[0][name]), name
        assert torch.equal(g2[name], alone[1][name]), name
    assert any(not torch.equal(g1[n], g2[n]) for n in g1)


def test_parameter_gradients_under_dropout_match_finite_differences(dropout_layer):
    """With a fixed seed the dropout layer is a deterministic function of its parameters; its compiled
    backward matches finite differences for a bias and a layer-norm weight."""
    layer = dropout_layer.train()
    x = randn(1, 4, 16, seed=21)
    for name in ("out_proj_bias", "norm1_weight"):
        def f(p, name=name):
            torch.manual_seed(7)
            return torch.func.functional_call(layer, {name: p}, (x,))
        p0 = getattr(layer, name).detach().clone().requires_grad_()
        assert torch.autograd.gradcheck(f, (p0,), eps=1e-6, atol=1e-7, rtol=1e-5), name


def test_same_seed_reproduces_a_training_run(dropout_layer):
    """Three SGD steps through two dropout layers: the same seed reproduces losses and parameters bitwise;
    another seed does not."""
    compiled = dropout_layer.compiled
    x, target = randn(2, 7, 16, seed=22), randn(2, 7, 16, seed=23)

    def train(seed):
        torch.manual_seed(0)
        model = torch.nn.Sequential(substation.EncoderLayer(compiled), substation.EncoderLayer(compiled))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(seed)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = F.mse_loss(model(x), target)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, [p.detach().clone() for p in model.parameters()]

    a, b, c = train(1), train(1), train(2)
    assert a[0] == b[0] and all(torch.equal(p, q) for p, q in zip(a[1], b[1]))
    assert a[0] != c[0] and any(not torch.equal(p, q) for p, q in zip(a[1], c[1]))
    assert len(set(a[0])) == 3


def test_identical_rows_and_heads_get_different_dropout_masks(dropout_layer):
    """Two identical sequences in one batch are dropped differently (A_drop keep patterns and outputs)."""
    layer = dropout_layer
    x = randn(1, 7, 16, seed=24).expand(2, 7, 16).contiguous()
    out = forward_tensors(layer, x, training=True, seed=123)
    kept = out["A_drop"] != 0
    assert (out["A"][0] - out["A"][1]).abs().max() < 1e-14
    assert not torch.equal(kept[0], kept[1])
    assert not torch.equal(kept[0, 0], kept[0, 1])  # heads too
    assert (out["Y"][0] - out["Y"][1]).abs().max() > 1e-3
    again = forward_tensors(layer, x, training=True, seed=123)
    assert torch.equal(again["Y"], out["Y"])


# -- 7. builds with the full encoder config ----------------------------------------------------------
RACE_CONFIG = TINY.to_dict()

COMPILE_SCRIPT = textwrap.dedent("""
    import json, sys
    import substation
    layer = substation.compile(json.loads(sys.argv[1]))
    c = layer.compiled
    print(json.dumps({"paths": [c.forward.path, c.backward.path], "seconds": c.build_seconds}))
""")


def entries(cache):
    return sorted(p for p in os.listdir(cache) if not p.startswith("."))


def compile_env(cache):
    return dict(os.environ, SUBSTATION_CACHE_DIR=str(cache), OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                            os.environ.get("PYTHONPATH", "")]))


@pytest.fixture(scope="module")
def raced_cache(tmp_path_factory):
    """Two processes compile the same encoder config at once into a fresh cache."""
    cache = tmp_path_factory.mktemp("race") / "cache"
    procs = [subprocess.Popen([sys.executable, "-c", COMPILE_SCRIPT, json.dumps(RACE_CONFIG)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=compile_env(cache)) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    return cache, [(p.returncode, o, e) for p, (o, e) in zip(procs, outs)]


def test_two_processes_compile_the_same_config(raced_cache, monkeypatch):
    cache, results = raced_cache
    assert [rc for rc, _, _ in results] == [0, 0], [e[-2000:] for _, _, e in results]
    reports = [json.loads(o.strip().splitlines()[-1]) for _, o, _ in results]
    assert reports[0]["paths"] == reports[1]["paths"]
    assert len(entries(cache)) == 2  # one forward and one backward entry, shared
    assert [p for p in os.listdir(cache) if p.startswith(".")] == []
    assert {os.path.dirname(p) for p in reports[0]["paths"]} == {str(cache / e) for e in entries(cache)}
    monkeypatch.setenv("SUBSTATION_CACHE_DIR", str(cache))
    compiled = compile_layer(TINY)
    assert compiled.build_seconds == {"forward": 0.0, "backward": 0.0}
    assert [compiled.forward.path, compiled.backward.path] == reports[0]["paths"]
    layer = substation.EncoderLayer(compiled)
    x = randn(2, 7, 16, seed=25)
    assert rel(layer(x), reference_for(layer)(x)) <= 1e-12


def test_corrupted_cache_entry_is_detected_and_rebuilt(raced_cache, tmp_path, monkeypatch):
    import shutil
    cache = tmp_path / "cache"
    shutil.copytree(raced_cache[0], cache)
    labels = {json.loads((cache / e / "manifest.json").read_text())["label"]: e for e in entries(cache)}
    lib = cache / labels["forward"] / "lib.so"
    data = bytearray(lib.read_bytes())
    data[len(data) // 2:len(data) // 2 + 64] = b"\xff" * 64
    lib.write_bytes(bytes(data))
    monkeypatch.setenv("SUBSTATION_CACHE_DIR", str(cache))
    compiled = compile_layer(TINY)
    assert compiled.build_seconds["forward"] > 0 and compiled.build_seconds["backward"] == 0.0
    assert compiled.forward.path == str(lib)
    manifest = json.loads((cache / labels["forward"] / "manifest.json").read_text())
    from substation.backends.cpu.build import _sha256
    assert manifest["sha256"] == _sha256(str(lib))
    assert entries(cache) == sorted(labels.values())
    layer = substation.EncoderLayer(compiled)
    x, g = randn(2, 7, 16, seed=26), randn(2, 7, 16, seed=27)
    check_against_reference(layer, x, g, {}, None)


def test_build_killed_while_compiling_leaves_nothing_loaded(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    proc = subprocess.Popen([sys.executable, "-c", COMPILE_SCRIPT, json.dumps(RACE_CONFIG)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=compile_env(cache), start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if os.path.isdir(cache) and any(p.startswith(".tmp-") and os.path.exists(cache / p / "source.cpp")
                                            for p in os.listdir(cache)):
                break
            time.sleep(0.02)
        assert proc.poll() is None, "the build finished before it could be killed"
        time.sleep(0.2)  # g++ is running now (a tiny build takes over a second)
        os.killpg(proc.pid, signal.SIGKILL)  # the compiling process and its g++ children
    finally:
        proc.wait(timeout=60)
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert entries(cache) == []  # nothing was published
    leftovers = [p for p in os.listdir(cache) if p.startswith(".tmp-")]
    assert leftovers
    monkeypatch.setenv("SUBSTATION_CACHE_DIR", str(cache))
    compiled = compile_layer(TINY)
    assert compiled.build_seconds["forward"] > 0 and compiled.build_seconds["backward"] > 0
    for path in (compiled.forward.path, compiled.backward.path):
        assert os.path.basename(os.path.dirname(path)) in entries(cache)
    assert len(entries(cache)) == 2
    layer = substation.EncoderLayer(compiled)
    x, g = randn(2, 7, 16, seed=28), randn(2, 7, 16, seed=29)
    check_against_reference(layer, x, g, {}, None)


# -- 9. errors -----------------------------------------------------------------------------------------
def fake_compiler(tmp_path, version_line="fakecxx 1.0"):
    exe = tmp_path / "fakecxx"
    version = f'if [ "$1" = --version ]; then echo "{version_line}"; exit 0; fi\n' if version_line else ""
    exe.write_text("#!/bin/sh\n" + version + 'echo "fakecxx: error: refusing to compile" >&2\nexit 1\n')
    exe.chmod(0o755)
    return str(exe)


def test_toolchain_error_missing_compiler(fresh_toolchain, capsys, tmp_path):
    fresh_toolchain.setenv("CXX", "no-such-compiler-xyz")
    message = r"C\+\+ compiler 'no-such-compiler-xyz' not found on PATH \(set \$CXX or install g\+\+\)"
    with pytest.raises(ToolchainError, match=message):
        toolchain()
    with pytest.raises(ToolchainError, match=message):
        substation.compile(TINY)
    from substation.cli import main
    assert main(["compile", "tiny", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "substation: error: C++ compiler 'no-such-compiler-xyz' not found on PATH" in err
    assert not (tmp_path / "out").exists()


def test_toolchain_error_missing_mkl_headers_and_libraries(fresh_toolchain, tmp_path):
    empty = tmp_path / "prefix"
    (empty / "include").mkdir(parents=True)
    fresh_toolchain.setattr(sys, "prefix", str(empty))
    fresh_toolchain.setenv("MKLROOT", str(tmp_path / "mklroot-empty"))
    with pytest.raises(ToolchainError, match=r"MKL headers \(mkl_cblas.h\) not found under sys.prefix/include "
                                             r"or \$MKLROOT/include; install the 'mkl-devel' package"):
        toolchain()
    (empty / "include" / "mkl_cblas.h").write_text("/* header only */\n")
    toolchain.cache_clear()
    with pytest.raises(ToolchainError, match=r"MKL library libmkl_intel_lp64.so not found under sys.prefix/lib or "
                                             r"\$MKLROOT/lib; install the 'mkl-devel' package"):
        toolchain()
    from substation.cli import main
    assert main(["compile", "tiny", "--out", str(tmp_path / "out")]) == 2


def test_build_error_from_a_failing_compiler(fresh_toolchain, tmp_path, capsys):
    fresh_toolchain.setenv("CXX", fake_compiler(tmp_path))
    with pytest.raises(BuildError, match=r"compiling (forward|backward) failed \(.*fakecxx[\s\S]*refusing to compile"):
        compile_layer(TINY)
    assert entries(tmp_path / "cache") == []
    from substation.cli import main
    assert main(["compile", "tiny", "--out", str(tmp_path / "out")]) == 2
    assert "substation: error: compiling" in capsys.readouterr().err


def test_compiler_without_version_output_is_a_toolchain_error(fresh_toolchain, tmp_path):
    fresh_toolchain.setenv("CXX", fake_compiler(tmp_path, version_line=None))
    with pytest.raises(ToolchainError):
        toolchain()


def test_cli_prints_error_and_exits_2_in_a_subprocess(tmp_path):
    env = dict(compile_env(tmp_path / "cache"), CXX="no-such-compiler-xyz")
    proc = subprocess.run([sys.executable, "-m", "substation", "compile", "tiny", "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2
    assert ("substation: error: C++ compiler 'no-such-compiler-xyz' not found on PATH (set $CXX or install g++)\n"
            in proc.stderr)
    assert "Traceback" not in proc.stderr and not (tmp_path / "o").exists()


def test_cli_whose_reader_left_stops_quietly(tmp_path):
    """``substation report ... | head``: a reader that closes the pipe early ends the command with the
    shell's SIGPIPE status (141) and no error message, as `cat` would."""
    proc = subprocess.Popen([sys.executable, "-m", "substation", "report", "tiny", "--mode", "eval"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=compile_env(tmp_path / "cache"))
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141, err
    assert err == ""


def test_cli_error_starts_its_own_line(fresh_toolchain, tmp_path, capsys):
    import re
    from substation.cli import main
    fresh_toolchain.setenv("CXX", "no-such-compiler-xyz")
    assert main(["compile", "tiny", "--out", str(tmp_path / "o")]) == 2
    lines = re.split(r"[\r\n]", capsys.readouterr().err)
    assert any(line.startswith("substation: error: C++ compiler") for line in lines), lines


def test_cli_missing_config_file(tmp_path, capsys):
    from substation.cli import main
    assert main(["compile", str(tmp_path / "missing.yaml"), "--out", str(tmp_path / "o")]) == 2
    assert f"substation: error: config file not found: {tmp_path / 'missing.yaml'}" in capsys.readouterr().err


def test_tensor_errors_not_on_cpu():
    layer = make_layer(TINY)
    x = randn(2, 7, 16)
    with pytest.raises(ValueError, match="hidden_states is on the meta device: the model.s weights are not loaded yet"):
        layer(x.to("meta"))
    with pytest.raises(ValueError, match="the mask must be on the CPU like hidden_states, got device meta"):
        layer(x, attention_mask=torch.zeros(2, 7, dtype=torch.float64, device="meta"))
    with pytest.raises(ValueError, match="the mask must be on the CPU like hidden_states, got device meta"):
        layer(x, key_padding_mask=torch.zeros(2, 7, dtype=torch.bool, device="meta"))
    with pytest.raises(TypeError, match="layers of this build run on the CPU only; moving them to meta is not "
                                        "supported$"):
        make_layer(TINY).to("meta")
    moved = make_layer(TINY)
    moved.in_proj_weight = torch.nn.Parameter(torch.empty_like(moved.in_proj_weight, device="meta"))
    with pytest.raises(ValueError, match=r"parameter in_proj_weight is on the meta device \(weights not loaded yet\)"):
        moved(x)


def test_library_errors():
    layer = make_layer(TINY)
    compiled = layer.compiled
    with pytest.raises(RuntimeError, match=r"library .*lib.so does not match the forward graph \(signature 'dY,"):
        CompiledGraph(compiled.forward.graph, compiled.backward.path)
    with pytest.raises(RuntimeError, match=r"built without per-operator timers \(instrument=True\)"):
        compiled.forward.op_seconds()
