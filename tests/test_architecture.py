"""The package's structure: no import cycles between its modules (function-level imports included), no
private name imported from another module, no module over the size one reads in a sitting."""
from __future__ import annotations

import ast
import os

import networkx as nx
import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "substation")
#: Lines a module may have (docstrings included).
MAX_MODULE_LINES = 620


def _modules() -> dict[str, str]:
    """Module name -> path of every Python file of the package."""
    out = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


MODULES = _modules()


def _imports(module: str, path: str):
    """(imported module, imported names) of every ``import`` / ``from ... import`` of ``module`` that
    targets the package, at any depth of the file."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "substation":
                continue
            names = [a.name for a in node.names]
            # "from . import x" may import a submodule x
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
            yield target, [n for n in names if f"{target}.{n}" not in MODULES]
            for s in subs:
                yield s, []
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "substation":
                    yield a.name, []


def _graph() -> nx.DiGraph:
    g = nx.DiGraph()
    for module, path in MODULES.items():
        g.add_node(module)
        for target, _ in _imports(module, path):
            # importing a.b.c runs a/__init__ and a/b/__init__ first
            parts = target.split(".")
            for k in range(1, len(parts) + 1):
                name = ".".join(parts[:k])
                if name in MODULES and name != module and not module.startswith(name + "."):
                    g.add_edge(module, name)
    return g


def test_the_package_has_modules_to_check():
    assert {"substation.pipeline", "substation.ir.graph", "substation.ops.kind", "substation.passes.fusion",
            "substation.backends.cpu.codegen", "substation.runtime.library", "substation.perf.timing"} <= set(MODULES)


def test_no_import_cycles():
    g = _graph()
    assert g.number_of_edges() > 50
    cycles = list(nx.simple_cycles(g))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c + c[:1]) for c in cycles[:10])


def test_no_private_names_across_modules():
    bad = []
    for module, path in MODULES.items():
        for target, names in _imports(module, path):
            bad += [f"{module} imports {target}.{n}" for n in names if n.startswith("_") and n != "__version__"]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_size(module):
    with open(MODULES[module]) as f:
        lines = sum(1 for _ in f)
    assert lines <= MAX_MODULE_LINES, f"{module} has {lines} lines (at most {MAX_MODULE_LINES})"


SCRIPTS = os.path.join(os.path.dirname(ROOT), "scripts")


def test_scripts_import_names_the_package_has():
    """Every ``from substation... import name`` in scripts/ (at any depth: the GPU check and the probes
    import inside functions) names a module and an attribute that exist, so a moved module cannot leave a
    script that fails only when someone runs it."""
    import importlib
    missing, checked = [], 0
    for name in sorted(os.listdir(SCRIPTS)):
        if not name.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(open(os.path.join(SCRIPTS, name)).read())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "substation":
                module = importlib.import_module(node.module)
                for alias in node.names:
                    checked += 1
                    if not hasattr(module, alias.name):
                        missing.append(f"{name}:{node.lineno}: {node.module}.{alias.name}")
    assert checked >= 20 and not missing, missing
