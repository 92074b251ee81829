"""The torch binding: dropout semantics, masks, input checks and errors."""
import math

import pytest
import torch

from conftest import make_layer, reference_for


@pytest.fixture(scope="module")
def drop_layer(tiny):
    """float64 tiny layer with heavy dropout everywhere, so every mask is visible."""
    return make_layer(tiny.replace(dropout={"attention": 0.3, "hidden": 0.2, "activation": 0.25}))


def x_for(layer, b=2, j=7, seed=0):
    torch.manual_seed(seed)
    return torch.randn(b, j, layer.config.hidden_size, dtype=layer.torch_dtype)


def test_same_seed_same_output_different_seed_different(drop_layer):
    x = x_for(drop_layer)
    drop_layer.train()
    torch.manual_seed(5)
    a = drop_layer(x)
    torch.manual_seed(5)
    b = drop_layer(x)
    torch.manual_seed(6)
    c = drop_layer(x)
    d = drop_layer(x)  # the generator advanced: consecutive calls differ
    assert torch.equal(a, b)
    assert (a - c).abs().max() > 1e-3 and (c - d).abs().max() > 1e-3


def test_eval_is_deterministic_and_dropout_free(drop_layer):
    x = x_for(drop_layer)
    drop_layer.eval()
    try:
        torch.manual_seed(1)
        a = drop_layer(x)
        torch.manual_seed(2)
        b = drop_layer(x)
        ref = reference_for(drop_layer).eval()
        assert torch.equal(a, b)
        assert (a - ref(x)).abs().max() / ref(x).abs().max() < 1e-12
    finally:
        drop_layer.train()


def test_backward_uses_the_forward_mask(drop_layer):
    """Finite differences of the (seeded, hence deterministic) dropout layer match its backward."""
    x = x_for(drop_layer, b=1, j=3).requires_grad_()
    drop_layer.train()

    def f(inp):
        torch.manual_seed(11)
        return drop_layer(inp)
    assert torch.autograd.gradcheck(f, (x,), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_dropout_keeps_1_minus_p_and_scales(drop_layer):
    """Kept attention probabilities are scaled by 1/(1-p); the kept fraction and the mean match."""
    c = drop_layer.compiled
    p = drop_layer.config.dropout.attention
    b, j = 64, 7
    given = {"X": x_for(drop_layer, b, j), "mask": torch.zeros(b, j, dtype=torch.float64),
             **{n: getattr(drop_layer, n).detach() for n in drop_layer.parameter_names}}
    out = c.forward(given, b, j, seed=1234, training=True)
    a, ad = out["A"], out["A_drop"]
    kept = ad != 0
    n = kept.numel()
    frac = kept.double().mean().item()
    assert abs(frac - (1 - p)) < 4 * math.sqrt(p * (1 - p) / n)
    from substation.ops.dropout import dropout_constants
    assert torch.allclose(ad[kept], a[kept] * dropout_constants(p)[1], rtol=1e-14, atol=0)
    assert abs(ad.sum().item() / a.sum().item() - 1) < 4 * math.sqrt(p / (1 - p) / n) * math.sqrt(j)
    other = c.forward(given, b, j, seed=1235, training=True)["A_drop"]
    assert not torch.equal(other != 0, kept)


def test_masks_equivalent_forms(tiny_nodrop):
    layer = make_layer(tiny_nodrop)
    x = x_for(layer)
    pad = torch.tensor([[False] * 7, [False] * 4 + [True] * 3])
    additive = torch.zeros(2, 7, dtype=torch.float64).masked_fill(pad, float("-inf"))
    outs = [layer(x, key_padding_mask=pad), layer(x, attention_mask=~pad), layer(x, attention_mask=(~pad).long()),
            layer(x, attention_mask=(~pad).short()), layer(x, attention_mask=(~pad).to(torch.uint8)),
            layer(x, attention_mask=additive), layer(x, attention_mask=additive[:, None, None, :]),
            layer(x, attention_mask=additive[:, None, None, :].expand(2, 1, 7, 7))]
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    ref = reference_for(layer)
    assert (outs[0] - ref(x, additive)).abs().max() < 1e-12


def test_non_contiguous_input_is_copied(tiny_nodrop):
    layer = make_layer(tiny_nodrop)
    x = x_for(layer, b=7, j=2).transpose(0, 1)
    assert not x.is_contiguous()
    ref = reference_for(layer)
    assert (layer(x) - ref(x)).abs().max() < 1e-12


def test_parameters_have_pytorch_shapes(tiny):
    layer = make_layer(tiny)
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    assert shapes == {"in_proj_weight": (48, 16), "in_proj_bias": (48,), "out_proj_weight": (16, 16),
                      "out_proj_bias": (16,), "linear1_weight": (24, 16), "linear1_bias": (24,),
                      "linear2_weight": (16, 24), "linear2_bias": (16,), "norm1_weight": (16,),
                      "norm1_bias": (16,), "norm2_weight": (16,), "norm2_bias": (16,)}
    assert all(p.dtype == torch.float64 for p in layer.parameters())


def test_only_some_inputs_require_grad(tiny_nodrop):
    layer = make_layer(tiny_nodrop)
    x = x_for(layer).requires_grad_()
    for p in layer.parameters():
        p.requires_grad_(False)
    layer(x).sum().backward()
    assert x.grad is not None and all(p.grad is None for p in layer.parameters())
    for p in layer.parameters():
        p.requires_grad_(True)
    x2 = x_for(layer)
    layer(x2).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters())


