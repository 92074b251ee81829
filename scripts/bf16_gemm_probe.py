#!/usr/bin/env python3
"""bf16 GEMM probe: oneDNN matmul against MKL on the BERT layer's own GEMMs, per instruction set.

    .venv/bin/python scripts/bf16_gemm_probe.py [--rounds 5] [--isas amx,avx512bf16] [--json out.json]
        [--onednn-root PREFIX] [--threads 2] [--batch 8 --seq 128 --hidden 768 --ff 3072 --heads 12]
        [--quick] [--only REGEX]

Compiles ``scripts/bf16_gemm_probe.cpp`` the way the project builds generated code (the compiler,
flags and MKL link line of ``substation.build.toolchain()``, plus oneDNN found under
``--onednn-root``, ``$DNNLROOT`` or ``sys.prefix``: ``include/oneapi/dnnl/dnnl.hpp`` and
``lib/libdnnl.so.3``), then runs one child process per (round, instruction set), interleaved, so
that a disturbance hits every library alike. Each child imports torch first (torch's ``libgomp`` is
then the one OpenMP runtime every library binds to: the child records the OpenMP, oneDNN and MKL
libraries mapped into it), loads the probe with ctypes and measures every case once: median seconds
per call after warm-up. The table shows, per case and instruction set, the median over rounds in
TFLOP/s (2*m*n*k per GEMM). One more child per instruction set runs every oneDNN case and torch's
with ``ONEDNN_VERBOSE=1`` and ``MKL_VERBOSE=1`` and records which implementation ran.

Instruction sets: ``amx`` (the libraries' defaults), ``avx512bf16`` (``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``,
``MKL_ENABLE_INSTRUCTIONS=AVX512_E3``: what an AMD Zen 4 or an Intel Cooper Lake offers), ``avx512``
(``AVX512_CORE`` / ``AVX512``: no bf16 instructions at all).

Cases (B*L = M tokens): the token-wise GEMMs forward (Y = X W^T, W stored [N, K] as torch does),
backward data (dX = dY W) and weight gradient (dW = dY^T X, float32 out), with bias / GELU / residual
epilogues on the forward ones; the per-head attention products (S = Q K^T, O = P V and the four of
their backward) as one batch of B*H GEMMs, both on contiguous head-major tensors ("attn") and on
per-head views into the token-major tensors the token-wise GEMMs write ("attn-view": Q, K, V in the
[M, 3*I] output of the QKV projection, O and dO in [M, I]; "attn-bjhp": Q, K, V, O, dO each in its own
[M, I] = [B, J, H, P] tensor). Checks every result against a float32
SGEMM of the same bf16 values (``max_rel_err``).
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "scripts", "bf16_gemm_probe.cpp")

ISAS = {
    "amx": {},
    "avx512bf16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "MKL_ENABLE_INSTRUCTIONS": "AVX512_E3"},
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
}
LIBS = {"onednn": 0, "mkl_bf16": 1, "mkl_bf16_packed": 2, "mkl_sgemm": 3, "torch": 100}
EPIS = {"": 0, "bias": 1, "bias+gelu_erf": 2, "bias+gelu_tanh": 3, "bias+resid": 4, "gelu_erf": 5, "scale": 6}


# -- cases ----------------------------------------------------------------------------------------
class Spec(ctypes.Structure):
    _fields_ = [("lib", ctypes.c_int), ("epilogue", ctypes.c_int), ("out_bf16", ctypes.c_int),
                ("weights_any", ctypes.c_int), ("b0", ctypes.c_long), ("b1", ctypes.c_long), ("m", ctypes.c_long),
                ("n", ctypes.c_long), ("k", ctypes.c_long), ("as_", ctypes.c_long * 4), ("bs", ctypes.c_long * 4),
                ("cs", ctypes.c_long * 4), ("min_iters", ctypes.c_int), ("max_iters", ctypes.c_int),
                ("min_time_s", ctypes.c_double)]


class Result(ctypes.Structure):
    _fields_ = [("median_s", ctypes.c_double), ("min_s", ctypes.c_double), ("create_ms", ctypes.c_double),
                ("create_again_ms", ctypes.c_double), ("first_exec_ms", ctypes.c_double),
                ("prep_ms", ctypes.c_double), ("prep_f32_ms", ctypes.c_double), ("max_rel_err", ctypes.c_double),
                ("iters", ctypes.c_int), ("status", ctypes.c_int), ("impl", ctypes.c_char * 256),
                ("msg", ctypes.c_char * 512)]


def _variant(lib: str, out: str = "f32", epi: str = "", packed: bool = False) -> dict:
    return {"lib": lib, "out": out, "epi": epi, "packed": packed}


def variant_name(v: dict) -> str:
    s = v["lib"] + ("" if v["lib"] in ("mkl_bf16", "mkl_bf16_packed", "mkl_sgemm") else f" {v['out']}")
    if v["packed"]:
        s += " packedW"
    if v["epi"]:
        s += f" +{v['epi']}"
    return s


def cases(batch: int, seq: int, hidden: int, ff: int, heads: int) -> list[dict]:
    """Every (shape, variant) the probe measures, with operand strides."""
    M, I, U, H, J = batch * seq, hidden, ff, heads, seq
    P = I // H
    out = []

    def add(group, name, m, n, k, a, b, c, variants, b0=1, b1=1):
        for v in variants:
            out.append({"group": group, "shape": name, "m": m, "n": n, "k": k, "b0": b0, "b1": b1,
                        "as": a, "bs": b, "cs": c, "flop": 2.0 * m * n * k * b0 * b1, **v,
                        "variant": variant_name(v), "id": f"{name}|{variant_name(v)}"})

    fwd_variants = [
        _variant("onednn", "f32"), _variant("onednn", "bf16"), _variant("onednn", "f32", "bias"),
        _variant("onednn", "bf16", "bias"), _variant("onednn", "bf16", "bias+gelu_erf"),
        _variant("onednn", "bf16", "bias+gelu_tanh"), _variant("onednn", "bf16", "bias+resid"),
        _variant("onednn", "bf16", "bias", packed=True),
        _variant("mkl_bf16"), _variant("mkl_bf16", epi="bias"), _variant("mkl_bf16", epi="bias+resid"),
        _variant("mkl_bf16_packed"), _variant("mkl_sgemm"),
        _variant("torch", "bf16"), _variant("torch", "bf16", "bias"),
    ]
    data_variants = [_variant("onednn", "f32"), _variant("onednn", "bf16"), _variant("onednn", "bf16", packed=True),
                     _variant("mkl_bf16"), _variant("mkl_bf16_packed"), _variant("mkl_sgemm"), _variant("torch", "bf16")]
    weight_variants = [_variant("onednn", "f32"), _variant("onednn", "bf16"), _variant("mkl_bf16"),
                       _variant("mkl_sgemm"), _variant("torch", "bf16")]
    for name, n, k in (("qkv", 3 * I, I), ("out", I, I), ("ff1", U, I), ("ff2", I, U)):
        # Y[M, n] = X[M, k] W^T, W stored [n, k]
        add("fwd", f"{name} fwd {M}x{n}x{k}", M, n, k, (0, 0, k, 1), (0, 0, 1, k), (0, 0, n, 1), fwd_variants)
        # dX[M, k] = dY[M, n] W
        add("bwd-data", f"{name} dX {M}x{k}x{n}", M, k, n, (0, 0, n, 1), (0, 0, k, 1), (0, 0, k, 1), data_variants)
        # dW[n, k] = dY^T X: A = dY^T (dY stored [M, n])
        add("bwd-weight", f"{name} dW {n}x{k}x{M}", n, k, M, (0, 0, 1, n), (0, 0, k, 1), (0, 0, k, 1),
            weight_variants)

    att_variants = [_variant("onednn", "f32"), _variant("onednn", "bf16"), _variant("mkl_bf16"), _variant("mkl_sgemm"),
                    _variant("torch", "bf16")]

    def dense(r, c, trans=False):  # head-major [B, H, r, c] (trans: the transpose of a stored [B, H, c, r])
        return (H * r * c, r * c, 1, r) if trans else (H * r * c, r * c, c, 1)

    def view(ld, trans=False):  # [J, P] of head h in a token-major [B, J, ld] tensor (trans: its [P, J] transpose)
        return (J * ld, P, 1, ld) if trans else (J * ld, P, ld, 1)

    nb = f"{batch * H}x"
    att = [  # name, m, n, k, dense A/B/C, view A/B/C
        ("S=QK^T", J, J, P, dense(J, P), dense(P, J, True), dense(J, J), view(3 * I), view(3 * I, True), dense(J, J)),
        ("O=PV", J, P, J, dense(J, J), dense(J, P), dense(J, P), dense(J, J), view(3 * I), view(I)),
        ("dP=dOV^T", J, J, P, dense(J, P), dense(P, J, True), dense(J, J), view(I), view(3 * I, True), dense(J, J)),
        ("dV=P^TdO", J, P, J, dense(J, J, True), dense(J, P), dense(J, P), dense(J, J, True), view(I), view(3 * I)),
        ("dQ=dSK", J, P, J, dense(J, J), dense(J, P), dense(J, P), dense(J, J), view(3 * I), view(3 * I)),
        ("dK=dS^TQ", J, P, J, dense(J, J, True), dense(J, P), dense(J, P), dense(J, J, True), view(3 * I),
         view(3 * I)),
    ]
    for name, m, n, k, da, db, dc, va, vb, vc in att:
        extra = [_variant("onednn", "f32", "scale"), _variant("mkl_bf16", epi="scale")] if name.startswith("S=") else []
        add("attn", f"attn {name} {nb}{m}x{n}x{k}", m, n, k, da, db, dc, att_variants + extra, b0=batch, b1=H)
        add("attn-view", f"attn-view {name} {nb}{m}x{n}x{k}", m, n, k, va, vb, vc, att_variants, b0=batch, b1=H)
        # the same with Q, K, V, O in separate token-major [B, J, H, P] tensors (row stride I, not 3*I)
        sep = [view(I, s[2] == 1) if s[1] == P else s for s in (va, vb, vc)]
        add("attn-bjhp", f"attn-bjhp {name} {nb}{m}x{n}x{k}", m, n, k, *sep, att_variants, b0=batch, b1=H)
    return out


# -- toolchain ------------------------------------------------------------------------------------
def find_onednn(root: str | None) -> dict:
    """oneDNN's include folder, ``libdnnl.so.3`` and its threading runtime, under ``root``, ``$DNNLROOT``
    or ``sys.prefix`` (where the PyPI wheels ``onednn-cpu-gomp``/``onednn-devel-cpu-gomp`` put them)."""
    for prefix in (root, os.environ.get("DNNLROOT"), sys.prefix):
        if not prefix:
            continue
        inc, lib = os.path.join(prefix, "include"), os.path.join(prefix, "lib", "libdnnl.so.3")
        if os.path.exists(os.path.join(inc, "oneapi", "dnnl", "dnnl.hpp")) and os.path.exists(lib):
            with open(os.path.join(inc, "oneapi", "dnnl", "dnnl_config.h")) as f:
                cfg = f.read()
            runtime = re.search(r"#define DNNL_CPU_RUNTIME (\w+)", cfg).group(1)
            ldd = subprocess.run(["ldd", lib], capture_output=True, text=True).stdout
            needs = sorted({ln.split()[0] for ln in ldd.splitlines() if "=>" in ln})
            return {"prefix": prefix, "include": inc, "lib": lib, "cpu_runtime": runtime, "needs": needs}
    raise SystemExit("oneDNN not found: install onednn-cpu-gomp and onednn-devel-cpu-gomp (pip), or pass --onednn-root "
                     "PREFIX (a folder with include/oneapi/dnnl/dnnl.hpp and lib/libdnnl.so.3), or set $DNNLROOT")


def build(onednn: dict, build_dir: str) -> tuple[str, list[str]]:
    sys.path.insert(0, ROOT)
    from substation.backends.cpu.build import FLAGS, toolchain
    tc = toolchain()
    os.makedirs(build_dir, exist_ok=True)
    d = os.path.dirname(onednn["lib"])
    flags = [*FLAGS, f"-I{onednn['include']}", f"-I{tc.blas_include}", SOURCE,
             f"-Wl,-rpath,{d}", f"-L{d}", "-l:libdnnl.so.3"] + tc.link_args()
    # named after its command: another oneDNN (--onednn-root) or compiler gets its own build
    tag = hashlib.sha256("\0".join([tc.cxx, *flags]).encode()).hexdigest()[:12]
    out = os.path.join(build_dir, f"bf16_gemm_probe-{tag}.so")
    cmd = [tc.cxx, *flags[:len(FLAGS) + 3], "-o", out, *flags[len(FLAGS) + 3:]]
    if not os.path.exists(out) or os.path.getmtime(out) < os.path.getmtime(SOURCE):
        t = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"compile failed:\n{' '.join(cmd)}\n{r.stderr}")
        print(f"compiled {out} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    return out, cmd


def cpu_info() -> dict:
    info = {"platform": platform.platform()}
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        info["model"] = re.search(r"model name\s*:\s*(.*)", text).group(1)
        flags = re.search(r"flags\s*:\s*(.*)", text).group(1).split()
        info["flags"] = [x for x in flags if re.match(r"(avx512|amx|avx_vnni|fma|avx2)", x)]
        info["cpus"] = os.cpu_count()
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for key in ("Vendor ID", "CPU family", "Model", "Stepping", "L2 cache", "L3 cache", "Hypervisor vendor"):
            m = re.search(rf"^{key}:\s*(.*)$", lscpu, re.M)
            if m:
                info[key] = m.group(1).strip()
    except (OSError, AttributeError):
        pass
    return info


# -- child: measure every case once ----------------------------------------------------------------
def torch_time(torch, c: dict, min_iters: int, max_iters: int, min_time: float) -> dict:
    def strided(rows, cols, s):
        size = 1 + (c["b0"] - 1) * s[0] + (c["b1"] - 1) * s[1] + (rows - 1) * s[2] + (cols - 1) * s[3]
        flat = torch.empty(size, dtype=torch.bfloat16).uniform_(-1, 1)
        if c["b0"] * c["b1"] == 1:
            return torch.as_strided(flat, (rows, cols), (s[2], s[3]))
        return torch.as_strided(flat, (c["b0"], c["b1"], rows, cols), tuple(s))

    a, b = strided(c["m"], c["k"], c["as"]), strided(c["k"], c["n"], c["bs"])
    shape = (c["m"], c["n"]) if c["b0"] * c["b1"] == 1 else (c["b0"], c["b1"], c["m"], c["n"])
    out = torch.empty(shape, dtype=torch.bfloat16)
    if c["epi"] == "bias":
        bias = torch.empty(c["n"], dtype=torch.bfloat16).uniform_(-1, 1)
        call = lambda: torch.addmm(bias, a, b, out=out)  # noqa: E731 - what F.linear runs for 2-D input
    else:
        call = lambda: torch.matmul(a, b, out=out)  # noqa: E731
    t0 = time.perf_counter()
    call()
    first = time.perf_counter() - t0
    call()
    call()
    ts = []
    while len(ts) < max_iters and (len(ts) < min_iters or sum(ts) < min_time):
        t0 = time.perf_counter()
        call()
        ts.append(time.perf_counter() - t0)
    ref = torch.matmul(a.float(), b.float())
    if c["epi"] == "bias":
        ref = ref + bias.float()
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    return {"median_s": statistics.median(ts), "min_s": min(ts), "iters": len(ts), "first_exec_ms": 1e3 * first,
            "max_rel_err": err, "status": 0, "impl": "torch.addmm" if c["epi"] == "bias" else "torch.matmul"}


def child(args) -> None:
    import torch  # first: its libgomp is the process's OpenMP runtime
    torch.set_num_threads(args.threads)
    lib = ctypes.CDLL(args.lib)
    lib.probe_run.argtypes = [ctypes.POINTER(Spec), ctypes.POINTER(Result)]
    lib.probe_versions.restype = ctypes.c_char_p
    lib.probe_peak.restype = ctypes.c_double
    lib.probe_peak.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_double]
    libc = ctypes.CDLL(None)
    with open(args.cases) as f:
        todo = json.load(f)
    res = {"versions": lib.probe_versions().decode(), "torch": torch.__version__,
           "torch_threads": torch.get_num_threads(), "loadavg_start": os.getloadavg(), "results": {}}
    cfg = torch.__config__.show()
    m = re.search(r"(Intel\(R\) MKL-DNN v[\d.]+[^\n]*)", cfg)
    res["torch_onednn"] = m.group(1).strip() if m else None
    m = re.search(r"(Intel\(R\) oneAPI Math Kernel Library Version[^\n]*)", cfg)
    res["torch_mkl"] = m.group(1).strip() if m else None
    # register-only instruction peaks (GFLOP/s): 512-bit float32 FMA and VDPBF16PS, one core and all threads
    if args.peak:
        res["peak_gflops"] = {f"{name} x{t}": lib.probe_peak(kind, t, 0.2)
                              for name, kind in (("fma_f32", 0), ("dpbf16", 1)) for t in (1, args.threads)}
    for c in todo:
        if args.verbose:
            print(f"PROBE_CASE {c['id']}", flush=True)
        if c["lib"] == "torch":
            r = torch_time(torch, c, args.min_iters, args.max_iters, args.min_time)
        else:
            s = Spec(LIBS[c["lib"]], EPIS[c["epi"]], int(c["out"] == "bf16"), int(c["packed"]), c["b0"], c["b1"],
                     c["m"], c["n"], c["k"], (ctypes.c_long * 4)(*c["as"]), (ctypes.c_long * 4)(*c["bs"]),
                     (ctypes.c_long * 4)(*c["cs"]), args.min_iters, args.max_iters, args.min_time)
            out = Result()
            lib.probe_run(ctypes.byref(s), ctypes.byref(out))
            r = {k: getattr(out, k) for k, _ in Result._fields_}
            r["impl"], r["msg"] = out.impl.decode(), out.msg.decode()
        if args.verbose:
            libc.fflush(None)
            print(f"PROBE_END {c['id']}", flush=True)
        res["results"][c["id"]] = r
    res["loadavg_end"] = os.getloadavg()
    with open("/proc/self/maps") as f:
        res["mapped"] = sorted({ln.split()[-1] for ln in f if re.search(r"(gomp|iomp|tbb|dnnl|mkl|sycl)[^/]*\.so",
                                                                      ln.split()[-1])})
    with open(args.out, "w") as f:
        json.dump(res, f)


# -- parent ---------------------------------------------------------------------------------------
def run_child(exe_args: list[str], isa: str, threads: int, verbose: bool) -> tuple[dict, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), **ISAS[isa])
    for k in ("ONEDNN_VERBOSE", "DNNL_VERBOSE", "MKL_VERBOSE"):
        env.pop(k, None)
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        path = tmp.name
    if verbose:  # also: which library each BLAS/OpenMP symbol of the probe and of oneDNN binds to
        env.update(ONEDNN_VERBOSE="1", MKL_VERBOSE="1", LD_DEBUG="bindings", LD_DEBUG_OUTPUT=path + ".ld")
    try:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--out", path, *exe_args],
                           env=env, capture_output=True, text=True)
        if p.returncode:
            raise SystemExit(f"child ({isa}) failed:\n{p.stderr[-4000:]}")
        with open(path) as f:
            res = json.load(f)
        if verbose:
            res["bindings"] = bindings(path + ".ld")
        return res, p.stdout
    finally:
        for f in [path] + [os.path.join(os.path.dirname(path), x) for x in os.listdir(os.path.dirname(path))
                           if x.startswith(os.path.basename(path) + ".ld")]:
            if os.path.exists(f):
                os.unlink(f)


def bindings(prefix: str) -> list[str]:
    """'probe -> library: symbol' for the BLAS and OpenMP entry points, from LD_DEBUG=bindings logs."""
    want = re.compile(r"binding file (\S+) \[\d+\] to (\S+) \[\d+\]: normal symbol `(cblas_gemm_bf16bf16f32|"
                      r"cblas_sgemm|GOMP_parallel|omp_get_max_threads|dnnl_primitive_execute)'")
    found = set()
    folder, base = os.path.dirname(prefix), os.path.basename(prefix)
    for name in os.listdir(folder):
        if name.startswith(base):
            with open(os.path.join(folder, name), errors="replace") as f:
                for ln in f:
                    m = want.search(ln)
                    if m and ("probe" in m.group(1) or "dnnl" in m.group(1) or "mkl" in m.group(1)):
                        found.add(f"{os.path.basename(m.group(1))} -> {m.group(2)}: {m.group(3)}")
    return sorted(found)


def parse_verbose(stdout: str) -> dict:
    """case id -> {'onednn': [impl, ...], 'mkl': [...]} from a verbose child's output."""
    out, cur = {}, None
    for ln in stdout.splitlines():
        if ln.startswith("PROBE_CASE "):
            cur = ln[len("PROBE_CASE "):]
            out[cur] = {"onednn": [], "mkl": []}
        elif ln.startswith("PROBE_END "):
            cur = None
        elif cur and ln.startswith(("onednn_verbose", "dnnl_verbose")):
            f = ln.split(",")
            for i in range(len(f) - 2):
                if f[i] == "exec" and f[i + 1] == "cpu":
                    out[cur]["onednn"].append(f"{f[i + 2]}:{f[i + 3]}")
                    break
        elif cur and ln.startswith("MKL_VERBOSE") and "NThr" in ln:
            w = ln.split()
            out[cur]["mkl"].append(" ".join([w[1].split("(")[0]] + [x for x in w if x.startswith("NThr")]))
    header = [ln for ln in stdout.splitlines() if ln.startswith("MKL_VERBOSE") and "NThr" not in ln]
    info = [ln for ln in stdout.splitlines() if ln.startswith(("onednn_verbose,info", "onednn_verbose,v1,info"))]
    return {"cases": {k: {kk: sorted(set(vv)) for kk, vv in v.items()} for k, v in out.items()},
            "mkl_header": sorted(set(header))[:4], "onednn_info": info[:12]}


