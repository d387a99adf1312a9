"""The analysis notebooks run headless against the committed results/
(docs/conventions.md#notebooks-read-results-only).

Each notebook in notebooks/ must be committed without outputs, open with a markdown cell that
names the command that produced its data, and execute top to bottom in a fresh kernel started
from the repository root, as `jupyter nbconvert --execute` would: an error in any cell fails
the test (nbclient raises CellExecutionError with the cell and its traceback). The notebooks
stay thin: what they share lives in experiments.reporting.notebook, never pasted into a cell,
and the Table 3 and Table 4 notebooks are one notebook with two parameters.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from experiments.reporting import notebook as helpers

REASON = "running a notebook needs nbclient, nbformat and ipykernel: pip install 'upipe[notebooks]'"

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# what the first cell must name: the runner, the CLI, or a harness module run with -m
COMMAND = re.compile(r"run_all\.sh|upipe-bench \w|python -m experiments\.\w")
CELL_TIMEOUT_S = 120  # per cell; a whole notebook takes a few seconds on 2 cores
# one notebook read with two parameters: they may differ in the title cell and the parameter cell
TWINS = ("table3_llama3_8b.ipynb", "table4_qwen3_32b.ipynb")


def _read(path: Path) -> dict:
    """The notebook's JSON (format 4), each cell's source joined into one string, as nbformat
    gives it. Read as JSON: importing nbformat builds jsonschema's URI grammar, 1.1 s of every
    test run's collection; the runs of ``test_executes`` read and validate with it."""
    nb = json.loads(path.read_text())
    assert nb.get("nbformat") == 4, f"{path.name}: notebook format {nb.get('nbformat')}, not 4"
    for cell in nb["cells"]:
        if isinstance(cell["source"], list):
            cell["source"] = "".join(cell["source"])
    return nb


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks/*.ipynb found"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_without_outputs(path: Path):
    nb = _read(path)
    dirty = [i for i, cell in enumerate(nb["cells"]) if cell["cell_type"] == "code"
             and (cell.get("outputs") or cell.get("execution_count") is not None)]
    assert not dirty, f"{path.name}: cells {dirty} have outputs or execution counts; clear them"
    assert nb["metadata"].get("kernelspec", {}).get("name") == "python3"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_first_cell_names_its_command(path: Path):
    first = _read(path)["cells"][0]
    assert first["cell_type"] == "markdown", f"{path.name}: the first cell must be markdown"
    assert COMMAND.search(first["source"]), (
        f"{path.name}: the first cell must name the command that produced the data "
        "(./run_all.sh, upipe-bench ..., python -m experiments....)")


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_executes(path: Path, monkeypatch: pytest.MonkeyPatch):
    # imported here, not at collection: the kernel's client and the kernel take seconds to
    # import, and only these (slow) tests run a kernel
    nbclient = pytest.importorskip("nbclient", reason=REASON)
    nbformat = pytest.importorskip("nbformat", reason=REASON)
    pytest.importorskip("ipykernel", reason=REASON)
    # The kernel inherits this environment: no display, one thread (2-core CI machines).
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    errors = [out for cell in nb.cells for out in cell.get("outputs", [])
              if out.output_type == "error"]
    assert not errors


def _parameter_cell(nb) -> int:
    """The index of the one code cell tagged ``parameters`` (the papermill convention)."""
    tagged = [i for i, cell in enumerate(nb["cells"]) if cell["cell_type"] == "code"
              and "parameters" in cell["metadata"].get("tags", [])]
    assert len(tagged) == 1, f"expected one cell tagged 'parameters', found cells {tagged}"
    return tagged[0]


def test_table_notebooks_differ_only_in_title_and_parameters():
    a, b = (_read(ROOT / "notebooks" / name) for name in TWINS)
    assert len(a["cells"]) == len(b["cells"]), f"{TWINS}: different numbers of cells"
    param = _parameter_cell(a)
    assert _parameter_cell(b) == param
    differ = [i for i, (x, y) in enumerate(zip(a["cells"], b["cells"], strict=True))
              if (x["cell_type"], x["source"]) != (y["cell_type"], y["source"])]
    assert differ == [0, param], (
        f"{TWINS} may differ only in the title (cell 0) and the parameter cell ({param}); "
        f"they differ in cells {differ}")
    artefacts = [re.search(r'ARTEFACT = "(\w+)"', nb["cells"][param]["source"]) for nb in (a, b)]
    assert all(artefacts) and artefacts[0][1] != artefacts[1][1]


# the title cell's sentence on what the paper's table runs: "The paper's Table 3 ... stack."
PAPER_SENTENCE = re.compile(r"The paper's Table \d (.*?)\.\s", re.S)


@pytest.mark.parametrize("name, table", list(zip(TWINS, ("table3", "table4"), strict=True)))
def test_title_says_what_the_papers_table_runs(name: str, table: str):
    """The sentence on the paper's table names the paper's Ulysses (its ratios' reference,
    ``reproduction.VERSUS``) by its method, and none of the sweep's rows beyond the paper
    (``paper_grid.NOT_IN_PAPER``: DeepSpeed's Ulysses; Table 4 has no 16-GPU Ulysses nor UPipe)."""
    from experiments.reporting.paper_grid import NOT_IN_PAPER
    from experiments.reporting.reproduction import VERSUS

    said = PAPER_SENTENCE.search(_read(ROOT / "notebooks" / name)["cells"][0]["source"])
    assert said, f"{name}: no sentence 'The paper's Table N ...' in the title cell"
    said = " ".join(said[1].split())
    assert f"`{VERSUS[table][0][0]}" in said, f"{name}: the paper's Ulysses is not named"
    assert "DeepSpeed's Ulysses" not in said and "`ds-ulysses`" not in said, NOT_IN_PAPER[
        "ds-ulysses"]
    assert not re.search(r"over (all )?16", said), f"{name}: Table 4 runs no 16x1 Ulysses/UPipe"


def _defined(path: Path) -> set[str]:
    """The names of the functions that a notebook's code cells define (magics skipped)."""
    names = set()
    for cell in _read(path)["cells"]:
        if cell["cell_type"] == "code":
            code = "\n".join(ln for ln in cell["source"].splitlines() if not ln.startswith("%"))
            names |= {n.name for n in ast.walk(ast.parse(code)) if isinstance(n, ast.FunctionDef)}
    return names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_uses_the_helpers_instead_of_pasting_them(path: Path):
    public = {name for name in dir(helpers) if not name.startswith("_")}
    pasted = _defined(path) & public
    assert not pasted, (f"{path.name} defines {sorted(pasted)}: import them from "
                        "experiments.reporting.notebook instead")
    sources = "\n".join(cell["source"] for cell in _read(path)["cells"])
    assert "from experiments.reporting import notebook as nb" in sources
