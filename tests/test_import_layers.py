"""Imports point one way, checked on the source with ``ast``, without importing.

The layering is docs/design.md#layout-and-dependency-direction:

upipe <- baselines <- experiments; inside experiments each package imports only the packages
below it (``ALLOWED``: config <- instruments <- harness <- timing <- emulation <- runner <- cli,
gpu beside the runner), reporting reads result files and is imported by the runner, gpu and the
CLI only, there is no import cycle between modules, and no module imports another of the project
inside a function (the way cycles get dodged).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("upipe", "baselines", "experiments")

# experiments' parts -> the parts each may import (itself included)
BASE = {"config", "row", "store", "provenance"}
ALLOWED = {
    "config": {"config"},
    "row": {"config"},
    "store": {"config", "row"},
    "provenance": set(),
    "sweeps": {"config", "sweeps"},
    "instruments": {"config", "instruments"},
    "harness": BASE | {"instruments", "harness"},
    "timing": BASE | {"instruments", "harness", "timing"},
    "emulation": BASE | {"instruments", "harness", "timing", "emulation"},
    "reporting": {"config", "row", "store", "reporting"},
    "runner": BASE | {"instruments", "harness", "timing", "emulation", "reporting", "runner"},
    # the GPU checks: beside the runner (neither imports the other), below the CLI
    "gpu": BASE | {"instruments", "harness", "timing", "emulation", "reporting", "gpu"},
    "cli": BASE | {"instruments", "harness", "timing", "emulation", "reporting", "runner", "gpu",
                   "sweeps", "cli"},
}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _part(module: str) -> str:
    """experiments.harness.launch -> harness; experiments.cli_args -> cli; upipe.x -> upipe."""
    top, _, rest = module.partition(".")
    if top != "experiments":
        return top
    part = rest.split(".")[0] if rest else "experiments"
    return "cli" if part in ("cli", "cli_args") else part


def _imports(path: Path) -> list[tuple[str, bool, int]]:
    """(imported project module, at module level?, line) for every import in the file."""
    tree = ast.parse(path.read_text())
    top_level = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]  # resolved by _resolve
        for name in names:
            if name.split(".")[0] in PROJECT:
                out.append((name, id(node) in top_level, node.lineno))
    return out


FILES = sorted(p for top in PROJECT for p in (ROOT / top).rglob("*.py"))
MODULES = {_module(p) for p in FILES}


def _resolve(name: str) -> str | None:
    """The project module an import name refers to (``from a.b import c``: a.b.c if a module,
    else a.b)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def test_there_is_something_to_check():
    assert len(FILES) > 60 and "experiments.harness.launch" in MODULES


def test_every_package_of_experiments_has_its_layer():
    parts = {_part(m) for m in MODULES if m.startswith("experiments.")}
    assert parts - {"experiments"} <= set(ALLOWED), sorted(parts - set(ALLOWED))
    assert {"timing", "gpu"} <= parts


def test_no_function_level_imports_of_project_modules():
    bad = [f"{p.relative_to(ROOT)}:{line} imports {name}" for p in FILES
           for name, at_top, line in _imports(p) if not at_top]
    assert not bad, "imports inside functions (move them up, or fix the cycle):\n" + \
        "\n".join(bad)


def test_each_part_imports_only_the_parts_below_it():
    bad = []
    for p in FILES:
        mod = _module(p)
        src = _part(mod)
        for name, _, line in _imports(p):
            target = _resolve(name)
            if target is None:
                continue
            dst = _part(target)
            if src == "upipe" and dst != "upipe" or src == "baselines" and dst == "experiments":
                bad.append(f"{mod}:{line} -> {target}")
            elif mod.startswith("experiments") and dst not in ("upipe", "baselines"):
                if dst not in ALLOWED.get(src, set()):
                    bad.append(f"{mod}:{line} ({src}) -> {target} ({dst})")
    assert not bad, (
        "imports against the layering of docs/design.md#layout-and-dependency-direction:\n"
        + "\n".join(bad))


def test_no_import_cycles():
    graph = {_module(p): {t for n, _, _ in _imports(p) if (t := _resolve(n)) and t != _module(p)}
             for p in FILES}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path + [m, n]
            if n not in state and (cycle := visit(n, path + [m])):
                return cycle
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m, [])):
            pytest.fail("import cycle: " + " -> ".join(cycle[cycle.index(cycle[-1]):]))
