"""The time validation's summary and plot (experiments/reporting/validation.py) on a table
whose answer is known, and its predictions' refusal of a run without its cell.json."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from experiments.config import Cell
from experiments.harness.launch import describe
from experiments.reporting.validation import summarize_errors, write_time_validation
from experiments.runner.time_validation import predictions
from experiments.store import BadResultFile, write_json


def _table(errors: list[float]) -> pd.DataFrame:
    measured = [1.0 + i for i in range(len(errors))]
    return pd.DataFrame({
        "cell_id": [f"c{i}" for i in range(len(errors))],
        "method": ["ulysses", "upipe"] * (len(errors) // 2) + ["ring"] * (len(errors) % 2),
        "model": "tiny", "measured_s": measured,
        "predicted_s": [m * (1 + e) for m, e in zip(measured, errors, strict=True)],
        "error": errors,
    })


def test_the_summary_reads_median_and_worst_absolute_errors():
    s = summarize_errors(_table([0.1, -0.2, 0.05, 0.4, -0.1]))
    assert s["cells"] == 5
    assert s["median_abs_error"] == pytest.approx(0.1)
    assert s["worst_abs_error"] == pytest.approx(0.4) and s["worst_cell"] == "c3"
    assert s["meets_targets"] is False  # worst 40% > 35%
    assert summarize_errors(_table([0.1, -0.12, 0.3]))["meets_targets"] is True


def test_the_files_are_written_and_an_empty_table_is_refused(tmp_path):
    write_time_validation(tmp_path, _table([0.1, -0.2, 0.05]))
    assert json.loads((tmp_path / "summary.json").read_text())["cells"] == 3
    assert len(pd.read_csv(tmp_path / "comparison.csv")) == 3
    assert (tmp_path / "predicted_vs_measured.png").stat().st_size > 0
    with pytest.raises(ValueError, match="no cell"):
        write_time_validation(tmp_path, _table([]).iloc[0:0])


def test_predictions_name_a_run_without_its_cell_json(tmp_path):
    """A measured row is predicted from its run's cell.json: without one (deleted, and the
    sweep not resumed since, which writes it again) the error names the file, not a bare
    FileNotFoundError. Nothing is emulated: the check comes first."""
    cell = Cell("ulysses", model="tiny", seq_len=256, nproc=2)
    row = tmp_path / "runs" / cell.cell_id() / "row.json"
    write_json(row, describe(cell, None) | {"status": "ok", "error": "", "mode": "measured",
                                            "time_median_s": 2.0})
    with pytest.raises(BadResultFile, match="cell.json: missing") as e:
        predictions(tmp_path, tmp_path / "profile.json")
    assert e.value.path == row.with_name("cell.json")
