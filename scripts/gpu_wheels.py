#!/usr/bin/env python3
"""The wheels a GPU machine without network needs for scripts/gpu_check.py, made here with pip.

    python3 scripts/gpu_wheels.py prepare .gpu-wheels     # here, with network
    python3 scripts/gpu_wheels.py verify .gpu-wheels      # here: resolves offline for Python 3.12
    python3 scripts/gpu_wheels.py install .gpu-wheels     # there, offline

The GPU machine is assumed to have Python 3.12, torch (with its dependencies, cuBLAS among them for
CUDA 13 builds) and numpy; it lacks DaCe 2.0.0b1, ``transformers`` and their dependencies, and
Substation. ``prepare`` builds Substation's and DaCe's wheels (DaCe is published as a source archive
only) and downloads every other dependency as a binary wheel for CPython 3.12 on manylinux x86-64,
without numpy (the machine's stays). ``verify`` installs nothing: it resolves the requirements with
``pip install --no-index --dry-run`` in a fresh Python 3.12 virtual environment that records torch and
numpy as installed, as on the GPU machine. ``install`` installs from the folder alone (Substation
without its CPU-only dependencies such as MKL). docs/cuda.md, "The GPU check".
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: What gpu_check.py imports beyond torch and numpy, with their dependencies (transformers: the version
#: the tests here use), DaCe's runtime dependencies included.
REQUIREMENTS = ("transformers==5.24.0", "pyyaml", "tqdm", "sympy", "networkx", "astunparse", "click", "dill",
                "fparser!=0.2.3", "ml_dtypes", "ordered-set", "packaging", "ply", "typing-extensions")
#: Installed without dependencies: DaCe (built here from its source archive, pure Python) leaves out its
#: build tools cmake, ninja and scikit-build (30 MiB; Substation's builds call g++ and nvcc themselves),
#: so that the folder fits the 64 MiB a device run carries.
WITHOUT_DEPS = ("dace==2.0.0b1",)
#: What the GPU machine has already (removed from the folder; recorded as installed by ``verify``).
PRESENT = {"torch": "2.11.0", "numpy": "2.5.0"}
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_28_x86_64")


def pip(python: str, *args: str) -> None:
    """Run ``python -m pip args``; raise CalledProcessError when it fails."""
    subprocess.run([python, "-m", "pip", *args], check=True)


def prepare(folder: str) -> None:
    """Fill ``folder`` (created) with Substation's wheel, the wheels built from :data:`WITHOUT_DEPS` and
    the CPython 3.12 manylinux x86-64 binary wheels of everything :data:`REQUIREMENTS` needs, minus
    :data:`PRESENT`. Needs network."""
    os.makedirs(folder, exist_ok=True)
    pip(sys.executable, "wheel", "--no-deps", "--no-build-isolation", "-w", folder, ROOT)
    pip(sys.executable, "wheel", "--no-deps", "-w", folder, *WITHOUT_DEPS)
    pip(sys.executable, "download", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
        "--abi", "cp312", *[a for p in PLATFORMS for a in ("--platform", p)], "--find-links", folder,
        "-d", folder, *REQUIREMENTS)
    for name in PRESENT:
        for path in glob.glob(os.path.join(folder, f"{name}-*.whl")):
            os.remove(path)
    files = sorted(os.listdir(folder))
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in files)
    print(f"{len(files)} wheels, {size / 2 ** 20:.1f} MiB in {folder}:\n  " + "\n  ".join(files))


def install_args(folder: str) -> tuple[list[str], list[str]]:
    """The two pip argument lists of :func:`install`: the requirements, then DaCe and Substation without
    dependencies (Substation's CPU-only ones, MKL and oneDNN, are not needed for the CUDA target)."""
    wheels = glob.glob(os.path.join(folder, "substation-*.whl"))
    if not wheels:
        raise SystemExit(f"no substation wheel in {folder}: run 'prepare' first")
    offline = ["install", "--no-index", "--find-links", folder]
    return offline + list(REQUIREMENTS), offline + ["--no-deps", *WITHOUT_DEPS, max(wheels, key=os.path.getmtime)]


def install(folder: str, python: str = sys.executable, dry_run: bool = False) -> None:
    """Install :data:`REQUIREMENTS`, :data:`WITHOUT_DEPS` and Substation from ``folder`` only (no index) into ``python``'s
    environment (a system Python marked externally managed too: this is a throw-away machine)."""
    os.environ["PIP_CONFIG_FILE"] = os.devnull  # the folder alone: no configured index or find-links
    for name in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        os.environ.pop(name, None)
    os.environ.setdefault("PIP_BREAK_SYSTEM_PACKAGES", "1")
    os.environ.setdefault("PIP_ROOT_USER_ACTION", "ignore")
    for args in install_args(folder):
        pip(python, *args, *(["--dry-run"] if dry_run else []))


def verify(folder: str, python: str | None) -> None:
    """Resolve :func:`install` offline in a fresh Python 3.12 virtual environment in which
    :data:`PRESENT` are recorded as installed (metadata only), as on the GPU machine."""
    candidates = [python] if python else [shutil.which("python3.12"),
                                          *sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12")))]
    python = next((c for c in candidates if c and subprocess.run([c, "-c", ""], capture_output=True).returncode == 0),
                  None)
    if python is None:
        raise SystemExit("no working python3.12 found: pass --python")
    with tempfile.TemporaryDirectory(prefix="gpu-wheels-") as tmp:
        subprocess.run([python, "-m", "venv", tmp], check=True)
        venv_python = os.path.join(tmp, "bin", "python")
        site = subprocess.run([venv_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()
        for name, version in PRESENT.items():
            info = os.path.join(site, f"{name}-{version}.dist-info")
            os.makedirs(info)
            with open(os.path.join(info, "METADATA"), "w") as f:
                f.write(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
            open(os.path.join(info, "RECORD"), "w").close()
        install(folder, venv_python, dry_run=True)
    print(f"{folder}: every requirement resolves offline for Python 3.12 with {', '.join(PRESENT)} present")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("prepare", "verify", "install"))
    parser.add_argument("folder", help="the wheel folder (.gpu-wheels in the repository is git-ignored)")
    parser.add_argument("--python", help="verify: the Python 3.12 to test with (default: python3.12 found here)")
    args = parser.parse_args(argv)
    folder = os.path.abspath(args.folder)
    {"prepare": lambda: prepare(folder), "verify": lambda: verify(folder, args.python),
     "install": lambda: install(folder)}[args.command]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
