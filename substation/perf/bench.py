"""Benchmarks: the compiled layer against PyTorch eager and ``torch.compile`` (``substation bench``).

:func:`run_bench` times, interleaved in one process (warm-up first, medians of repeated steps), the
forward pass, the backward pass (``y.backward(dy)`` timed on its own) and forward+backward of

* ``substation``: the compiled :class:`~substation.EncoderLayer`;
* ``eager``: the same layer in PyTorch eager mode with identical weights: a Hugging Face
  ``transformers`` ``BertLayer`` when the config is BERT-like (post-LN, no activation dropout, a
  padding mask or none), else :class:`~substation.reference.ReferenceEncoderLayer`;
* ``compile``: that eager module under ``torch.compile`` (default mode, inductor).

All run in train mode with the config's dropout and a padding mask (the second half of the batch is
padded from position 3L/4 on), on ``torch.get_num_threads()`` threads. It also reports the bytes each
holds for backward (:func:`saved_tensor_bytes`) and the compile time of each, cold: Substation's
whole pipeline into an empty build cache, ``torch.compile``'s first forward and backward call with an
empty inductor cache.

:func:`kernel_table` (``substation bench --kernels``) times every memory-bound (SN/EW, fused) kernel
of the instrumented build and relates its bytes (:func:`substation.perf.analysis.operator_count`) to the
copy bandwidth measured in the same run (:func:`substation.perf.analysis.copy_bandwidth`).

Units everywhere: seconds, bytes, bytes/s; ratios are plain numbers. See docs/performance.md.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from typing import Callable, Iterable

from ..config import load_config
from ..files import atomic_write
from ..layer import EncoderLayer
from ..pipeline import compile_layer
from ..reference import ReferenceEncoderLayer
from .analysis import analyze, copy_bandwidth, fma_peak, gemm_rate, measure, operator_count

__all__ = [
    "PASSES", "IMPLEMENTATIONS", "Candidate", "machine_info", "set_substation_threads", "padding_mask",
    "hf_bert_layer", "eager_baseline", "time_step", "interleaved_times",
    "saved_tensor_bytes", "fresh_inductor_cache", "sample_stats", "run_bench", "time_limit", "kernel_table",
    "format_bench", "format_kernels", "pyplot", "plot_bench", "plot_kernels", "write_json",
]

#: The timed passes, in order (``forward_backward`` is one step's forward plus its backward).
PASSES = ("forward", "backward", "forward_backward")
#: The implementations of a bench, in order.
IMPLEMENTATIONS = ("substation", "eager", "compile")
#: Config activation -> Hugging Face ``hidden_act`` of the same function.
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}
SCHEMA = "substation-bench/1"


# -- machine and threads -------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _cpu_isa() -> list[str]:
    """The vector-ISA flags that matter for GEMMs (from /proc/cpuinfo), plus ``hypervisor`` on a VM."""
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "hypervisor")
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return [w for w in wanted if w in flags]
    except OSError:
        pass
    return []


def machine_info() -> dict:
    """What the run ran on: ``cpu`` (model name), ``isa`` (vector-ISA flags), ``cores`` (logical CPUs), ``threads``
    (``torch.get_num_threads()``, used by every implementation), ``load_average`` (1, 5, 15 min),
    library versions and ``OMP_WAIT_POLICY``. Raises nothing."""
    import torch
    try:
        import transformers
        hf = transformers.__version__
    except ImportError:
        hf = None
    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    return {"cpu": _cpu_model(), "isa": _cpu_isa(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "load_average": load, "python": platform.python_version(), "torch": torch.__version__,
            "transformers": hf, "platform": platform.platform(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}


def set_substation_threads(compiled, threads: int) -> int:
    """Make the compiled libraries' OpenMP runtime (which MKL's GNU-threading layer follows) use
    ``threads`` threads from the calling thread on.

    Args:
        compiled: a :class:`~substation.runtime.CompiledLayer`.
        threads: number of threads, >= 1.

    Returns:
        The thread count the runtime now reports (``omp_get_max_threads``).

    Raises:
        ValueError: ``threads`` < 1.
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    lib = compiled.forward.lib
    lib.omp_set_num_threads(int(threads))
    compiled.backward.lib.omp_set_num_threads(int(threads))
    return int(lib.omp_get_max_threads())


