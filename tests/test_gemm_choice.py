"""fp32_gemm="auto": inference builds take the float32 GEMM library measured faster on this machine
(substation.perf.gemm_choice), training builds MKL; the measurement's decision rule and its record."""
import json
import os
import time

import pytest

from substation.config import load_config
from substation.perf import gemm_choice
from substation.perf.gemm_choice import ENVIRONMENT, ROUNDS, choose_fp32_gemm, resolve_fp32_gemm


@pytest.fixture
def unpinned(tmp_path, monkeypatch):
    """No SUBSTATION_FP32_GEMM, a private cache, no remembered choice."""
    monkeypatch.delenv(ENVIRONMENT, raising=False)
    monkeypatch.setenv("SUBSTATION_CACHE_DIR", str(tmp_path / "cache"))
    choose_fp32_gemm.cache_clear()
    yield tmp_path / "cache"
    choose_fp32_gemm.cache_clear()


def fake_probe(monkeypatch, onednn_factor, occupancy=1.0, threads=2):
    """gemm_seconds as a machine where oneDNN takes ``onednn_factor(round)`` of MKL's time in round
    1, 2, ... (round 0: the discarded one), the process's threads on the cores ``occupancy`` of the
    time, ``threads`` OpenMP threads (a list: the count may change)."""
    calls = {"mkl": 0, "onednn": 0}
    running = threads if isinstance(threads, list) else [threads]
    monkeypatch.setattr("substation.perf.probes.openmp_threads", lambda: running[0])
    monkeypatch.setattr(gemm_choice, "_process_seconds", lambda: time.perf_counter() * occupancy * running[0])

    def gemm_seconds(shapes, fp32_gemm, repeats=2, dtype="float32", packed_weights=False, epilogues=None):
        assert packed_weights  # oneDNN's calls as inference builds make them
        assert epilogues == gemm_choice.EPILOGUES[fp32_gemm]  # with what each build runs after its GEMMs
        calls[fp32_gemm] += 1
        time.sleep(0.002)  # long against the gaps between reading the two clocks: the occupancy is as set
        scale = onednn_factor(calls["onednn"] - 1) if fp32_gemm == "onednn" else 1.0
        return [2e-9 * m * n * k * scale for m, n, k in shapes]
    monkeypatch.setattr("substation.perf.probes.gemm_seconds", gemm_seconds)
    return calls


@pytest.mark.parametrize("factor,library", [
    (lambda i: 0.8, "onednn"),                         # 1.25x faster in every round
    (lambda i: 0.99, "mkl"),                           # faster in every round, but by less than MIN_GAIN
    (lambda i: 0.8 if i <= 7 else 1.2, "mkl"),         # 7 wins of 9: not significant at 5%
    (lambda i: 0.8 if i != 4 else 1.2, "onednn"),      # 8 wins of 9
    (lambda i: 1.2, "mkl"),
])
def test_measured_choice_and_its_record(unpinned, monkeypatch, factor, library):
    threads = [2]
    calls = fake_probe(monkeypatch, factor, threads=threads)
    record = choose_fp32_gemm(384, 1536, 2)
    assert record["library"] == library and calls == {"mkl": ROUNDS + 1, "onednn": ROUNDS + 1}
    assert record["rounds"] == ROUNDS and len(record["seconds"]["mkl"]) == ROUNDS
    assert record["threads"] == 2 and record["occupancy"] == pytest.approx(1.0, abs=0.1)
    assert record["shapes"] == [[1024, 384, 384]] * 4 + [[1024, 1536, 384], [1024, 384, 1536]]
    files = [f for f in os.listdir(unpinned / "tune") if f.endswith(".json")]
    assert len(files) == 1 and files[0].startswith("fp32-gemm-")
    assert json.loads((unpinned / "tune" / files[0]).read_text()) == record
    choose_fp32_gemm.cache_clear()  # another process: reads the record, measures nothing
    assert choose_fp32_gemm(384, 1536, 2) == record and calls == {"mkl": ROUNDS + 1, "onednn": ROUNDS + 1}
    with pytest.raises(ValueError, match=r"choose_fp32_gemm\(threads=1\) measures on the current OpenMP thread "
                                         r"count, 2; set it first \(torch.set_num_threads\(1\)\)"):
        choose_fp32_gemm(384, 1536, 1)  # a measurement due for 1 thread, run on 2: refused, nothing measured
    assert calls["mkl"] == ROUNDS + 1
    threads[0] = 1
    assert choose_fp32_gemm(384, 1536, 1)["library"] == library and calls["mkl"] == 2 * ROUNDS + 2  # 1 thread: its own