BAD_CALLS = [
    (lambda l, x: l(x.numpy()), TypeError, "hidden_states must be a torch.Tensor"),
    (lambda l, x: l(x.float()), TypeError, "hidden_states has dtype torch.float32 but the layer was compiled for torch.float64"),
    (lambda l, x: l(x[0]), ValueError, r"with I = 16; got \(7, 16\) \(one sequence: pass hidden_states\[None\]\)$"),
    (lambda l, x: l(x[..., :8]), ValueError, r"hidden_states must have shape \[B, J, I\] with I = 16"),
    (lambda l, x: l(x[:0, :, :8]), ValueError, r"hidden_states must have shape \[B, J, I\] with I = 16"),
    (lambda l, x: l(x, attention_mask=torch.zeros(2, 6, dtype=torch.float64)), ValueError, r"mask must have shape \[B, K\] = \[2, 7\]"),
    (lambda l, x: l(x, key_padding_mask=torch.zeros(2, 7)), TypeError, "key_padding_mask must be a bool tensor"),
    (lambda l, x: l(x, key_padding_mask=torch.zeros(2, 8, dtype=torch.bool)), ValueError, r"key_padding_mask must have shape \[B, K\] = \[2, 7\] \(or \[1, K\]\), got \(2, 8\)$"),
    (lambda l, x: l(x, key_padding_mask=torch.zeros(2, 1, 1, 7, dtype=torch.bool)), ValueError, r"key_padding_mask must have shape \[B, K\] = \[2, 7\] \(or \[1, K\]\), got \(2, 1, 1, 7\)"),
    (lambda l, x: l(x, attention_mask=torch.tensor([[0, 0, 0, 0, 0, -10000, -10000]])), ValueError, "the integer attention mask holds values from -10000 to 0; integer and bool masks hold 1 \\(attend\\) and 0"),
    (lambda l, x: l(x, attention_mask=torch.full((2, 7), 2, dtype=torch.uint8)), ValueError, "integer attention mask holds values from 2 to 2"),
    (lambda l, x: l(x, attention_mask=torch.zeros(2, 7), key_padding_mask=torch.zeros(2, 7, dtype=torch.bool)), ValueError, "not both"),
    (lambda l, x: l(x, attention_mask=torch.randn(2, 1, 7, 7, dtype=torch.float64)), ValueError, "differs between queries"),
    (lambda l, x: l(x, attention_mask=torch.zeros(2, 2, 1, 7)), ValueError, r"attention_mask must have shape \[B, K\] = \[2, 7\], \[B, 1, 1, K\], \[B, 1, J, K\] or \[B, H, J, K\] with H = \d+; got \(2, 2, 1, 7\)"),
    (lambda l, x: l(x, attention_mask=torch.zeros(2, 7, dtype=torch.complex64)), TypeError, r"attention_mask has dtype torch.complex64; give a bool or integer mask"),
    (lambda l, x: l(x, attention_mask=torch.zeros(2, 7).index_fill_(1, torch.tensor([3]), float("nan"))), ValueError, "holds NaN or"),
    (lambda l, x: l(x, attention_mask=torch.zeros(2, 1, 1, 7).index_fill_(3, torch.tensor([6]), float("inf"))), ValueError, r"holds NaN or \+inf"),
]


@pytest.mark.parametrize("call,exc,message", BAD_CALLS)
def test_bad_tensors_raise_clear_errors(call, exc, message, tiny):
    layer = make_layer(tiny)
    with pytest.raises(exc, match=message):
        call(layer, x_for(layer))


@pytest.mark.parametrize("b,j", [(0, 7), (2, 0)])
def test_empty_batch_or_sequence_gives_empty_output_and_zero_gradients(tiny_nodrop, b, j):
    layer = make_layer(tiny_nodrop)
    x = x_for(layer, b=max(b, 1), j=max(j, 1))[:b, :j].clone().requires_grad_()
    mask = torch.ones(b, j, dtype=torch.bool)
    y = layer(x, attention_mask=mask)
    assert y.shape == (b, j, 16) and y.dtype == x.dtype
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert all(p.grad is not None and p.grad.shape == p.shape and not p.grad.any() for p in layer.parameters())
    with torch.inference_mode():
        assert layer.eval()(x.detach()).shape == (b, j, 16)
    with pytest.raises(TypeError, match="has dtype torch.float32"):  # still checked
        layer(x.detach().float())