# -- the three modules ---------------------------------------------------------------------------
def padding_mask(config, batch: int, seq: int, dtype):
    """The bench's additive key mask [B, K] (0 = attend, -inf = padding): batch rows ``B // 2`` and
    up are padded from position ``3 * seq // 4`` on (with B = 1 that is the only row). None when the
    config has ``mask: none``. Raises nothing."""
    import torch
    if config.mask == "none":
        return None
    mask = torch.zeros(batch, seq, dtype=dtype)
    mask[batch // 2:, (3 * seq) // 4:] = float("-inf")
    return mask


def _hf_eligible(config) -> bool:
    return (config.layer_norm == "post" and config.mask in ("padding", "none")
            and config.dropout.activation == 0.0 and config.activation in HF_ACTIVATIONS)


def hf_bert_layer(layer, attn_implementation: str = "sdpa"):
    """A ``transformers`` ``BertLayer`` with the weights of ``layer`` (copied) in its train/eval mode.

    Args:
        layer: a post-LN :class:`~substation.EncoderLayer` without activation dropout.
        attn_implementation: ``"sdpa"`` (the Hugging Face default on the CPU) or ``"eager"``.

    Raises:
        ImportError: ``transformers`` is not installed.
        ValueError: the config has no ``BertLayer`` equivalent (pre-LN, causal mask, activation dropout).
    """
    import torch
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    c = layer.config
    if not _hf_eligible(c):
        raise ValueError(f"config {c.name} has no BertLayer equivalent (needs post-LN, no activation dropout, "
                         f"mask padding or none)")
    hf = BertLayer(BertConfig(
        hidden_size=c.hidden_size, num_attention_heads=c.num_heads, intermediate_size=c.ffn_size,
        hidden_act=HF_ACTIVATIONS[c.activation], hidden_dropout_prob=c.dropout.hidden,
        attention_probs_dropout_prob=c.dropout.attention, layer_norm_eps=c.layer_norm_eps,
        attn_implementation=attn_implementation)).to(layer.torch_dtype)
    sa, ao = hf.attention.self, hf.attention.output
    q, k, v = layer.in_proj_weight.detach().chunk(3)
    qb, kb, vb = layer.in_proj_bias.detach().chunk(3)
    pairs = [(sa.query.weight, q), (sa.key.weight, k), (sa.value.weight, v),
             (sa.query.bias, qb), (sa.key.bias, kb), (sa.value.bias, vb),
             (ao.dense.weight, layer.out_proj_weight), (ao.dense.bias, layer.out_proj_bias),
             (hf.intermediate.dense.weight, layer.linear1_weight), (hf.intermediate.dense.bias, layer.linear1_bias),
             (hf.output.dense.weight, layer.linear2_weight), (hf.output.dense.bias, layer.linear2_bias),
             (ao.LayerNorm.weight, layer.norm1_weight), (ao.LayerNorm.bias, layer.norm1_bias),
             (hf.output.LayerNorm.weight, layer.norm2_weight), (hf.output.LayerNorm.bias, layer.norm2_bias)]
    with torch.no_grad():
        for dst, src in pairs:
            dst.copy_(src.detach())
    return hf.train(layer.training)


def eager_baseline(layer, attn_implementation: str = "sdpa"):
    """The eager PyTorch module of the bench for ``layer`` and how to call it.

    Returns:
        ``(module, call, label)``: ``call(module, x, mask)`` runs it on ``x`` [B, J, I] with the
        additive mask [B, K] (or None); ``label`` names the module. A ``BertLayer``
        (:func:`hf_bert_layer`) when ``transformers`` is installed and the config is BERT-like, else a
        :class:`~substation.reference.ReferenceEncoderLayer`, with ``layer``'s weights, in its mode.

    Raises nothing beyond :func:`hf_bert_layer`'s construction errors.
    """

    if _hf_eligible(layer.config):
        try:
            module = hf_bert_layer(layer, attn_implementation)
        except ImportError:
            module = None
        if module is not None:
            def call_hf(m, x, mask):
                return m(x, None if mask is None else mask[:, None, None, :])
            return module, call_hf, f"transformers BertLayer (attn_implementation={attn_implementation})"
    ref = ReferenceEncoderLayer(layer.config, layer.torch_dtype)
    ref.load_state_dict(layer.state_dict())
    ref.train(layer.training)
    return ref, (lambda m, x, mask: m(x, mask)), "substation.reference.ReferenceEncoderLayer"


# -- timing --------------------------------------------------------------------------------------
@dataclasses.dataclass
class Candidate:
    """One implementation under test.

    Attributes:
        name: key in the results (``substation``, ``eager``, ``compile``, ...).
        call: ``call(x)`` runs the forward pass on ``x`` (which requires grad) and returns ``y``.
        params: the parameters whose ``.grad`` is cleared before each step (so no step accumulates).
    """

    name: str
    call: Callable
    params: list


def time_step(candidate: Candidate, x, dy) -> tuple[float, float]:
    """One forward+backward step of ``candidate``: gradients cleared (set to None), a fresh leaf copy of
    ``x`` that requires grad, ``y = call(x)`` timed, then ``y.backward(dy)`` timed on its own.

    Returns:
        (forward seconds, backward seconds).

    Raises:
        whatever the candidate raises.
    """
    for p in candidate.params:
        p.grad = None
    xg = x.detach().requires_grad_()
    t0 = time.perf_counter()
    y = candidate.call(xg)
    t1 = time.perf_counter()
    y.backward(dy)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def interleaved_times(candidates: Iterable[Candidate], x, dy, repeats: int, warmup: int = 1) -> dict:
    """Time the candidates interleaved: ``warmup`` untimed steps of each, then ``repeats`` rounds of one
    step per candidate, the starting candidate rotating every round (so none always runs first).
    Python's garbage collector is paused during the rounds.

    Returns:
        name -> pass (``forward``, ``backward``, ``forward_backward``) -> list of seconds, one per round.

    Raises:
        ValueError: ``repeats`` < 1 or ``warmup`` < 0.
    """
    cands = list(candidates)
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    out = {c.name: {p: [] for p in PASSES} for c in cands}
    for _ in range(warmup):
        for c in cands:
            time_step(c, x, dy)
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(repeats):
            for k in range(len(cands)):
                c = cands[(r + k) % len(cands)]
                f, b = time_step(c, x, dy)
                out[c.name]["forward"].append(f)
                out[c.name]["backward"].append(b)
                out[c.name]["forward_backward"].append(f + b)
    finally:
        if was_enabled:
            gc.enable()
    return out


def saved_tensor_bytes(forward: Callable, exclude: Iterable = ()) -> tuple[object, int, int]:
    """Bytes held for backward by one forward pass.

    Runs ``forward()`` under ``torch.autograd.graph.saved_tensors_hooks`` and sums the sizes of the
    unique storages (by data pointer, each counted in full: a saved view holds its whole storage) of
    every tensor autograd saves for backward, except the storages of ``exclude`` (parameters, the
    input, the mask: the caller holds them anyway). Covers built-in ops, custom
    ``autograd.Function``'s ``save_for_backward`` and ``torch.compile``'s compiled graphs alike.

    Returns:
        (``forward()``'s result, bytes, number of storages).

    Raises:
        whatever ``forward`` raises.
    """
    import torch
    skip = {t.untyped_storage().data_ptr() for t in exclude if t is not None}
    held: dict[int, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = t.untyped_storage()
            ptr, n = st.data_ptr(), st.nbytes()
            if n and ptr not in skip:
                held[ptr] = max(held.get(ptr, 0), n)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = forward()
    return y, sum(held.values()), len(held)


# -- cold compiles -------------------------------------------------------------------------------
@contextlib.contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@contextlib.contextmanager
def fresh_inductor_cache():
    """A context in which ``torch.compile`` (inductor) starts from an empty cache (torch's own
    ``fresh_cache`` when available, else a temporary ``TORCHINDUCTOR_CACHE_DIR``). Raises nothing."""
    try:
        from torch._inductor.utils import fresh_cache
    except ImportError:  # pragma: no cover - other torch versions
        fresh_cache = None
    if fresh_cache is not None:
        with fresh_cache():
            yield
        return
    with tempfile.TemporaryDirectory(prefix="substation-bench-inductor-") as tmp:  # pragma: no cover
        with _env("TORCHINDUCTOR_CACHE_DIR", tmp):
            yield


def _cold_compile(config, layout=None):
    """(CompiledLayer, pipeline seconds) with an empty, temporary build cache."""
    with tempfile.TemporaryDirectory(prefix="substation-bench-cache-") as tmp, _env("SUBSTATION_CACHE_DIR", tmp):
        t0 = time.perf_counter()
        compiled = compile_layer(config, layout=layout)
        seconds = time.perf_counter() - t0
    return compiled, seconds  # the libraries stay loaded after their files are removed


def sample_stats(samples: list[float]) -> dict:
    """``median``, ``min``, ``max``, quartiles ``q1`` and ``q3`` (inclusive method) and the ``samples``
    themselves of a non-empty list of measurements, in their unit. Raises ValueError when it is empty."""
    if not samples:
        raise ValueError("sample_stats needs at least one sample")
    q = statistics.quantiles(samples, n=4, method="inclusive") if len(samples) > 1 else [samples[0]] * 3
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples),
            "q1": q[0], "q3": q[2], "samples": list(samples)}


