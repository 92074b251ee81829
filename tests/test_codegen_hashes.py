"""Safety net for refactoring: the SHA-256 of the generated CPU and CUDA sources of every bundled config
(unfused and fused, PyTorch's layouts and the bundled tuned plan, forward and backward) must stay what
``tests/data/codegen_hashes.json`` records. A deliberate change of generated code updates that file in
its own commit: ``python tests/test_codegen_hashes.py --update``.
"""
import hashlib
import json
import pathlib
import sys
import warnings

import pytest

from substation.backends.cpu.codegen import generate_cpu
from substation.backends.cuda.codegen import generate_cuda
from substation.config import load_config
from substation.pipeline import compile_graphs

HASHES = pathlib.Path(__file__).resolve().parent / "data" / "codegen_hashes.json"
CONFIGS = ("tiny", "minilm-l6", "bert-base", "bert-large-b8-l512", "bert-large-b96-l128")


def cases():
    """(case id, config, fuse, layout) of every hashed build."""
    out = []
    for name in CONFIGS:
        base = load_config(name)
        variants = [("cpu", base)] + [(f"cuda-{d}", base.replace(target="cuda", dtype=d))
                                      for d in ("float32", "float16", "bfloat16")]
        for target, config in variants:
            for fuse in (False, True):
                out.append((f"{name}/{target}/{'fused' if fuse else 'unfused'}/default", config, fuse, None))
    out.append(("bert-base/cpu/fused/bert-base.plan", load_config("bert-base"), True, "bert-base"))
    return out


def generate_source(graph) -> str:
    return generate_cuda(graph) if graph.config.target == "cuda" else generate_cpu(graph)


def source_hashes(config, fuse, layout) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graphs = compile_graphs(config, fuse_ops=fuse, layout=layout)
    return {phase: hashlib.sha256(generate_source(g).encode()).hexdigest() for phase, g in zip(("forward", "backward"), graphs)}


@pytest.fixture(scope="module")
def recorded():
    return json.loads(HASHES.read_text())


@pytest.mark.parametrize("case,config,fuse,layout", cases(), ids=[c[0] for c in cases()])
def test_generated_source_unchanged(recorded, case, config, fuse, layout):
    assert source_hashes(config, fuse, layout) == recorded[case], \
        f"generated code of {case} changed; if deliberate, run python tests/test_codegen_hashes.py --update"


def test_every_case_is_recorded(recorded):
    assert sorted(recorded) == sorted(c[0] for c in cases()) and len(recorded) == 41


if __name__ == "__main__" and sys.argv[1:] == ["--update"]:
    HASHES.write_text(json.dumps({c[0]: source_hashes(*c[1:]) for c in cases()}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {HASHES}")