def test_mask_on_unmasked_layer_and_wrong_parameter_dtype(tiny):
    layer = make_layer(tiny.replace(mask="none"))
    x = x_for(layer)
    with pytest.raises(ValueError, match="compiled with mask: none"):
        layer(x, attention_mask=torch.ones(2, 7, dtype=torch.bool))
    layer.in_proj_weight.data = layer.in_proj_weight.data.float()
    with pytest.raises(TypeError, match="parameter in_proj_weight is torch.float32"):
        layer(x)


def test_the_library_call_checks_dtype_shape_and_contiguity(tiny_nodrop):
    """``CompiledGraph`` takes raw pointers: a wrong dtype, shape or a strided view is refused by name
    before the library runs (it would read garbage or out of bounds)."""
    graph = make_layer(tiny_nodrop).compiled.forward
    sizes = graph.graph.config.sizes(2, 7)
    given = {t.name: torch.randn(t.shape(sizes), dtype=graph.dtypes[t.name]) for t in graph.args
             if t.role in ("input", "param")}
    assert graph(given, 2, 7)["Y"].shape == (2, 7, 16)
    cases = [("X", given["X"].float(), TypeError, r"X is torch.float32, not torch.float64"),
             ("X", given["X"][:1], ValueError, r"X \(1, 7, 16\) \(needs 224 elements\)"),
             ("linear1_weight", given["linear1_weight"].t().contiguous().t(), ValueError,
              r"linear1_weight \(24, 16\) non-contiguous")]
    for name, bad, exc, message in cases:
        with pytest.raises(exc, match=message):
            graph({**given, name: bad}, 2, 7)


def test_bound_parameters_are_checked_once_and_used_in_place_of_tensors(tiny_nodrop):
    """``CompiledGraph.bind`` checks parameters as ``run_into`` does and keeps their addresses: a call
    with them bound gives bit-identical results without them in ``given``; a binding of another
    library, an unknown name and a bad parameter are refused by name."""
    layer = make_layer(tiny_nodrop)
    graph = layer.compiled.forward
    sizes = graph.graph.config.sizes(2, 7)
    given = {t.name: torch.randn(t.shape(sizes), dtype=graph.dtypes[t.name]) for t in graph.args
             if t.role in ("input", "param")}
    params = {n: v for n, v in given.items() if n not in ("X", "mask")}
    bound = graph.bind(params)
    calls = {n: v for n, v in given.items() if n not in params}
    assert torch.equal(graph(calls, 2, 7, bound=bound)["Y"], graph(given, 2, 7)["Y"])
    some = graph.bind({"linear1_weight": params["linear1_weight"]})  # the others come with the call
    assert torch.equal(graph({n: v for n, v in given.items() if n != "linear1_weight"}, 2, 7, bound=some)["Y"],
                       graph(given, 2, 7)["Y"])
    with pytest.raises(ValueError, match="parameters bound for the library"):
        layer.compiled.backward.run_into({}, 2, 7, bound=bound)
    with pytest.raises(ValueError, match="has no parameter X, nonsense"):
        graph.bind({"X": given["X"], "nonsense": given["X"]})
    with pytest.raises(TypeError, match="linear1_weight is torch.float32, not torch.float64"):
        graph.bind({"linear1_weight": params["linear1_weight"].float()})


def test_eager_calls_remember_checked_parameters_by_address_dtype_and_shape(tiny_nodrop):
    """``run_layer`` remembers, per build, the parameters it checked and their binding to the
    forward-only library: one entry per set of tensors, none for non-contiguous ones (copied per call),
    a bounded number, no tensor kept alive; a parameter replaced by a new tensor (another address) or
    given another dtype is checked again, and the call reads the new values."""
    import weakref

    from substation.runtime.library import MEMO_ENTRIES
    layer = make_layer(tiny_nodrop).eval()
    compiled, inference = layer.compiled, layer.compiled.forward_only()
    compiled.checked_parameters.clear()
    inference.bound_parameters.clear()
    x = x_for(layer)
    with torch.inference_mode():
        want = layer(x)
        assert torch.equal(layer(x), want)
        assert len(compiled.checked_parameters) == 1 and len(inference.bound_parameters) == 1
        old = layer.linear2_weight
        layer.linear2_weight = torch.nn.Parameter(old.detach() * 2)
        changed = layer(x)
        exact = reference_for(layer)(x)
        assert float((changed - exact).abs().max()) < 1e-12 and not torch.equal(changed, want)
        assert len(compiled.checked_parameters) == 2 and len(inference.bound_parameters) == 2
        dead = weakref.ref(old)
        del old
        assert dead() is None  # the memos hold addresses, not tensors
        layer.linear2_weight = torch.nn.Parameter(layer.linear2_weight.detach().t().contiguous().t())
        assert torch.equal(layer(x), changed)  # a non-contiguous weight: copied, not remembered
        assert len(compiled.checked_parameters) == 2 and len(inference.bound_parameters) == 2
        layer.linear2_weight.data = layer.linear2_weight.data.float()
        with pytest.raises(TypeError, match="parameter linear2_weight is torch.float32 on cpu"):
            layer(x)
        for _ in range(MEMO_ENTRIES + 1):
            layer.linear2_weight = torch.nn.Parameter(torch.randn(16, 24, dtype=torch.float64))
            layer(x)
        assert len(compiled.checked_parameters) <= MEMO_ENTRIES and len(inference.bound_parameters) <= MEMO_ENTRIES