def _apply_overrides(config, batch_size: int | None, seq_len: int | None):
    config = load_config(config)
    changes = {}
    if batch_size is not None:
        changes["batch_size"] = batch_size
    if seq_len is not None:
        changes["max_seq_len"] = seq_len
    if not changes:
        return config
    config = config.replace(**changes)
    base = re.sub(r"-b\d+-l\d+$", "", config.name)  # bert-large-b8-l512 at L=128 -> bert-large-b8-l128
    return config.replace(name=f"{base}-b{config.batch_size}-l{config.max_seq_len}")


# -- the bench -----------------------------------------------------------------------------------
def run_bench(config, repeats: int = 20, warmup: int = 3, batch_size: int | None = None,
              seq_len: int | None = None, include_compile: bool = True, compile_backend: str = "inductor",
              hf_attn: str = "sdpa", seed: int = 0, layout=None,
              progress: Callable[[str], None] | None = None) -> dict:
    """Benchmark the compiled layer against PyTorch eager and ``torch.compile`` (see the module docstring).

    Args:
        config: an :class:`~substation.EncoderConfig`, a YAML path or a bundled config name.
        repeats: timed rounds (each runs one step of every implementation), >= 1.
        warmup: untimed steps of each implementation before the rounds, >= 0 (``torch.compile``'s
            compiling first call comes before these and is not one of them).
        batch_size, seq_len: override the config's B and L.
        include_compile: also benchmark ``torch.compile`` (False: ``implementations`` has no
            ``compile`` entry and ``speedup_vs_compile`` is None).
        compile_backend: ``torch.compile`` backend; ``"inductor"`` is the default mode (other values,
            e.g. ``"eager"``, are for quick tests and are recorded in the result).
        hf_attn: ``attn_implementation`` of the Hugging Face ``BertLayer`` (``"sdpa"`` or ``"eager"``).
        seed: seeds the parameters, the input and ``dy``.
        layout: a layout plan for Substation's pipeline (``compile_layer(layout=...)``); None: the
            pipeline's default.
        progress: called with a short message before each phase.

    Returns:
        The result as plain data (the JSON of ``substation bench``; keys in docs/performance.md).
        Times in seconds, memory in bytes; ``speedup_vs_eager`` = eager's median forward+backward
        seconds / Substation's, ``speedup_vs_compile`` likewise for ``torch.compile``.

    Raises:
        ValueError: ``repeats`` < 1 or ``warmup`` < 0.
        ConfigError, FileNotFoundError: a bad config or override.
        ToolchainError, BuildError: Substation's compilation failed (PlanError: a layout plan that
            does not fit).
    """
    import torch


    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    say = progress or (lambda msg: None)
    config = _apply_overrides(config, batch_size, seq_len)
    machine = machine_info()
    threads = machine["threads"]
    torch.set_num_threads(threads)

    say(f"compiling {config.name} with Substation (cold build cache)")
    compiled, sub_compile = _cold_compile(config, layout)
    torch.manual_seed(seed)
    layer = EncoderLayer(compiled)
    sub_threads = set_substation_threads(compiled, threads)
    eager, call_eager, eager_label = eager_baseline(layer, hf_attn)

    b, j, i = config.batch_size, config.max_seq_len, config.hidden_size
    dtype = layer.torch_dtype
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, j, i, generator=gen, dtype=dtype)
    dy = torch.randn(b, j, i, generator=gen, dtype=dtype)
    mask = padding_mask(config, b, j, dtype)

    # identical weights: the outputs agree with dropout off
    layer.eval(), eager.eval()
    with torch.no_grad():
        y_sub, y_ref = layer(x, attention_mask=mask), call_eager(eager, x, mask)
    rel_err = float((y_sub - y_ref).abs().max() / y_ref.abs().max())
    layer.train(), eager.train()

    cands = [Candidate("substation", lambda t: layer(t, attention_mask=mask), list(layer.parameters())),
             Candidate("eager", lambda t: call_eager(eager, t, mask), list(eager.parameters()))]
    info = {"substation": {"label": "substation.EncoderLayer", "compile_seconds": sub_compile,
                           "compile_method": "substation pipeline (graph ... load) into an empty temporary "
                                             "SUBSTATION_CACHE_DIR",
                           "build_seconds": dict(compiled.build_seconds), "threads": sub_threads},
            "eager": {"label": eager_label, "compile_seconds": None, "compile_method": None, "threads": threads}}
    if include_compile:
        say(f"torch.compile (backend {compile_backend}, cold inductor cache): first call")
        torch._dynamo.reset()
        opt = torch.compile(eager, backend=compile_backend)
        with fresh_inductor_cache():
            f, bwd = time_step(Candidate("compile", lambda t: call_eager(opt, t, mask), list(eager.parameters())),
                               x, dy)
        cands.append(Candidate("compile", lambda t: call_eager(opt, t, mask), list(eager.parameters())))
        info["compile"] = {"label": f"torch.compile({eager_label}, backend={compile_backend!r})",
                           "compile_seconds": f + bwd, "first_call_seconds": {"forward": f, "backward": bwd},
                           "compile_method": "first forward + first backward call (each compiles its graph) with "
                                             "an empty inductor cache, after torch._dynamo.reset()",
                           "backend": compile_backend, "threads": threads}

    say(f"timing: {warmup} warm-up step(s) each, then {repeats} interleaved rounds")
    times = interleaved_times(cands, x, dy, repeats, warmup)

    say("memory held for backward")
    impls = {}
    for c in cands:
        exclude = [*c.params, x, mask]
        xg = x.detach().requires_grad_()
        y, nbytes, count = saved_tensor_bytes(lambda: c.call(xg), exclude + [xg])
        y.backward(dy)
        del y
        impls[c.name] = {**info[c.name], "seconds": {p: sample_stats(times[c.name][p]) for p in PASSES},
                         "saved_for_backward_bytes": int(nbytes), "saved_for_backward_storages": int(count)}
    med = {n: {p: impls[n]["seconds"][p]["median"] for p in PASSES} for n in impls}
    sub = med["substation"]["forward_backward"]
    say("limit: BLAS GEMM rate, FMA peak and copy bandwidth")
    limit = time_limit(config, {n: med[n]["forward_backward"] for n in med})
    result = {
        "schema": SCHEMA,
        "config": config.to_dict(),
        "batch_size": b, "seq_len": j, "dtype": config.dtype,
        "layout": None if layout is None else str(layout),
        "mode": "train",
        "dropout": dataclasses.asdict(config.dropout),
        "mask": (None if mask is None else
                 f"additive key mask [B, K]: rows {b // 2}..{b - 1} padded from position {(3 * j) // 4} on"),
        "threads": threads,
        "machine": {**machine, "load_average_after": _load()},
        "repeats": repeats, "warmup": warmup,
        "implementations": impls,
        "median_seconds": med,
        "speedup_vs_eager": med["eager"]["forward_backward"] / sub,
        "speedup_vs_compile": med["compile"]["forward_backward"] / sub if "compile" in med else None,
        "max_rel_error_vs_eager": rel_err,
        "limit": limit,
    }
    return result