def test_a_choice_measured_on_busy_cores_is_not_recorded(unpinned, monkeypatch):
    """Other work on the cores while the libraries are timed (the process ran 40% of the rounds' time x
    its threads): this process uses the choice, with a warning; nothing is recorded, so the next process
    measures again, and a quiet measurement is recorded."""
    calls = fake_probe(monkeypatch, lambda i: 0.5, occupancy=0.4)
    with pytest.warns(UserWarning, match=r"float32 inference builds call onednn: the float32 GEMM libraries were "
                                         r"measured while other work held the cores \(the measurement ran \d+% of its "
                                         r"time x 2 threads\); this process keeps the choice, a later one measures again"):
        record = choose_fp32_gemm(384, 1536, 2)
    assert record["library"] == "onednn" and record["occupancy"] == pytest.approx(0.4, abs=0.1)
    assert not list((unpinned / "tune").glob("*.json"))
    assert choose_fp32_gemm(384, 1536, 2) is record  # this process: measured once
    choose_fp32_gemm.cache_clear()  # the next process, on quiet cores
    fake_probe(monkeypatch, lambda i: 0.5, occupancy=0.95)
    assert choose_fp32_gemm(384, 1536, 2)["library"] == "onednn" and calls["mkl"] == ROUNDS + 1
    assert len(list((unpinned / "tune").glob("*.json"))) == 1


def test_an_unreadable_or_older_record_is_measured_again(unpinned, monkeypatch):
    calls = fake_probe(monkeypatch, lambda i: 0.5)
    assert choose_fp32_gemm(64, 256, 2)["library"] == "onednn"
    (record,) = (unpinned / "tune").glob("*.json")
    # a library that is none; records of earlier formats (measured without the epilogues, on unpacked weights)
    for text in ('{"format": "substation-fp32-gemm/3", "library": "blas"}',
                 '{"format": "substation-fp32-gemm/2", "library": "mkl"}',
                 '{"format": "substation-fp32-gemm/1", "library": "mkl"}'):
        record.write_text(text)
        choose_fp32_gemm.cache_clear()
        measured = calls["mkl"]
        assert choose_fp32_gemm(64, 256, 2)["library"] == "onednn" and calls["mkl"] == measured + ROUNDS + 1
        assert json.loads(record.read_text())["library"] == "onednn"