def test_torch_compile_does_not_follow_the_eager_memo(tiny_nodrop):
    """Under ``torch.compile(fullgraph=True)`` the eager calls' memo is not consulted while tracing, so
    parameter sets seen by eager calls (another layer of the same build, a replaced weight) cause no
    recompilation; the compiled layer reads a replaced weight as eager does."""
    from torch._dynamo.utils import counters
    layer = make_layer(tiny_nodrop).eval()
    other = make_layer(tiny_nodrop).eval()  # the same build: one memo
    x = x_for(layer)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    with torch.inference_mode():
        compiled(x)
        for k in range(10):
            other.linear1_weight = torch.nn.Parameter(torch.randn(24, 16, dtype=torch.float64))
            other(x)
            assert torch.equal(compiled(x), layer(x))
        assert counters["stats"]["unique_graphs"] == 1
        for k in range(10):  # dynamo recompiles once for a replaced parameter of its own module, not each time
            layer.linear1_weight = torch.nn.Parameter(layer.linear1_weight.detach() * 1.5)
            assert torch.equal(compiled(x), layer(x))
    assert counters["stats"]["unique_graphs"] == 2


def test_lazy_negations_are_read_as_their_values(tiny_nodrop):
    """A parameter, input or float mask that is a lazy negation (``torch._neg_view``: the bytes hold the
    opposite values) gives the output of its values; the library call itself refuses one by name."""
    layer = make_layer(tiny_nodrop).eval()
    x = x_for(layer)
    pad = torch.zeros(2, 7, dtype=torch.float64)
    pad[1, 5:] = float("-inf")
    with torch.inference_mode():
        want = layer(x, attention_mask=pad)
        bias = layer.linear1_bias.detach().clone()
        layer.linear1_bias.data = torch._neg_view(-bias)
        assert layer.linear1_bias.is_neg()
        assert torch.equal(layer(torch._neg_view(-x), attention_mask=torch._neg_view(-pad)), want)
    graph = layer.compiled.forward
    sizes = graph.graph.config.sizes(2, 7)
    given = {t.name: torch.randn(t.shape(sizes), dtype=graph.dtypes[t.name]) for t in graph.args
             if t.role in ("input", "param")}
    with pytest.raises(ValueError, match=r"X \(2, 7, 16\) a lazy negation \(torch._neg_view: pass .resolve_neg\(\)\)"):
        graph({**given, "X": torch._neg_view(given["X"])}, 2, 7)


def test_dtype_change_switches_the_build(tiny_nodrop):
    layer = make_layer(tiny_nodrop)
    assert layer.to("cpu") is layer and layer.compiled.config.dtype == "float64"  # a device move keeps the dtype
    x = x_for(layer)
    with torch.no_grad():
        want = layer(x)
    assert layer.float() is layer and layer.compiled.config.dtype == "float32" and layer.torch_dtype == torch.float32
    with torch.no_grad():
        assert float((layer(x.float()).double() - want).abs().max() / want.abs().max()) < 1e-5
    with pytest.raises(TypeError, match="target cpu compiles float32, float64, bfloat16 layers; converting them to torch.float16"):
        layer.half()
    assert layer.in_proj_weight.dtype == torch.float32


