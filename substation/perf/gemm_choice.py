"""The library of float32 inference builds' token-wise GEMMs, measured per machine (``fp32_gemm="auto"``).

Which float32 GEMM is faster depends on the CPU: on AMD Zen 4 oneDNN's matmul ran MiniLM's token-wise
GEMMs 1.17-1.19x faster than MKL's SGEMM at 256 to 3584 rows (docs/toolchain.md, "float32 GEMMs"),
elsewhere MKL may win. With ``fp32_gemm="auto"`` (the default) an inference build takes the library
that :func:`choose_fp32_gemm` measured faster on this machine for the layer's shape; training builds
keep MKL, whose weight gradients carry PyTorch float32's error (oneDNN's reached 2.2x of it, the
chunked inner sums of ``ss::matmul<float>`` do not reach GEMMs whose k is the token count).

The measurement: a discarded round, then :data:`ROUNDS` rounds, each timing both libraries (the
first alternating) on the layer's token-wise GEMMs at :data:`ROWS` token rows (Q, K, V and out_proj:
I x I, linear1: U x I, linear2: I x U) with what each library's build runs at once after them
(:data:`EPILOGUES`: on oneDNN the biases of out_proj, linear1 and linear2 and linear1's GELU in the
call's epilogue; on MKL linear1's bias and GELU as a pass of their own, the other biases inside the
memory-bound kernels that follow), the fastest of two calls per GEMM
(:func:`~substation.perf.probes.gemm_seconds`: the weights stored as PyTorch stores them, oneDNN's
read from their packed copies as inference builds read them), summed over the GEMMs. oneDNN is
chosen only when it won significantly many rounds (one-sided sign test at 5%,
:func:`~substation.perf.timing.sign_test_wins`) and its median sum is at least :data:`MIN_GAIN` below
MKL's: a small or inconsistent lead keeps MKL.
The choice is recorded per CPU, OpenMP thread count, library versions and (I, U) in
``<build cache>/tune/fp32-gemm-<key>.json`` (written atomically) and measured once, by one process at
a time, unless other work held the cores while it measured (:data:`MIN_OCCUPANCY`: then the process
keeps its choice and a later process measures again); ``SUBSTATION_FP32_GEMM=mkl`` or ``onednn`` in
the environment fixes the inference builds' library instead (reproducible runs, a machine whose record
is wrong); training builds call MKL either way.

Units: seconds.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import statistics
import time
import warnings

from ..backends.cpu.build import TUNE_FOLDER, BuildError, ToolchainError, cache_dir, cpu_id, onednn, toolchain
from ..backends.cpu.gemm_libraries import FP32_GEMM_LIBRARIES, check_fp32_gemm
from ..files import atomic_write_text
from ..version import __version__
from . import probes
from .timing import sign_test_wins

__all__ = ["ROWS", "ROUNDS", "MIN_GAIN", "MIN_OCCUPANCY", "EPILOGUES", "ENVIRONMENT", "gemm_label", "fixed_fp32_gemm",
           "resolve_fp32_gemm", "choose_fp32_gemm"]

#: Token rows of the measured GEMMs: where inference batches spend their time (fewer than 256 rows go
#: to MKL in either library, substation_dnnl.h).
ROWS = 1024
#: Paired rounds of the measurement.
ROUNDS = 9
#: oneDNN's median time must be at least this fraction below MKL's.
MIN_GAIN = 0.03
#: The environment variable that fixes float32 inference builds' library under ``"auto"``.
ENVIRONMENT = "SUBSTATION_FP32_GEMM"
#: The least share of the measurement's wall time times its threads that the process must have run on
#: the cores (CPU seconds over wall seconds x threads, :func:`_process_seconds`) for the choice to be
#: recorded: below it other work held the cores, and the process keeps its choice without recording it.
MIN_OCCUPANCY = 0.8
#: Records of another format (measured on other calls) are measured again.
RECORD_FORMAT = "substation-fp32-gemm/3"
#: Per library, what a float32 inference build computes with each of :func:`_shapes`' GEMMs before
#: anything else reads its result (:data:`~substation.perf.probes.EPILOGUES`). Both add Q, K and V's
#: biases inside the attention kernel. oneDNN builds add out_proj's, linear1's (with its GELU) and
#: linear2's in the matmul's epilogue (:mod:`substation.passes.epilogue`); MKL builds add out_proj's
#: and linear2's inside the norms that follow, at no extra pass, but linear1's bias and GELU in an
#: element-wise kernel of their own (BA).
EPILOGUES = {"mkl": ["", "", "", "", "bias_gelu", ""], "onednn": ["", "", "", "bias", "bias_gelu", "bias"]}


def gemm_label(library: str | None) -> str:
    """`` (<library> GEMMs)`` for result texts, naming MKL's share of a oneDNN build (calls under 256
    token rows); empty for None (no float32 GEMMs)."""
    if library is None:
        return ""
    return f" ({library} GEMMs{', MKL under 256 token rows' if library == 'onednn' else ''})"


def fixed_fp32_gemm() -> str | None:
    """The library ``$SUBSTATION_FP32_GEMM`` fixes for float32 inference builds with ``"auto"``, or None
    (unset or empty).

    Raises:
        ValueError: it is set to something else than a library.
    """
    fixed = os.environ.get(ENVIRONMENT)
    if fixed and fixed not in FP32_GEMM_LIBRARIES:
        raise ValueError(f"${ENVIRONMENT} must be one of {', '.join(FP32_GEMM_LIBRARIES)} (or unset), got {fixed!r}")
    return fixed or None


def resolve_fp32_gemm(fp32_gemm: str, config, mode: str) -> str:
    """The library a build of ``config`` in ``mode`` (``train`` or ``eval``) calls for ``fp32_gemm``: the
    library itself when one is named; for ``"auto"``: MKL for training builds and for builds that are not
    float32 CPU builds (which ignore the option); for float32 inference builds :func:`fixed_fp32_gemm`
    when set, else :func:`choose_fp32_gemm` of the layer's hidden and feed-forward sizes on the current
    OpenMP thread count (MKL, with a warning, where the probes that measure cannot be built).

    Raises:
        ValueError: an unknown ``fp32_gemm``, or ``$SUBSTATION_FP32_GEMM`` set to something else than a
            library (where it is read).
    """
    check_fp32_gemm(fp32_gemm)
    if fp32_gemm != "auto":
        return fp32_gemm
    if mode != "eval" or config.dtype != "float32" or config.target != "cpu":
        return "mkl"
    fixed = fixed_fp32_gemm()
    if fixed is not None:
        return fixed
    try:
        threads = probes.openmp_threads()
    except (BuildError, ToolchainError) as e:
        return _unmeasured(e)["library"]
    return choose_fp32_gemm(config.hidden_size, config.ffn_size, threads)["library"]


def _shapes(hidden: int, ffn: int) -> list[tuple[int, int, int]]:
    """(m, n, k) of a layer's token-wise GEMMs at :data:`ROWS` rows: Q, K, V, out_proj, linear1, linear2."""
    return [(ROWS, hidden, hidden)] * 4 + [(ROWS, ffn, hidden), (ROWS, hidden, ffn)]


