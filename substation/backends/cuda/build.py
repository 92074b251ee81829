"""Compiling generated CUDA into shared libraries with nvcc, through the build cache of
:mod:`substation.backends.cpu.build` (same atomic publication: an entry is assembled in a private folder and
published with one rename; a failed build leaves nothing behind).

Toolchain (found by :func:`cuda_toolchain`):

* ``nvcc`` of CUDA 12 or newer: ``$SUBSTATION_NVCC``, else ``nvcc`` on ``PATH``, else
  ``$CUDA_HOME/bin/nvcc`` or ``/usr/local/cuda/bin/nvcc``. Its include and library folders are read
  from ``nvcc -dryrun``, so wrapper scripts and pip-installed toolkits work.
* cuBLAS headers (``cublas_v2.h``) and library (``libcublas.so.<major>``): ``$SUBSTATION_CUBLAS_ROOT``
  (a folder with ``include/`` and ``lib/`` or ``lib64/``), else the toolkit's own folders, else the
  PyPI wheels in ``sys.path`` (``nvidia-cublas`` for CUDA 13: ``nvidia/cu13/{include,lib}``;
  ``nvidia-cublas-cu12``: ``nvidia/cublas/{include,lib}``). A cuBLAS of nvcc's major version is
  preferred. The wheels ship only versioned libraries (``libcublas.so.13``): the link names that file
  directly (``-Xlinker <path>``), so no unversioned link is needed, and an rpath records its folder.
  At run time a process that already loaded PyTorch's cuBLAS of the same major version shares it.

Flags: ``nvcc -O3 -std=c++17 -DNDEBUG --diag-error=20011,20013 -gencode
arch=compute_NN,code=[sm_NN,compute_NN] -Xcompiler -fPIC -shared -cudart shared`` for the config's
``cuda_arch`` (default ``sm_90``: H100/H200), plus the cuBLAS library (device code calling a host
function is an error, not a warning). ``emulate=True`` compiles the same source with the host C++
compiler and ``-DSS_EMULATE`` instead (see ``csrc/substation_cuda.cuh``): a sequential CPU emulation
for tests on machines without a GPU; it needs only the toolkit's headers (``cuda_fp16.h``), not
cuBLAS.
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

from ...resources import csrc_dir, csrc_file
from ...version import __version__
from ..cpu.build import CUDA_KEY_PREFIX, BuildError, BuildResult, ToolchainError, cached_build, find_cxx

__all__ = ["CudaToolchain", "cuda_toolchain", "nvcc_flags", "build_cuda_library", "build_cuda_libraries",
           "emulation_toolchain", "arch_number", "KernelResources", "ptxas_resources", "ptx_entries"]

_ARCH_RE = re.compile(r"^sm_(\d{2,3})([a-z]?)$")
#: Toolkit folders searched for bin/nvcc after PATH, $CUDA_HOME and $CUDA_PATH.
DEFAULT_CUDA_ROOTS = ("/usr/local/cuda",)


@dataclasses.dataclass(frozen=True)
class CudaToolchain:
    """nvcc and cuBLAS as found on this machine.

    Attributes:
        nvcc: the nvcc executable.
        nvcc_version: e.g. ``13.0.88``; cuda_major: its major version (>= 12).
        include_dirs: the toolkit's include folders (``cuda_runtime.h``, ``cuda_fp16.h``).
        lib_dirs: the toolkit's library folders (``libcudart.so``).
        cublas_include: folder holding ``cublas_v2.h``; cublas_lib: path of ``libcublas.so.<major>``.
        cublas_version: from ``cublas_api.h`` (``major.minor.patch``).
    """

    nvcc: str
    nvcc_version: str
    cuda_major: int
    include_dirs: tuple[str, ...]
    lib_dirs: tuple[str, ...]
    cublas_include: str | None
    cublas_lib: str | None
    cublas_version: str | None

    def require_cublas(self) -> None:
        """Raises:
            ToolchainError: no cuBLAS headers or library were found."""
        if self.cublas_lib is None or self.cublas_include is None:
            raise ToolchainError(
                "cuBLAS not found: no cublas_v2.h and libcublas.so.* in $SUBSTATION_CUBLAS_ROOT, in the CUDA "
                f"toolkit of {self.nvcc}, or in the PyPI wheels on sys.path; install it with "
                f"'pip install \"nvidia-cublas{'' if self.cuda_major >= 13 else '-cu12'}\"' "
                "(or 'pip install substation[cuda]')")


def _find_nvcc() -> str:
    env = os.environ.get("SUBSTATION_NVCC")
    if env:
        exe = shutil.which(env)
        if exe is None:
            raise ToolchainError(f"$SUBSTATION_NVCC={env!r} is not an executable")
        return exe
    exe = shutil.which("nvcc")
    if exe:
        return exe
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), *DEFAULT_CUDA_ROOTS):
        if root and os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
            return os.path.join(root, "bin", "nvcc")
    raise ToolchainError("nvcc (the CUDA compiler, CUDA 12 or newer) not found on PATH, in $CUDA_HOME/bin or "
                         "/usr/local/cuda/bin; install the CUDA toolkit or set $SUBSTATION_NVCC")


def _dryrun_dirs(nvcc: str) -> tuple[list[str], list[str]]:
    """The toolkit's include and library folders, as nvcc itself reports them."""
    proc = subprocess.run([nvcc, "-dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                          capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    inc, lib = [], []
    for line in text.splitlines():
        if line.startswith("#$ INCLUDES=") or line.startswith("#$ SYSTEM_INCLUDES="):
            inc += [os.path.normpath(p) for p in re.findall(r'-I"?([^"\s]+)', line)]
            inc += [os.path.normpath(p) for p in re.findall(r'"-isystem"\s+"([^"]+)"', line)]
        if line.startswith("#$ LIBRARIES="):
            lib += [os.path.normpath(p) for p in re.findall(r'-L"?([^"\s]+)', line) if not p.rstrip("/").endswith("stubs")]
    top = re.search(r"^#\$ TOP=(.+)$", text, re.M)
    if top:
        root = os.path.normpath(top.group(1).strip())
        inc.append(os.path.join(root, "include"))
        lib += [os.path.join(root, "lib64"), os.path.join(root, "lib")]
    inc = [d for d in dict.fromkeys(inc) if os.path.isdir(d)]
    lib = [d for d in dict.fromkeys(lib) if os.path.isdir(d)]
    return inc, lib


def _cublas_candidates(include_dirs, lib_dirs, major: int) -> list[tuple[str, str]]:
    """(include folder, library path) pairs, best first."""
    pairs: list[tuple[str, str]] = []

    def add(inc_dirs, libdirs):
        inc = next((d for d in inc_dirs if os.path.exists(os.path.join(d, "cublas_v2.h"))), None)
        if inc is None:
            return
        libs = []
        for d in libdirs:
            libs += sorted(glob.glob(os.path.join(d, "libcublas.so.*")))
        libs = [p for p in libs if re.search(r"libcublas\.so\.\d+$", p)]
        if libs:
            pairs.append((inc, libs[0]))

    root = os.environ.get("SUBSTATION_CUBLAS_ROOT")
    if root:
        add([os.path.join(root, "include")], [os.path.join(root, "lib"), os.path.join(root, "lib64")])
    add(include_dirs, lib_dirs)
    for base in dict.fromkeys(p for p in sys.path if p and os.path.isdir(p)):
        for sub in (f"cu{major}", "cu13", "cu12", "cublas"):
            d = os.path.join(base, "nvidia", sub)
            if os.path.isdir(d):
                add([os.path.join(d, "include")], [os.path.join(d, "lib")])
    # Prefer the library of nvcc's own major version.
    pairs.sort(key=lambda p: 0 if p[1].endswith(f".so.{major}") else 1)
    return list(dict.fromkeys(pairs))


def _cublas_version(include: str) -> str:
    try:
        with open(os.path.join(include, "cublas_api.h")) as f:
            text = f.read()
        parts = [re.search(rf"#define\s+CUBLAS_VER_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
        return ".".join(m.group(1) for m in parts if m)
    except OSError:
        return "unknown"


@functools.lru_cache(maxsize=None)
def cuda_toolchain() -> CudaToolchain:
    """Find nvcc (CUDA >= 12) and, if present, cuBLAS (see the module docstring).

    Raises:
        ToolchainError: nvcc missing, not runnable, or older than CUDA 12. (A missing cuBLAS is
            reported by :meth:`CudaToolchain.require_cublas`, which every nvcc build calls.)
    """
    nvcc = _find_nvcc()
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise ToolchainError(f"cannot run {nvcc} --version: {e}") from None
    m = re.search(r"release (\d+)\.(\d+), V([\d.]+)", out)
    if not m:
        raise ToolchainError(f"cannot read the CUDA version from '{nvcc} --version': {out.strip()[:200]!r}")
    major = int(m.group(1))
    if major < 12:
        raise ToolchainError(f"{nvcc} is CUDA {m.group(1)}.{m.group(2)}; Substation needs CUDA 12 or newer")
    inc, lib = _dryrun_dirs(nvcc)
    cands = _cublas_candidates(inc, lib, major)
    cinc, clib = cands[0] if cands else (None, None)
    return CudaToolchain(nvcc, m.group(3), major, tuple(inc), tuple(lib), cinc, clib,
                         _cublas_version(cinc) if cinc else None)


def arch_number(arch: str) -> str:
    """``"sm_90"`` -> ``"90"``, ``"sm_90a"`` -> ``"90a"``.

    Raises:
        ValueError: not of the form ``sm_<digits>[letter]``.
    """
    m = _ARCH_RE.match(arch)
    if not m:
        raise ValueError(f"cuda_arch: must look like sm_90 or sm_90a, got {arch!r}")
    return m.group(1) + m.group(2)


def nvcc_flags(arch: str = "sm_90") -> list[str]:
    """The nvcc flags of a build for ``arch`` (machine code for it plus PTX for newer GPUs).

    Raises:
        ValueError: a malformed ``arch``.
    """
    n = arch_number(arch)
    # Device code calling a host function (std::min in a __host__ __device__ helper) is only a
    # warning by default, and nvcc then compiles the call into wrong code: make it an error.
    return ["-O3", "-std=c++17", "-DNDEBUG", "--diag-error=20011,20013", f"-gencode=arch=compute_{n},code=sm_{n}",
            f"-gencode=arch=compute_{n},code=compute_{n}", "-Xcompiler", "-fPIC", "-shared", "-cudart", "shared"]


EMULATION_FLAGS = ("-O1", "-std=c++17", "-fPIC", "-shared", "-fno-strict-aliasing", "-DSS_EMULATE", "-x", "c++")


@functools.lru_cache(maxsize=None)
def emulation_toolchain() -> tuple[str, str, tuple[str, ...]]:
    """(C++ compiler, its version, CUDA include folders) for ``emulate=True`` builds.

    Raises:
        ToolchainError: no C++ compiler, or no CUDA headers (``cuda_fp16.h``) found.
    """
    cxx, version = find_cxx()
    incs: list[str] = []
    try:
        incs = list(cuda_toolchain().include_dirs)
    except ToolchainError:
        pass
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            incs.append(os.path.join(root, "include"))
    incs = [d for d in dict.fromkeys(incs) if os.path.exists(os.path.join(d, "cuda_fp16.h"))]
    if not incs:
        raise ToolchainError("CUDA headers (cuda_fp16.h) not found: install the CUDA toolkit (nvcc) or set $CUDA_HOME")
    return cxx, version, tuple(incs)


def _header_text() -> str:
    """The runtime header that generated CUDA code includes (``substation_cuda.cuh``), for the build key."""
    with open(csrc_file("substation_cuda.cuh")) as f:
        return f.read()


def _command(src: str, lib: str, arch: str, emulate: bool) -> tuple[list[str], str]:
    """(compiler command, identity of the toolchain for the cache key)."""
    if emulate:
        cxx, version, incs = emulation_toolchain()
        cmd = [cxx, *EMULATION_FLAGS, f"-I{csrc_dir()}", *(f"-I{d}" for d in incs), src, "-o", lib]
        return cmd, version
    tc = cuda_toolchain()
    tc.require_cublas()
    link = ["-Xlinker", tc.cublas_lib, "-Xlinker", "-rpath", "-Xlinker", os.path.dirname(tc.cublas_lib)]
    for d in tc.lib_dirs:
        link += ["-Xlinker", "-rpath", "-Xlinker", d]
    cmd = [tc.nvcc, *nvcc_flags(arch), f"-I{csrc_dir()}", f"-I{tc.cublas_include}", src, "-o", lib, *link]
    return cmd, f"nvcc {tc.nvcc_version} cublas {tc.cublas_version} {os.path.realpath(tc.cublas_lib)}"


def build_cuda_library(source: str, label: str = "lib", arch: str = "sm_90", emulate: bool = False) -> BuildResult:
    """Compile generated CUDA ``source`` into a shared library for ``arch``, or reuse the cached build.

    With ``emulate``, compile it for the CPU emulation instead (tests without a GPU).

    Returns:
        a :class:`~substation.backends.cpu.build.BuildResult` (path, cached, compile seconds).

    Raises:
        ToolchainError: nvcc (CUDA >= 12) or cuBLAS missing (emulation: C++ compiler or CUDA headers).
        BuildError: the compiler failed (nothing is written to the cache).
        ValueError: a malformed ``arch``.
    """
    arch_number(arch)
    probe_cmd, ident = _command("source.cu", "lib.so", arch, emulate)
    h = hashlib.sha256()
    for part in (source, _header_text(), ident, " ".join(probe_cmd[1:]), str(emulate), __version__):
        h.update(part.encode())
        h.update(b"\0")
    key = CUDA_KEY_PREFIX[emulate] + h.hexdigest()[:32]
    return cached_build(key, label, source, "source.cu", lambda src, lib: _command(src, lib, arch, emulate)[0],
                        {"arch": arch, "emulate": emulate})


def build_cuda_libraries(sources: dict[str, str], arch: str = "sm_90", emulate: bool = False,
                         jobs: int | None = None) -> dict[str, BuildResult]:
    """Build several CUDA sources in parallel (one compiler process each, at most ``jobs`` at once,
    default the number of CPUs).

    Raises:
        ToolchainError, BuildError, ValueError: as :func:`build_cuda_library`.
    """
    workers = max(1, min(len(sources), jobs or os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {name: pool.submit(build_cuda_library, src, name, arch, emulate) for name, src in sources.items()}
        return {name: f.result() for name, f in futures.items()}


@dataclasses.dataclass(frozen=True)
class KernelResources:
    """What ptxas reports for one kernel entry (``nvcc -Xptxas -v``).

    Attributes:
        name: the demangled entry name, e.g. ``k3_MSD<8, true>`` (namespaces and parameters removed).
        registers: registers per thread.
        spill_stores, spill_loads: bytes of register spills to local memory per thread.
        stack_bytes: stack frame in bytes per thread.
    """

    name: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int


_ENTRY_RE = re.compile(r"Compiling entry function '(\S+)' for 'sm_")
_FRAME_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS_RE = re.compile(r"Used (\d+) registers")


def _demangle(names: list[str]) -> list[str]:
    """``k3_MSD<8, true>`` for a mangled kernel entry (the mangled names where c++filt is missing)."""
    cxxfilt = shutil.which("c++filt")
    if cxxfilt is None or not names:
        return names
    out = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    if len(out) != len(names):
        return names
    res = []
    for o in out:
        o = o.replace("(anonymous namespace)::", "")
        o = o[len("void "):] if o.startswith("void ") else o
        res.append(o.split("(")[0])
    return res


def _compile_device(source: str, arch: str, mode: list[str], suffix: str) -> tuple[str, str]:
    """Compile generated CUDA ``source`` for ``arch`` with the flags of :func:`nvcc_flags` (no link,
    nothing cached) plus ``mode``; returns (compiler output, text of the output file or "")."""
    tc = cuda_toolchain()
    tc.require_cublas()
    flags = [f for f in nvcc_flags(arch) if f not in ("-shared", "-cudart", "shared") and "code=compute_" not in f]
    with tempfile.TemporaryDirectory(prefix="substation-nvcc-") as tmp:
        src, out = os.path.join(tmp, "source.cu"), os.path.join(tmp, "source" + suffix)
        with open(src, "w") as f:
            f.write(source)
        cmd = [tc.nvcc, *flags, *mode, f"-I{csrc_dir()}", f"-I{tc.cublas_include}", src, "-o", out]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"compiling {' '.join(mode)} failed ({' '.join(cmd)}):\n{proc.stderr[-6000:]}")
        text = ""
        if suffix == ".ptx":
            with open(out) as f:
                text = f.read()
    return proc.stdout + proc.stderr, text


def ptxas_resources(source: str, arch: str = "sm_90") -> list[KernelResources]:
    """Compile generated CUDA ``source`` to an object file for ``arch`` (the flags of
    :func:`nvcc_flags`, no link, nothing cached) with ``-Xptxas -v`` and return the register and
    spill usage of every kernel entry, in ptxas's order.

    Raises:
        ToolchainError: nvcc (CUDA >= 12) or cuBLAS headers missing.
        BuildError: the compiler failed.
        ValueError: a malformed ``arch``.
    """
    log, _ = _compile_device(source, arch, ["-Xptxas", "-v", "-c"], ".o")
    entries: list[list] = []  # [mangled name, registers, spill stores, spill loads, stack]
    for line in log.splitlines():
        m = _ENTRY_RE.search(line)
        if m:
            entries.append([m.group(1), 0, 0, 0, 0])
            continue
        if not entries:
            continue
        m = _FRAME_RE.search(line)
        if m:
            entries[-1][2:5] = int(m.group(2)), int(m.group(3)), int(m.group(1))
        m = _REGS_RE.search(line)
        if m:
            entries[-1][1] = int(m.group(1))
    names = _demangle([e[0] for e in entries])
    return [KernelResources(n, e[1], e[2], e[3], e[4]) for n, e in zip(names, entries)]


_PTX_ENTRY_RE = re.compile(r"^(?:\.visible )?\.entry (\S+)\(", re.M)


def ptx_entries(source: str, arch: str = "sm_90") -> dict[str, str]:
    """The PTX of every kernel entry of generated CUDA ``source`` for ``arch`` (``nvcc -ptx``, the
    flags of :func:`nvcc_flags`), by demangled name (``k1_input_bias<8, true>``): the text from the
    entry's parameter list to the next entry, for counting instructions.

    Raises:
        ToolchainError, BuildError, ValueError: as :func:`ptxas_resources`.
    """
    _, text = _compile_device(source, arch, ["-ptx"], ".ptx")
    parts = _PTX_ENTRY_RE.split(text)
    names = _demangle(parts[1::2])
    return dict(zip(names, parts[2::2]))