def test_random_row_matches_random_bits(tmp_path, monkeypatch):
    """The per-row fast path of the dropout generator gives every element the same 16 bits as the
    per-element path, for rows starting anywhere (both are used, depending on the layout), and the
    kept fraction is 1 - threshold / 2^16."""
    import ctypes

    from substation.backends.cpu.build import build_library
    from substation.ops.dropout import dropout_constants
    monkeypatch.setenv("SUBSTATION_CACHE_DIR", str(tmp_path))
    src = """
        #include "substation_cpu.h"
        extern "C" int64_t mismatches(uint64_t seed, uint32_t stream) {
          int64_t bad = 0;
          for (uint64_t first = 0; first < 50; first += 7)
            for (int64_t n = 1; n < 300; n += 37) {
              // random_row_words(n) words of scratch, then guard words it must leave alone
              const size_t words = ss::random_row_words(n);
              std::vector<uint32_t> scratch(words + 16, 0xA5A5A5A5u);
              const ss::bits16_t* w = ss::random_row(seed, stream, first, n, scratch.data());
              for (int64_t i = 0; i < n; ++i) bad += w[i] != ss::random_bits(seed, stream, first + i);
              for (size_t g = words; g < words + 16; ++g) bad += scratch[g] != 0xA5A5A5A5u;
            }
          return bad;
        }
        extern "C" double kept_fraction(uint64_t seed, uint32_t threshold) {
          int64_t kept = 0;
          for (uint64_t i = 0; i < 1000000; ++i) kept += ss::random_bits(seed, 3, i) >= threshold;
          return kept / 1e6;
        }
    """
    lib = ctypes.CDLL(build_library(src, "rng").path)
    lib.mismatches.restype = ctypes.c_int64
    lib.kept_fraction.restype = ctypes.c_double
    assert lib.mismatches(ctypes.c_uint64(2 ** 40 + 5), 2) == 0
    for p in (0.1, 0.5):
        threshold, scale = dropout_constants(p)
        keep = 1 - threshold / 65536
        assert abs(keep - (1 - p)) <= 2 ** -17 and scale == 1 / keep
        frac = lib.kept_fraction(ctypes.c_uint64(99), ctypes.c_uint32(threshold))
        assert abs(frac - keep) < 5 * math.sqrt(p * (1 - p) / 1e6)


def test_exp_shifted_row_matches_float64(tmp_path, monkeypatch):
    """ss::exp_shifted_row (softmax's exponentials of a row buffer) against float64 exp: within 2 ulp
    (relative 2.4e-7), exactly 0 below -87.3 and for -inf, NaN kept, nothing written past n, the sum
    of what it wrote; rows of 1..40 elements cover the vector tail."""
    import ctypes

    import numpy as np

    from substation.backends.cpu.build import build_library
    monkeypatch.setenv("SUBSTATION_CACHE_DIR", str(tmp_path))
    src = """
        #include "substation_cpu.h"
        extern "C" float row(const float* x, float* y, int64_t n, float mx) { return ss::exp_shifted_row(x, y, n, mx); }
    """
    lib = ctypes.CDLL(build_library(src, "exp_row").path)
    lib.row.restype = ctypes.c_float
    lib.row.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float]
    ptr = lambda arr: arr.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    x = np.concatenate([np.linspace(-90, 88, 200001), [-np.inf, 0.69, 0.71, 88.0]]).astype(np.float32)
    y = np.full(len(x) + 3, 7.0, dtype=np.float32)
    total = lib.row(ptr(x), ptr(y), len(x), ctypes.c_float(88.0))
    t = x - np.float32(88.0)  # the shift happens in float32
    want = np.exp(t.astype(np.float64))
    normal = t >= -87.3
    assert np.all(np.abs(y[:len(x)][normal] - want[normal]) <= 2.4e-7 * want[normal])
    assert np.all(y[:len(x)][~normal] == 0) and (y[len(x):] == 7.0).all()
    assert math.isclose(total, y[:len(x)].astype(np.float64).sum(), rel_tol=1e-5)
    for n in range(1, 41):
        xs = np.linspace(-3, 1, n).astype(np.float32)
        ys = np.full(n + 1, 7.0, dtype=np.float32)
        s = lib.row(ptr(xs), ptr(ys), n, ctypes.c_float(1.0))
        assert np.allclose(ys[:n], np.exp(xs.astype(np.float64) - 1), rtol=2.4e-7, atol=0) and ys[n] == 7.0
        assert math.isclose(s, ys[:n].astype(np.float64).sum(), rel_tol=1e-6)
    nan = np.array([0.0, np.nan, -1.0], dtype=np.float32)
    assert np.isnan(lib.row(ptr(nan), ptr(y), 3, ctypes.c_float(0.0))) and np.isnan(y[1])


