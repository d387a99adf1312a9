"""experiments.store beyond a cut or malformed file (tests/test_faults.py): a row that is valid
JSON but not its folder's is as bad as a cut one, and the files get the process's umask.

Run folders are written here by hand (``runs/<cell_id>/{cell.json,row.json}``, as the runner
writes them); no rank is launched.
"""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from experiments.cli import main
from experiments.config import Cell, Sweep
from experiments.harness.launch import describe
from experiments.reporting.tables import ROWS, load_rows, write_tables
from experiments.row import NUMBERS, unknown_keys
from experiments.runner.sweep_runner import SweepRunner
from experiments.store import ROW_FIELDS, BadResultFile, read_row, write_json, write_row

ROOT = Path(__file__).resolve().parents[1]
BASE = {"model": "tiny", "nproc": 2, "stack": "alst", "warmup": 0, "iters": 1, "seq_len": 256}


def _stored(tmp_path: Path) -> tuple[SweepRunner, list[Cell]]:
    """A sweep of two cells (ulysses, upipe) whose runs are stored, each with its cell.json."""
    sweep = Sweep("s", "store", "cpu", base=dict(BASE),
                  axes={"variant": [{"method": "ulysses"}, {"method": "upipe"}]})
    runner = SweepRunner(sweep, tmp_path, progress=False)
    cells = sweep.cells()
    for cell in cells:
        path = runner._row_path(cell)
        write_json(path.with_name("cell.json"), cell.to_dict())
        write_json(path, describe(cell, None) | {"status": "ok", "error": "", "mode": "measured",
                                                 "peak_device_bytes": 2**20, "mfu": None,
                                                 "times_s": [0.5, 0.5]})
    (runner.dir / "sweep.json").write_text(json.dumps({"plots": []}))
    return runner, cells


class _Quick:
    """The executor: records the cell and returns its row instead of launching ranks."""

    def __init__(self):
        self.ran = []

    def unavailable(self, cell):
        return None

    def run(self, cell):
        self.ran.append(cell)
        return describe(cell, None) | {"status": "ok", "error": "", "mode": "measured"}


def test_a_row_from_another_cell_is_set_aside_and_its_cell_runs_again(tmp_path, capsys):
    runner, (ulysses, upipe) = _stored(tmp_path)
    assert sorted(load_rows(runner.dir)["method"]) == ["ulysses", "upipe"]  # both rows stand
    copied = runner._row_path(upipe)
    shutil.copy(runner._row_path(ulysses), copied)  # ulysses' row in upipe's folder
    # a rebuild names it (and the CLI exits 2) instead of listing ulysses twice, upipe never
    assert main(["plot", str(runner.dir)]) == 2
    assert f"{copied}: the row of cell '{ulysses.cell_id()}'" in capsys.readouterr().err
    assert runner.action(upipe) == "re-run"
    runner.executor = _Quick()
    assert runner.run(upipe)["method"] == "upipe" and runner.executor.ran == [upipe]
    kept = copied.with_name("row.json.bad")  # kept for inspection, as it was
    assert kept.read_text() == runner._row_path(ulysses).read_text()
    assert read_row(copied)["cell_id"] == upipe.cell_id()  # its own row now
    assert "own cell's folder" in capsys.readouterr().err
    write_tables(runner.dir)
    assert sorted(pd.read_csv(runner.dir / ROWS)["method"]) == ["ulysses", "upipe"]


@pytest.mark.parametrize("field, value, why", [
    ("peak_device_bytes", "abc", "peak_device_bytes must be a number or null, got 'abc'"),
    ("tokens_per_s_per_gpu", True, "tokens_per_s_per_gpu must be a number or null"),
    ("seq_len", 512, r"differ from .*cell.json: seq_len 512 \(cell.json: 256\)"),
    ("stack", "none", r"stack 'none' \(cell.json: 'alst'\)"),
])
def test_a_row_that_is_not_its_cells_or_not_numeric_is_bad(tmp_path, field, value, why):
    runner, (ulysses, _) = _stored(tmp_path)
    path = runner._row_path(ulysses)
    write_json(path, json.loads(path.read_text()) | {field: value})
    with pytest.raises(BadResultFile, match=why) as e:
        write_tables(runner.dir)
    assert e.value.path == path
    assert runner.action(ulysses) == "re-run"  # set aside and run again, as a cut row


@pytest.mark.slow  # about 3 s on 2 cores (docs/testing.md)
@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_result_files_get_the_umask(tmp_path, umask, mode):
    """Results are shared and committed: a written file is 0666 less the umask, as any file
    the process creates (mkstemp's 0600 is not kept). A fresh process: the store reads the
    umask once, at import."""
    path = tmp_path / "runs" / "row.json"
    code = (f"import os; os.umask({umask:#o}); from experiments.store import write_json; "
            f"write_json({str(path)!r}, {{'a': 1}})")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    assert stat.S_IMODE(path.stat().st_mode) == mode
    assert json.loads(path.read_text()) == {"a": 1}


def test_the_row_is_typed_once_and_every_committed_row_is_one():
    """experiments/row.py declares every column; the required keys and the numbers are read
    from its types, and every row.json under results/ has only declared columns."""
    assert set(ROW_FIELDS) == {"cell_id", "method", "model", "seq_len", "nproc", "ring_degree",
                               "stack", "status", "mode"}
    assert {"tokens_per_s_per_gpu", "peak_device_bytes", "budget_mib"} <= set(NUMBERS)
    assert not {"host_pinned", "status", "times_s", "heads_per_stage"} & set(NUMBERS)
    paths = sorted(ROOT.glob("results/*/runs/*/row.json"))
    assert len(paths) > 100
    for path in paths:
        read_row(path)  # raises BadResultFile naming an undeclared column or a text number


def test_a_row_with_an_undeclared_column_is_refused_where_written_and_read(tmp_path):
    cell = Cell("ulysses", extra={"rep": 0})
    row = describe(cell, None) | {"status": "ok", "mode": "measured", "tokens_per_sec": 1.0}
    path = tmp_path / "runs" / cell.cell_id() / "row.json"
    with pytest.raises(ValueError, match="'tokens_per_sec' is no column of a row"):
        write_row(path, row, tuple(cell.extra))
    assert not path.exists()
    with pytest.raises(ValueError, match="heads_per_stage must be a number or null, got '8'"):
        write_row(path, describe(cell, None) | {"status": "ok", "mode": "measured",
                                                "heads_per_stage": "8"}, ("rep",))
    good = describe(cell, None) | {"status": "ok", "mode": "measured"}
    assert "rep" in good and unknown_keys(good) == ["rep"]  # a label of the cell's own
    write_row(path, good, tuple(cell.extra))
    write_json(path.with_name("cell.json"), cell.to_dict())
    assert read_row(path) == good
    write_json(path, row)  # written past the check: read_row names it
    with pytest.raises(BadResultFile, match="'tokens_per_sec' is no column"):
        read_row(path)
