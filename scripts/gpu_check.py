#!/usr/bin/env python3
"""GPU check of Substation's CUDA target: one command, one JSON file, under 10 minutes on one H200.

    python3 scripts/gpu_check.py [--out gpu_check.json] [--budget 540] [--iters 20] [--no-compile]

Run from anywhere on a machine with an NVIDIA GPU, nvcc (CUDA >= 12), cuBLAS (e.g. the
``nvidia-cublas`` wheel PyTorch brings), PyTorch with CUDA and DaCe (docs/cuda.md lists the
prerequisites and how to carry DaCe's wheels to a machine without network). Stages, each recorded in
the JSON whatever happens to the others:

1. environment and prerequisites (GPU, torch, nvcc, cuBLAS, substation importable);
2. build: every library the later stages use, compiled in parallel through the build cache
   (tiny layers in float64/float32/float16/bfloat16 and two variants, BERT-large in
   float32/float16/bfloat16), with compile times;
3. correctness (a subprocess, so that a GPU fault cannot take the benchmarks down): forward output,
   dX and every parameter gradient on CUDA against the fp64 CPU ``ReferenceEncoderLayer`` (dropout
   off), next to PyTorch eager in the same dtype on the GPU; sizes that take the vector and scalar
   paths and warp- and block-per-row kernels; the same on a side stream (bitwise equality recorded);
   dropout masks equal to the CPU build's (numpy Philox); autocast with float32 parameters;
4. benchmarks (one subprocess per case): BERT-large forward+backward, training mode (dropout 0.1),
   B=8 L=512 and B=96 L=128, float16 and bfloat16: Substation, PyTorch eager and ``torch.compile``
   (CUDA events, median of ``--iters`` steps after warm-up, peak memory), time-boxed: a case or a
   ``torch.compile`` run that would not fit the budget is skipped and recorded as such.

The JSON is rewritten after every stage (atomically), so a killed run still leaves what it measured.
Exit status: 0 when every correctness check passed, 1 otherwise, 2 when prerequisites are missing.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

#: Hidden --dry-run-cpu mode (development only): the same flow on the CPU with the emulated CUDA
#: code (substation.backends.cuda.build emulate=True) and tiny layers in place of BERT-large.
DRY_RUN = os.environ.get("SUBSTATION_GPU_CHECK_DRY_RUN") == "1"
DEVICE = "cpu" if DRY_RUN else "cuda"
NO_DROPOUT = {"attention": 0.0, "hidden": 0.0, "activation": 0.0}
HEAVY_DROPOUT = {"attention": 0.3, "hidden": 0.2, "activation": 0.25}
#: Relative max error allowed against the fp64 reference (or 4x PyTorch eager's own error in that dtype).
TOLERANCE = {"float64": 1e-10, "float32": 1e-4, "float16": 2e-2, "bfloat16": 8e-2}
#: What a GPU machine with only PyTorch lacks to import Substation (all pure Python).
WHEELS = ("dace==2.0.0b1", "astunparse==1.6.3", "dill", "ordered-set", "ply", "fparser")
BENCH_CASES = [(dt, b, l) for b, l in ((8, 512), (96, 128)) for dt in ("float16", "bfloat16")]
#: Contraction GFLOP of one BERT-large layer forward+backward (DESIGN.md).
GFLOP = {(8, 512): 335.0, (96, 128): 947.0}


# -- configs ---------------------------------------------------------------------------------------
def configs() -> dict:
    """name -> EncoderConfig of every build the check uses."""
    from substation.config import load_config
    arch = os.environ.get("SUBSTATION_GPU_CHECK_ARCH", "sm_90")
    tiny = load_config("tiny").replace(target="cuda", dropout=NO_DROPOUT, cuda_arch=arch)
    res = {f"tiny-{dt}": tiny.replace(dtype=dt) for dt in ("float64", "float32", "float16", "bfloat16")}
    res["tiny-float32-pre-causal"] = tiny.replace(dtype="float32", layer_norm="pre", mask="causal",
                                                  activation="gelu_tanh")
    res["tiny-float32-dropout"] = tiny.replace(dtype="float32", dropout=HEAVY_DROPOUT)
    large = load_config("bert-large-b8-l512").replace(target="cuda", cuda_arch=arch)
    if DRY_RUN:
        large = load_config("tiny").replace(target="cuda")
    for dt in ("float32", "float16", "bfloat16"):
        res[f"bert-large-{dt}"] = large.replace(dtype=dt)
    return res


def compiled_layer(name: str):
    """The CompiledLayer of config ``name`` (from the build cache after the build stage)."""
    if DRY_RUN:
        from substation.backends.cuda.build import build_cuda_libraries
        from substation.backends.cuda.codegen import generate_cuda
        from substation.pipeline import compile_graphs
        from substation.runtime import CompiledGraph, CompiledLayer
        cfg = configs()[name]
        fwd, bwd = compile_graphs(cfg, fuse_ops=True)
        src = {"forward": generate_cuda(fwd), "backward": generate_cuda(bwd)}
        built = build_cuda_libraries(src, emulate=True)
        return CompiledLayer(cfg, CompiledGraph(fwd, built["forward"].path), CompiledGraph(bwd, built["backward"].path),
                             {k: v.seconds for k, v in built.items()}, src)
    from substation.pipeline import compile_layer
    return compile_layer(configs()[name])


# -- results file ----------------------------------------------------------------------------------
def write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def error_record(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}


# -- stage 1: environment --------------------------------------------------------------------------
def environment() -> dict:
    env = {"python": sys.version.split()[0], "platform": platform.platform(), "host_cpus": os.cpu_count()}
    try:
        import torch
        env["torch"] = torch.__version__
        env["torch_cuda"] = torch.version.cuda
        env["cuda_available"] = torch.cuda.is_available() or DRY_RUN
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            env["gpu"] = {"name": p.name, "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
                          "memory_gib": round(p.total_memory / 2 ** 30, 1)}
    except Exception as e:  # noqa: BLE001
        env["torch_error"] = f"{type(e).__name__}: {e}"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,power.limit",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        env["nvidia_smi"] = out.stdout.strip() or out.stderr.strip()
    except Exception as e:  # noqa: BLE001
        env["nvidia_smi"] = f"unavailable: {e}"
    try:
        import substation
        env["substation"] = substation.__version__
        import dace
        env["dace"] = dace.__version__
    except Exception as e:  # noqa: BLE001
        env["substation_error"] = (f"{type(e).__name__}: {e} -- install DaCe and the package's dependencies "
                                   "(docs/cuda.md, 'Prerequisites')")
    try:
        from substation.backends.cuda.build import cuda_toolchain
        tc = cuda_toolchain()
        env["nvcc"] = {"path": tc.nvcc, "version": tc.nvcc_version}
        env["cublas"] = {"include": tc.cublas_include, "library": tc.cublas_lib, "version": tc.cublas_version}
        tc.require_cublas()
    except Exception as e:  # noqa: BLE001
        env["toolchain_error"] = f"{type(e).__name__}: {e}"
    return env


# -- stage 2: builds -------------------------------------------------------------------------------
def build_all(jobs: int) -> dict:
    from substation.backends.cuda.codegen import generate_cuda
    from substation.pipeline import compile_graphs
    t0 = time.perf_counter()
    sources, res = {}, {}
    for name, cfg in configs().items():
        try:
            fwd, bwd = compile_graphs(cfg, fuse_ops=True)
            sources[f"{name}/forward"] = generate_cuda(fwd)
            sources[f"{name}/backward"] = generate_cuda(bwd)
        except Exception as e:  # noqa: BLE001
            res[name] = error_record(e)
    codegen = time.perf_counter() - t0
    # One build at a time per failure domain: a broken source must not hide the others' results.
    from concurrent.futures import ThreadPoolExecutor

    from substation.backends.cuda.build import build_cuda_library
    t1 = time.perf_counter()

    def one(item):
        key, src = item
        name, phase = key.split("/")
        try:
            r = build_cuda_library(src, f"{name}-{phase}", configs()[name].cuda_arch, emulate=DRY_RUN)
            return key, {"seconds": round(r.seconds, 2), "cached": r.cached}
        except Exception as e:  # noqa: BLE001
            return key, error_record(e)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for key, r in pool.map(one, sorted(sources.items(), key=lambda kv: -len(kv[1]))):
            res[key] = r
    return {"libraries": res, "codegen_seconds": round(codegen, 2), "build_wall_seconds": round(time.perf_counter() - t1, 2),
            "jobs": jobs, "ok": all("error" not in r for r in res.values())}


# -- stage 3: correctness (subprocess) -------------------------------------------------------------
def _rel(a, r) -> float:
    a, r = a.detach().double().cpu(), r.detach().double().cpu()
    return float((a - r).abs().max() / r.abs().max().clamp_min(1e-300))


def _randomize(layer, seed: int) -> None:
    import torch
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if name.startswith("norm") and "weight" in name else 0.0))


def _run(module, x, mask, dy):
    """Forward+backward of ``module``: (output, dX, {parameter: gradient})."""
    xg = x.detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    y = module(xg, mask)
    y.backward(dy.to(y.dtype))
    return y.detach(), xg.grad, {n: p.grad for n, p in module.named_parameters()}


def check_numerics(name: str, b: int, j: int, seed: int = 0) -> dict:
    """One layer at one size against the fp64 CPU reference, next to PyTorch eager in the same dtype."""
    import torch

    from substation.reference import ReferenceEncoderLayer
    from substation import EncoderLayer
    compiled = compiled_layer(name)
    cfg = compiled.config
    layer = EncoderLayer(compiled).to(DEVICE).eval()
    _randomize(layer, seed)
    dt = layer.torch_dtype
    ref = ReferenceEncoderLayer(cfg, torch.float64).eval()
    ref.load_state_dict({k: v.double().cpu() for k, v in layer.state_dict().items()})
    eager = ReferenceEncoderLayer(cfg, dt).to(DEVICE).eval()
    eager.load_state_dict(layer.state_dict())
    torch.manual_seed(seed + 1)
    x = torch.randn(b, j, cfg.hidden_size, dtype=torch.float64)
    dy = torch.randn(b, j, cfg.hidden_size, dtype=torch.float64)
    mask = None
    if cfg.mask != "none":
        mask = torch.zeros(b, j, dtype=torch.float64)
        mask[-1, j - max(1, j // 4):] = float("-inf")
    dev = lambda t: None if t is None else t.to(DEVICE, dt)  # noqa: E731
    ours = _run(layer, dev(x), dev(mask), dev(dy))
    theirs = _run(eager, dev(x), dev(mask), dev(dy))
    exact = _run(ref, x, mask, dy)
    names = ["Y", "dX"] + [f"d{n}" for n in ours[2]]
    flat = lambda r: [r[0], r[1], *r[2].values()]  # noqa: E731
    tol = TOLERANCE[cfg.dtype]
    errors, eager_errors, failed = {}, {}, []
    for n, o, e, r in zip(names, flat(ours), flat(theirs), flat(exact)):
        errors[n], eager_errors[n] = _rel(o, r), _rel(e, r)
        if not (errors[n] <= max(tol, 4 * eager_errors[n])) or math.isnan(errors[n]):
            failed.append(n)
    # The same call on a side stream (PyTorch's current stream is honoured): as accurate; bitwise
    # equality is recorded (our kernels are deterministic; cuBLAS may pick another algorithm).
    if DEVICE == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            again = _run(layer, dev(x), dev(mask), dev(dy))
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
    else:
        again = _run(layer, dev(x), dev(mask), dev(dy))
    same = all(torch.equal(a, c) for a, c in zip(flat(ours), flat(again)))
    side_errors = {n: _rel(o, r) for n, o, r in zip(names, flat(again), flat(exact))}
    side_failed = [n for n, e in side_errors.items() if not e <= max(tol, 4 * eager_errors[n])]
    return {"config": name, "B": b, "J": j, "dtype": cfg.dtype, "max_error": max(errors.values()),
            "eager_max_error": max(eager_errors.values()), "tolerance": tol, "errors": errors,
            "eager_errors": eager_errors, "failed": failed, "side_stream_max_error": max(side_errors.values()),
            "side_stream_failed": side_failed, "side_stream_bitwise_identical": same,
            "passed": not failed and not side_failed}


def check_dropout(name: str, b: int, j: int, seed: int = 0x0123456789ABCDEF) -> dict:
    """Training-mode forward: the saved dropout outputs keep exactly the elements the CPU build keeps."""
    import numpy as np
    import torch

    from substation.ops.dropout import dropout_keep_mask
    from substation.ir.graph import DROPOUT_SITES
    from substation import EncoderLayer
    compiled = compiled_layer(name)
    cfg = compiled.config
    layer = EncoderLayer(compiled).to(DEVICE)
    sizes = cfg.sizes(b, j)
    given = {"X": torch.randn(b, j, cfg.hidden_size, device=DEVICE, dtype=layer.torch_dtype),
             "mask": torch.zeros(b, j, device=DEVICE, dtype=layer.torch_dtype),
             **{n: getattr(layer, n).detach() for n in layer.parameter_names}}
    out = compiled.forward(given, b, j, seed=seed, training=True)
    checked, ok = {}, True
    for site, tensor, before in (("attention_dropout", "A_drop", "A"), ("activation_dropout", "F1_drop", "F1_act")):
        if tensor not in out:
            continue
        field, stream, dims = DROPOUT_SITES[site]
        p = cfg.dropout.probability(field)
        shape = [sizes[d] for d in dims]
        keep = dropout_keep_mask(seed, stream, np.arange(int(np.prod(shape))).reshape(shape), p)
        got = out[tensor].float().cpu().numpy() != 0
        nonzero = out[before].float().cpu().numpy() != 0 if before in out else np.ones_like(got)
        same = bool(np.array_equal(got, keep & nonzero))
        kept = out[tensor].float().cpu()[torch.from_numpy(keep & nonzero)]
        scale_ok = True
        if before in out:
            ref = out[before].float().cpu()[torch.from_numpy(keep & nonzero)] / (1 - p)
            scale_ok = bool(torch.allclose(kept, ref, rtol=1e-5 if cfg.dtype == "float32" else 1e-2, atol=0))
        checked[tensor] = {"mask_identical": same, "scaled_by_1_over_1_minus_p": scale_ok,
                           "kept_fraction": float(got.mean()), "p": p}
        ok = ok and same and scale_ok
    return {"config": name, "B": b, "J": j, "sites": checked, "passed": ok and bool(checked)}


def check_autocast(name: str, b: int, j: int) -> dict:
    """A half layer with float32 parameters under torch.autocast: runs, float32 gradients, close to eager."""
    import torch

    from substation.reference import ReferenceEncoderLayer
    from substation import EncoderLayer
    compiled = compiled_layer(name)
    cfg = compiled.config
    layer = EncoderLayer(compiled).to(DEVICE).float().eval()
    _randomize(layer, 3)
    ref = ReferenceEncoderLayer(cfg, torch.float64).eval()
    ref.load_state_dict({k: v.double().cpu() for k, v in layer.state_dict().items()})
    x = torch.randn(b, j, cfg.hidden_size, device=DEVICE, requires_grad=True)
    with torch.autocast(DEVICE, dtype=layer.torch_dtype):
        y = layer(x)
    y.float().sum().backward()
    with torch.no_grad():
        yr = ref(x.detach().double().cpu())
    grads_ok = all(p.grad is not None and p.grad.dtype == torch.float32 and bool(torch.isfinite(p.grad).all())
                   for p in layer.parameters())
    err = _rel(y.float(), yr)
    tol = 2 * TOLERANCE[cfg.dtype]
    return {"config": name, "B": b, "J": j, "output_dtype": str(y.dtype), "error_vs_fp64": err, "tolerance": tol,
            "float32_parameter_gradients": grads_ok, "passed": grads_ok and y.dtype == layer.torch_dtype and err < tol}


def correctness_stage(part: str) -> None:
    cases = [("numerics", check_numerics, n, b, j) for n in ("tiny-float64", "tiny-float32", "tiny-float16",
                                                            "tiny-bfloat16")
             for b, j in ((2, 7), (2, 8), (3, 33), (2, 64))]
    cases += [("numerics", check_numerics, "tiny-float32-pre-causal", b, j) for b, j in ((2, 8), (2, 33))]
    cases += [("numerics", check_numerics, f"bert-large-{dt}", b, j) for dt in ("float32", "float16", "bfloat16")
              for b, j in ((2, 64), (1, 203))]
    cases += [("dropout", check_dropout, "tiny-float32-dropout", 3, 33),
              ("dropout", check_dropout, "bert-large-float16", 2, 128),
              ("autocast", check_autocast, "bert-large-bfloat16", 2, 64)]
    results = []
    for kind, fn, name, b, j in cases:
        t0 = time.perf_counter()
        try:
            r = fn(name, b, j)
        except Exception as e:  # noqa: BLE001
            r = {"config": name, "B": b, "J": j, "passed": False, **error_record(e)}
        r["kind"], r["seconds"] = kind, round(time.perf_counter() - t0, 2)
        results.append(r)
        write_json(part, {"results": results})


# -- stage 4: benchmarks (one subprocess per case) -------------------------------------------------
def _time_steps(fn, x, dy, warmup: int, iters: int) -> dict:
    """Milliseconds per step (CUDA events on the GPU) and the peak memory the steps add."""
    import torch
    for _ in range(warmup):
        fn(x, dy)
    cuda = DEVICE == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(iters):
        if cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(x, dy)
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn(x, dy)
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    res = {"median_ms": statistics.median(times), "min_ms": times[0], "p90_ms": times[int(0.9 * (len(times) - 1))],
           "iters": iters}
    if cuda:
        res["peak_extra_memory_gib"] = round((torch.cuda.max_memory_allocated() - base) / 2 ** 30, 3)
    return res


def bench_stage(part: str, dtype: str, b: int, seq: int, iters: int, deadline: float, use_compile: bool) -> None:
    import torch

    from substation.reference import ReferenceEncoderLayer
    from substation import EncoderLayer
    torch.backends.cuda.matmul.allow_tf32 = False
    res = {"dtype": dtype, "B": b, "L": seq, "gflop": GFLOP.get((b, seq)), "results": {}}
    write_json(part, res)
    compiled = compiled_layer(f"bert-large-{dtype}")
    cfg = compiled.config
    layer = EncoderLayer(compiled).to(DEVICE).train()
    eager = ReferenceEncoderLayer(cfg, layer.torch_dtype).to(DEVICE).train()
    eager.load_state_dict(layer.state_dict())
    torch.manual_seed(0)
    x = torch.randn(b, seq, cfg.hidden_size, device=DEVICE, dtype=layer.torch_dtype).requires_grad_()
    dy = torch.randn_like(x)
    mask = torch.zeros(b, seq, device=DEVICE, dtype=layer.torch_dtype)  # BERT passes a padding mask

    def step(module):
        def fn(inp, grad):
            for p in module.parameters():
                p.grad = None
            inp.grad = None
            module(inp, mask).backward(grad)
        return fn
    impls = [("substation", step(layer)), ("pytorch_eager", step(eager))]
    for name, fn in impls:
        try:
            res["results"][name] = _time_steps(fn, x, dy, 3, iters)
        except Exception as e:  # noqa: BLE001
            res["results"][name] = error_record(e)
        write_json(part, res)
    if not use_compile:
        res["results"]["torch_compile"] = {"skipped": "--no-compile"}
    elif deadline - time.time() < 45:
        res["results"]["torch_compile"] = {"skipped": f"time budget ({deadline - time.time():.0f} s left)"}
    else:
        try:
            comp = torch.compile(eager)
            t0 = time.perf_counter()
            step(comp)(x, dy)
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            r = _time_steps(step(comp), x, dy, 2, iters)
            r["compile_seconds"] = round(compile_s, 1)
            res["results"]["torch_compile"] = r
        except Exception as e:  # noqa: BLE001
            res["results"]["torch_compile"] = error_record(e)
    sub = res["results"].get("substation", {}).get("median_ms")
    for k, v in res["results"].items():
        if isinstance(v, dict) and v.get("median_ms"):
            if sub and k != "substation":
                v["substation_speedup"] = round(v["median_ms"] / sub, 3)  # this time / Substation's
            if res["gflop"] and not DRY_RUN:
                v["contraction_tflops"] = round(res["gflop"] / v["median_ms"], 1)
    write_json(part, res)


# -- wheels for a machine without network ---------------------------------------------------------
def prepare_wheels(folder: str) -> int:
    """Fill ``folder`` with the pure-Python wheels of DaCe and its imported dependencies (needs
    network: run it where pip works, then carry the folder to the GPU machine; docs/cuda.md)."""
    os.makedirs(folder, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    # dace 2.0.0b1 is published as a source archive only: build its (pure-Python) wheel here.
    rc = subprocess.run(pip + ["wheel", "--no-deps", "-w", folder, WHEELS[0]]).returncode
    rc = rc or subprocess.run(pip + ["download", "--no-deps", "--only-binary=:all:", "--implementation", "cp",
                                     "--python-version", "3.12", "--platform", "any", "-d", folder,
                                     *WHEELS[1:]]).returncode
    if rc == 0:
        print(f"wrote {', '.join(sorted(os.listdir(folder)))} to {folder}")
    return rc


# -- driver ----------------------------------------------------------------------------------------
def run_stage(args_list: list[str], part: str, timeout: float) -> dict:
    """Run a stage in a fresh Python; return its part file (and how the process ended)."""
    t0 = time.perf_counter()
    cmd = [sys.executable, os.path.abspath(__file__), *args_list, "--part", part]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1.0, timeout))
        status = {"returncode": proc.returncode, "stderr_tail": proc.stderr[-3000:]}
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        status = {"returncode": None, "timeout_seconds": round(timeout), "stderr_tail": err[-3000:]}
    try:
        with open(part) as f:
            data = json.load(f)
    except (OSError, ValueError):
        data = {}
    data["process"] = {**status, "seconds": round(time.perf_counter() - t0, 1)}
    return data


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_check.json", help="JSON file to write (default gpu_check.json)")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for the whole check (default 540)")
    parser.add_argument("--iters", type=int, default=20, help="timed steps per benchmark (default 20)")
    parser.add_argument("--jobs", type=int, default=0, help="parallel nvcc processes (default: CPUs, at most 16)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    parser.add_argument("--prepare-wheels", metavar="DIR",
                        help="only download/build the wheels a PyTorch-only GPU machine lacks into DIR, then exit")
    parser.add_argument("--dry-run-cpu", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stage", choices=("correctness", "bench"), help=argparse.SUPPRESS)
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.prepare_wheels:
        return prepare_wheels(args.prepare_wheels)
    if args.dry_run_cpu and not DRY_RUN:  # re-run with the mode fixed before anything is imported
        env = dict(os.environ, SUBSTATION_GPU_CHECK_DRY_RUN="1")
        return subprocess.run([sys.executable, os.path.abspath(__file__)]
                              + [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--dry-run-cpu"],
                              env=env).returncode
    os.environ.setdefault("SUBSTATION_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "substation"))
    if args.stage == "correctness":
        correctness_stage(args.part)
        return 0
    if args.stage == "bench":
        dtype, b, seq = args.case.split(":")
        bench_stage(args.part, dtype, int(b), int(seq), args.iters, args.deadline, not args.no_compile)
        return 0

    start = time.time()
    deadline = start + args.budget
    out = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    report = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(), "budget_seconds": args.budget,
              "command": " ".join(sys.argv)}
    print(f"gpu_check: writing {out}", flush=True)
    report["environment"] = env = environment()
    if "gpu" in env:  # build for this GPU (sm_90 on H100/H200)
        os.environ["SUBSTATION_GPU_CHECK_ARCH"] = "sm_" + env["gpu"]["capability"].replace(".", "")
    report["cuda_arch"] = os.environ.get("SUBSTATION_GPU_CHECK_ARCH", "sm_90")
    report["dry_run_cpu"] = DRY_RUN
    write_json(out, report)
    missing = [k for k in ("torch_error", "substation_error", "toolchain_error") if k in env]
    if missing or not env.get("cuda_available"):
        report["status"] = "prerequisites missing: " + "; ".join(
            [env[k] for k in missing] + ([] if env.get("cuda_available") else ["torch sees no CUDA GPU"]))
        report["finished_seconds"] = round(time.time() - start, 1)
        write_json(out, report)
        print(report["status"], file=sys.stderr)
        return 2
    print("gpu_check: building", flush=True)
    try:
        report["build"] = build_all(args.jobs or min(16, os.cpu_count() or 1))
    except Exception as e:  # noqa: BLE001
        report["build"] = error_record(e)
    write_json(out, report)
    print(f"gpu_check: build done ({time.time() - start:.0f} s); correctness", flush=True)
    parts = tempfile.mkdtemp(prefix="gpu_check-")  # the stages' own files; everything ends up in `out`
    # Correctness gets at most a third of what is left; benchmarks share the rest.
    left = deadline - time.time()
    report["correctness"] = run_stage(["--stage", "correctness"], os.path.join(parts, "correctness.json"),
                                      min(left / 3, 240))
    results = report["correctness"].get("results", [])
    report["correctness"]["passed"] = bool(results) and all(r.get("passed") for r in results)
    report["correctness"]["summary"] = f"{sum(bool(r.get('passed')) for r in results)}/{len(results)} passed"
    write_json(out, report)
    print(f"gpu_check: correctness {report['correctness']['summary']} ({time.time() - start:.0f} s); benchmarks",
          flush=True)
    report["benchmarks"] = []
    for i, (dtype, b, seq) in enumerate(BENCH_CASES):
        left = deadline - time.time()
        if left < 20:
            report["benchmarks"].append({"dtype": dtype, "B": b, "L": seq, "skipped": f"time budget ({left:.0f} s left)"})
            continue
        share = left / (len(BENCH_CASES) - i)
        case_deadline = time.time() + share
        part = os.path.join(parts, f"bench-{dtype}-{b}-{seq}.json")
        r = run_stage(["--stage", "bench", "--case", f"{dtype}:{b}:{seq}", "--iters", str(args.iters),
                       "--deadline", str(case_deadline - 5)] + (["--no-compile"] if args.no_compile else []),
                      part, share)
        report["benchmarks"].append(r)
        write_json(out, report)
        sub = r.get("results", {})
        print(f"gpu_check: {dtype} B={b} L={seq}: " + ", ".join(
            f"{k} {v['median_ms']:.2f} ms" for k, v in sub.items() if isinstance(v, dict) and "median_ms" in v),
            flush=True)
    shutil.rmtree(parts, ignore_errors=True)
    report["finished_seconds"] = round(time.time() - start, 1)
    report["status"] = "ok" if report["correctness"]["passed"] else "correctness failures"
    write_json(out, report)
    print(f"gpu_check: {report['status']} in {report['finished_seconds']:.0f} s; wrote {out}", flush=True)
    return 0 if report["correctness"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
