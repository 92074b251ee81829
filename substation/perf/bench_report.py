"""Bench results as text, JSON and plots (``substation bench``)."""
from __future__ import annotations

import json

from ..files import atomic_write
from .gemm_choice import gemm_label
from .timing import PASSES

__all__ = ["format_bench", "format_kernels", "plot_bench", "plot_kernels", "pyplot", "write_json"]


_NAMES = {"substation": "Substation", "eager": "PyTorch eager", "compile": "torch.compile"}


def _header(r: dict) -> list[str]:
    c = r["config"]
    m = r["machine"]
    load = m.get("load_average")
    isa = " ".join(m.get("isa") or []) or "flags unknown"
    return [f"{c['name']}: B={r['batch_size']} L={r['seq_len']} I={c['hidden_size']} H={c['num_heads']} "
            f"U={c['ffn_size']} {c['activation']} {c['layer_norm']}-LN {c['dtype']}"
            + gemm_label(r.get("fp32_gemm")) + f" mask={c['mask']}, "
            + (f"train mode, dropout {c['dropout']['attention']}/{c['dropout']['hidden']}/{c['dropout']['activation']}"
             if r.get("mode", "train") == "train" else "eval mode, torch.inference_mode (Substation: inference build)"),
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
    train = r.get("mode", "train") == "train"
    if train:
        lines.append(f"  {'':<16}{'forward ms':>12}{'backward ms':>13}{'fwd+bwd ms':>12}{'saved MiB':>11}")
    else:
        lines.append(f"  {'':<16}{'forward ms':>12}{'min ms':>10}{'max ms':>10}")
    for n, v in impls.items():
        s = v["seconds"]
        if train:
            lines.append(f"  {_NAMES.get(n, n):<16}{s['forward']['median'] * 1e3:>12.2f}"
                         f"{s['backward']['median'] * 1e3:>13.2f}{s['forward_backward']['median'] * 1e3:>12.2f}"
                         f"{v['saved_for_backward_bytes'] / 2**20:>11.2f}")
        else:
            lines.append(f"  {_NAMES.get(n, n):<16}{s['forward']['median'] * 1e3:>12.2f}"
                         f"{s['forward']['min'] * 1e3:>10.2f}{s['forward']['max'] * 1e3:>10.2f}")
    lines.append(f"  eager module: {impls['eager']['label']}")
    sc = r["speedup_vs_compile"]
    lines.append(f"speedup_vs_eager {r['speedup_vs_eager']:.3f}x, speedup_vs_compile "
                 + (f"{sc:.3f}x" if sc is not None else "- (torch.compile skipped)")
                 + (" (forward+backward)" if train else " (forward, eval)"))
    lim = r.get("limit")
    if lim:
        per = lim["per_implementation"]
        # float32: the build's library; bfloat16 builds call oneDNN, float64 builds MKL
        library = {"mkl": "MKL", "onednn": "oneDNN"}.get(r.get("fp32_gemm")) or \
            ("oneDNN" if r["dtype"] == "bfloat16" else "MKL")
        lines.append(f"limit (measured now): {lim['contraction_flop'] / 1e9:.4g} GFLOP of contractions at "
                     f"{library}'s {lim['gemm_rate'] / 1e9:.0f} GFLOP/s + {lim['memory_bound_bytes'] / 1e6:.4g} MB of SN/EW "
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