def test_resolution(unpinned, monkeypatch):
    monkeypatch.setattr(gemm_choice, "choose_fp32_gemm", lambda hidden, ffn, threads: {"library": "onednn"})
    monkeypatch.setattr("substation.perf.probes.openmp_threads", lambda: 2)
    f32, bf16, f64 = (load_config("tiny").replace(dtype=d) for d in ("float32", "bfloat16", "float64"))
    assert [resolve_fp32_gemm("auto", c, m) for c, m in ((f32, "eval"), (f32, "train"), (bf16, "eval"),
                                                        (f64, "eval"), (f32.replace(target="cuda"), "eval"))] \
        == ["onednn", "mkl", "mkl", "mkl", "mkl"]
    assert resolve_fp32_gemm("mkl", f32, "eval") == "mkl" and resolve_fp32_gemm("onednn", f32, "train") == "onednn"
    monkeypatch.setenv(ENVIRONMENT, "mkl")
    assert resolve_fp32_gemm("auto", f32, "eval") == "mkl" and resolve_fp32_gemm("onednn", f32, "eval") == "onednn"
    monkeypatch.setenv(ENVIRONMENT, "onednn")  # the inference builds' library; training builds keep MKL
    assert resolve_fp32_gemm("auto", f32, "eval") == "onednn" and resolve_fp32_gemm("auto", f32, "train") == "mkl"
    monkeypatch.setenv(ENVIRONMENT, "blis")
    with pytest.raises(ValueError, match=r"\$SUBSTATION_FP32_GEMM must be one of mkl, onednn \(or unset\), got 'blis'"):
        resolve_fp32_gemm("auto", f32, "eval")
    assert resolve_fp32_gemm("auto", f64, "eval") == "mkl"  # read only where it applies
    monkeypatch.delenv(ENVIRONMENT)

    def unbuildable():
        raise gemm_choice.BuildError("the build cache folder /ro is not writable")
    monkeypatch.setattr("substation.perf.probes.openmp_threads", unbuildable)
    with pytest.warns(UserWarning, match=r"float32 inference builds call MKL: the float32 GEMM libraries could not "
                                         r"be measured \(BuildError: the build cache folder /ro is not writable\)"):
        assert resolve_fp32_gemm("auto", f32, "eval") == "mkl"
    with pytest.raises(ValueError, match="fp32_gemm .* must be one of auto, mkl, onednn, got 'cublas'"):
        resolve_fp32_gemm("cublas", f32, "eval")


def test_auto_builds_call_the_chosen_library(unpinned, monkeypatch):
    """The inference build of an "auto" layer calls the chosen library (its source, its record), the
    training build MKL; the option stays "auto" so that derived builds choose again."""
    from substation.pipeline import compile_layer
    monkeypatch.setattr(gemm_choice, "choose_fp32_gemm", lambda hidden, ffn, threads: {"library": "onednn"})
    # a config of its own: the process memo of builds keys "auto" builds by the option, not the choice
    compiled = compile_layer(load_config("tiny").replace(dtype="float32", name="tiny-gemm-choice"))
    inference = compiled.forward_only()
    assert compiled.options["fp32_gemm"] == inference.options["fp32_gemm"] == "auto"
    assert (compiled.fp32_gemm_library, inference.fp32_gemm_library) == ("mkl", "onednn")
    assert "ss::matmul<float>" in inference.sources["forward"]
    assert "ss::matmul<float>" not in compiled.sources["forward"] + compiled.sources["backward"]


def test_a_record_written_while_waiting_is_read_and_a_failed_probe_means_mkl(unpinned, monkeypatch):
    import contextlib
    calls = fake_probe(monkeypatch, lambda i: 0.5)
    theirs = {"format": gemm_choice.RECORD_FORMAT, "library": "mkl", "measured": "by another process"}

    @contextlib.contextmanager
    def another_process_measured(path):  # the lock was held by a process that wrote its record
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(theirs, f)
        yield
    monkeypatch.setattr(gemm_choice, "_measuring_alone", another_process_measured)
    assert choose_fp32_gemm(32, 128, 2) == theirs and calls == {"mkl": 0, "onednn": 0}
    monkeypatch.undo()
    choose_fp32_gemm.cache_clear()

    def broken(*args, **kwargs):
        raise gemm_choice.BuildError("the compiler failed")
    monkeypatch.setattr("substation.perf.probes.gemm_seconds", broken)
    with pytest.warns(UserWarning, match="could not be measured"):
        record = choose_fp32_gemm(48, 96, 2)
    assert record["library"] == "mkl" and record["unavailable"] == "BuildError: the compiler failed"
    assert len(list((unpinned / "tune").glob("*.json"))) == 1  # the other process's record alone


def test_a_bad_environment_is_named_when_a_layer_compiles(monkeypatch):
    import substation
    from substation.pipeline import PipelineOptions
    monkeypatch.setenv(ENVIRONMENT, "MKL")
    with pytest.raises(ValueError, match=r"\$SUBSTATION_FP32_GEMM must be one of mkl, onednn \(or unset\), got 'MKL'"):
        substation.compile("tiny")
    assert PipelineOptions(fp32_gemm="mkl").fp32_gemm == "mkl"  # a named library does not read it
