"""The analysis report: text (``substation report``), the kernel table, JSON and a plot of an
:class:`~substation.perf.analysis.Analysis`."""
from __future__ import annotations

import json

from ..files import atomic_write
from ..ir.graph import OP_CLASSES
from ..passes.precision import applies_to
from .analysis import PAPER_CLASS_SHARES, PAPER_MAX_REDUCTION_PCT, PASSES, Analysis
from .gemm_choice import gemm_label

__all__ = ["differences", "format_kernels", "format_report", "plot_report", "write_json"]


def differences(analysis: "Analysis") -> list[str]:
    """Why our class shares differ from the paper's Table 1 (one sentence each; details in docs/analysis.md)."""
    k = analysis.kernels()
    notes = [
        "flop: the paper does not publish its per-operator counting rules; ours count every arithmetic "
        "operation (erf/exp/tanh = 1; GELU 5 flop per element forward, 11 backward), every dropout multiply "
        "and the attention-mask add" + ("; a fused kernel counts as SN when any member is SN, so the flop of "
                                        "its EW members move to SN." if analysis.optimized else "."),
        "bytes vs runtime: the paper's runtime shares come from PyTorch on a V100 (tensor cores, fp16); ours "
        "are required bytes and, with --measure, CPU time, where GEMMs are slow relative to memory, so TC's "
        "time share is larger than the paper's and SN+EW's smaller.",
    ]
    if analysis.optimized:
        nf = k["forward"]["all"] - k["forward"]["TC"]
        nb = k["backward"]["all"] - k["backward"]["TC"]
        notes.append(f"after fusion we run {nf} non-TC kernels forward and {nb} backward (paper: 5 and 9); "
                     "intermediates inside a fused kernel never reach memory.")
    else:
        notes.append("our unfused graph writes and re-reads every intermediate (QKV_raw, S, S_masked, O_raw, "
                     "F2_drop, ...): mask, biases and residuals are separate operators; dropout masks are "
                     "regenerated from a counter-based RNG (no mask bytes, but Philox costs time); backward "
                     "sums gradients with explicit add operators.")
    return notes


def _fmt_rate(v, scale, fmt="{:.1f}") -> str:
    return fmt.format(v / scale) if v is not None else "-"