def time_limit(config, measured_seconds: dict | None = None) -> dict:
    """The analysis' lower bound on one forward+backward step of ``config``, from rates measured now:
    contraction flop at the BLAS's GEMM rate plus the SN/EW kernels' required bytes at the copy bandwidth.

    ``limit_seconds = TC flop / gemm_rate + (SN + EW bytes) / copy_bandwidth`` with the optimized
    graphs' counts (:func:`substation.perf.analysis.analyze`), :func:`~substation.perf.analysis.gemm_rate` (the
    linked BLAS's best over a 2048^3 GEMM and the feed-forward shapes [B L, U, I] and [B L, I, U]),
    :func:`~substation.perf.analysis.copy_bandwidth` (DRAM-sized buffers; kernels whose data stay in cache
    can beat it) and, as the hardware's ceiling for the contractions,
    :func:`~substation.perf.analysis.fma_peak` (``fma_limit_seconds`` puts the flop at that peak instead).
    All on the current OpenMP thread count.

    Args:
        config: an :class:`~substation.EncoderConfig` (sizes as benchmarked).
        measured_seconds: implementation name -> measured forward+backward seconds; each gets
            ``fraction_of_limit`` (limit / measured) and ``speedup_at_limit`` (measured / limit: the
            largest speedup over it that a layer running at the limit would show).

    Returns:
        Plain data: ``contraction_flop`` (flop), ``memory_bound_bytes`` (bytes), ``gemm_rate``,
        ``fma_peak`` (flop/s), ``copy_bandwidth`` (bytes/s), ``limit_seconds``, ``fma_limit_seconds``,
        ``per_implementation`` (see above).

    Raises:
        ToolchainError, BuildError: the probe library cannot be built.
    """

    an = analyze(config, optimized=True)
    flop = an.total("total", "TC")["flop"]
    nbytes = an.total("total", "SN")["bytes"] + an.total("total", "EW")["bytes"]
    tokens, hidden, ffn = config.batch_size * config.max_seq_len, config.hidden_size, config.ffn_size
    shapes = ((2048, 2048, 2048), (tokens, ffn, hidden), (tokens, hidden, ffn))  # square; linear1, linear2
    calls = 5
    rate, peak = gemm_rate(config.dtype, shapes, repeats=calls), fma_peak(config.dtype)
    bw, buffer_bytes = copy_bandwidth()
    limit = flop / rate + nbytes / bw
    per = {name: {"seconds": secs, "fraction_of_limit": limit / secs, "speedup_at_limit": secs / limit}
           for name, secs in (measured_seconds or {}).items()}
    return {"contraction_flop": int(flop), "memory_bound_bytes": int(nbytes), "gemm_rate": rate,
            "gemm_probe": {"shapes_mnk": [list(v) for v in shapes], "method": "best over the shapes of the fastest "
                           f"of {calls} calls after one untimed call"}, "fma_peak": peak,
            "copy_bandwidth": bw, "copy_buffer_bytes": buffer_bytes, "limit_seconds": limit,
            "fma_limit_seconds": flop / peak + nbytes / bw, "per_implementation": per}


