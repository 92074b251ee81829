"""Machine probes: the copy bandwidth, the GEMM rate and the FMA peak measured on this machine, and
the facts benchmarks record with every figure (CPU model, vector ISA, threads, versions).

Units: bytes, bytes/s, flop/s, seconds."""
from __future__ import annotations

import functools
import glob
import os
import platform
import statistics
import time

from ..backends.cpu.build import build_library
from ..backends.cpu.gemm_libraries import FP32_GEMM_LIBRARIES, check_fp32_gemm
from ..resources import csrc_file

__all__ = ["EPILOGUES", "CopyTimer", "copy_bandwidth", "fma_peak", "gemm_rate", "gemm_seconds", "machine_info",
           "openmp_threads"]


def _l3_bytes() -> int:
    """The largest CPU cache in bytes (from sysfs), 32 MiB when unknown."""
    best = 0
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(path) as f:
                text = f.read().strip()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
            best = max(best, int(text.rstrip("KkMmGg")) * mult)
        except (OSError, ValueError):
            continue
    return best or 32 << 20


class CopyTimer:
    """Times one STREAM-like copy ``dst.copy_(src)`` (torch, all threads) of float64 buffers per call.

    Buffers are ``buffer_bytes`` each (default 4x the largest cache, at least 64 MiB); two untimed
    copies at construction touch every page.
    """

    def __init__(self, buffer_bytes: int | None = None):
        import torch

        n = int(buffer_bytes or max(4 * _l3_bytes(), 64 << 20)) // 8
        self.buffer_bytes = n * 8
        self._src = torch.ones(n, dtype=torch.float64)
        self._dst = torch.empty_like(self._src)
        self._dst.copy_(self._src)
        self._dst.copy_(self._src)
        self.seconds: list[float] = []

    def __call__(self) -> None:
        t0 = time.perf_counter()
        self._dst.copy_(self._src)
        self.seconds.append(time.perf_counter() - t0)

    def bandwidth(self) -> float:
        """Bytes/s of the median timed copy, counting read + write = 2 x buffer bytes as STREAM does."""
        return 2 * self.buffer_bytes / statistics.median(self.seconds)