def format_report(analysis: Analysis) -> str:
    """The per-operator table, the class summary next to the paper's Table 1, and notes (text).

    Units: GFLOP, MB (1e6 bytes), flop/byte; with a measurement ms, GB/s (1e9 bytes/s) and % efficiency.
    """
    a, m = analysis, analysis.measurement
    bw = m.copy_bandwidth if m else None
    c = a.config
    width_note = (f"{c.itemsize} bytes; float32 residual stream, norms, statistics" if applies_to(c.dtype, c.target)
                  else f"{c.itemsize} bytes")
    lines = [f"{c.name}: B={c.batch_size} J=K={c.max_seq_len} I={c.hidden_size} H={c.num_heads} P={c.head_size} "
             f"U={c.ffn_size} {c.dtype} ({width_note}){gemm_label(a.fp32_gemm)} {c.layer_norm}-LN {c.activation}"
             + ("  [optimized graphs]" if a.optimized else "  [unfused graphs]")
             + ("  [inference build: forward only, no dropout, nothing saved]" if a.mode == "eval" else "")]
    width = max([len("operator")] + [len(o.name) for o in a.operators])
    head = f"{'operator':<{width}} {'pass':<8} {'class':<5} {'GFLOP':>9} {'MB read':>9} {'MB writ.':>9} {'flop/B':>8}"
    if m:
        head += f" {'ms':>8} {'GFLOP/s':>8} {'GB/s':>7} {'eff %':>6}"
    lines += ["", head, "-" * len(head)]
    for o in a.operators:
        row = (f"{o.name:<{width}} {o.phase:<8} {o.op_class:<5} {o.flop / 1e9:>9.4f} {o.bytes_read / 1e6:>9.2f} "
               f"{o.bytes_written / 1e6:>9.2f} {o.intensity:>8.2f}")
        if m:
            eff = o.efficiency(bw)
            rate = o.flop / o.seconds if o.seconds else None
            row += (f" {_fmt_rate(o.seconds, 1e-3, '{:.3f}'):>8} {_fmt_rate(rate, 1e9):>8} "
                    f"{_fmt_rate(o.bandwidth(), 1e9):>7} {_fmt_rate(eff, 0.01):>6}")
        lines.append(row)
    if any(o.name == "master_weight_casts" for o in a.operators):
        lines.append("master_weight_casts: the float32 master weights cast to bf16 inside the operator, once per call "
                     "under autocast (a pure-bf16 layer skips it; an inference build packs its weights from float32 "
                     "and casts the rest)")
    lines += ["", "class summary (share of the pass; kernels = operators, a fused kernel counts once)"]
    head = f"{'pass':<9} {'class':<5} {'kernels':>7} {'GFLOP':>9} {'MB':>9} {'flop %':>7} {'bytes %':>7}"
    if m:
        head += f" {'ms':>8} {'time %':>7} {'GB/s':>7} {'eff %':>6}"
    if a.mode == "train":
        head += f"  {'paper flop %':>12} {'paper time %':>12}"
    lines += [head, "-" * len(head)]
    shares, kernels = a.shares(), a.kernels()
    train = a.mode == "train"
    for p in ((*PASSES, "total") if train else ("forward",)):
        for cl in (*OP_CLASSES, "all"):
            t = a.total(p, cl)
            sh = shares[p].get(cl, {"flop_pct": 100.0, "bytes_pct": 100.0, "time_pct": 100.0})
            row = (f"{p:<9} {cl:<5} {kernels[p][cl]:>7} {t['flop'] / 1e9:>9.3f} {t['bytes'] / 1e6:>9.1f} "
                   f"{sh['flop_pct']:>7.2f} {sh['bytes_pct']:>7.2f}")
            if m:
                row += (f" {t['seconds'] * 1e3:>8.2f} {sh['time_pct']:>7.2f} {_fmt_rate(t['bandwidth'], 1e9):>7} "
                        f"{_fmt_rate(t['efficiency'], 0.01):>6}")
            if train and p == "total" and cl in PAPER_CLASS_SHARES:
                row += f"  {PAPER_CLASS_SHARES[cl]['flop_pct']:>12.2f} {PAPER_CLASS_SHARES[cl]['runtime_pct']:>12.1f}"
            lines.append(row)
    tc = a.contraction_flop()
    tot = a.total()
    what = "TC kernel flop (contractions and what is fused into them)" if a.optimized else "contraction flop"
    if train:
        lines += ["", f"{what}: forward {tc['forward'] / 1e9:.2f} GFLOP, backward {tc['backward'] / 1e9:.2f} "
                      f"GFLOP, forward+backward {tc['total'] / 1e9:.2f} GFLOP"]
        lines.append(f"data movement: forward {a.total('forward')['bytes'] / 1e6:.1f} MB, backward "
                     f"{a.total('backward')['bytes'] / 1e6:.1f} MB, forward+backward {tot['bytes'] / 1e6:.1f} MB")
    else:
        lines += ["", f"{what}: forward {tc['forward'] / 1e9:.4g} GFLOP; data movement: forward "
                      f"{tot['bytes'] / 1e6:.4g} MB"]
    if a.optimized:
        paper = f"; paper: up to {PAPER_MAX_REDUCTION_PCT}%" if train else ""  # the paper's is a training step's
        lines.append(f"data movement reduction vs the unfused graphs: {a.data_movement_reduction_pct:.2f}% "
                     f"({a.unfused_bytes / 1e6:.4g} MB -> {tot['bytes'] / 1e6:.4g} MB{paper})")
    if m:
        lines.append(f"measured: copy bandwidth {m.copy_bandwidth / 1e9:.2f} GB/s (STREAM-like copy, "
                     f"{m.copy_buffer_bytes / 2 ** 20:.0f} MiB buffers); "
                     + ", ".join(f"{p} {v * 1e3:.2f} ms" for p, v in m.pass_seconds.items())
                     + f" wall (median of {m.repeats}); "
                     f"timed operators {tot['seconds'] * 1e3:.2f} ms"
                     + (f"; float32 GEMMs: {m.fp32_gemm}" if m.fp32_gemm else ""))
    if not train:
        lines += ["", "eval mode: the inference build's forward graph alone (no dropout, nothing saved for backward); "
                      "the paper's Table 1 is a forward+backward training step, so no comparison is made"]
        return "\n".join(lines + _missing_timers(a))
    sh = shares["total"]
    paper_other = PAPER_CLASS_SHARES["SN"]["runtime_pct"] + PAPER_CLASS_SHARES["EW"]["runtime_pct"]
    line = (f"ours vs the paper (forward+backward): TC flop {sh['TC']['flop_pct']:.2f}% "
            f"(paper {PAPER_CLASS_SHARES['TC']['flop_pct']:.2f}%); SN+EW move "
            f"{sh['SN']['bytes_pct'] + sh['EW']['bytes_pct']:.1f}% of the bytes")
    if m:
        line += f" and take {sh['SN']['time_pct'] + sh['EW']['time_pct']:.1f}% of the operator time"
    lines += ["", line + f" (paper: {paper_other:.1f}% of the runtime)"]
    gap = max(abs(sh[c]["flop_pct"] - PAPER_CLASS_SHARES[c]["flop_pct"]) for c in OP_CLASSES)
    lines.append(f"  flop shares differ from the paper's by at most {gap:.2f} percentage points; why:")
    lines += [f"  - {d}" for d in differences(a)]
    return "\n".join(lines + _missing_timers(a))


def _missing_timers(a: Analysis) -> list[str]:
    """A warning line when measured operators lack a timer (the measured build is not the analysed graph)."""
    missing = [f"{o.phase}/{o.name}" for o in a.operators if o.seconds is None] if a.measurement else []
    if not missing:
        return []
    return [f"  warning: no timer for {len(missing)} operators ({', '.join(missing[:5])}"
            f"{', ...' if len(missing) > 5 else ''}): the measured build is not the analysed graph"]