@pytest.mark.parametrize("function,approximate,bounds", [
    ("gelu", "none", (1.6e-7, 2.6e-7, 6e-9)),
    ("gelu_tanh", "tanh", (2e-7, 3e-7, 1e-8)),
])
def test_gelu_float_matches_float64_without_bias(tmp_path, monkeypatch, function, approximate, bounds):
    """ss::gelu / ss::gelu_tanh and their gradients in float (a vectorized loop, as in the row kernels)
    against float64 over [-10, 10]: errors of float rounding (at most ``bounds[0]`` max(|x|, 1) for the
    function, ``bounds[1]`` for its gradient) and no bias: the mean error over each interval of width
    0.5 in [-4.5, 4.5) stays below ``bounds[2]`` for both (an approximation's smooth error curve would not
    average out: the A&S 7.1.26 erf gave up to 6e-8; the tanh form's gradient through 1 - tanh^2, 1e-7)."""
    import ctypes

    import numpy as np

    from substation.backends.cpu.build import build_library
    monkeypatch.setenv("SUBSTATION_CACHE_DIR", str(tmp_path))
    src = f"""
        #include "substation_cpu.h"
        extern "C" void run(const float* x, float* y, float* g, int64_t n) {{
        #pragma omp simd
          for (int64_t i = 0; i < n; ++i) {{ y[i] = ss::{function}(x[i]); g[i] = ss::{function}_grad(x[i]); }}
        }}
    """
    lib = ctypes.CDLL(build_library(src, function).path)
    lib.run.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64]
    ptr = lambda arr: arr.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    x = np.linspace(-10, 10, 2_000_001).astype(np.float32)
    y, g = np.empty_like(x), np.empty_like(x)
    lib.run(ptr(x), ptr(y), ptr(g), len(x))
    xd = torch.from_numpy(x.astype(np.float64)).requires_grad_()
    want = torch.nn.functional.gelu(xd, approximate=approximate)
    want.sum().backward()
    err = (y - want.detach().numpy()) / np.maximum(np.abs(x), 1.0)
    gerr = g - xd.grad.numpy()
    assert np.abs(err).max() <= bounds[0] and np.abs(gerr).max() <= bounds[1]
    bins = np.floor(x / 0.5)
    inner = (x >= -4.5) & (x < 4.5)
    for e in (err, gerr):
        worst = max(abs(e[inner & (bins == b)].mean()) for b in np.unique(bins[inner]))
        assert worst < bounds[2], worst
    ends = np.array([-np.inf, np.inf, -20, 20, 0], dtype=np.float32)
    out = np.empty_like(ends)
    lib.run(ptr(ends), ptr(out), ptr(np.empty_like(ends)), 5)
    assert np.isnan(out[0]) and out[1] == np.inf and out[2] == 0 and out[3] == 20 and out[4] == 0  # as PyTorch


_FREED_TENSOR = """
import ctypes, torch
import substation.runtime.library as lib
applied = lib.keep_freed_memory()
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
before = libc.mallinfo2()
t = torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
during = libc.mallinfo2()
del t
after = libc.mallinfo2()
print(int(applied), (during.hblkhd - before.hblkhd) >> 20, (after.fordblks - before.fordblks) >> 20)
"""


def test_freed_memory_is_kept_between_steps():
    """With the malloc tuning a freed 64 MiB tensor (a saved tensor of a big step) stays in glibc's heap
    for the next step instead of being unmapped (then every page of the next step's tensors faults in
    anew). Checked in fresh processes, as glibc reports it (mallinfo2: mmapped bytes, free heap bytes),
    with the tuning and with SUBSTATION_MALLOC_TUNING=0."""
    import os
    import subprocess
    import sys
    seen = {}
    for tuning in ("1", "0"):
        run = subprocess.run([sys.executable, "-c", _FREED_TENSOR], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "SUBSTATION_MALLOC_TUNING": tuning})
        assert run.returncode == 0, run.stderr[-2000:]
        seen[tuning] = [int(v) for v in run.stdout.split()]
    assert seen["1"][0] == 1 and seen["1"][1] == 0 and seen["1"][2] >= 63, seen  # heap, kept after free
    assert seen["0"][0] == 0 and seen["0"][1] == 64 and seen["0"][2] == 0, seen  # mmapped, returned


def test_a_layer_nobody_holds_is_freed_but_a_pending_backward_keeps_it(tiny_nodrop):
    """The operators' registry holds layers weakly: a layer of its own build (``substation.compile``)
    and its workspace are freed once the last module holding it goes; an output whose backward has not
    run yet keeps its layer alive until then."""
    import gc
    import weakref

    import substation
    from substation.runtime.library import registered_layer
    layer = substation.compile(tiny_nodrop)
    x = torch.randn(2, 7, tiny_nodrop.hidden_size, dtype=layer.torch_dtype, requires_grad=True)
    layer(x)
    key, alive = layer.compiled.key, weakref.ref(layer.compiled)
    del layer
    gc.collect()
    assert alive() is None
    with pytest.raises(KeyError, match="freed"):
        registered_layer(key)
    layer = substation.compile(tiny_nodrop)
    expected = torch.autograd.grad(layer(x).square().sum(), x)[0]
    y = layer(x)
    alive = weakref.ref(layer.compiled)
    del layer
    gc.collect()
    assert alive() is not None
    assert torch.equal(torch.autograd.grad(y.square().sum(), x)[0], expected)
    del y
    gc.collect()
    assert alive() is None