def copy_bandwidth(buffer_bytes: int | None = None, repeats: int = 10) -> tuple[float, int]:
    """STREAM-like copy bandwidth: median over ``repeats`` of ``dst.copy_(src)`` (torch, all threads).

    Args:
        buffer_bytes: bytes per buffer; default 4x the largest cache (at least 64 MiB).
        repeats: timed copies (two untimed ones come first).

    Returns:
        (bytes/s, counting read + write = 2 x buffer bytes per copy as STREAM does; buffer bytes).

    Raises:
        ValueError: ``repeats`` < 1.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    timer = CopyTimer(buffer_bytes)
    for _ in range(repeats):
        timer()
    return timer.bandwidth(), timer.buffer_bytes


@functools.lru_cache(maxsize=None)
def _probe_library():
    """The machine-probe library (``csrc/substation_probe.cpp``), built through the build cache."""
    import ctypes


    with open(csrc_file("substation_probe.cpp")) as f:
        lib = ctypes.CDLL(build_library(f.read(), "probe").path)
    lib.substation_probe_gemm_seconds.restype = ctypes.c_double
    lib.substation_probe_gemm_seconds.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_int32] * 3
    lib.substation_probe_fma_flops.restype = ctypes.c_double
    lib.substation_probe_fma_flops.argtypes = [ctypes.c_int64, ctypes.c_int32]
    return lib


@functools.lru_cache(maxsize=None)
def _onednn_probe_library():
    """The oneDNN matmul probes (``csrc/substation_probe_onednn.cpp``: bf16 and float32), built through the cache."""
    import ctypes

    with open(csrc_file("substation_probe_onednn.cpp")) as f:
        lib = ctypes.CDLL(build_library(f.read(), "probe-onednn", with_onednn=True).path)
    for name in ("substation_probe_matmul_bf16_seconds", "substation_probe_matmul_f32_seconds"):
        getattr(lib, name).restype = ctypes.c_double
        getattr(lib, name).argtypes = [ctypes.c_int64] * 3 + [ctypes.c_int32] * 3
    return lib


def _probe_dtype(dtype: str, allowed=("float32", "float64")) -> int:
    if dtype not in allowed:
        raise ValueError(f"dtype must be one of {', '.join(allowed)}, got {dtype!r}")
    return int(dtype == "float64")


def openmp_threads() -> int:
    """The OpenMP thread count that the generated code and the probes run with now (``omp_get_max_threads``
    of their runtime, which ``torch.set_num_threads`` and :func:`~substation.perf.timing.set_substation_threads`
    set).

    Raises:
        ToolchainError, BuildError: the probe library cannot be built.
    """
    return int(_probe_library().omp_get_max_threads())


#: What may follow a probed GEMM (:func:`gemm_seconds`): nothing, a bias [n], or the bias and GELU (erf).
EPILOGUES = ("", "bias", "bias_gelu")


def gemm_seconds(shapes, fp32_gemm: str = "mkl", repeats: int = 2, dtype: str = "float32",
                 packed_weights: bool = False, epilogues=None) -> list[float]:
    """Seconds of each of ``shapes`` (``(m, n, k)`` tuples): the fastest of ``repeats`` row-major
    ``C[m, n] = A[m, k] W[n, k]^T`` calls (W stored as a PyTorch ``Linear`` weight, as the layers store
    theirs) of the library the generated code calls, on its OpenMP threads, after one untimed call.
    ``float32``: MKL's ``cblas_sgemm`` (``fp32_gemm="mkl"``) or oneDNN's float32 matmul as builds call
    it (``"onednn"``: ``ss::matmul<float>``, k summed in chunks of 512, fewer than 256 rows on MKL);
    ``float64``: ``cblas_dgemm``; ``bfloat16``: oneDNN's bf16 matmul (bf16 in and out).
    ``packed_weights`` (oneDNN's calls only): W is read from its packed copy, as inference builds read
    their weights (each call digests W; the untimed call packs it). ``epilogues`` (float32 and
    bfloat16; None: none): per shape, one of :data:`EPILOGUES`, timed with the call: oneDNN adds it in
    the matmul's epilogue (a bias, a GELU post-op), MKL in one pass over C after the SGEMM, on all
    threads (``ss::gelu``), as the element-wise kernel after such a GEMM does (BA).

    Raises:
        ValueError: another dtype or ``fp32_gemm`` (a library, not ``"auto"``), no shapes, a size < 1,
            ``repeats`` < 1, or ``epilogues`` not one of :data:`EPILOGUES` per shape (none for float64).
        ToolchainError, BuildError: the probe library cannot be built.
        RuntimeError: oneDNN refused a call.
    """
    use_double = _probe_dtype(dtype, ("float32", "float64", "bfloat16"))
    check_fp32_gemm(fp32_gemm, FP32_GEMM_LIBRARIES)
    shapes = [tuple(int(v) for v in s) for s in shapes]
    if not shapes or any(len(s) != 3 or min(s) < 1 for s in shapes) or repeats < 1:
        raise ValueError(f"need shapes of (m, n, k) >= 1 and repeats >= 1, got {shapes} and {repeats}")
    epilogues = [""] * len(shapes) if epilogues is None else list(epilogues)
    if len(epilogues) != len(shapes) or any(e not in EPILOGUES for e in epilogues) or (use_double and any(epilogues)):
        raise ValueError(f"epilogues must give one of {EPILOGUES} per shape ({len(shapes)}; float64: none), "
                         f"got {epilogues}")
    codes = [EPILOGUES.index(e) for e in epilogues]
    if dtype == "bfloat16" or (dtype == "float32" and fp32_gemm == "onednn"):
        probe = getattr(_onednn_probe_library(), f"substation_probe_matmul_{'bf16' if dtype == 'bfloat16' else 'f32'}"
                                                 "_seconds")
        seconds = [probe(m, n, k, repeats, int(packed_weights), e) for (m, n, k), e in zip(shapes, codes)]
        if min(seconds) < 0:
            raise RuntimeError(f"oneDNN refused a {dtype} matmul of the shapes {shapes}")
        return seconds
    lib = _probe_library()
    return [lib.substation_probe_gemm_seconds(m, n, k, repeats, use_double, e) for (m, n, k), e in zip(shapes, codes)]


def gemm_rate(dtype: str = "float32", shapes=((2048, 2048, 2048),), repeats: int = 5, fp32_gemm: str = "mkl",
              packed_weights: bool = False) -> float:
    """The GEMM rate in flop/s of the library the generated code calls (:func:`gemm_seconds`, weights
    read from packed copies with ``packed_weights``, as inference builds on oneDNN read them): the best
    over ``shapes`` of 2 m n k / seconds.

    Raises:
        as :func:`gemm_seconds`.
    """
    shapes = [tuple(int(v) for v in s) for s in shapes]
    seconds = gemm_seconds(shapes, fp32_gemm, repeats, dtype, packed_weights)
    return max(2.0 * m * n * k / s for (m, n, k), s in zip(shapes, seconds))


def fma_peak(dtype: str = "float32", iterations: int = 30_000_000, repeats: int = 3) -> float:
    """The cores' fused-multiply-add peak in flop/s (2 flop per FMA lane), the best of ``repeats``
    runs in which every OpenMP thread runs 12 independent chains of ``iterations`` FMAs on the widest
    vectors of the build (AVX-512, AVX2 or scalar); an upper bound for any GEMM of ``dtype`` on
    these threads.

    Raises:
        ValueError: another dtype, ``iterations`` < 1 or ``repeats`` < 1.
        ToolchainError, BuildError: the probe library cannot be built.
    """
    use_double = _probe_dtype(dtype)
    if iterations < 1 or repeats < 1:
        raise ValueError(f"need iterations >= 1 and repeats >= 1, got {iterations} and {repeats}")
    return max(_probe_library().substation_probe_fma_flops(iterations, use_double) for _ in range(repeats))


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
