"""Benchmarks: the compiled layer against PyTorch eager and ``torch.compile`` (``substation bench``).

:func:`run_bench` times, interleaved in one process (warm-up first, medians of repeated steps), the
forward pass, the backward pass (``y.backward(dy)`` timed on its own) and forward+backward of

* ``substation``: the compiled :class:`~substation.EncoderLayer`;
* ``eager``: the same layer in PyTorch eager mode with identical weights: a Hugging Face
  ``transformers`` ``BertLayer`` when the config is BERT-like (post-LN, no activation dropout, a
  padding mask or none), else :class:`~substation.reference.ReferenceEncoderLayer`;
* ``compile``: that eager module under ``torch.compile`` (default mode, inductor).

With ``dtype: bfloat16`` (the config's or ``--dtype``), every implementation runs under
``torch.autocast("cpu", dtype=torch.bfloat16)`` with float32 weights, inputs and gradients: Substation's
bf16 build (float32 master weights, cast once per step), the eager module and its ``torch.compile``
as autocast runs them.

All run in train mode with the config's dropout and a padding mask (the second half of the batch is
padded from position 3L/4 on), on ``torch.get_num_threads()`` threads. It also reports the bytes each
holds for backward (:func:`saved_tensor_bytes`) and the compile time of each, cold: Substation's
whole pipeline into an empty build cache, ``torch.compile``'s first forward and backward call with an
empty inductor cache.

:func:`kernel_table` (``substation bench --kernels``) times every memory-bound (SN/EW, fused) kernel
of the instrumented build and relates its bytes (:func:`substation.perf.analysis.operator_count`) to the
copy bandwidth measured in the same run (:func:`substation.perf.probes.copy_bandwidth`).

Units everywhere: seconds, bytes, bytes/s; ratios are plain numbers. See docs/performance.md.
"""
from __future__ import annotations

import dataclasses
import os
import re
import tempfile
import time
from typing import Callable

from ..config import load_config
from ..layer import EncoderLayer
from ..pipeline import MODES, compile_layer
from .analysis import analyze, measure, operator_count
from .baselines import eager_baseline, padded_from, padding_mask, real_token_error
from .probes import copy_bandwidth, fma_peak, gemm_rate, machine_info
from .timing import (PASSES, Candidate, env_var, fresh_inductor_cache, interleaved_times, sample_stats,
                     saved_tensor_bytes, set_substation_threads, time_step)

__all__ = ["IMPLEMENTATIONS", "SCHEMA", "kernel_table", "run_bench", "time_limit"]

#: The implementations of a bench, in order.
IMPLEMENTATIONS = ("substation", "eager", "compile")
SCHEMA = "substation-bench/1"


# -- machine and threads -------------------------------------------------------------------------


# -- the three modules ---------------------------------------------------------------------------


# -- timing --------------------------------------------------------------------------------------


# -- cold compiles -------------------------------------------------------------------------------


def _cold_compile(config, layout=None, fp32_gemm: str = "auto"):
    """(CompiledLayer, pipeline seconds) with an empty, temporary build cache."""
    with tempfile.TemporaryDirectory(prefix="substation-bench-cache-") as tmp, env_var("SUBSTATION_CACHE_DIR", tmp):
        t0 = time.perf_counter()
        compiled = compile_layer(config, layout=layout, fp32_gemm=fp32_gemm)
        seconds = time.perf_counter() - t0
    return compiled, seconds  # the libraries stay loaded after their files are removed


