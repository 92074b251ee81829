"""The operator-kind registry: every kind has every piece, every kind the pipeline creates is registered,
and each kind's float64 reference semantics, interpreted over the forward and backward graphs
(:func:`substation.reference.run_graph`), reproduces the PyTorch reference layer, its autograd
gradients and the compiled layer's training-mode dropout."""
import pytest
import torch

from conftest import make_layer, reference_for, rel
from substation.config import TARGETS, load_config
from substation.ops import KINDS, OpKind, op_kind
from substation.passes.layout import load_plan
from substation.pipeline import compile_graphs
from substation.reference import run_graph

VARIANTS = {
    "post-gelu": {},
    "pre-relu-causal": {"layer_norm": "pre", "activation": "relu", "mask": "causal"},
    "gelu_tanh-activation-dropout": {"activation": "gelu_tanh", "dropout": {"activation": 0.2}},
    "no-mask": {"mask": "none"},
}


def graphs_of(config, fuse):
    return compile_graphs(config, fuse_ops=fuse)


def members(graph):
    for op in graph.operators():
        yield from (op.attrs["ops"] if op.kind == "fused" else [{"kind": op.kind}])


def test_every_kind_has_every_piece():
    assert len(KINDS) == 19
    for name, kind in KINDS.items():
        assert kind.name == name and kind.op_class in ("TC", "SN", "EW")
        assert callable(kind.flop) and callable(kind.reference), name
        if kind.op_class == "TC":
            assert kind.row is None and not kind.overrides
            with pytest.raises(ValueError, match="has no row-kernel body"):
                kind.row_emitter("cpu")
        else:  # one body for every target; an override only where a target differs
            # every kind names its fused kernels but the cast, which leaves the paper's names alone
            assert callable(kind.row) and (kind.letter or name == "cast"), name
            assert set(kind.overrides) <= set(TARGETS) and all(map(callable, kind.overrides.values())), name
            assert {kind.row_emitter(t) for t in TARGETS} <= {kind.row, *kind.overrides.values()}
        assert kind.reduction in (None, "row", "column")
    # autocast's op lists: contractions in the low precision, normalizations in float32, the rest promote
    assert {n: k.autocast for n, k in KINDS.items() if k.autocast != "promote"} == {
        "contraction": "lower_precision_fp", "attention": "lower_precision_fp", "layer_norm": "fp32", "rms_norm": "fp32"}
    # The CPU's softmax keeps its exponentials in a row buffer (its vector exp routine); nothing else differs.
    assert {name: sorted(k.overrides) for name, k in KINDS.items() if k.overrides} == {"softmax": ["cpu"]}
    with pytest.raises(ValueError, match=r"unknown operator kind 'group_norm' \(known: activation"):
        op_kind("group_norm")


def test_a_kind_without_its_pieces_is_refused():
    flop, reference, row = (lambda *a: 0), (lambda *a: {}), (lambda k, attrs: None)
    with pytest.raises(ValueError, match="an EW or SN kind needs a row-kernel body"):
        OpKind("scale", "EW", flop=flop, reference=reference)
    with pytest.raises(ValueError, match="a TC kind has no row-kernel body"):
        OpKind("matmul", "TC", flop=flop, reference=reference, row=row)
    with pytest.raises(ValueError, match=r"autocast must be one of lower_precision_fp, fp32, promote, got 'fp16'"):
        OpKind("scale", "EW", flop=flop, reference=reference, row=row, autocast="fp16")
    with pytest.raises(ValueError, match=r"overrides must map targets \(cpu, cuda\)"):
        OpKind("scale", "EW", flop=flop, reference=reference, row=row, overrides={"tpu": row})


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_kind_the_pipeline_creates_is_registered_and_differentiable(variant):
    config = load_config("tiny").replace(**VARIANTS[variant])
    for fuse in (False, True):
        fwd, bwd = graphs_of(config, fuse)
        for m in members(fwd):
            assert op_kind(m["kind"]).vjp is not None, m["kind"]
        for m in members(bwd):
            op_kind(m["kind"])
    fwd, bwd = compile_graphs(load_config("bert-base"), fuse_ops=True, layout=load_plan("bert-base"))
    assert {m["kind"] for g in (fwd, bwd) for m in members(g)} <= set(KINDS)


