"""The fusion pass: kernel counts per variant, what stays in memory, fused numerics."""
import itertools

import pytest
import torch

from conftest import NO_DROPOUT, reference_for
from substation import EncoderLayer
from substation.config import load_config
from substation.passes.fusion import FusionOptions, fuse
from substation.pipeline import compile_graphs, compile_layer

VARIANTS = list(itertools.product(("post", "pre"), ("gelu", "relu"), ("padding", "none")))


def kernels(graph):
    """Memory-bound kernels (non-TC operators) as {name: members}."""
    return {o.label: o.attrs.get("members", [o.label]) for o in graph.operators() if o.op_class != "TC"}


@pytest.mark.parametrize("placement,activation,mask", VARIANTS)
def test_kernel_counts(placement, activation, mask):
    config = load_config("bert-base").replace(layer_norm=placement, activation=activation, mask=mask)
    fwd, bwd = compile_graphs(config, fuse_ops=True)
    assert sum(o.op_class == "TC" for o in fwd.operators()) == 6
    assert sum(o.op_class == "TC" for o in bwd.operators()) == 12
    kf, kb = kernels(fwd), kernels(bwd)
    if placement == "post":
        assert len(kf) == 5 and len(kb) == 6  # the paper: 5 forward, 9 backward
    else:
        assert len(kf) == 6 and len(kb) == 6  # pre-LN normalizes the layer input on its own
    members = sorted(kf.values())
    assert ["out_bias", "out_dropout", "residual1", "layer_norm1" if placement == "post" else "layer_norm2"] in members
    assert (["mask", "softmax", "attention_dropout"] if mask == "padding" else ["softmax", "attention_dropout"]) in members
    assert ["linear1_bias", "activation"] in members
    assert ["attention_dropout_grad", "softmax_grad"] in kb.values()
    # every non-TC operator of the unfused graphs is in exactly one kernel
    ufwd, ubwd = compile_graphs(config)
    for fused, plain in ((kf, ufwd), (kb, ubwd)):
        flat = sorted(m for ms in fused.values() for m in ms)
        assert flat == sorted(o.label for o in plain.operators() if o.op_class != "TC")


def test_bert_forward_kernels_match_the_paper():
    fwd, bwd = compile_graphs(load_config("bert-large-b8-l512"), fuse_ops=True)
    kf = kernels(fwd)
    assert kf == {"input_bias": ["input_bias"],
                  "MSD": ["mask", "softmax", "attention_dropout"],
                  "BDRLN": ["out_bias", "out_dropout", "residual1", "layer_norm1"],
                  "BA": ["linear1_bias", "activation"],
                  "BDRLN2": ["linear2_bias", "ffn_dropout", "residual2", "layer_norm2"]}
    kb = kernels(bwd)
    assert kb["BRSBLNDB"] == ["N1_grad_sum", "layer_norm1_dparams", "layer_norm1_dx", "out_dropout_grad",
                              "out_bias_grad"]
    assert len(kb) == 6


def test_intermediates_never_reach_memory():
    fwd, bwd = compile_graphs(load_config("bert-base"), fuse_ops=True)
    for gone in ("S_masked", "O", "O_drop", "F2", "F2_drop"):  # GEMM outputs (O_raw, ...) stay
        assert gone not in fwd.tensors
    for gone in ("dA", "dN1"):
        assert gone not in bwd.tensors
    saved = {t.name for t in fwd.tensors.values() if t.role == "saved"}
    assert saved == {"QKV", "A", "A_drop", "C", "R1", "N1", "layer_norm1_mean", "layer_norm1_rstd", "F1", "F1_act",
                     "R2", "layer_norm2_mean", "layer_norm2_rstd"}


def test_options_switch_off_and_round_trip():
    fwd, _ = compile_graphs(load_config("tiny"))
    only_vertical = FusionOptions(horizontal=False)
    assert FusionOptions.from_json(only_vertical.to_json()) == only_vertical
    none = fuse(fwd, FusionOptions(vertical=False, horizontal=False))
    assert [o.label for o in none.operators()] == [o.label for o in fwd.operators()]
    with pytest.raises(ValueError, match="already fused"):
        fuse(fuse(fwd))


@pytest.mark.parametrize("placement", ["post", "pre"])
def test_fused_and_unfused_agree_with_reference(placement, tiny):
    config = tiny.replace(layer_norm=placement, dropout=NO_DROPOUT)
    torch.manual_seed(0)
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    g = torch.randn_like(x)
    pad = torch.tensor([[False] * 7, [False] * 3 + [True] * 4])
    results = []
    for fused in (True, False):
        torch.manual_seed(1)
        layer = EncoderLayer(compile_layer(config, fuse=fused))
        xg = x.clone().requires_grad_()
        layer(xg, key_padding_mask=pad).backward(g)
        results.append((layer, xg.grad))
    ref = reference_for(results[0][0])
    xr = x.clone().requires_grad_()
    ref(xr, torch.zeros(2, 7, dtype=torch.float64).masked_fill(pad, float("-inf"))).backward(g)
    for layer, dx in results:
        assert (dx - xr.grad).abs().max() / xr.grad.abs().max() < 1e-10
        for (n, p), pr in zip(layer.named_parameters(), ref.parameters()):
            assert (p.grad - pr.grad).abs().max() / pr.grad.abs().max() < 1e-10, n


def test_fused_dropout_masks_match_unfused(tiny):
    """The same seed gives the same result fused and unfused: masks come from element indices."""
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    outs = []
    for fused in (True, False):
        torch.manual_seed(1)
        layer = EncoderLayer(compile_layer(tiny, fuse=fused))
        torch.manual_seed(7)
        outs.append(layer(x))
    assert (outs[0] - outs[1]).abs().max() < 1e-12