def format_kernels(analysis: Analysis) -> str:
    """The memory-bound (SN/EW) kernels of each pass, one line each: name, class, MB moved and the
    operators it runs (a fused kernel lists its members in order; an unfused operator is its own
    kernel). Contractions are not kernels of this list. Raises nothing."""
    phases = PASSES if analysis.mode == "train" else ("forward",)
    ops = {phase: [o for o in analysis.select(phase) if o.op_class != "TC"] for phase in phases}
    width = max([len("kernel")] + [len(o.name) for group in ops.values() for o in group])
    lines = ["memory-bound kernels (contractions not counted)" + (" after fusion" if analysis.optimized else "")
             + gemm_label(analysis.fp32_gemm) + (", inference build" if analysis.mode == "eval" else ""),
             f"{'pass':<9} {'kernel':<{width}} {'class':<5} {'MB':>10}  operators"]
    for phase, group in ops.items():
        for o in group:
            lines.append(f"{phase:<9} {o.name:<{width}} {o.op_class:<5} {o.bytes / 1e6:>10.4g}  "
                         + (" + ".join(o.members) if o.members else o.name))
        lines.append(f"{phase:<9} {len(group)} kernels")
    return "\n".join(lines)


def write_json(analysis: Analysis, path: str) -> None:
    """Write :meth:`Analysis.to_json` to ``path`` atomically (temporary file + rename).

    Raises:
        OSError: the folder cannot be written.
    """
    data = analysis.to_json()

    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
    atomic_write(path, write)


def plot_report(analysis: Analysis, path: str) -> None:
    """Bar chart of the flop, bytes and (when measured) time share of each class, one panel per pass
    (forward, backward, forward+backward), with the paper's shares beside the forward+backward panel;
    written to ``path`` (PNG) atomically.

    Raises:
        ImportError: matplotlib is not installed. OSError: the folder cannot be written.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a, m = analysis, analysis.measurement
    shares = a.shares()
    series = [("flop", "flop_pct", "#4c72b0"), ("bytes", "bytes_pct", "#dd8452")]
    if m:
        series.append(("time (measured)", "time_pct", "#55a868"))
    panels = [("forward", "forward"), ("backward", "backward"), ("total", "forward + backward")]
    fig, axes = plt.subplots(1, 4, figsize=(17, 5.2), gridspec_kw={"width_ratios": [3, 3, 3, 2.2]})
    x = list(range(len(OP_CLASSES)))
    width = 0.8 / len(series)
    for ax, (phase, title) in zip(axes, panels):
        t = a.total(phase)
        for k, (label, key, color) in enumerate(series):
            vals = [shares[phase][c][key] for c in OP_CLASSES]
            pos = [xi - 0.4 + width * (k + 0.5) for xi in x]
            bars = ax.bar(pos, vals, width, label=label, color=color)
            for b_, v in zip(bars, vals):
                ax.annotate(f"{v:.1f}" if v >= 0.05 or v == 0 else f"{v:.2f}", (b_.get_x() + b_.get_width() / 2, v),
                            ha="center", va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
        k = a.kernels()[phase]
        ax.set_xticks(x, [f"{c}\n({k[c]} kernel{'' if k[c] == 1 else 's'})" for c in OP_CLASSES])
        sub = f"{t['flop'] / 1e9:.1f} GFLOP, {t['bytes'] / 1e6:.0f} MB"
        if m:
            sub += f", {t['seconds'] * 1e3:.1f} ms"
        ax.set_title(f"{title}\n{sub}", fontsize=10)
        ax.set_ylim(0, 112)
        ax.set_ylabel("share of the pass (%)")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(loc="upper right", fontsize=9)
    ax = axes[3]
    pw = 0.38
    paper_series = (("paper flop", "flop_pct", "#8172b3"), ("paper runtime", "runtime_pct", "#937860"))
    for k, (label, key, color) in enumerate(paper_series):
        vals = [PAPER_CLASS_SHARES[c][key] for c in OP_CLASSES]
        bars = ax.bar([xi - 0.4 + pw * (k + 0.5) + 0.02 for xi in x], vals, pw, label=label, color=color)
        for b_, v in zip(bars, vals):
            ax.annotate(f"{v:g}", (b_.get_x() + b_.get_width() / 2, v), ha="center", va="bottom", fontsize=8,
                        xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(x, list(OP_CLASSES))
    ax.set_ylim(0, 112)
    ax.set_title("paper, Table 1\n(BERT-large fwd+bwd, V100)", fontsize=10)
    ax.legend(loc="upper right", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    c = a.config
    fig.suptitle(f"{c.name} (B={c.batch_size}, J={c.max_seq_len}, I={c.hidden_size}, {c.dtype}): share per operator "
                 f"class, {'optimized' if a.optimized else 'unfused'} graphs", fontsize=12)
    fig.tight_layout()

    def write(tmp):
        fig.savefig(tmp, format="png", dpi=110)
    try:
        atomic_write(path, write)
    finally:
        plt.close(fig)
