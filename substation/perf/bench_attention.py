"""Fused against unfused attention in the inference build (``substation bench CONFIG --attention-lengths``).

For each sequence length L, :func:`run_bench_attention` builds the config's forward-only library twice
(instrumented, float32, float64 or bfloat16 as the config says): with the
``attention`` kernel (:mod:`substation.passes.attention`) and with the chain (Q/K/V bias where the kernel
takes it, scores, mask + softmax (MS), context) kept apart (``PipelineOptions.attention=False``), and times both in
interleaved rounds in one process. It
reports per L: the bytes the attention operators move (the analysis' counts), the workspace each
library needs, the attention operators' time (per-operator timers) and the whole layer's forward time,
medians, and the ratios unfused / fused.

The batch keeps the config's token count: B = max(1, config B x config L / L).
Units: bytes, seconds. Dimension letters: B batch, L = J = K sequence length, H heads.
"""
from __future__ import annotations

import ctypes
import os
from typing import Callable

from ..config import EncoderConfig, load_config
from .analysis import operator_count
from .gemm_choice import gemm_label
from .probes import machine_info
from .timing import interleaved_rounds, sample_stats, set_substation_threads

__all__ = ["LENGTHS", "SCHEMA", "run_bench_attention", "format_bench_attention"]

#: The default lengths (the inference issue's).
LENGTHS = (128, 512, 2048)
SCHEMA = "substation-bench-attention/1"


def _workspace_bytes(graph, batch: int, seq: int) -> int:
    fn = graph.lib.substation_workspace_bytes
    fn.restype = ctypes.c_int64
    return int(fn((ctypes.c_int64 * 3)(batch, seq, seq)))


def _inputs(graph, config: EncoderConfig, batch: int, seq: int) -> dict:
    import torch
    gen = torch.Generator().manual_seed(0)
    sizes = config.sizes(batch, seq)
    given = {}
    for t in graph.args:
        if t.role in ("input", "param"):
            given[t.name] = torch.randn(t.shape(sizes), generator=gen, dtype=graph.dtypes[t.name]) * 0.05
    if "mask" in given:
        given["mask"].zero_()
    return given