def _load():
    try:
        return list(os.getloadavg())
    except OSError:
        return None


# -- per-kernel table ----------------------------------------------------------------------------
def kernel_table(config, repeats: int = 20, warmup: int = 3, batch_size: int | None = None,
                 seq_len: int | None = None, copy_bytes: int | None = None, layout=None) -> dict:
    """Time every memory-bound (SN/EW, fused or not) kernel of the compiled layer and relate its bytes
    to the machine's copy bandwidth.

    Compiles ``config`` with per-operator timers (through the usual build cache), runs ``warmup`` +
    ``repeats`` forward+backward steps in train mode on ``torch.get_num_threads()`` threads and a
    STREAM-like copy in the same run (:func:`substation.perf.analysis.measure`, which uses
    :func:`substation.perf.analysis.copy_bandwidth`); bytes per kernel are
    :func:`substation.perf.analysis.operator_count`'s (every connector's elements x itemsize). ``layout``
    is passed to ``compile_layer`` as in :func:`run_bench`; ``copy_bytes`` sizes the copy buffers (bytes).

    Returns:
        Plain data: ``kernels`` (rows with ``pass``, ``name``, ``class``, ``kind``, ``members``,
        ``seconds`` (median per call), ``bytes``, ``bandwidth`` (bytes/s), ``fraction_of_copy``),
        ``totals`` per pass, ``copy_bandwidth`` (bytes/s), ``copy_buffer_bytes``, ``machine``.

    Raises:
        ValueError: ``repeats`` < 1 or ``warmup`` < 0.
        ConfigError, FileNotFoundError, ToolchainError, BuildError: as :func:`run_bench`.
    """
    import torch


    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    config = _apply_overrides(config, batch_size, seq_len)
    machine = machine_info()
    torch.set_num_threads(machine["threads"])
    compiled = compile_layer(config, instrument=True, layout=layout)
    set_substation_threads(compiled, machine["threads"])
    m = measure(config, repeats=repeats, warmup=warmup, compiled=compiled, copy_bytes=copy_bytes)
    sizes = config.sizes()
    rows = []
    for graph in (compiled.forward.graph, compiled.backward.graph):
        for op in graph.operators():
            if op.op_class == "TC":
                continue
            count = operator_count(graph, op, sizes)
            secs = m.op_seconds.get((graph.phase, op.label))
            bw = count.bytes / secs if secs else None
            rows.append({"pass": graph.phase, "name": op.label, "class": op.op_class, "kind": op.kind,
                         "members": list(count.members), "seconds": secs, "bytes": int(count.bytes),
                         "bandwidth": bw, "fraction_of_copy": bw / m.copy_bandwidth if bw else None})
    totals = {}
    for phase in ("forward", "backward"):
        sel = [r for r in rows if r["pass"] == phase]
        secs = sum(r["seconds"] or 0.0 for r in sel)
        nbytes = sum(r["bytes"] for r in sel)
        totals[phase] = {"kernels": len(sel), "seconds": secs, "bytes": nbytes,
                         "bandwidth": nbytes / secs if secs else None,
                         "fraction_of_copy": nbytes / secs / m.copy_bandwidth if secs else None,
                         "pass_seconds": m.pass_seconds.get(phase)}
    return {"schema": SCHEMA, "config": config.to_dict(), "batch_size": config.batch_size,
            "seq_len": config.max_seq_len, "dtype": config.dtype,
            "layout": None if layout is None else str(layout), "mode": "train", "threads": machine["threads"],
            "machine": machine, "repeats": repeats, "warmup": warmup,
            "copy_bandwidth": m.copy_bandwidth, "copy_buffer_bytes": m.copy_buffer_bytes,
            "kernels": rows, "totals": totals}