def _record_path(hidden: int, ffn: int, threads: int) -> str:
    h = hashlib.sha256("\0".join([cpu_id(), str(threads), toolchain().blas_version, onednn().version, str(hidden),
                                  str(ffn), str(ROWS), __version__]).encode())
    return os.path.join(cache_dir(), TUNE_FOLDER, f"fp32-gemm-{h.hexdigest()[:16]}.json")


def _process_seconds() -> float:
    """CPU seconds of this process so far, all its threads (:func:`time.process_time`)."""
    return time.process_time()


def _measure(hidden: int, ffn: int, threads: int) -> dict:
    shapes = _shapes(hidden, ffn)
    for lib in FP32_GEMM_LIBRARIES:  # a first round, discarded: libraries and threads start up
        probes.gemm_seconds(shapes, lib, repeats=1, packed_weights=True, epilogues=EPILOGUES[lib])
    seconds = {lib: [] for lib in FP32_GEMM_LIBRARIES}
    wall, cpu = time.perf_counter(), _process_seconds()
    for r in range(ROUNDS):
        for lib in FP32_GEMM_LIBRARIES[r % 2:] + FP32_GEMM_LIBRARIES[:r % 2]:
            seconds[lib].append(sum(probes.gemm_seconds(shapes, lib, repeats=2, packed_weights=True,
                                                        epilogues=EPILOGUES[lib])))
    occupancy = (_process_seconds() - cpu) / ((time.perf_counter() - wall) * threads)
    wins = sum(o < m for o, m in zip(seconds["onednn"], seconds["mkl"]))
    median = {lib: statistics.median(s) for lib, s in seconds.items()}
    faster = wins >= sign_test_wins(ROUNDS) and median["onednn"] <= (1 - MIN_GAIN) * median["mkl"]
    return {"format": RECORD_FORMAT, "library": "onednn" if faster else "mkl", "rows": ROWS,
            "shapes": [list(s) for s in shapes], "epilogues": EPILOGUES, "seconds": seconds, "onednn_wins": wins,
            "rounds": ROUNDS, "speedup": median["mkl"] / median["onednn"], "threads": threads,
            "occupancy": occupancy, "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _read_record(path: str) -> dict | None:
    try:
        with open(path) as f:
            record = json.load(f)
        if record.get("format") == RECORD_FORMAT and record.get("library") in FP32_GEMM_LIBRARIES:
            return record
    except (OSError, ValueError, AttributeError):
        pass  # none yet, or unreadable: measure again
    return None


@contextlib.contextmanager
def _measuring_alone(path: str):
    """Hold an exclusive lock next to the record ``path`` (where the folder can be written): processes
    that start together measure one after the other, not against each other."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lock = open(path + ".lock", "a")
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _unmeasured(error: Exception) -> dict:
    """The record of a choice that could not be measured: MKL (no oneDNN build would work either)."""
    warnings.warn(f"float32 inference builds call MKL: the float32 GEMM libraries could not be measured "
                  f"({type(error).__name__}: {error}); ${ENVIRONMENT}=mkl says so without measuring", stacklevel=3)
    return {"format": RECORD_FORMAT, "library": "mkl", "unavailable": f"{type(error).__name__}: {error}"}


@functools.lru_cache(maxsize=None)
def choose_fp32_gemm(hidden: int, ffn: int, threads: int) -> dict:
    """The float32 GEMM library for layers of hidden size ``hidden`` (I) and feed-forward size ``ffn``
    (U) on this machine with ``threads`` OpenMP threads (the current count,
    :func:`~substation.perf.probes.openmp_threads`, which the measurement runs on): the record of an
    earlier measurement, else a new measurement (see the module docstring; about 1 s for
    all-MiniLM-L6-v2's sizes, 4 s for BERT-base's on 2 threads), recorded. Processes that find no record
    measure one at a time (a lock file next to the record); the later ones read the first one's record.

    Returns:
        The record: ``library`` (``"mkl"`` or ``"onednn"``), ``seconds`` (per library, each round's sum
        over ``shapes``, with their epilogues), ``onednn_wins`` of ``rounds``, ``speedup`` (MKL's median /
        oneDNN's), ``rows``, ``shapes`` ((m, n, k) lists), ``epilogues`` (:data:`EPILOGUES`),
        ``threads``, ``occupancy`` (the process's CPU seconds over the rounds' wall seconds x threads)
        and ``measured`` (local time). A measurement with ``occupancy`` under :data:`MIN_OCCUPANCY`
        (other work held the cores) is used by this process but not recorded, with a warning. Where
        oneDNN or a probe library cannot be built: ``library`` ``"mkl"`` and ``unavailable`` (why),
        with a warning, nothing recorded.

    Raises:
        BuildError: the build cache folder cannot be created. ValueError: a measurement is due and
            ``threads`` is not the current OpenMP thread count.
    """
    try:
        onednn()
    except ToolchainError as e:
        return _unmeasured(e)
    path = _record_path(hidden, ffn, threads)
    record = _read_record(path)
    if record is not None:
        return record
    with _measuring_alone(path):
        record = _read_record(path)  # measured by another process while this one waited
        if record is not None:
            return record
        try:
            running = probes.openmp_threads()
            if threads != running:
                raise ValueError(f"choose_fp32_gemm(threads={threads}) measures on the current OpenMP thread count, "
                                 f"{running}; set it first (torch.set_num_threads({threads}))")
            record = _measure(hidden, ffn, threads)
        except (BuildError, ToolchainError, RuntimeError) as e:
            return _unmeasured(e)
        if record["occupancy"] < MIN_OCCUPANCY:
            warnings.warn(f"float32 inference builds call {record['library']}: the float32 GEMM libraries were "
                          f"measured while other work held the cores (the measurement ran "
                          f"{record['occupancy']:.0%} of its time x {threads} threads); this process keeps the "
                          f"choice, a later one measures again", stacklevel=3)
            return record
        try:
            atomic_write_text(path, json.dumps(record, indent=1))
        except OSError:
            pass  # a read-only cache: this process keeps its measurement
    return record
