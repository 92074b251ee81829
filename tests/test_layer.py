"""Forward output and every gradient of the compiled layer against an fp64 PyTorch reference."""
import itertools

import pytest
import torch

from conftest import NO_DROPOUT, additive, make_layer, reference_for, rel, run
from substation.config import EncoderConfig

SMALL = EncoderConfig(name="small", batch_size=3, max_seq_len=13, hidden_size=64, num_heads=4, ffn_size=96,
                      layer_norm_eps=1e-5).replace(dropout=NO_DROPOUT)

VARIANTS = list(itertools.product(("post", "pre"), ("gelu", "relu"), (True, False)))


def inputs(config, dtype, masked):
    torch.manual_seed(1)
    b, j, i = config.batch_size, config.max_seq_len, config.hidden_size
    x = torch.randn(b, j, i, dtype=torch.float64)
    g = torch.randn(b, j, i, dtype=torch.float64)
    pad = None
    if masked:
        pad = torch.zeros(b, j, dtype=torch.bool)
        pad[1:, j // 2:] = True  # later sequences padded to half length
    return x, g, pad


@pytest.mark.parametrize("placement,activation,masked", VARIANTS)
def test_float64_matches_reference(placement, activation, masked):
    config = SMALL.replace(layer_norm=placement, activation=activation, dtype="float64",
                           max_seq_len=7, batch_size=2, hidden_size=32, ffn_size=40)
    layer = make_layer(config)
    ref = reference_for(layer)
    x, g, pad = inputs(config, torch.float64, masked)
    ours = run(layer, x, g, key_padding_mask=pad)
    want = run(ref, x, g, mask=additive(pad, torch.float64))
    assert set(ours) == set(want) and len(ours) == 14
    for name in want:
        assert ours[name].shape == want[name].shape, name
        assert rel(ours[name], want[name]) <= 1e-10, (name, rel(ours[name], want[name]))


@pytest.mark.parametrize("placement,activation,masked", VARIANTS)
def test_float32_error_within_twice_pytorch(placement, activation, masked):
    config = SMALL.replace(layer_norm=placement, activation=activation, dtype="float32")
    layer = make_layer(config)
    ref64 = reference_for(layer, torch.float64)
    ref32 = reference_for(layer, torch.float32)
    x, g, pad = inputs(config, torch.float32, masked)
    want = run(ref64, x, g, mask=additive(pad, torch.float64))
    torch32 = run(ref32, x.float(), g, mask=additive(pad, torch.float32))
    # Hugging Face convention here (True = attend); the float64 test uses PyTorch's key_padding_mask.
    ours = run(layer, x.float(), g, attention_mask=None if pad is None else ~pad)
    for name in want:
        e_ours, e_torch = rel(ours[name], want[name]), rel(torch32[name], want[name])
        assert e_ours <= 2 * e_torch, (name, e_ours, e_torch)
        assert e_ours < 1e-4, (name, e_ours)


@pytest.mark.parametrize("variant", [{"activation": "gelu_tanh"}, {"mask": "causal"}, {"mask": "none"},
                                     {"mask": "causal", "layer_norm": "pre"}])
def test_other_variants_float64(variant, tiny_nodrop):
    config = tiny_nodrop.replace(**variant)
    layer = make_layer(config)
    ref = reference_for(layer)
    x, g, pad = inputs(config, torch.float64, config.mask != "none")
    want = run(ref, x, g, mask=additive(pad, torch.float64))
    ours = run(layer, x, g, key_padding_mask=pad)
    for name in want:
        assert rel(ours[name], want[name]) <= 1e-10, (name, rel(ours[name], want[name]))


@pytest.mark.parametrize("b,j", [(1, 1), (1, 7), (2, 3), (5, 11)])
def test_runtime_sizes_differ_from_config(b, j, tiny_nodrop):
    layer = make_layer(tiny_nodrop)
    ref = reference_for(layer)
    torch.manual_seed(3)
    x = torch.randn(b, j, tiny_nodrop.hidden_size, dtype=torch.float64)
    g = torch.randn_like(x)
    want = run(ref, x, g)
    ours = run(layer, x, g)
    for name in want:
        assert rel(ours[name], want[name]) <= 1e-10, (name, b, j)