# -- presentation --------------------------------------------------------------------------------
_NAMES = {"substation": "Substation", "eager": "PyTorch eager", "compile": "torch.compile"}


def _header(r: dict) -> list[str]:
    c = r["config"]
    m = r["machine"]
    load = m.get("load_average")
    isa = " ".join(m.get("isa") or []) or "flags unknown"
    return [f"{c['name']}: B={r['batch_size']} L={r['seq_len']} I={c['hidden_size']} H={c['num_heads']} "
            f"U={c['ffn_size']} {c['activation']} {c['layer_norm']}-LN {c['dtype']} mask={c['mask']}, "
            f"train mode, dropout {c['dropout']['attention']}/{c['dropout']['hidden']}/{c['dropout']['activation']}",
            f"machine: {m['cpu']} ({isa}), {m['cores']} logical CPUs; threads: {r['threads']} "
            f"(torch.get_num_threads(), all implementations)" + (f"; load average {load[0]:.2f}" if load else "")]


def format_bench(r: dict) -> str:
    """The bench result as a text table (times in ms, memory in MiB). Raises KeyError on a malformed result."""
    lines = _header(r)
    impls = r["implementations"]
    comp = []
    for n, v in impls.items():
        if v.get("compile_seconds") is not None:
            comp.append(f"{_NAMES.get(n, n)} {v['compile_seconds']:.1f} s")
    lines.append("compile (cold caches): " + (", ".join(comp) or "-"))
    lines.append(f"check (eval mode, same weights): max relative error vs eager {r['max_rel_error_vs_eager']:.1e}")
    lines.append(f"medians of {r['repeats']} interleaved rounds after {r['warmup']} warm-up step(s) each:")
    lines.append(f"  {'':<16}{'forward ms':>12}{'backward ms':>13}{'fwd+bwd ms':>12}{'saved MiB':>11}")
    for n, v in impls.items():
        s = v["seconds"]
        lines.append(f"  {_NAMES.get(n, n):<16}{s['forward']['median'] * 1e3:>12.2f}"
                     f"{s['backward']['median'] * 1e3:>13.2f}{s['forward_backward']['median'] * 1e3:>12.2f}"
                     f"{v['saved_for_backward_bytes'] / 2**20:>11.2f}")
    lines.append(f"  eager module: {impls['eager']['label']}")
    sc = r["speedup_vs_compile"]
    lines.append(f"speedup_vs_eager {r['speedup_vs_eager']:.3f}x, speedup_vs_compile "
                 + (f"{sc:.3f}x" if sc is not None else "- (torch.compile skipped)") + " (forward+backward)")
    lim = r.get("limit")
    if lim:
        per = lim["per_implementation"]
        lines.append(f"limit (measured now): {lim['contraction_flop'] / 1e9:.4g} GFLOP of contractions at the BLAS's "
                     f"{lim['gemm_rate'] / 1e9:.0f} GFLOP/s + {lim['memory_bound_bytes'] / 1e6:.4g} MB of SN/EW "
                     f"bytes at {lim['copy_bandwidth'] / 1e9:.1f} GB/s = {lim['limit_seconds'] * 1e3:.4g} ms "
                     f"(at the FMA peak {lim['fma_peak'] / 1e9:.0f} GFLOP/s: {lim['fma_limit_seconds'] * 1e3:.4g} ms; "
                     f"{r['dtype']})")
        others = ", ".join(f"{v['speedup_at_limit']:.3f}x {_NAMES.get(n, n)}" for n, v in per.items() if n != "substation")
        lines.append(f"  Substation at {per['substation']['fraction_of_limit'] * 100:.0f}% of the limit; "
                     f"a layer at the limit would be {others}")
    return "\n".join(lines)


