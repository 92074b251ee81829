"""Packaging: the wheel ships every module, C++/CUDA source and bundled config, and the package finds
its files both from the source checkout and from an unpacked wheel."""
import glob
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

import substation
from substation.config import load_config
from substation.resources import bundled_file, configs_dir, csrc_dir, csrc_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: What setup.py builds the wheel from (copied so that no stale build/ folder of the checkout leaks in).
BUILD_INPUTS = ("setup.py", "setup.cfg", "pyproject.toml", "README.md", "substation", "configs")


def _repo_files(folder: str, *patterns: str) -> set[str]:
    return {os.path.basename(p) for pat in patterns for p in glob.glob(os.path.join(ROOT, folder, pat))}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    """A wheel built by pip from a clean copy of the build inputs."""
    src = tmp_path_factory.mktemp("src")
    for name in BUILD_INPUTS:
        path = os.path.join(ROOT, name)
        if os.path.isdir(path):
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, src / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(src)], check=True, capture_output=True, text=True)
    (whl,) = glob.glob(str(out / "substation-*.whl"))
    return whl


def test_wheel_ships_sources_configs_and_entry_point(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    csrc = _repo_files("substation/csrc", "*.h", "*.cuh", "*.cpp")
    configs = _repo_files("configs", "*.yaml", "*.plan.json")
    assert {"substation_cpu.h", "substation_cuda.cuh", "substation_probe.cpp"} <= csrc
    assert {"bert-base.yaml", "tiny.yaml", "default.plan.json", "bert-base.plan.json"} <= configs
    assert {n.split("/")[-1] for n in names if n.startswith("substation/csrc/") and not n.endswith(".py")} == csrc
    assert {n[len("substation/configs/"):] for n in names if n.startswith("substation/configs/")} == configs
    modules = {os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "substation", "**", "*.py"),
                                                           recursive=True)}
    assert modules and modules <= names
    entry_points = zipfile.ZipFile(wheel).read(f"substation-{substation.__version__}.dist-info/entry_points.txt")
    assert "substation = substation.cli:main" in entry_points.decode()


def test_checkout_lookup_finds_existing_files():
    assert os.path.isfile(os.path.join(csrc_dir(), "substation_cpu.h"))
    for name in ("substation_cpu.h", "substation_cuda.cuh", "substation_probe.cpp"):
        assert os.path.isfile(csrc_file(name))
    assert sorted(os.listdir(configs_dir())) == sorted(_repo_files("configs", "*"))
    assert bundled_file("tiny", ".yaml") == os.path.join(configs_dir(), "tiny.yaml")
    assert bundled_file("bert-base", ".plan.json") == os.path.join(configs_dir(), "bert-base.plan.json")
    assert bundled_file("no-such-config", ".yaml") is None
    assert load_config("tiny").name == "tiny"
    with pytest.raises(FileNotFoundError, match="no-such-header.h is missing"):
        csrc_file("no-such-header.h")


def test_unpacked_wheel_finds_its_own_files(wheel, tmp_path):
    """Imported from an unpacked wheel (as from site-packages), outside the checkout, the package finds
    the headers and configs inside itself."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    script = ("import substation.resources as r, substation.config as c; "
              "print(r.csrc_dir()); print(r.configs_dir()); print(c.load_config('tiny').hidden_size); "
              "print(r.bundled_file('default', '.plan.json'))")
    env = dict(os.environ, PYTHONPATH=str(site))
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.split()
    assert lines == [str(site / "substation" / "csrc"), str(site / "substation" / "configs"),
                     str(load_config("tiny").hidden_size), str(site / "substation" / "configs" / "default.plan.json")]


def test_missing_configs_folder_is_named(tmp_path):
    """A package folder without configs (neither installed nor in a checkout) fails naming both places."""
    pkg = tmp_path / "substation"
    shutil.copytree(os.path.join(ROOT, "substation"), pkg, ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    script = "import substation; substation.load_config('tiny')"
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode != 0
    assert f"neither {pkg / 'configs'} (installed package) nor {tmp_path / 'configs'}" in proc.stderr


def test_command_line_help_and_version_load_no_compiler():
    """``substation --version`` and ``--help`` answer without importing PyTorch, DaCe or SymPy (they
    took 4-6 s before the package's names loaded lazily), and every public name still resolves."""
    script = ("import sys, substation.cli as cli\n"
              "try:\n    cli.main(['--version'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
              "heavy = sorted(m for m in ('torch', 'dace', 'sympy') if m in sys.modules)\n"
              "assert not heavy, heavy\n"
              "import substation\n"
              "print(sorted(n for n in substation.__all__ if getattr(substation, n, None) is None))\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"substation {substation.__version__}", "[]"]
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        substation.no_such_name  # noqa: B018
