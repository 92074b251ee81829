"""Every per-row ``omp simd`` loop of the generated CPU kernels, and of the header functions they call,
vectorizes with the project's compiler flags: GCC's own report (``-fopt-info-vec-all``) on the fused
sources of the tiny config (float32 and bfloat16, train and eval). A loop GCC leaves scalar runs
several times slower: ``std::max`` in the fused attention's ``reduction(max: ...)`` compiled to a
chain of scalar ``vmaxss``, and the row maximum took twice as long as the row's exponentials."""
import os
import re
import subprocess
import warnings

import pytest

from substation.backends.cpu.build import FLAGS, onednn, toolchain
from substation.backends.cpu.codegen import generate_cpu
from substation.config import load_config
from substation.pipeline import compile_graphs
from substation.resources import csrc_dir

CASES = [(dtype, mode) for dtype in ("float32", "bfloat16") for mode in ("train", "eval")]


def _loop_end(lines: list[str], start: int) -> int:
    """Index of the line closing the braces opened from ``lines[start]`` on (the loop's own line when
    its body is one statement)."""
    depth = 0
    for n in range(start, len(lines)):
        depth += lines[n].count("{") - lines[n].count("}")
        if depth <= 0 and (n > start or "{" not in lines[start]):
            return n
    raise AssertionError(f"unbalanced loop at line {start + 1}")


def simd_loops(text: str) -> list[tuple[int, int, str]]:
    """(first line, last line, text of the first line), 1-based, of every ``#pragma omp simd`` loop of
    ``text`` without a nested loop (the per-thread column sums after the rows have one)."""
    lines = text.split("\n")
    out = []
    for n, line in enumerate(lines):
        if line.strip().startswith("#pragma omp simd"):
            start, end = n + 1, _loop_end(lines, n + 1)
            if not any("for (" in body for body in lines[start + 1:end]):
                out.append((start + 1, end + 1, lines[start].strip()))
    return out


def scalar_simd_loops(source: str, tmp_path) -> list[str]:
    """The simd loops (:func:`simd_loops`) of ``source`` and of the headers it includes that GCC does
    not vectorize, as 'file:line: text'. A header's loop is checked when GCC reports on it (its
    function is compiled in this source); every loop of the source itself must be reported vectorized."""
    path = tmp_path / "source.cpp"
    path.write_text(source)
    tc = toolchain()
    flags = [f for f in FLAGS if f != "-shared"]
    includes = [f"-I{csrc_dir()}", f"-I{tc.blas_include}"] + (["-I" + onednn().include] if "dnnl" in source else [])
    run = subprocess.run([tc.cxx, *flags, *includes, "-c", str(path), "-o", str(tmp_path / "source.o"),
                          "-fopt-info-vec-all"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    reports: dict[str, dict[int, bool]] = {}
    for m in re.finditer(r"^(?:.*/)?([\w.]+):(\d+):\d+: (optimized: loop vectorized|missed)", run.stderr, re.M):
        lines = reports.setdefault(m.group(1), {})
        lines[int(m.group(2))] = lines.get(int(m.group(2)), False) or m.group(3).startswith("optimized")
    texts = {"source.cpp": source}
    texts.update({name: open(os.path.join(csrc_dir(), name)).read() for name in reports if name.startswith("substation_")})
    scalar = []
    for name, text in texts.items():
        seen = reports.get(name, {})
        for first, last, line in simd_loops(text):
            inside = [ok for n, ok in seen.items() if first <= n <= last]
            if (inside or name == "source.cpp") and not any(inside):
                scalar.append(f"{name}:{first}: {line}")
    return scalar


@pytest.mark.parametrize("dtype, mode", CASES)
def test_row_kernel_loops_vectorize(dtype, mode, tmp_path):
    config = load_config("tiny").replace(dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graphs = [g for g in compile_graphs(config, fuse_ops=True, mode=mode) if g is not None]
    for graph in graphs:
        source = generate_cpu(graph)
        loops = source.count("#pragma omp simd")
        assert loops >= 3, f"{graph.phase}: only {loops} simd loops"
        assert scalar_simd_loops(source, tmp_path) == [], f"{dtype} {mode} {graph.phase}: loops GCC left scalar"