def run_bench_attention(config, lengths=LENGTHS, repeats: int = 5, warmup: int = 1,
                        progress: Callable[[str], None] | None = None, dtype: str | None = None) -> dict:
    """Time the fused attention kernel against the unfused chain (see the module docstring).

    Args:
        config: a config, YAML path or bundled name (target ``cpu``, float32, float64 or bfloat16). dtype: replaces the config's dtype, when given.
        lengths: sequence lengths L, each >= 1.
        repeats: interleaved rounds per length, >= 1. warmup: untimed calls of each first, >= 0.
        progress: called with a short message before each phase.

    Returns:
        Plain data: ``schema``, ``config``, ``fp32_gemm`` (the library the float32 builds' token-wise
        GEMMs call; None for other dtypes), ``machine``, ``threads``, ``repeats``, ``warmup`` and
        ``lengths``: one entry per L with ``batch_size``, ``seq_len``, ``bytes`` / ``workspace_bytes`` /
        ``attention_seconds`` / ``layer_seconds`` (each ``{"fused": ..., "unfused": ...}``, seconds as
        :func:`~substation.perf.timing.sample_stats`), ``bytes_saved`` and the ratios
        ``attention_speedup`` and ``layer_speedup`` (unfused median / fused median).

    Raises:
        ValueError: repeats < 1, warmup < 0, an empty or non-positive length, a length whose unfused
            workspace exceeds half the machine's memory, or a config the fused kernel is not for (target
            cuda, float16).
        ConfigError, FileNotFoundError, ToolchainError, BuildError: from loading and compiling.
    """
    import torch

    from ..pipeline import cached_compile
    config = load_config(config)
    if dtype is not None:
        config = config.replace(dtype=dtype)
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    lengths = tuple(int(n) for n in lengths)
    if not lengths or min(lengths) < 1:
        raise ValueError(f"need sequence lengths >= 1, got {list(lengths)}")
    if config.target != "cpu" or config.dtype not in ("float32", "float64", "bfloat16"):
        raise ValueError(f"the fused attention kernel is for float32, float64 and bfloat16 CPU builds; the config "
                         f"is {config.dtype} for target {config.target}")
    say = progress or (lambda msg: None)
    machine = machine_info()
    torch.set_num_threads(machine["threads"])
    say("the inference builds, with and without the attention kernel (instrumented)")
    builds = {"fused": cached_compile(config, mode="eval", instrument=True),
              "unfused": cached_compile(config, mode="eval", instrument=True, attention=False)}
    for compiled in builds.values():
        set_substation_threads(compiled, machine["threads"])
    # The chain: the fused build's attention operator; in the other build, the operators that write or
    # read the tensors the fusion removed (biased QKV, scores, probabilities).
    fused_graph, unfused_graph = builds["fused"].forward.graph, builds["unfused"].forward.graph
    removed = set(unfused_graph.tensors) - set(fused_graph.tensors)
    labels = {"fused": {op.label for op in fused_graph.operators() if op.kind == "attention"},
              "unfused": {op.label for op in unfused_graph.operators()
                          if {t for t, _ in unfused_graph.operands(op).values()} & removed}}
    tokens = config.batch_size * config.max_seq_len
    batches = {seq: max(1, tokens // seq) for seq in lengths}  # B keeps the config's token count
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for seq, batch in batches.items():  # before any tensor is made: the unfused chain's [B, H, L, L] scores
        need = _workspace_bytes(builds["unfused"].forward, batch, seq)
        if need > memory // 2:
            raise ValueError(f"L={seq}: the unfused chain needs {need / 2**30:.1f} GiB of workspace at B={batch}, "
                             f"over half of this machine's {memory / 2**30:.1f} GiB; give shorter lengths")
    rows = []
    for seq in lengths:
        batch = batches[seq]
        sizes = config.sizes(batch, seq)
        graphs = {n: c.forward for n, c in builds.items()}
        given = _inputs(graphs["fused"], config, batch, seq)
        nbytes = {n: int(sum(operator_count(g.graph, op, sizes).bytes for op in g.graph.operators()
                             if op.label in labels[n])) for n, g in graphs.items()}

        def step(name):
            graph = graphs[name]

            def run():
                graph.op_seconds(reset=True)
                graph(given, batch, seq)
                secs = graph.op_seconds(reset=True)
                return sum(v for k, v in secs.items() if k in labels[name]), sum(secs.values())
            return run
        say(f"L={seq}: B={batch}, {warmup} warm-up call(s) of each, then {repeats} interleaved rounds")
        steps = {n: step(n) for n in graphs}
        for _ in range(warmup):
            for run in steps.values():
                run()
        times = interleaved_rounds(steps, repeats)
        attention = {n: sample_stats([t[0] for t in v]) for n, v in times.items()}
        layer = {n: sample_stats([t[1] for t in v]) for n, v in times.items()}
        rows.append({"batch_size": batch, "seq_len": seq, "bytes": nbytes,
                     "bytes_saved": nbytes["unfused"] - nbytes["fused"],
                     "workspace_bytes": {n: _workspace_bytes(g, batch, seq) for n, g in graphs.items()},
                     "attention_seconds": attention, "layer_seconds": layer,
                     "attention_speedup": attention["unfused"]["median"] / attention["fused"]["median"],
                     "layer_speedup": layer["unfused"]["median"] / layer["fused"]["median"]})
    return {"schema": SCHEMA, "config": config.to_dict(), "fp32_gemm": builds["fused"].fp32_gemm_library,
            "machine": machine, "threads": machine["threads"], "repeats": repeats, "warmup": warmup, "lengths": rows}


def format_bench_attention(r: dict) -> str:
    """The result of :func:`run_bench_attention` as a table (MB, MiB, ms).

    Raises:
        KeyError: a malformed result.
    """
    c, m = r["config"], r["machine"]
    lines = [f"{c['name']}: I={c['hidden_size']} H={c['num_heads']} {c['dtype']}{gemm_label(r.get('fp32_gemm'))}, "
             f"inference build; "
             f"{m['cpu']}, {r['threads']} threads; medians of {r['repeats']} interleaved rounds",
             f"{'B x L':>10} {'MB unfused':>11} {'MB fused':>9} {'ws MiB unf.':>12} {'ws MiB fused':>13} "
             f"{'attn ms unf.':>13} {'attn ms fused':>14} {'attn x':>7} {'layer ms unf.':>14} "
             f"{'layer ms fused':>15} {'layer x':>8}"]
    for row in r["lengths"]:
        b, w, a, lay = row["bytes"], row["workspace_bytes"], row["attention_seconds"], row["layer_seconds"]
        lines.append(f"{row['batch_size']:>4} x {row['seq_len']:<4} {b['unfused'] / 1e6:>11.1f} "
                     f"{b['fused'] / 1e6:>9.1f} "
                     f"{w['unfused'] / 2**20:>12.1f} {w['fused'] / 2**20:>13.1f} "
                     f"{a['unfused']['median'] * 1e3:>13.2f} {a['fused']['median'] * 1e3:>14.2f} "
                     f"{row['attention_speedup']:>7.2f} {lay['unfused']['median'] * 1e3:>14.1f} "
                     f"{lay['fused']['median'] * 1e3:>15.1f} {row['layer_speedup']:>8.2f}")
    return "\n".join(lines)
