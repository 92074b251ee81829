"""scripts/gpu_check.py's --dry-run-cpu (the GPU check's path on the CPU, tiny sizes) and the wheel
folder commands of scripts/gpu_wheels.py."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = {"numerics", "masked_rows", "block_softmax", "dropout_masks", "training", "autocast", "sanitizer"}


def test_dry_run_cpu_writes_the_report_and_its_checks_pass(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py"), "--dry-run-cpu", "--quick",
                           "--json", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["schema"] == "substation-gpu-check/1" and report["mode"]["dry_run_cpu"] is True
    assert report["status"] == "ok" and report["summary"]["failed"] == 0 and not report["summary"]["problems"]
    assert set(report["sections"]) >= {"environment", "build", "correctness", "benchmarks", "profile"}
    assert report["sections"]["build"]["status"] == "passed"
    checks = report["checks"]
    assert {c["kind"] for c in checks} == KINDS
    for c in checks:
        assert c["status"] in ("passed", "skipped"), c
        assert c["status"] == "passed" or c["reason"], c
    ran = {c["kind"] for c in checks if c["status"] == "passed"}
    assert ran == KINDS - {"autocast", "sanitizer"}  # autocast needs a half build, the sanitizer a GPU
    train = next(c for c in checks if c["kind"] == "training")
    assert set(train["errors"]) == {"Y", "dX", *(f"d{n}" for n in (
        "in_proj_weight", "in_proj_bias", "out_proj_weight", "out_proj_bias", "linear1_weight", "linear1_bias",
        "linear2_weight", "linear2_bias", "norm1_weight", "norm1_bias", "norm2_weight", "norm2_bias"))}
    sites = next(c for c in checks if c["config"] == "tiny-float32-dropout")["sites"]
    assert set(sites) == {"attention_dropout", "activation_dropout", "out_dropout", "ffn_dropout"}
    assert all(s["mask_identical"] for s in sites.values())
    (case,) = report["sections"]["benchmarks"]["cases"]
    assert (case["B"], case["L"], case["dtype"], case["status"]) == (2, 16, "float32", "done")
    pure = case["modes"]["pure"]
    assert all(pure[impl]["median_ms"] > 0 and pure[impl]["rounds"] == 20 for impl in ("substation", "eager", "compile"))
    assert set(case["speedups"]["pure"]) == {"speedup_vs_eager", "speedup_vs_compile"}
    assert all(v > 0 for v in case["speedups"]["pure"].values())
    profile = report["sections"]["profile"]
    assert profile["status"] == "done" and {o["operator"] for o in profile["operators"]} >= {"qkv", "MSD", "BDS"}
    assert "vs compile" in proc.stdout and "0 failed" in proc.stdout


def _gpu_wheels():
    spec = importlib.util.spec_from_file_location("gpu_wheels", os.path.join(ROOT, "scripts", "gpu_wheels.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_install_uses_the_folder_alone_and_substation_without_its_cpu_dependencies(tmp_path):
    wheels = _gpu_wheels()
    with pytest.raises(SystemExit, match="no substation wheel"):
        wheels.install_args(str(tmp_path))
    (tmp_path / "substation-0.1.0-py3-none-any.whl").write_bytes(b"")
    deps, own = wheels.install_args(str(tmp_path))
    assert deps[:4] == own[:4] == ["install", "--no-index", "--find-links", str(tmp_path)]
    assert "transformers==5.24.0" in deps and not any(d.startswith(("dace", "torch", "numpy")) for d in deps)
    assert own[4:] == ["--no-deps", "dace==2.0.0b1", str(tmp_path / "substation-0.1.0-py3-none-any.whl")]