def logical(layer, name, dims, sizes):
    """A parameter in the graph's logical dims (``in_proj_weight`` [3I, I] -> [T, H, P, I])."""
    return getattr(layer, name).detach().reshape([sizes[d] for d in dims])


def interpreted(config, fuse, x, mask, g, seed=0, training=False, layer=None):
    fwd, bwd = graphs_of(config, fuse)
    b, j, _ = x.shape
    sizes = config.sizes(b, j)
    params = {n: logical(layer, n, t.dims, sizes) for n, t in fwd.tensors.items() if t.role == "param"}
    given = {"X": x, **params}
    if config.mask != "none":
        given["mask"] = mask if mask is not None else torch.zeros(b, j, dtype=x.dtype)
    env = run_graph(fwd, given, seed, training)
    saved = {n: env[n] for n, t in bwd.tensors.items() if t.role in ("saved", "param")}
    genv = run_graph(bwd, {**saved, "dY": g}, seed, training)
    return env, genv


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_interpreted_graphs_match_the_reference_layer_and_autograd(variant, fuse):
    config = load_config("tiny").replace(**VARIANTS[variant])
    layer = make_layer(config).eval()
    ref = reference_for(layer).eval()
    torch.manual_seed(1)
    b, j = 3, 7
    x = torch.randn(b, j, config.hidden_size, dtype=torch.float64)
    g = torch.randn_like(x)
    mask = None
    if config.mask != "none":
        pad = torch.zeros(b, j, dtype=torch.bool)
        pad[1, 4:] = True
        pad[2, :] = True                      # a fully padded sequence: zero probabilities
        mask = torch.zeros(b, j, dtype=torch.float64).masked_fill(pad, float("-inf"))
    env, genv = interpreted(config, fuse, x, mask, g, layer=layer)
    xr = x.clone().requires_grad_()
    y_ref = ref(xr, mask)
    y_ref.backward(g)
    assert rel(env["Y"], y_ref) <= 1e-12
    assert rel(genv["dX"], xr.grad) <= 1e-12
    for name, p in ref.named_parameters():
        got = genv[f"d{name}"].reshape(p.shape)
        scale = float(p.grad.abs().max())
        assert float((got - p.grad).abs().max()) <= 1e-12 * max(scale, 1.0), name


def test_interpreted_dropout_masks_equal_the_compiled_layer():
    """Training mode, heavy dropout at every site: the interpreter's Philox masks (numpy) and the
    compiled CPU build give the same forward tensors and gradients for one seed."""
    config = load_config("tiny").replace(dropout={"attention": 0.3, "hidden": 0.25, "activation": 0.2})
    layer = make_layer(config).train()
    torch.manual_seed(2)
    b, j = 2, 7
    x = torch.randn(b, j, config.hidden_size, dtype=torch.float64)
    g = torch.randn_like(x)
    seed = 0x1234_5678_9ABC
    env, genv = interpreted(config, True, x, None, g, seed=seed, training=True, layer=layer)
    compiled = layer.compiled
    given = {"X": x, "mask": torch.zeros(b, j, dtype=torch.float64),
             **{n: getattr(layer, n).detach() for n in layer.parameter_names}}
    out = compiled.forward(given, b, j, seed, True)
    for name in ("A_drop", "F1_drop", "Y"):
        assert rel(out[name].reshape(env[name].shape), env[name]) <= 1e-12, name
    assert float((out["A_drop"] == 0).double().mean()) > 0.25     # the masks are really there
    saved = {**given, **out}
    grads = compiled.backward({**{n: saved[n] for n in compiled.saved_names}, "dY": g}, b, j, seed, True)
    assert rel(grads["dX"], genv["dX"]) <= 1e-12
    assert rel(grads["dlinear1_weight"].reshape(genv["dlinear1_weight"].shape), genv["dlinear1_weight"]) <= 1e-12
