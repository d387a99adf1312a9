"""The analysis notebooks run headless against the committed results/ (STYLE.md §13).

Each notebook in notebooks/ must be committed without outputs, open with a markdown cell that
names the command that produced its data, and execute top to bottom in a fresh kernel started
from the repository root, as `jupyter nbconvert --execute` would: an error in any cell fails
the test (nbclient raises CellExecutionError with the cell and its traceback).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REASON = "the notebook tests need nbclient, nbformat and ipykernel: pip install 'upipe[notebooks]'"
nbformat = pytest.importorskip("nbformat", reason=REASON)
nbclient = pytest.importorskip("nbclient", reason=REASON)
pytest.importorskip("ipykernel", reason=REASON)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# what the first cell must name: the runner, the CLI, or a harness module run with -m
COMMAND = re.compile(r"run_all\.sh|upipe-bench \w|python -m experiments\.\w")
CELL_TIMEOUT_S = 120  # per cell; a whole notebook takes a few seconds on 2 cores


def _read(path: Path):
    return nbformat.read(path, as_version=4)


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks/*.ipynb found"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_without_outputs(path: Path):
    nb = _read(path)
    dirty = [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
             and (cell.outputs or cell.execution_count is not None)]
    assert not dirty, f"{path.name}: cells {dirty} have outputs or execution counts; clear them"
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_first_cell_names_its_command(path: Path):
    first = _read(path).cells[0]
    assert first.cell_type == "markdown", f"{path.name}: the first cell must be markdown"
    assert COMMAND.search(first.source), (
        f"{path.name}: the first cell must name the command that produced the data "
        "(./run_all.sh, upipe-bench ..., python -m experiments....)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_executes(path: Path, monkeypatch: pytest.MonkeyPatch):
    # The kernel inherits this environment: no display, one thread (2-core CI machines).
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = _read(path)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    errors = [out for cell in nb.cells for out in cell.get("outputs", [])
              if out.output_type == "error"]
    assert not errors