def busy_fraction(seconds: float = 1.0) -> float:
    """Fraction of all CPUs busy over ``seconds`` (from /proc/stat): what else runs on the machine."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]
    t0, i0 = sample()
    time.sleep(seconds)
    t1, i1 = sample()
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def wait_quiet(threshold: float, max_wait: float) -> tuple[float, float]:
    """Wait (up to ``max_wait`` s) until the machine is less than ``threshold`` busy; (busy, waited)."""
    t = time.time()
    while True:
        b = busy_fraction()
        if b < threshold or time.time() - t > max_wait:
            return b, time.time() - t
        time.sleep(4)


def _cpu_counters() -> tuple[float, float, float]:
    """(wall time, busy CPU seconds of the machine, CPU seconds of this process's finished children)."""
    import resource
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.time(), (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK"), ru.ru_utime + ru.ru_stime


def _foreign(before: tuple[float, float, float]) -> dict:
    """What else ran while a child ran: busy CPU time not spent by the child, as a fraction of all CPUs."""
    after = _cpu_counters()
    wall, busy, mine = (a - b for a, b in zip(after, before))
    return {"wall_s": wall, "foreign_load": max(0.0, (busy - mine) / (wall * os.cpu_count()))}


def summarize(report: dict, all_cases: list[dict], isas: list[str], max_foreign: float) -> None:
    """Per ISA and case: the median over the clean rounds (other processes used at most ``max_foreign``
    of the CPUs meanwhile), or over every round when fewer than 3 are clean (then ``disturbed``)."""
    for isa in isas:
        mine = [r for r in report["rounds"] if r["isa"] == isa]
        summ = {}
        for c in all_cases:
            rows = [r for r in mine if c["id"] in r["results"]]
            if not rows:
                continue
            ok = [r for r in rows if r["foreign_load"] <= max_foreign]
            use = ok if len(ok) >= 3 else rows
            rs = [r["results"][c["id"]] for r in use if r["results"][c["id"]].get("status") == 0]
            if not rs:
                r0 = rows[0]["results"][c["id"]]
                summ[c["id"]] = {"status": r0.get("status"), "msg": r0.get("msg", "")}
                continue
            med = statistics.median(r["median_s"] for r in rs)
            summ[c["id"]] = {
                "shape": c["shape"], "variant": c["variant"], "flop": c["flop"], "median_s": med,
                "tflops_median": tflops(c, med), "tflops_rounds": [tflops(c, r["median_s"]) for r in rs],
                "tflops_best": tflops(c, min(r["min_s"] for r in rs)), "rounds_used": len(rs),
                "disturbed": len(ok) < 3, "max_rel_err": max(r["max_rel_err"] for r in rs),
                "impl": rs[0].get("impl", ""), "msg": rs[0].get("msg", ""),
                **{k: statistics.median(r[k] for r in rs) for k in
                   ("create_ms", "create_again_ms", "first_exec_ms", "prep_ms", "prep_f32_ms") if k in rs[0]}}
        report["summary"][isa] = summ
        peaks = [r for r in mine if r.get("peak_gflops")]
        ok = [r for r in peaks if r["foreign_load"] <= max_foreign] or peaks
        if ok:
            report["summary"][isa + ":peak_gflops"] = {
                k: statistics.median(r["peak_gflops"][k] for r in ok) for k in ok[0]["peak_gflops"]}
    report["versions"] = report["rounds"][0]["versions"] if report["rounds"] else None
    report["torch_onednn"] = report["rounds"][0].get("torch_onednn") if report["rounds"] else None


def tflops(c: dict, seconds: float | None) -> float | None:
    return None if not seconds else c["flop"] / seconds / 1e12


def print_table(all_cases: list[dict], summary: dict, isas: list[str]) -> None:
    shapes = list(dict.fromkeys(c["shape"] for c in all_cases))
    for shape in shapes:
        print(f"\n{shape}")
        print(f"  {'variant':34s}" + "".join(f"{isa:>12s}" for isa in isas) + "   impl (first ISA) / note")
        for c in (c for c in all_cases if c["shape"] == shape):
            row = f"  {c['variant']:34s}"
            note = ""
            for isa in isas:
                s = summary[isa].get(c["id"], {})
                t = s.get("tflops_median")
                row += (f"{t:11.3f}" + ("*" if s.get("disturbed") else " ")) if t else f"{'n/a':>12s}"
                if isa == isas[0]:
                    note = s.get("impl", "") or s.get("msg", "")
                    if s.get("max_rel_err") is not None and s["max_rel_err"] > 2e-2:
                        note += f"  ERR {s['max_rel_err']:.2g}"
            print(row + "   " + note)


def print_markdown(all_cases: list[dict], summary: dict, isas: list[str]) -> None:
    """One row per case: median TFLOP/s per ISA (``*``: fewer than 3 clean rounds)."""
    print("| shape | variant | " + " | ".join(isas) + " | implementation |")
    print("|---|---|" + "---:|" * len(isas) + "---|")
    for c in all_cases:
        cells = []
        for isa in isas:
            s = summary[isa].get(c["id"], {})
            t = s.get("tflops_median")
            cells.append(f"{t:.2f}" + ("*" if s.get("disturbed") else "") if t else "n/a")
        s0 = summary[isas[0]].get(c["id"], {})
        impl = " / ".join(dict.fromkeys(summary[i].get(c["id"], {}).get("impl", "") for i in isas)) or s0.get("msg", "")
        print(f"| {c['shape']} | {c['variant']} | " + " | ".join(cells) + f" | {impl} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="clean rounds wanted per ISA (see --max-foreign)")
    ap.add_argument("--max-rounds", type=int, default=12, help="give up after this many rounds per ISA")
    ap.add_argument("--max-foreign", type=float, default=0.1,
                    help="a round is clean when other processes used at most this fraction of the CPUs meanwhile")
    ap.add_argument("--isas", default="amx,avx512bf16", help=f"comma-separated, of {','.join(ISAS)}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--ff", type=int, default=3072)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--only", default=None, help="regex: measure only cases whose id matches")
    ap.add_argument("--min-iters", type=int, default=10)
    ap.add_argument("--max-iters", type=int, default=400)
    ap.add_argument("--min-time", type=float, default=0.1, help="seconds of timed calls per case (at least)")
    ap.add_argument("--quick", action="store_true", help="1 round, 3 iterations per case (a smoke test)")
    ap.add_argument("--no-verbose-pass", action="store_true")
    ap.add_argument("--quiet-threshold", type=float, default=0.15,
                    help="before each child, wait until the CPUs are less busy than this (fraction, 1 s sample)")
    ap.add_argument("--quiet-wait", type=float, default=600, help="the longest wait for that, seconds (0: never)")
    ap.add_argument("--onednn-root", default=None)
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build", "bf16_gemm_probe"))
    ap.add_argument("--json", default="bf16_gemm_probe.json")
    ap.add_argument("--from-json", metavar="PATH", help="print the table of an earlier run's JSON; measure nothing")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown (median TFLOP/s)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--verbose", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--peak", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--lib", help=argparse.SUPPRESS)
    ap.add_argument("--cases", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    if args.from_json:
        with open(args.from_json) as f:
            data = json.load(f)
        for report in data.get("runs", [data]):  # a run's JSON, or several runs' summaries (docs/data/)
            isas = [k for k in report["isa_env"]]
            shown = cases(**report["problem"])
            if args.only:
                shown = [c for c in shown if re.search(args.only, c["id"])]
            shown = [c for c in shown if any(c["id"] in report["summary"].get(i, {}) for i in isas)]
            (print_markdown if args.markdown else print_table)(shown, report["summary"], isas)
        return None
    if args.quick:
        args.rounds, args.max_rounds, args.min_iters, args.max_iters, args.min_time = 1, 1, 3, 3, 0.0
        args.quiet_wait = 0
    isas = args.isas.split(",")
    for isa in isas:
        if isa not in ISAS:
            raise SystemExit(f"unknown ISA {isa!r}: one of {', '.join(ISAS)}")
    onednn = find_onednn(args.onednn_root)
    so, cmd = build(onednn, args.build_dir)
    all_cases = cases(args.batch, args.seq, args.hidden, args.ff, args.heads)
    if args.only:
        all_cases = [c for c in all_cases if re.search(args.only, c["id"])]
    groups = list(dict.fromkeys(c["group"] for c in all_cases))
    case_files = {}
    for g in groups + ["all"]:
        case_files[g] = os.path.join(args.build_dir, f"cases-{g}.json")
        with open(case_files[g], "w") as f:
            json.dump([c for c in all_cases if g in ("all", c["group"])], f)
    common = ["--lib", so, "--threads", str(args.threads), "--min-iters", str(args.min_iters),
              "--max-iters", str(args.max_iters), "--min-time", str(args.min_time)]
    report = {"cpu": cpu_info(), "onednn": onednn, "compile": cmd, "threads": args.threads,
              "problem": {"batch": args.batch, "seq": args.seq, "hidden": args.hidden, "ff": args.ff,
                          "heads": args.heads},
              "isa_env": {isa: ISAS[isa] for isa in isas}, "rounds": [], "verbose": {}, "summary": {}}
    try:
        from importlib.metadata import version
        report["packages"] = {p: version(p) for p in ("torch", "mkl", "mkl-devel")}
        for p in ("onednn-cpu-gomp", "onednn-devel-cpu-gomp"):
            try:
                report["packages"][p] = version(p)
            except Exception:  # noqa: BLE001 - oneDNN from --onednn-root, outside this environment
                pass
    except Exception:  # noqa: BLE001
        pass
    if not args.no_verbose_pass:
        vcommon = common[:]
        vcommon[vcommon.index("--min-iters") + 1] = "1"
        vcommon[vcommon.index("--max-iters") + 1] = "1"
        vcommon[vcommon.index("--min-time") + 1] = "0"
        for isa in isas:
            res, stdout = run_child(vcommon + ["--verbose", "--cases", case_files["all"]], isa, args.threads, True)
            report["verbose"][isa] = parse_verbose(stdout)
            report["verbose"][isa]["mapped"] = res["mapped"]
            report["verbose"][isa]["bindings"] = res.get("bindings", [])
            print(f"[verbose {isa}] mapped: {', '.join(os.path.basename(p) for p in res['mapped'])}", file=sys.stderr)
    t_start = time.time()

    def clean(isa, group):
        return [r for r in report["rounds"] if r["isa"] == isa and r["group"] == group
                and r["foreign_load"] <= args.max_foreign]

    for attempt in range(args.max_rounds):
        if all(len(clean(isa, g)) >= args.rounds for isa in isas for g in groups):
            break
        for g in groups:
            for isa in (isas if attempt % 2 == 0 else isas[::-1]):
                if len(clean(isa, g)) >= args.rounds:
                    continue
                busy, waited = wait_quiet(args.quiet_threshold, args.quiet_wait) if args.quiet_wait > 0 else (None, 0)
                before = _cpu_counters()
                extra = ["--peak"] if g == groups[0] else []
                res, _ = run_child(common + ["--cases", case_files[g]] + extra, isa, args.threads, False)
                res.update(isa=isa, group=g, round=attempt, busy_before=busy, waited_s=waited, **_foreign(before))
                report["rounds"].append(res)
                print(f"round {attempt + 1} {g} {isa}: {res['wall_s']:.0f} s after {waited:.0f} s waiting; foreign "
                      f"load {res['foreign_load']:.2f} ({len(clean(isa, g))} clean of {args.rounds} wanted)",
                      file=sys.stderr, flush=True)
        report["elapsed_s"] = time.time() - t_start
        summarize(report, all_cases, isas, args.max_foreign)
        with open(args.json + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(args.json + ".tmp", args.json)
    used = {isa: f"{min(len(clean(isa, g)) for g in groups)}-{max(len(clean(isa, g)) for g in groups)} clean"
            for isa in isas}
    print(f"# {report['cpu'].get('model')}; {report['versions']}; torch {report['rounds'][0]['torch']} "
          f"({report['torch_onednn']}); {args.threads} threads; median TFLOP/s over rounds {used}")
    for isa in isas:
        print(f"# instruction peak, GFLOP/s ({isa} round): " + ", ".join(
            f"{k} {v:.0f}" for k, v in report["summary"].get(isa + ":peak_gflops", {}).items()))
    print("# *: fewer than 3 clean rounds (other processes used over --max-foreign of the CPUs): median over all rounds")
    print_table(all_cases, report["summary"], isas)
    print(f"\nJSON: {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