def _apply_overrides(config, batch_size: int | None, seq_len: int | None, dtype: str | None = None):
    config = load_config(config)
    if dtype is not None:
        config = config.replace(dtype=dtype)
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
              hf_attn: str = "sdpa", seed: int = 0, layout=None, mode: str = "train", dtype: str | None = None,
              fp32_gemm: str = "auto", progress: Callable[[str], None] | None = None) -> dict:
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
        mode: ``train`` (forward+backward steps in train mode, dropout on) or ``eval`` (forward
            passes in eval mode under ``torch.inference_mode``: Substation runs its inference build,
            the others their eval forward; nothing is held for backward).
        dtype: override the config's dtype; ``bfloat16``: everything under CPU bf16 autocast (see the
            module docstring).
        fp32_gemm: the library of a float32 build's token-wise GEMMs (``compile_layer(fp32_gemm=...)``);
            the limit's GEMM rate is that of the library the timed build calls (the result's ``fp32_gemm``).
        progress: called with a short message before each phase.

    Returns:
        The result as plain data (the JSON of ``substation bench``; keys in docs/performance.md).
        Times in seconds, memory in bytes; ``speedup_vs_eager`` = eager's median forward+backward
        seconds (mode ``eval``: forward seconds) / Substation's, ``speedup_vs_compile`` likewise for
        ``torch.compile``.

    Raises:
        ValueError: ``repeats`` < 1 or ``warmup`` < 0, an unknown mode or ``fp32_gemm``, ``layout`` with mode
            ``eval``.
        ConfigError, FileNotFoundError: a bad config or override.
        ToolchainError, BuildError: Substation's compilation failed (PlanError: a layout plan that
            does not fit).
    """
    import torch


    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "eval" and layout is not None:
        raise ValueError("a layout plan applies to training builds; bench --mode eval runs the inference build")
    train = mode == "train"
    say = progress or (lambda msg: None)
    config = _apply_overrides(config, batch_size, seq_len, dtype)
    autocast = config.dtype == "bfloat16"
    machine = machine_info()
    threads = machine["threads"]
    torch.set_num_threads(threads)

    say(f"compiling {config.name} with Substation (cold build cache)")
    compiled, sub_compile = _cold_compile(config, layout, fp32_gemm)
    torch.manual_seed(seed)
    layer = EncoderLayer(compiled)
    if autocast:
        layer = layer.float()  # float32 weights: the float32 build, which runs this bf16 build under autocast
    sub_threads = set_substation_threads(compiled, threads)
    eager, call_eager, eager_label = eager_baseline(layer, hf_attn)
    if autocast:
        plain_eager = call_eager

        def call_eager(m, t, mask):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return plain_eager(m, t, mask)
        eager_label += " under torch.autocast('cpu', dtype=torch.bfloat16)"

    def call_sub(t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return layer(t, attention_mask=mask)

    b, j, i = config.batch_size, config.max_seq_len, config.hidden_size
    dtype = layer.torch_dtype
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, j, i, generator=gen, dtype=dtype)
    dy = torch.randn(b, j, i, generator=gen, dtype=dtype) if train else None
    mask = padding_mask(config, b, j, dtype)

    # identical weights: the outputs agree with dropout off
    layer.eval(), eager.eval()
    with torch.no_grad():
        y_sub, y_ref = call_sub(x), call_eager(eager, x, mask)
    rel_err = real_token_error(y_sub, y_ref, mask)
    layer.train(train), eager.train(train)
    if not train:
        say("building the inference build")
        inference = compiled.forward_only()
        set_substation_threads(inference, threads)
        info_inference = {"inference_build_seconds": dict(inference.build_seconds)}

    cands = [Candidate("substation", call_sub, list(layer.parameters())),
             Candidate("eager", lambda t: call_eager(eager, t, mask), list(eager.parameters()))]
    info = {"substation": {"label": "substation.EncoderLayer", "compile_seconds": sub_compile,
                           "compile_method": "substation pipeline (graph ... load) into an empty temporary "
                                             "SUBSTATION_CACHE_DIR",
                           "build_seconds": dict(compiled.build_seconds), "threads": sub_threads,
                           **({} if train else info_inference)},
            "eager": {"label": eager_label, "compile_seconds": None, "compile_method": None, "threads": threads}}
    if include_compile:
        say(f"torch.compile (backend {compile_backend}, cold inductor cache): first call")
        torch._dynamo.reset()
        opt = torch.compile(eager, backend=compile_backend)
        with fresh_inductor_cache():
            f, bwd = time_step(Candidate("compile", lambda t: call_eager(opt, t, mask), list(eager.parameters())),
                               x, dy)
        first = {"forward": f, "backward": bwd} if train else {"forward": f}
        cands.append(Candidate("compile", lambda t: call_eager(opt, t, mask), list(eager.parameters())))
        info["compile"] = {"label": f"torch.compile({eager_label}, backend={compile_backend!r})",
                           "compile_seconds": f + bwd, "first_call_seconds": first,
                           "compile_method": ("first forward + first backward call (each compiles its graph)"
                                              if train else "first forward call under torch.inference_mode")
                                             + " with an empty inductor cache, after torch._dynamo.reset()",
                           "backend": compile_backend, "threads": threads}

    say(f"timing: {warmup} warm-up step(s) each, then {repeats} interleaved rounds")
    times = interleaved_times(cands, x, dy, repeats, warmup)

    say("memory held for backward" if train else "collecting the results")
    impls = {}
    for c in cands:
        impls[c.name] = {**info[c.name], "seconds": {p: sample_stats(times[c.name][p]) for p in PASSES}}
        if train:
            exclude = [*c.params, x, mask]
            xg = x.detach().requires_grad_()
            y, nbytes, count = saved_tensor_bytes(lambda: c.call(xg), exclude + [xg])
            y.backward(dy)
            del y
            impls[c.name].update(saved_for_backward_bytes=int(nbytes), saved_for_backward_storages=int(count))
    med = {n: {p: impls[n]["seconds"][p]["median"] for p in PASSES} for n in impls}
    timed = "forward_backward" if train else "forward"
    sub = med["substation"][timed]
    say("limit: BLAS GEMM rate, FMA peak and copy bandwidth")
    library = (compiled if train else compiled.forward_only()).fp32_gemm_library
    limit = time_limit(config, {n: med[n][timed] for n in med}, mode=mode, fp32_gemm=library or "mkl")
    result = {
        "schema": SCHEMA,
        "config": config.to_dict(),
        "batch_size": b, "seq_len": j, "dtype": config.dtype,
        "layout": None if layout is None else str(layout),
        "fp32_gemm": library,
        "mode": mode,
        "dropout": dataclasses.asdict(config.dropout),
        "mask": (None if mask is None else
                 f"additive key mask [B, K]: rows {b // 2}..{b - 1} padded from position {padded_from(j)} on"),
        "threads": threads,
        "machine": {**machine, "load_average_after": _load()},
        "repeats": repeats, "warmup": warmup,
        "implementations": impls,
        "median_seconds": med,
        "speedup_vs_eager": med["eager"][timed] / sub,
        "speedup_vs_compile": med["compile"][timed] / sub if "compile" in med else None,
        "max_rel_error_vs_eager": rel_err,
        "limit": limit,
    }
    return result


def time_limit(config, measured_seconds: dict | None = None, mode: str = "train", fp32_gemm: str = "mkl") -> dict:
    """The analysis' lower bound on one forward+backward step of ``config`` (``mode="eval"``: one
    forward pass of the inference build), from rates measured now: contraction flop at the GEMM rate of
    the library the build calls (float32: ``fp32_gemm``, ``"mkl"`` or ``"onednn"``; inference: oneDNN's
    weights read from packed copies) plus the SN/EW kernels' required bytes at the copy bandwidth, both
    counted on the graphs of that library.

    ``limit_seconds = TC flop / gemm_rate + (SN + EW bytes) / copy_bandwidth`` with the optimized
    graphs' counts (:func:`substation.perf.analysis.analyze`), :func:`~substation.perf.probes.gemm_rate` (the
    linked BLAS's best over a 2048^3 GEMM and the feed-forward shapes [B L, U, I] and [B L, I, U]),
    :func:`~substation.perf.probes.copy_bandwidth` (DRAM-sized buffers; kernels whose data stay in cache
    can beat it) and, as the hardware's ceiling for the contractions,
    :func:`~substation.perf.probes.fma_peak` (``fma_limit_seconds`` puts the flop at that peak instead).
    All on the current OpenMP thread count.

    Args:
        config: an :class:`~substation.EncoderConfig` (sizes as benchmarked).
        measured_seconds: implementation name -> measured seconds of the same step; each gets
            ``fraction_of_limit`` (limit / measured) and ``speedup_at_limit`` (measured / limit: the
            largest speedup over it that a layer running at the limit would show).

    Returns:
        Plain data: ``contraction_flop`` (flop), ``memory_bound_bytes`` (bytes), ``gemm_rate``,
        ``fma_peak`` (flop/s), ``copy_bandwidth`` (bytes/s), ``limit_seconds``, ``fma_limit_seconds``,
        ``per_implementation`` (see above).

    Raises:
        ToolchainError, BuildError: the probe library cannot be built.
    """

    an = analyze(config, optimized=True, mode=mode, fp32_gemm=fp32_gemm)
    flop = an.total("total", "TC")["flop"]
    nbytes = an.total("total", "SN")["bytes"] + an.total("total", "EW")["bytes"]
    tokens, hidden, ffn = config.batch_size * config.max_seq_len, config.hidden_size, config.ffn_size
    shapes = ((2048, 2048, 2048), (tokens, ffn, hidden), (tokens, hidden, ffn))  # square; linear1, linear2
    calls = 5
    # bf16 builds: the FMA peak of their float32 arithmetic (no AMX peak probe)
    rate = gemm_rate(config.dtype, shapes, repeats=calls, fp32_gemm=fp32_gemm, packed_weights=mode == "eval")
    peak = fma_peak(_ARITHMETIC.get(config.dtype, config.dtype))
    bw, buffer_bytes = copy_bandwidth()
    limit = flop / rate + nbytes / bw
    per = {name: {"seconds": secs, "fraction_of_limit": limit / secs, "speedup_at_limit": secs / limit}
           for name, secs in (measured_seconds or {}).items()}
    return {"contraction_flop": int(flop), "memory_bound_bytes": int(nbytes), "gemm_rate": rate,
            "gemm_probe": {"shapes_mnk": [list(v) for v in shapes], "method": "best over the shapes of the fastest "
                           f"of {calls} calls after one untimed call"}, "fma_peak": peak,
            "copy_bandwidth": bw, "copy_buffer_bytes": buffer_bytes, "limit_seconds": limit,
            "fma_limit_seconds": flop / peak + nbytes / bw, "per_implementation": per}


_ARITHMETIC = {"bfloat16": "float32"}


def _load():
    try:
        return list(os.getloadavg())
    except OSError:
        return None


# -- per-kernel table ----------------------------------------------------------------------------
def kernel_table(config, repeats: int = 20, warmup: int = 3, batch_size: int | None = None,
                 seq_len: int | None = None, copy_bytes: int | None = None, layout=None,
                 fp32_gemm: str = "auto") -> dict:
    """Time every memory-bound (SN/EW, fused or not) kernel of the compiled layer and relate its bytes
    to the machine's copy bandwidth.

    Compiles ``config`` with per-operator timers (through the usual build cache), runs ``warmup`` +
    ``repeats`` forward+backward steps in train mode on ``torch.get_num_threads()`` threads and a
    STREAM-like copy in the same run (:func:`substation.perf.analysis.measure`, which uses
    :func:`substation.perf.probes.copy_bandwidth`); bytes per kernel are
    :func:`substation.perf.analysis.operator_count`'s (every connector's elements x itemsize). ``layout``
    and ``fp32_gemm`` are passed to ``compile_layer`` as in :func:`run_bench`; ``copy_bytes`` sizes the copy buffers (bytes).

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
    compiled = compile_layer(config, instrument=True, layout=layout, fp32_gemm=fp32_gemm)
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
    return {"schema": SCHEMA, "config": config.to_dict(), "fp32_gemm": compiled.fp32_gemm_library,
            "batch_size": config.batch_size,
            "seq_len": config.max_seq_len, "dtype": config.dtype,
            "layout": None if layout is None else str(layout), "mode": "train", "threads": machine["threads"],
            "machine": machine, "repeats": repeats, "warmup": warmup,
            "copy_bandwidth": m.copy_bandwidth, "copy_buffer_bytes": m.copy_buffer_bytes,
            "kernels": rows, "totals": totals}


# -- presentation --------------------------------------------------------------------------------