def format_kernels(r: dict) -> str:
    """The kernel table as text (time in us, bytes in MB, GB/s = 1e9 bytes/s). Raises KeyError on a malformed result."""
    lines = _header(r)
    bw = r["copy_bandwidth"]
    lines.append(f"copy bandwidth (STREAM-like, {r['copy_buffer_bytes'] / 2**20:.0f} MiB buffers): "
                 f"{bw / 1e9:.1f} GB/s; kernel times: medians of {r['repeats']} steps")
    lines.append(f"  {'pass':<9}{'kernel':<34}{'class':<6}{'time us':>10}{'MB':>9}{'GB/s':>8}{'% copy':>8}")

    def row(pass_, name, cls, secs, nbytes, kbw, frac):
        return (f"  {pass_:<9}{name[:33]:<34}{cls:<6}{(secs or 0) * 1e6:>10.1f}{nbytes / 1e6:>9.2f}"
                f"{(kbw or 0) / 1e9:>8.1f}{(frac or 0) * 100:>7.0f}%")
    for k in r["kernels"]:
        lines.append(row(k["pass"], k["name"], k["class"], k["seconds"], k["bytes"], k["bandwidth"],
                         k["fraction_of_copy"]))
    for phase, t in r["totals"].items():
        lines.append(row(phase, f"all {t['kernels']} memory-bound kernels", "", t["seconds"], t["bytes"],
                         t["bandwidth"], t["fraction_of_copy"]))
    return "\n".join(lines)


