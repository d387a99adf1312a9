"""experiments/emulation/audit.py: a committed fitted row against the exact emulation of its cell.

The rows audited here are a tiny cell's exact emulation written as a sweep's run and labelled as
a fit's (the audit reads only what the row claims, its cell and its hardware); a difference is
made by a ``measure`` that returns the same row with one number changed.
"""

from __future__ import annotations

import pandas as pd
import pytest

from experiments.config import Cell, Hardware
from experiments.emulation import audit
from experiments.emulation.emulate import emulate_cell
from experiments.store import CELL_FILE, write_json, write_row

CELL = Cell.from_dict(dict(method="ulysses", model="tiny", seq_len=1024, nproc=2, dtype="bf16"))
HW = Hardware(gpu_mem_gib=1.0, reserve_gib=0.0)


@pytest.fixture(scope="module")
def exact_row() -> dict:
    return emulate_cell(CELL, HW, count=False, exact=True)


def _write(sweep, row: dict, cell: Cell = CELL):
    d = sweep / "runs" / cell.cell_id()
    write_json(d / CELL_FILE, cell.to_dict())
    write_row(d / "row.json", {**row, "sweep": sweep.name, "run_id": "20261130T000000Z"},
              tuple(cell.extra))
    return d / "row.json"


@pytest.mark.slow  # two exact emulations of a tiny step: 1-3 s each
def test_a_row_equal_to_its_exact_emulation_matches(tmp_path, exact_row):
    path = _write(tmp_path / "s-emulated", exact_row | {"emulation": "fit"})
    got = audit.audit_run(path)  # emulated again, on the hardware its hw_* columns name
    assert got["match"] == "yes", got
    assert (got["device_diff_bytes"], got["row_status"], got["exact_status"]) == (0, "ok", "ok")
    assert got["exact_peak_device_bytes"] == exact_row["peak_device_bytes"]
    assert (got["sweep"], got["cell_id"], got["row_git_rev"]) == (
        "s-emulated", CELL.cell_id(), exact_row["git_rev"])


@pytest.mark.slow  # one exact emulation of a tiny step (the fixture's)
def test_a_peak_or_a_status_that_differs_is_no_match(tmp_path, exact_row):
    path = _write(tmp_path / "s-emulated", exact_row | {"emulation": "fit"})
    peak = exact_row["peak_device_bytes"]
    got = audit.audit_run(path, lambda *a, **k: exact_row | {"peak_device_bytes": peak + 512})
    assert (got["match"], got["device_diff_bytes"]) == ("no", 512)
    got = audit.audit_run(path, lambda *a, **k: exact_row | {"status": "oom"})
    assert (got["match"], got["device_diff_bytes"], got["exact_status"]) == ("no", 0, "oom")
    host = exact_row["peak_host_bytes"] or 0
    got = audit.audit_run(path, lambda *a, **k: exact_row | {"peak_host_bytes": host + 1})
    assert got["match"] == "no"


@pytest.mark.slow  # one exact emulation of a tiny step (the fixture's)
def test_only_fitted_rows_of_the_kernel_and_methods_asked_for_are_audited(tmp_path, exact_row):
    sweep = tmp_path / "s-emulated"
    fitted = _write(sweep, exact_row | {"emulation": "fit"})
    other = Cell.from_dict(CELL.to_dict() | {"seq_len": 2048})
    _write(sweep, exact_row | {"seq_len": 2048, "cell_id": other.cell_id()}, other)  # exact
    kernel = exact_row["kernel"]
    assert audit.fitted_runs(sweep) == [fitted]
    assert audit.fitted_runs(sweep, kernel=kernel, methods=["ulysses"]) == [fitted]
    assert audit.fitted_runs(sweep, kernel="not-" + kernel) == []
    assert audit.fitted_runs(sweep, methods=["upipe"]) == []


@pytest.mark.slow  # one exact emulation of a tiny step (the fixture's)
def test_the_cli_writes_updates_and_fails_on_a_difference(tmp_path, exact_row, monkeypatch,
                                                          capsys):
    sweep, out = tmp_path / "s-emulated", tmp_path / "fit_audit"
    _write(sweep, exact_row | {"emulation": "fit"})
    monkeypatch.setattr(audit, "emulate_cell", lambda *a, **k: exact_row)
    assert audit.main([str(sweep), "--out", str(out)]) == 0
    first = pd.read_csv(out / "rows.csv")
    assert list(first["match"]) == ["yes"] and "1 of 1 fitted rows" in capsys.readouterr().out
    # audited again with a different answer: the row is replaced, not added, and the exit is 1
    monkeypatch.setattr(audit, "emulate_cell",
                        lambda *a, **k: exact_row | {"peak_device_bytes": 0})
    assert audit.main([str(sweep), "--out", str(out)]) == 1
    again = pd.read_csv(out / "rows.csv")
    assert len(again) == 1 and list(again["match"]) == ["no"]
    with pytest.raises(SystemExit) as e:  # a folder that is not a sweep's results
        audit.main([str(tmp_path), "--out", str(out)])
    assert e.value.code == 2 and "has no runs/ folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # nothing to audit
        audit.main([str(sweep), "--method", "upipe", "--out", str(out)])
    assert "no fitted row matches" in capsys.readouterr().err


@pytest.mark.slow  # one exact emulation of a tiny step (the fixture's)
def test_a_row_that_does_not_name_its_hardware_is_refused(tmp_path, exact_row):
    row = {k: v for k, v in exact_row.items() if k != "hw_gpu_mem_gib"} | {"emulation": "fit"}
    path = _write(tmp_path / "s-emulated", row)
    with pytest.raises(ValueError, match="no hw_gpu_mem_gib: it does not say which hardware"):
        audit.audit_run(path, lambda *a, **k: pytest.fail("emulated a row it cannot reproduce"))


@pytest.mark.slow  # one exact emulation of a tiny step (the fixture's)
def test_the_cli_reports_a_cell_that_did_not_run(tmp_path, exact_row, monkeypatch, capsys):
    sweep = tmp_path / "s-emulated"
    _write(sweep, exact_row | {"emulation": "fit"})
    monkeypatch.setattr(audit, "emulate_cell", lambda *a, **k: exact_row | {
        "status": "error", "peak_device_bytes": None, "peak_host_bytes": None})
    assert audit.main([str(sweep), "--out", str(tmp_path / "out")]) == 1
    assert "no (device ? B, status ok / error" in capsys.readouterr().out
