"""The command line: compile writes graphs, sources, libraries and a report; graphs regenerates SDFGs."""
import json
import os
import subprocess
import sys

import pytest
import yaml

from substation.backends.cpu.build import cpu_flags
from substation.cli import CHECK_TOLERANCE, main
from substation.config import load_config


def test_compile_writes_everything(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert main(["compile", "tiny", "--out", str(out), "--repeats", "2"]) == 0
    files = sorted(os.listdir(out))
    assert files == [".substation-output", "backward.cpp", "backward.sdfg", "backward.so", "forward.cpp",
                     "forward.sdfg", "forward.so", "report.json"]
    report = json.loads((out / "report.json").read_text())
    assert report["operators"] == {"forward": 11, "backward": 18}  # 6 + 5 and 12 + 6 kernels
    assert report["operators_by_class"]["forward"] == {"TC": 6, "SN": 3, "EW": 2}
    assert report["max_rel_error_vs_pytorch"] < 1e-10 and report["fp32_gemm"] is None  # float64
    assert report["speedup_vs_eager"] > 0 and len(report["forward_backward_seconds_median"]) == 2
    text = capsys.readouterr().out
    assert "max relative error" in text and "speedup" in text
    # recompiling replaces the folder as a whole
    assert main(["compile", "tiny", "--out", str(out), "--repeats", "1", "--no-fuse"]) == 0
    assert json.loads((out / "report.json").read_text())["operators"] == {"forward": 20, "backward": 27}
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []


def test_compile_with_onednn_float32_gemms(tmp_path, capsys):
    """--fp32-gemm onednn: the generated code calls oneDNN's float32 matmul, the report records it."""
    path = tmp_path / "tiny-f32.yaml"
    path.write_text(yaml.safe_dump({**load_config("tiny").to_dict(), "dtype": "float32", "name": "tiny-f32"}))
    out = tmp_path / "out"
    assert main(["compile", str(path), "--out", str(out), "--repeats", "1", "--fp32-gemm", "onednn"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["fp32_gemm"] == report["check_fp32_gemm"] == "onednn"
    assert report["max_rel_error_vs_pytorch"] < CHECK_TOLERANCE["float32"]
    assert (out / "forward.cpp").read_text().count("ss::matmul<float>(") == 4  # the token-wise GEMMs
    assert "float32 (onednn GEMMs, MKL under 256 token rows)" in capsys.readouterr().out


@pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="bfloat16 CPU builds need AVX512-BF16")
def test_compile_checks_a_bfloat16_config_at_its_own_precision(tmp_path, capsys):
    """A bf16 config compiles and passes the check against PyTorch's bf16 layer (bf16-sized errors)."""
    path = tmp_path / "tiny-bf16.yaml"
    path.write_text(yaml.safe_dump({**load_config("tiny").to_dict(), "dtype": "bfloat16", "name": "tiny-bf16"}))
    out = tmp_path / "out"
    assert main(["compile", str(path), "--out", str(out), "--repeats", "1"]) == 0, capsys.readouterr().err
    err = json.loads((out / "report.json").read_text())["max_rel_error_vs_pytorch"]
    assert 1e-4 < err < CHECK_TOLERANCE["bfloat16"]


def test_outputs_never_replace_foreign_files(tmp_path, capsys, monkeypatch):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    import substation.pipeline

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled before checking --out")
    with monkeypatch.context() as m:  # the refusal comes before the pipeline runs
        m.setattr(substation.pipeline, "compile_layer", no_compile)
        assert main(["compile", "tiny", "--out", str(mine), "--repeats", "1"]) == 2
    assert "refusing to replace" in capsys.readouterr().err and os.listdir(mine) == ["notes.txt"]
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["compile", "tiny", "--out", str(afile), "--repeats", "1"]) == 2
    assert "is an existing file" in capsys.readouterr().err and afile.read_text() == "x"
    # graphs writes its files next to the ones already there
    assert main(["graphs", "tiny", "--out", str(mine)]) == 0
    assert sorted(os.listdir(mine)) == ["notes.txt", "tiny.backward.fused.sdfg", "tiny.backward.sdfg",
                                        "tiny.forward.fused.sdfg", "tiny.forward.sdfg"]
    assert (mine / "notes.txt").read_text() == "keep me"


def test_an_output_folder_that_cannot_be_renamed_is_refilled_in_place(tmp_path, monkeypatch):
    """A mount point (a container volume) or a folder under a read-only parent: publish_dir replaces its
    files instead of renaming it, and leaves nothing next to it."""
    from substation import files
    out = tmp_path / "volume"

    def write(names):
        def build(tmp):
            for n in names:
                with open(os.path.join(tmp, n), "w") as f:
                    f.write(n)
        return build
    assert files._is_mount_point("/") and not files._is_mount_point(str(tmp_path))
    files.publish_dir(write(["a.txt", "b.txt"]), str(out))
    monkeypatch.setattr(files, "_is_mount_point", lambda path: os.path.abspath(path) == str(out))
    os.mkdir(out / "sub")
    files.publish_dir(write(["b.txt", "c.txt"]), str(out))
    assert sorted(os.listdir(out)) == [files.OUTPUT_MARKER, "b.txt", "c.txt"]
    assert os.listdir(tmp_path) == ["volume"]


def test_unwritable_outputs_are_refused_before_the_work(tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if os.fspath(path) == str(locked)
                        else real_access(path, mode, **kw))  # as a read-only mount (root ignores chmod)
    import substation.pipeline
    import substation.perf.tune

    def no_work(*args, **kwargs):
        raise AssertionError("worked before checking the output")
    monkeypatch.setattr(substation.pipeline, "compile_layer", no_work)
    monkeypatch.setattr(substation.pipeline, "compile_graphs", no_work)
    monkeypatch.setattr(substation.perf.tune, "tune", no_work)
    for argv in (["compile", "tiny", "--out", str(locked / "new" / "deeper")], ["graphs", "tiny", "--out", str(locked)],
                 ["tune", "tiny", "--out", str(locked / "p.json")], ["report", "tiny", "--json", str(locked / "r.json")],
                 ["bench", "tiny", "--json", str(locked / "b.json")]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"the folder {locked} is not writable" in err, (argv, err)
    assert os.listdir(locked) == []
    assert main(["report", "tiny", "--plot", str(tmp_path / "chart.txt")]) == 2  # the chart is always a PNG
    assert "give a file name ending in .png" in capsys.readouterr().err
    for argv in (["report", "tiny", "--json", str(tmp_path)], ["tune", "tiny", "--out", str(tmp_path)]):
        assert main(argv) == 2, argv  # a folder where a file is to be written
        assert f"{tmp_path}: is a folder; give the name of a file to write" in capsys.readouterr().err
    if os.path.isdir("/proc/self"):  # a file system that refuses new entries whatever os.access says
        assert main(["graphs", "tiny", "--out", "/proc/substation-out"]) == 2
        assert "the folder /proc is not writable" in capsys.readouterr().err


def test_empty_paths_and_numbers_are_named(capsys):
    for argv, flag in ((["report", "tiny", "--json", ""], "--json"), (["graphs", "tiny", "--out", ""], "--out"),
                       (["bench", "tiny", "--plot", ""], "--plot")):
        assert main(argv) == 2
        assert f"{flag} needs a path, got an empty one" in capsys.readouterr().err
    for value, message in (("abc", "must be a number, got 'abc'"), ("-1", "must be >= 0, got -1.0")):
        with pytest.raises(SystemExit):
            main(["cache", "--prune-days", value])
        assert f"argument --prune-days: {message}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["compile", "tiny", "--repeats", "1.5"])
    assert "argument --repeats: must be an integer, got '1.5'" in capsys.readouterr().err
    for value, message in (("128,abc", "must be an integer, got 'abc'"), ("128,0", "must be >= 1, got 0")):
        with pytest.raises(SystemExit):
            main(["bench", "tiny", "--attention-lengths", value])
        assert f"argument --attention-lengths: {message}" in capsys.readouterr().err


def test_a_bad_fp32_gemm_environment_is_named_before_any_work(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("SUBSTATION_FP32_GEMM", "ONEDNN")
    assert main(["compile", "tiny", "--out", str(tmp_path / "out")]) == 2
    assert "substation: error: $SUBSTATION_FP32_GEMM must be one of mkl, onednn (or unset), got 'ONEDNN'" \
        in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert main(["cache"]) == 0  # builds nothing: the variable does not matter there


def test_a_bad_layout_plan_is_named_before_any_work(capsys, tmp_path):
    assert main(["compile", "tiny", "--out", str(tmp_path / "out"), "--layout", str(tmp_path / "none.json")]) == 2
    err = capsys.readouterr().err
    assert f"substation: error: no layout plan '{tmp_path / 'none.json'}': no such file, nor a bundled plan" in err
    assert "compile tiny" not in err and not (tmp_path / "out").exists()  # no progress bar, no output
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    assert main(["compile", "tiny", "--out", str(tmp_path / "out"), "--layout", str(broken)]) == 2
    assert f"substation: error: layout plan '{broken}': plan is not valid JSON" in capsys.readouterr().err
    assert main(["compile", "tiny", "--out", str(tmp_path / "out"), "--layout", str(tmp_path)]) == 2
    assert f"substation: error: layout plan '{tmp_path}' is a folder; give a plan JSON file" in capsys.readouterr().err
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00")
    assert main(["compile", "tiny", "--out", str(tmp_path / "out"), "--layout", str(binary)]) == 2
    assert f"substation: error: layout plan '{binary}' is not a text (JSON) file" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_version(capsys):
    from substation import __version__
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"substation {__version__}\n"


def test_graphs_and_errors(tmp_path, capsys):
    assert main(["graphs", "tiny", "--out", str(tmp_path / "g")]) == 0
    assert sorted(os.listdir(tmp_path / "g")) == ["tiny.backward.fused.sdfg", "tiny.backward.sdfg",
                                                  "tiny.forward.fused.sdfg", "tiny.forward.sdfg"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("hidden_size: 30\nnum_heads: 4\n")
    assert main(["compile", str(bad), "--out", str(tmp_path / "x")]) == 2
    assert "hidden_size: must be divisible by num_heads" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_python_dash_m():
    proc = subprocess.run([sys.executable, "-m", "substation", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "compile" in proc.stdout and "graphs" in proc.stdout


def test_report_kernels_lists_fused_members(capsys):
    """`substation report --kernels`: every memory-bound kernel of the fused graphs with its operators."""
    assert main(["report", "bert-base", "--kernels"]) == 0
    out = capsys.readouterr().out
    rows = [ln.split(None, 4) for ln in out.splitlines()[2:] if not ln.split()[1].isdigit()]
    kernels = {(r[0], r[1]): r[4] for r in rows}
    assert "forward   5 kernels" in out and "backward  6 kernels" in out
    assert kernels[("forward", "MSD")] == "mask + softmax + attention_dropout"
    assert kernels[("forward", "BDRLN")] == "out_bias + out_dropout + residual1 + layer_norm1"
    assert kernels[("backward", "BDS")] == "attention_dropout_grad + softmax_grad"
    assert all(r[2] in ("SN", "EW") for r in rows) and len(rows) == 11
    assert main(["report", "bert-base", "--kernels", "--no-fuse"]) == 0
    out = capsys.readouterr().out
    assert "after fusion" not in out and "forward   14 kernels" in out and "backward  15 kernels" in out
    # the first line names the GEMM library counted; an inference build has no backward pass to list
    assert main(["report", "bert-base", "--kernels", "--mode", "eval", "--fp32-gemm", "onednn"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith("after fusion (onednn GEMMs, MKL under 256 token rows), inference build")
    assert "forward   2 kernels" in out and "backward" not in out  # RLN, RLN2: the rest is in GEMM epilogues


def test_report_kernels_option_conflicts(capsys):
    assert main(["report", "tiny", "--kernels", "--json", "k.json"]) == 2
    assert "does not take --json" in capsys.readouterr().err
    assert main(["report", "tiny", "--no-fuse"]) == 2
    assert "--no-fuse goes with --kernels" in capsys.readouterr().err
