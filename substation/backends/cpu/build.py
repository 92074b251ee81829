"""Compiling generated C++ into shared libraries, with an atomic on-disk build cache.

A build is keyed by everything that changes the machine code: the generated source, the runtime
header, the compiler's version, the flags, the BLAS library and the CPU. An entry is a folder
``<cache>/<key>/`` holding ``source.cpp``, ``lib.so`` and ``manifest.json`` (with the library's
SHA-256). It is assembled in a private temporary folder and published with one ``rename``, so a
killed or failed build leaves nothing that is later loaded; two processes building the same key
both succeed and share the first published entry; an entry whose library does not match its
manifest is discarded and rebuilt.
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from ...files import remove_path
from ...resources import csrc_dir, csrc_file
from ...version import __version__

__all__ = ["ToolchainError", "BuildError", "Toolchain", "OneDNN", "toolchain", "onednn", "cache_dir", "cache_path",
           "TUNE_FOLDER", "CUDA_KEY_PREFIX", "build_library", "build_libraries", "cpu_flags", "require_bf16_isa",
           "CacheEntry", "cache_entries", "prune_cache"]

#: -mprefer-vector-width=512: GCC's tuning for recent Xeons keeps auto-vectorized loops at 256 bits;
#: the compute-bound row kernels (GELU and its gradient) take 35-40% less time at 512 (docs/toolchain.md).
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-std=c++17", "-fopenmp", "-fPIC", "-shared",
         "-fno-math-errno", "-fno-trapping-math")


class ToolchainError(RuntimeError):
    """A compiler or library needed to build generated code is missing; the message says which."""


class BuildError(RuntimeError):
    """The compiler rejected generated code; the message holds the command and its output."""


@dataclasses.dataclass(frozen=True)
class Toolchain:
    """The C++ compiler and BLAS used for CPU builds.

    Attributes:
        cxx: compiler executable (``$CXX`` or ``g++``).
        cxx_version: first line of ``cxx --version``.
        blas_include: folder holding ``mkl_cblas.h``.
        blas_libs: absolute paths of the MKL libraries linked (LP64 interface, GNU OpenMP threading).
        blas_version: the MKL package version.
    """

    cxx: str
    cxx_version: str
    blas_include: str
    blas_libs: tuple[str, ...]
    blas_version: str

    def link_args(self) -> list[str]:
        """Linker arguments for MKL (rpath, library folders, versioned library files)."""
        dirs = sorted({os.path.dirname(p) for p in self.blas_libs})
        return ([f"-Wl,-rpath,{d}" for d in dirs] + [f"-L{d}" for d in dirs]
                + [f"-l:{os.path.basename(p)}" for p in self.blas_libs] + ["-lm", "-ldl", "-lpthread"])


@dataclasses.dataclass(frozen=True)
class OneDNN:
    """oneDNN, linked by bfloat16 CPU builds for their contractions (docs/toolchain.md).

    Attributes:
        include: folder holding ``oneapi/dnnl/dnnl.hpp``.
        library: absolute path of ``libdnnl.so.3``.
        version: the package version (``onednn-cpu-gomp``), else the library's real path.
    """

    include: str
    library: str
    version: str

    def link_args(self) -> list[str]:
        """Linker arguments for oneDNN (rpath, library folder, versioned library file)."""
        folder = os.path.dirname(self.library)
        return [f"-Wl,-rpath,{folder}", f"-L{folder}", f"-l:{os.path.basename(self.library)}"]


@functools.lru_cache(maxsize=None)
def onednn() -> OneDNN:
    """Find oneDNN 3 (installed from PyPI by the project's set-up into ``sys.prefix``, or under ``$DNNLROOT``).
    Its headers are taken from there, never from torch's include folder (torch bundles another oneDNN).

    Raises:
        ToolchainError: the headers or ``libdnnl.so.3`` are missing.
    """
    prefixes = [p for p in (sys.prefix, os.environ.get("DNNLROOT", "")) if p]
    include = next((os.path.join(p, "include") for p in prefixes
                    if os.path.exists(os.path.join(p, "include", "oneapi", "dnnl", "dnnl.hpp"))), None)
    library = next((os.path.join(p, "lib", "libdnnl.so.3") for p in prefixes
                    if os.path.exists(os.path.join(p, "lib", "libdnnl.so.3"))), None)
    if include is None or library is None:
        missing = "headers (oneapi/dnnl/dnnl.hpp)" if include is None else "library libdnnl.so.3"
        raise ToolchainError(f"oneDNN {missing} not found under sys.prefix or $DNNLROOT; dtype bfloat16 on the CPU "
                             "needs it: install 'onednn-cpu-gomp==2023.2.0' and 'onednn-devel-cpu-gomp==2023.2.0' "
                             "(the README's set-up does)")
    try:
        from importlib.metadata import version as _v
        version = _v("onednn-cpu-gomp")
    except Exception:  # noqa: BLE001 - oneDNN outside pip: key by the library file instead
        version = os.path.realpath(library)
    return OneDNN(include, library, version)


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``flags`` line of ``/proc/cpuinfo``, read once; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def require_bf16_isa() -> None:
    """Check that this CPU runs bfloat16 builds: they need AVX512-BF16 (``avx512_bf16``; AMX, where
    present, is used by oneDNN too).

    Raises:
        ToolchainError: the flag is missing; the message names the CPU.
    """
    if "avx512_bf16" not in cpu_flags():
        model = next((ln.partition(":")[2].strip() for ln in cpu_id().splitlines() if ln.startswith("model name")),
                     "this CPU")
        raise ToolchainError(f"dtype bfloat16 on the CPU needs the AVX512-BF16 instruction set (flag avx512_bf16); "
                             f"{model} does not have it: compile with dtype float32")


def find_cxx() -> tuple[str, str]:
    """The C++ compiler (``$CXX`` or ``g++``) and the first line of its ``--version``.

    Raises:
        ToolchainError: not on PATH, or it prints no version.
    """
    cxx = os.environ.get("CXX", "g++")
    exe = shutil.which(cxx)
    if exe is None:
        raise ToolchainError(f"C++ compiler {cxx!r} not found on PATH (set $CXX or install g++)")
    lines = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.splitlines()
    if not lines:
        raise ToolchainError(f"C++ compiler {exe!r} printed no version (is $CXX a C++ compiler?)")
    return exe, lines[0]


@functools.lru_cache(maxsize=None)
def toolchain() -> Toolchain:
    """Find the compiler and MKL (installed from PyPI by the project's set-up into ``sys.prefix``).

    Raises:
        ToolchainError: no C++ compiler, or MKL's headers or libraries are missing.
    """
    exe, version = find_cxx()
    prefixes = [sys.prefix, os.environ.get("MKLROOT", "")]
    include = next((os.path.join(p, "include") for p in prefixes
                    if p and os.path.exists(os.path.join(p, "include", "mkl_cblas.h"))), None)
    if include is None:
        raise ToolchainError("MKL headers (mkl_cblas.h) not found under sys.prefix/include or $MKLROOT/include; "
                             "install the 'mkl-devel' package (the README's set-up does)")
    libs = []
    for name in ("mkl_intel_lp64", "mkl_gnu_thread", "mkl_core"):
        found = sorted(f for p in prefixes if p for f in glob.glob(os.path.join(p, "lib", f"lib{name}.so*")))
        if not found:
            raise ToolchainError(f"MKL library lib{name}.so not found under sys.prefix/lib or $MKLROOT/lib; "
                                 "install the 'mkl-devel' package (the README's set-up does)")
        libs.append(found[0])
    try:
        from importlib.metadata import version as _v
        blas_version = _v("mkl")
    except Exception:  # noqa: BLE001 - MKL outside pip: key by the library file instead
        blas_version = os.path.realpath(libs[-1])
    return Toolchain(exe, version, include, tuple(libs), blas_version)


#: The subfolder of the build cache holding tuning records (layout measurements, float32 GEMM choices),
#: which pruning keeps.
TUNE_FOLDER = "tune"


def cache_path() -> str:
    """The build cache folder's path, created or not: ``$SUBSTATION_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/substation``, else ``~/.cache/substation``."""
    return os.environ.get("SUBSTATION_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "substation")


def cache_dir() -> str:
    """The build cache folder (:func:`cache_path`), created if needed.

    Raises:
        BuildError: the folder cannot be created or is not a folder.
    """
    path = cache_path()
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise BuildError(f"the build cache folder {path} cannot be created ({e.strerror}); "
                         "set SUBSTATION_CACHE_DIR to a writable folder") from None
    return path


def cpu_id() -> str:
    """The CPU's model name and flag lines of ``/proc/cpuinfo`` (else ``platform.processor()``): part
    of every key that depends on the machine (builds with ``-march=native``, tuning measurements)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        import platform
        return platform.processor()


def _header_text() -> str:
    """Every file of ``substation/csrc`` (name and text; folders such as ``__pycache__`` skipped), for
    the build key.

    Raises:
        FileNotFoundError: the install lacks the runtime header ``substation_cpu.h``.
    """
    csrc_file("substation_cpu.h")  # an install without its headers fails here, naming the file
    folder = csrc_dir()
    parts = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path) as f:
                parts.append(name + "\n" + f.read())
    return "\n".join(parts)


def _compile_command(with_onednn: bool):
    """``command(src, lib)`` -> the compiler's argv for a CPU build (with oneDNN: also against it)."""
    tc = toolchain()
    dnnl = onednn() if with_onednn else None
    extra_include = [f"-I{dnnl.include}"] if dnnl and dnnl.include != tc.blas_include else []
    return lambda src, lib: [tc.cxx, *FLAGS, f"-I{csrc_dir()}", f"-I{tc.blas_include}", *extra_include,
                             src, "-o", lib, *tc.link_args(), *(dnnl.link_args() if dnnl else [])]


def build_key(source: str, with_onednn: bool = False) -> str:
    """SHA-256 over everything that changes the compiled library: the source, the headers, the compiler
    and library versions, the CPU and the whole compiler command (its rpaths name the library folders, so
    a build linked against another environment's MKL or oneDNN is never reused)."""
    tc = toolchain()
    command = " ".join(_compile_command(with_onednn)("source.cpp", "lib.so"))
    h = hashlib.sha256()
    for part in (source, _header_text(), tc.cxx_version, command, tc.blas_version, cpu_id(), __version__,
                 onednn().version if with_onednn else ""):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _valid(entry: str) -> bool:
    try:
        with open(os.path.join(entry, "manifest.json")) as f:
            manifest = json.load(f)
        return manifest["sha256"] == _sha256(os.path.join(entry, "lib.so"))
    except (OSError, ValueError, KeyError):
        return False


#: Prefixes of the build keys of other back ends' builds in the same cache: CUDA (``True``: emulated
#: on the CPU) -> prefix (:func:`~substation.backends.cuda.build.build_cuda`).
CUDA_KEY_PREFIX = {False: "cuda-", True: "cuda-emu-"}
#: The names of build entries: a key (32 hex digits), possibly after a :data:`CUDA_KEY_PREFIX`; and of
#: entries being deleted (:func:`_discard`).
_ENTRY_NAME = re.compile("(" + "|".join(map(re.escape, CUDA_KEY_PREFIX.values())) + r")?[0-9a-f]{32}")
_TRASH_NAME = re.compile(_ENTRY_NAME.pattern + r"\.trash-\d+-\d+")


def _discard(entry: str) -> str | None:
    """Rename ``entry`` away, then delete it; None, or why it could not be renamed (gone already: None)."""
    trash = f"{entry}.trash-{os.getpid()}-{time.monotonic_ns()}"
    try:
        os.rename(entry, trash)
    except FileNotFoundError:
        return None
    except OSError as e:
        return e.strerror or str(e)
    remove_path(trash, ignore_errors=True)  # an entry may have been replaced by a file
    return None


def _remove_stale_temporaries(root: str, age_seconds: float = 24 * 3600) -> None:
    """Delete build folders left by killed builds (older than a day: no build runs that long)."""
    now = time.time()
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.startswith(".tmp-") or _TRASH_NAME.fullmatch(name):
            try:
                if now - os.path.getmtime(path) > age_seconds:
                    remove_path(path, ignore_errors=True)
            except OSError:
                pass


def _mark_used(entry: str) -> None:
    """Set the entry folder's modification time to now: its last use, which :func:`prune_cache` reads
    (a read-only cache keeps the old time)."""
    try:
        os.utime(entry)
    except OSError:
        pass


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """One build in the cache: its folder, the ``label`` it was built under (config and graph, as in
    ``manifest.json``), its size in bytes and its last use (seconds since the epoch: the last build or
    load)."""

    path: str
    label: str
    bytes: int
    last_used: float


def cache_entries() -> list[CacheEntry]:
    """The builds in :func:`cache_path`, oldest use first: folders (not links) named by a build key whose
    ``manifest.json`` records that key (CPU and CUDA builds; anything else in the folder is not listed);
    none where the folder does not exist (it is not created).

    Raises:
        BuildError: the path exists but is not a readable folder.
    """
    root = cache_path()
    if not os.path.lexists(root):
        return []
    try:
        names = os.listdir(root)
    except OSError as e:
        raise BuildError(f"the build cache folder {root} cannot be read ({e.strerror})") from None
    entries = []
    for name in names:
        path = os.path.join(root, name)
        if not _ENTRY_NAME.fullmatch(name) or os.path.islink(path):
            continue
        try:
            with open(os.path.join(path, "manifest.json")) as f:
                manifest = json.load(f)
            if manifest.get("key") != name:
                continue
            size = sum(e.stat(follow_symlinks=False).st_size for e in os.scandir(path))
            entries.append(CacheEntry(path, str(manifest.get("label", "")), size, os.stat(path).st_mtime))
        except (OSError, ValueError, AttributeError):
            continue  # removed meanwhile, or not a build
    return sorted(entries, key=lambda e: e.last_used)


def prune_cache(unused_seconds: float | None = None) -> list[CacheEntry]:
    """Remove the builds of :func:`cache_path` not used for ``unused_seconds`` (None: every build), and
    the folders of builds killed over a day ago. Each entry is renamed away before it is deleted, so no
    process loads half of one; a process that loaded a library keeps it mapped. Tuning records stay.

    Returns:
        The removed entries.

    Raises:
        ValueError: ``unused_seconds`` negative. BuildError: as :func:`cache_entries`; some builds could not
            be removed (a read-only cache: the message says how many were and why).
    """
    if unused_seconds is not None and not unused_seconds >= 0:
        raise ValueError(f"unused_seconds must be >= 0, got {unused_seconds}")
    root, now = cache_path(), time.time()
    stale = [e for e in cache_entries() if unused_seconds is None or now - e.last_used > unused_seconds]
    failed = [why for why in map(_discard, (e.path for e in stale)) if why]
    if os.path.isdir(root):
        _remove_stale_temporaries(root)
    if failed:
        raise BuildError(f"removed {len(stale) - len(failed)} of {len(stale)} builds from {root}; the others "
                         f"could not be removed ({failed[0]})")
    return stale


@dataclasses.dataclass(frozen=True)
class BuildResult:
    """A built library: its path, whether it came from the cache, and the compile time in seconds."""

    path: str
    cached: bool
    seconds: float


def build_library(source: str, label: str = "lib", with_onednn: bool = False) -> BuildResult:
    """Compile ``source`` (C++) into a shared library, or reuse the cached build; ``with_onednn``: also
    against oneDNN (bfloat16 builds).

    Raises:
        ToolchainError: compiler, BLAS or (with oneDNN) oneDNN missing.
        BuildError: the compiler failed (nothing is written to the cache).
    """
    return cached_build(build_key(source, with_onednn), label, source, "source.cpp", _compile_command(with_onednn))


def cached_build(key: str, label: str, source: str, filename: str, command, manifest: dict | None = None) -> BuildResult:
    """The cache entry ``key``: reused when valid, else built from ``source`` with ``command(src, lib)``
    (the compiler's argv) in a private folder and published with one rename.

    Raises:
        BuildError: the compiler failed or wrote no library (nothing is written to the cache); the cache
            folder is not writable and has no valid entry ``key``.
    """
    root = cache_dir()
    entry = os.path.join(root, key)
    if os.path.isdir(entry):
        if _valid(entry):
            _mark_used(entry)
            return BuildResult(os.path.join(entry, "lib.so"), True, 0.0)
        _discard(entry)
    _remove_stale_temporaries(root)
    try:
        tmp = tempfile.mkdtemp(prefix=f".tmp-{label}-", dir=root)
    except OSError as e:
        raise BuildError(f"cannot build {label}: the build cache folder {root} is not writable ({e.strerror}) and "
                         f"holds no build of it; set SUBSTATION_CACHE_DIR to a writable folder") from None
    try:
        src = os.path.join(tmp, filename)
        with open(src, "w") as f:
            f.write(source)
        lib = os.path.join(tmp, "lib.so")
        cmd = command(src, lib)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        if proc.returncode != 0 or not os.path.exists(lib):
            raise BuildError(f"compiling {label} failed ({' '.join(cmd)}):\n{(proc.stderr or proc.stdout)[-6000:]}")
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump({"key": key, "label": label, "sha256": _sha256(lib), "command": cmd,
                       "compile_seconds": seconds, **(manifest or {})}, f, indent=1)
        try:
            os.rename(tmp, entry)
        except OSError:
            if not _valid(entry):  # lost the race to a broken entry: replace it
                _discard(entry)
                os.rename(tmp, entry)
        return BuildResult(os.path.join(entry, "lib.so"), False, seconds)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def build_libraries(sources: dict[str, str], with_onednn: bool = False) -> dict[str, BuildResult]:
    """Build several sources in parallel (one compiler process each); ``with_onednn`` as :func:`build_library`."""
    with ThreadPoolExecutor(max_workers=max(1, min(len(sources), os.cpu_count() or 1))) as pool:
        futures = {name: pool.submit(build_library, src, name, with_onednn) for name, src in sources.items()}
        return {name: f.result() for name, f in futures.items()}