def test_deepcopy_and_pickle(tiny_nodrop, tmp_path):
    """Copies share the compiled libraries but own their parameters; torch.save/torch.load rebuild
    the libraries from the build cache."""
    import copy
    layer = make_layer(tiny_nodrop)
    x = x_for(layer)
    twin = copy.deepcopy(layer)
    assert twin.compiled is layer.compiled
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(layer.parameters(), twin.parameters()))
    assert torch.equal(twin(x), layer(x))
    with torch.no_grad():
        twin.out_proj_bias.add_(1.0)
    assert not torch.equal(twin(x), layer(x))
    torch.save(layer, tmp_path / "layer.pt")
    loaded = torch.load(tmp_path / "layer.pt", weights_only=False)
    assert torch.equal(loaded(x), layer(x)) and loaded.compiled.options == layer.compiled.options


def test_gemm_small_matches_float64(tmp_path, monkeypatch):
    """ss::gemm_small (the per-head attention GEMM of AVX-512 builds) against float64 products, for
    every transpose combination, sizes off the 8-row / 32-column blocking, leading dimensions larger
    than the rows and a scaling alpha."""
    import ctypes

    import numpy as np

    from substation.backends.cpu.build import build_library
    monkeypatch.setenv("SUBSTATION_CACHE_DIR", str(tmp_path))
    src = """
        #include "substation_cpu.h"
        extern "C" int gemm(int ta, int tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                            int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc) {
        #if defined(__AVX512F__)
          std::vector<float> pack(ss::gemm_small_pack_floats(n, k));
          ss::gemm_small(ta, tb, m, n, k, alpha, a, lda, b, ldb, c, ldc, pack.data());
          return 1;
        #else
          return 0;
        #endif
        }
    """
    lib = ctypes.CDLL(build_library(src, "gemm_small").path)
    lib.gemm.argtypes = [ctypes.c_int, ctypes.c_int] + [ctypes.c_int64] * 3 + [ctypes.c_float] + \
        [ctypes.c_void_p, ctypes.c_int64] * 3
    rng = np.random.default_rng(0)
    ptr = lambda arr: arr.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    for ta, tb, m, n, k in [(0, 1, 128, 128, 64), (0, 0, 13, 70, 9), (1, 0, 9, 33, 17), (1, 1, 1, 1, 1),
                            (0, 1, 8, 32, 5), (1, 1, 23, 47, 130)]:
        a = rng.standard_normal((k, m + 3) if ta else (m, k + 3)).astype(np.float32)
        b = rng.standard_normal((n, k + 2) if tb else (k, n + 2)).astype(np.float32)
        c = np.full((m, n + 5), 7.0, dtype=np.float32)
        if not lib.gemm(ta, tb, m, n, k, 0.5, ptr(a), a.shape[1], ptr(b), b.shape[1], ptr(c), c.shape[1]):
            pytest.skip("the build has no AVX-512: attention GEMMs use the BLAS")
        opa = (a[:, :m].T if ta else a[:, :k]).astype(np.float64)
        opb = (b[:, :k].T if tb else b[:, :n]).astype(np.float64)
        want = 0.5 * opa @ opb
        err = np.abs(c[:, :n] - want).max() / np.abs(want).max()
        assert err < 1e-6, (ta, tb, m, n, k, err)
        assert (c[:, n:] == 7.0).all()  # nothing written past column n