def write_json(result: dict, path: str) -> None:
    """Write a bench or kernel result as JSON (atomically). Raises OSError when it cannot be written."""
    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    atomic_write(path, write)


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend. Raises ImportError without matplotlib."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_bench(result: dict, path: str) -> None:
    """Bar chart (PNG) of the median forward, backward and forward+backward times of each
    implementation side by side, whiskers from the first to the third quartile.

    Raises:
        ImportError: matplotlib is not installed. OSError: the file cannot be written.
    """
    plt = pyplot()
    impls = list(result["implementations"])
    fig, ax = plt.subplots(figsize=(8.5, 4.8))
    width = 0.8 / len(impls)
    colors = {"substation": "#2b7bba", "eager": "#e6862e", "compile": "#4d9f45"}
    for n_i, name in enumerate(impls):
        secs = result["implementations"][name]["seconds"]
        med = [secs[p]["median"] * 1e3 for p in PASSES]
        lo = [max(0.0, m - secs[p]["q1"] * 1e3) for m, p in zip(med, PASSES)]
        hi = [max(0.0, secs[p]["q3"] * 1e3 - m) for m, p in zip(med, PASSES)]
        xs = [k + (n_i - (len(impls) - 1) / 2) * width for k in range(len(PASSES))]
        bars = ax.bar(xs, med, width, yerr=[lo, hi], capsize=3, label=_NAMES.get(name, name),
                      color=colors.get(name))
        ax.bar_label(bars, labels=[f"{m:.1f}" for m in med], label_type="center", color="white", fontsize=8)
    ax.set_xticks(range(len(PASSES)), ["forward", "backward", "forward+backward"])
    ax.set_ylabel("median time per step (ms)")
    ax.set_xlabel(f"bars: medians of {result['repeats']} interleaved rounds; whiskers: first to third quartile",
                  fontsize=8)
    c = result["config"]
    sc = result["speedup_vs_compile"]
    ax.set_title(f"{c['name']} B={result['batch_size']} L={result['seq_len']} {c['dtype']}, train, "
                 f"{result['threads']} threads\n{result['machine']['cpu']}: speedup vs eager "
                 f"{result['speedup_vs_eager']:.2f}x" + (f", vs torch.compile {sc:.2f}x" if sc else ""), fontsize=9)
    ax.legend()
    ax.margins(y=0.12)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)


def plot_kernels(result: dict, path: str) -> None:
    """Bar chart (PNG) of each memory-bound kernel's achieved bandwidth, with the copy bandwidth as a line.

    Raises:
        ImportError: matplotlib is not installed. OSError: the file cannot be written.
    """
    plt = pyplot()
    rows = result["kernels"]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(rows) + 2), 4.8))
    colors = ["#2b7bba" if k["pass"] == "forward" else "#e6862e" for k in rows]
    ax.bar(range(len(rows)), [(k["bandwidth"] or 0) / 1e9 for k in rows], color=colors)
    copy = result["copy_bandwidth"] / 1e9
    ax.axhline(copy, color="k", linestyle="--")
    ax.text(len(rows) - 0.5, copy, f"copy bandwidth {copy:.1f} GB/s", ha="right", va="bottom", fontsize=8)
    ax.margins(y=0.1)
    ax.set_xticks(range(len(rows)), [f"{k['pass'][0]}:{k['name']}" for k in rows], rotation=70, ha="right",
                  fontsize=7)
    ax.set_ylabel("achieved GB/s")
    c = result["config"]
    ax.set_title(f"{c['name']} B={result['batch_size']} L={result['seq_len']}: memory-bound kernels "
                 f"(blue forward, orange backward)", fontsize=9)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)


def _progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)