def test_eager_inference_skips_the_dispatcher_and_a_dispatch_mode_sees_the_operator(tiny_nodrop):
    """An eager call that needs no gradient runs the operator's implementation directly; under a
    TorchDispatchMode (as tracers and profilers install) the same call goes through
    ``substation::layer_forward``, with bit-identical results."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recording(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    layer = make_layer(tiny_nodrop).eval()
    x = x_for(layer)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, 5:] = True
    with torch.inference_mode():
        direct = layer(x, key_padding_mask=pad)
        with Recording() as seen:
            through = layer(x, key_padding_mask=pad)
    assert any(op.startswith("substation.layer_forward") for op in seen.ops), seen.ops
    assert torch.equal(direct, through)


def test_exported_and_traced_programs_outlive_their_layer(tiny_nodrop):
    """torch.export and torch.jit.trace programs name the layer by its key only: the layer stays
    registered after its module is gone (pinned while tracing)."""
    import gc

    import substation
    x = torch.randn(2, 5, tiny_nodrop.hidden_size, dtype=torch.float64)
    for capture in ("export", "trace"):
        layer = substation.compile(tiny_nodrop).eval()
        with torch.no_grad():
            want = layer(x)
            program = (torch.export.export(layer, (x,)).module() if capture == "export"
                       else torch.jit.trace(layer, (x,)))
        del layer
        gc.collect()
        with torch.no_grad():
            assert (program(x) - want).abs().max() < 1e-12, capture


def test_second_order_gradients_raise_a_clear_error(tiny_nodrop):
    layer = make_layer(tiny_nodrop).train()
    x = x_for(layer).requires_grad_()
    g, = torch.autograd.grad(layer(x).pow(2).sum(), x, create_graph=True)  # first order works
    with pytest.raises(NotImplementedError, match="second-order gradients through Substation's layers"):
        g.pow(2).sum().backward()


def test_forward_mode_ad_and_vmap_raise_and_the_profiler_sees_the_operator(tiny_nodrop):
    """Forward-mode AD (torch.func.jvp, forward_ad) has no rule: a clear NotImplementedError instead
    of a silently dropped tangent; vmap reaches the operator and names it; an eager inference call
    under torch.profiler goes through the operator, so the profile shows it."""
    import torch.autograd.forward_ad as fwAD
    layer = make_layer(tiny_nodrop).eval()
    x = x_for(layer)
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.func.jvp(lambda t: layer(t), (x,), (torch.ones_like(x),))
    with fwAD.dual_level(), pytest.raises(NotImplementedError, match="forward-mode AD"):
        layer(fwAD.make_dual(x, torch.ones_like(x)))
    soft = torch.zeros(2, 7, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.func.jvp(lambda m: layer(x, attention_mask=m), (soft,), (torch.ones_like(soft),))
    with pytest.raises(NotImplementedError, match="the attention mask requires grad"):
        layer(x, attention_mask=soft.requires_grad_())
    for p in layer.parameters():
        p.requires_grad_(False)
    with pytest.raises(RuntimeError, match="substation::layer_forward"):
        torch.func.vmap(layer)(x.unsqueeze(0))
    with torch.inference_mode(), torch.profiler.profile() as prof:
        layer(x)
    assert any(e.key == "substation::layer_forward" for e in prof.key_averages())


def test_backward_fills_no_zero_gradients_for_the_saved_outputs(tiny_nodrop):
    """The operator's outputs besides Y (the tensors saved for backward) get no gradient: autograd must
    not fill a zero tensor for each of them before the backward library runs (a BERT-base bf16 step
    spent 2.6 ms of its 35 ms backward on that)."""
    layer = make_layer(tiny_nodrop)
    x = x_for(layer).requires_grad_()
    y = layer(x)
    dy = torch.ones_like(y)
    with torch.profiler.profile() as prof:
        y.backward(dy)
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get("substation::layer_backward") == 1
    assert counts.get("aten::fill_", 0) == 0 and counts.get("aten::zero_", 0) == 0
    assert x.grad is not None and all(p.grad is not None for p in layer.parameters())


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int64, torch.float16, torch.bfloat16,
                                   torch.float32, torch.float64])
@pytest.mark.parametrize("k", [7, 8, 24])
def test_mask_differs_matches_a_comparison_by_value(dtype, k):
    """The row checks (a bool mask read as uint8) answer as a comparison of every row with the first by
    value does (NaN unequal to itself, -0.0 equal to 0.0), for every mask dtype, several K, and a
    strided last dimension."""
    from substation.runtime.masks import heads_differ, mask_differs, queries_differ

    def by_value(m, dim):
        first = m.narrow(dim, 0, 1)
        return not bool((m == first).all()) or (m.is_floating_point() and bool(m.isnan().any()))

    def flip(t):
        return ~t if t.dtype == torch.bool else t + 1 if t.is_floating_point() else 1 - t

    gen = torch.Generator().manual_seed(k)
    floating = dtype.is_floating_point
    for trial in range(40):
        row = torch.randint(0, 2, (3, 1, 1, k), generator=gen).to(dtype)
        if floating and trial % 4 == 1:
            row = row.masked_fill(row == 0, float("-inf"))
        m = row.expand(3, 2, 5, k).contiguous()
        b, h, j, c = (int(v) for v in torch.randint(0, 3, (1,), generator=gen).tolist() + [
            torch.randint(0, 2, (1,), generator=gen).item(), torch.randint(0, 5, (1,), generator=gen).item(),
            torch.randint(0, k, (1,), generator=gen).item()])
        change = trial % 5
        if change == 1:  # one element of one query row
            m[b, h, j, c] = flip(m[b, h, j, c])
        elif change == 2 and floating:  # -0.0 where the other rows hold 0.0: equal values, other bytes
            m[b, h, j] = torch.where(m[b, h, j] == 0, torch.tensor(-0.0, dtype=dtype), m[b, h, j])
        elif change == 3 and floating:  # NaN in every row at one key
            m[..., c] = float("nan")
        elif change == 4:  # one head
            m[b, h] = flip(m[b, h])
        for mask in (m, m.transpose(2, 3).contiguous().transpose(2, 3)):  # contiguous, strided last dimension
            assert queries_differ(mask) == by_value(mask, 2), (trial, change)
            assert heads_differ(mask) == by_value(mask, 1), (trial, change)
            expected = "heads" if by_value(mask, 1) else "queries" if by_value(mask, 2) else None
            assert mask_differs(mask) == expected
