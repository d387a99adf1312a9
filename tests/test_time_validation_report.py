"""The time validation's summary and plot (experiments/reporting/validation.py) on a table
whose answer is known, and its predictions' refusal of a run without its cell.json; the GPU
validation's summary, plot and refusal without a GPU."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from experiments import cli
from experiments.config import Cell
from experiments.gpu import time_validation_gpu as tvg
from experiments.harness.launch import describe
from experiments.reporting.validation import (
    plot_gpu_validation,
    summarize_errors,
    summarize_gpu_validation,
    write_time_validation,
)
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
    here = {"cpu_model": "AMD EPYC", "cpu_count": 2}
    write_json(row, describe(cell, None) | here | {"status": "ok", "error": "",
                                                   "mode": "measured", "time_median_s": 2.0})
    write_json(tmp_path / "profile.json", {"provenance": here})
    with pytest.raises(BadResultFile, match="cell.json: missing") as e:
        predictions(tmp_path, tmp_path / "profile.json")
    assert e.value.path == row.with_name("cell.json")


def test_predictions_refuse_rows_of_another_cpu_than_the_profiles(tmp_path):
    """A profile calibrated on one CPU does not price step times measured on another (a fresh
    clone's --calibrate beside the committed rows): refused by name before anything is
    emulated, with the way out."""
    cell = Cell("ulysses", model="tiny", seq_len=256, nproc=2)
    write_json(tmp_path / "runs" / cell.cell_id() / "row.json",
               describe(cell, None) | {"cpu_model": "AMD EPYC", "cpu_count": 2, "status": "ok",
                                       "error": "", "mode": "measured", "time_median_s": 2.0})
    write_json(tmp_path / "profile.json", {"provenance": {"cpu_model": "Intel Xeon",
                                                          "cpu_count": "2"}})
    with pytest.raises(ValueError, match=r"1 measured row\(s\) .* another CPU than its "
                       r"profile.json was calibrated on \(Intel Xeon x 2\): .*AMD EPYC x 2.*"
                       r"--out <an empty directory>"):
        predictions(tmp_path, tmp_path / "profile.json")


def _gpu_table() -> pd.DataFrame:
    """Two lengths, Ulysses and UPipe at each; the shipped profile 5% and 10% slow on the 1K
    pair, exact on the 2K pair; the calibrated one 2% fast everywhere; one failed cell."""
    rows = [
        ("ulysses", 1024, 1.0, 1.05, 0.98), ("upipe", 1024, 1.25, 1.375, 1.225),
        ("ulysses", 2048, 2.0, 2.0, 1.96), ("upipe", 2048, 2.5, 2.5, 2.45),
    ]
    table = pd.DataFrame([{
        "cell_id": f"{m}-{s}", "method": m, "nproc": 8, "seq_len": s, "extra": "",
        "status": "ok", "step_s": meas, "predicted_s_shipped": ship,
        "predicted_s_calibrated": cal} for m, s, meas, ship, cal in rows])
    for p in ("shipped", "calibrated"):
        table[f"error_{p}"] = table[f"predicted_s_{p}"] / table["step_s"] - 1
    failed = {"cell_id": "fpdt-1024", "method": "fpdt", "nproc": 8, "seq_len": 1024,
              "status": "error"}
    return pd.concat([table, pd.DataFrame([failed])], ignore_index=True)


def test_the_gpu_summary_reads_errors_ratios_and_targets():
    s = summarize_gpu_validation(_gpu_table(), ["shipped", "calibrated"])
    assert (s["cells"], s["measured_ok"]) == (5, 4)
    assert s["shipped"]["worst_abs_error"] == pytest.approx(0.10)
    assert s["shipped"]["median_abs_error"] == pytest.approx(0.025)  # 0, 0, 0.05, 0.10
    assert s["shipped"]["worst_cell"] == "upipe-1024"
    # UPipe / Ulysses at 1K: measured 1 / 1.25 = 0.8, shipped 1.05 / 1.375 = 0.7636
    r1k = next(r for r in s["ratios"] if r["cell_id"] == "upipe-1024")
    assert r1k["measured"] == pytest.approx(0.8)
    assert r1k["shipped"] == pytest.approx(1.05 / 1.375)
    assert s["shipped"]["worst_ratio_abs_error"] == pytest.approx(0.8 - 1.05 / 1.375)
    assert not s["shipped"]["meets_targets"]  # 10% > 8%, and the ratio is 0.036 off
    # a uniform 2% error moves no ratio and meets median <= 5%, worst <= 10%
    assert s["calibrated"]["worst_ratio_abs_error"] == pytest.approx(0.0, abs=1e-12)
    assert s["calibrated"]["meets_targets"]
    # a name without targets (another --profile) neither meets nor misses any
    s = summarize_gpu_validation(_gpu_table().rename(columns={"error_calibrated": "error_mine"}),
                                 ["shipped", "mine"])
    assert s["mine"]["targets"] == {} and s["mine"]["meets_targets"] is None


def test_the_gpu_plot_is_written(tmp_path):
    plot_gpu_validation(_gpu_table(), ["shipped", "calibrated"], tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_validate_time_on_cuda_without_a_gpu_exits_2(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["validate-time", "--device", "cuda", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "torch.cuda.is_available() is False" in err
    assert not any(tmp_path.iterdir())  # nothing measured, nothing written


@pytest.mark.slow  # about 3 s on 2 cores (docs/testing.md)
def test_the_gpu_validation_runs_end_to_end_at_smoke_sizes(monkeypatch, tmp_path):
    """Measure, emulate, price, summarise and write, on the CPU at the smoke sizes (two cells;
    priced on the shipped h200 profile, no calibration): every file, a prediction and an
    error per cell, the UPipe / Ulysses ratio."""
    monkeypatch.setattr(tvg, "STEP_CELLS", [("ulysses", 1, 2**15, {}, False),
                                            ("upipe", 1, 2**15, {"heads_per_stage": 4}, False)])
    summary = tvg.validate_gpu(tmp_path, small=True, progress=False)
    folder = tmp_path / tvg.FOLDER
    assert {p.name for p in folder.iterdir()} == {"rows.csv", "summary.json", "env.json",
                                                  "predicted_vs_measured.png"}
    rows = pd.read_csv(folder / "rows.csv")
    assert list(rows["status"]) == ["ok", "ok"]
    # the kernel the cells ran, named in the cells priced: "auto" there would be the emulated
    # profile's GPU's choice (cudnn on the h200 profile), not the CPU's sdpa
    assert list(rows["kernel"]) == ["sdpa", "sdpa"]
    assert all(tvg.cell_of(m, n, s, e, small=True)[0].cell_id() != c for (m, n, s, e, _), c
               in zip(tvg.STEP_CELLS, rows["cell_id"], strict=True))
    assert (rows["predicted_s_shipped"] > 0).all()
    assert rows["error_shipped"].tolist() == pytest.approx(  # rows.csv keeps 6 digits
        (rows["predicted_s_shipped"] / rows["step_s"] - 1).tolist(), rel=1e-4)
    assert summary["shipped"]["cells"] == 2 and len(summary["ratios"]) == 1
    assert json.loads((folder / "env.json").read_text())["profiles"]["shipped"].endswith(
        "h200.json")


def test_reprice_keeps_the_measured_columns_and_prices_every_profile(monkeypatch, tmp_path):
    """A finished run priced again: the measured columns as they were, each profile's predicted
    step and error recomputed (the emulator stubbed: a fixed seconds per profile), a row whose
    cell is no longer declared says so, env.json records the repricing."""
    folder = tmp_path / tvg.FOLDER
    folder.mkdir()
    cells = [tvg.cell_of(m, n, s, e) for m, n, s, e, _ in tvg.STEP_CELLS[:2]]
    rows = [ident | {"cell_id": cell.cell_id()} for cell, ident in cells]
    rows.append(rows[0] | {"cell_id": "gone-cell", "method": "ring"})
    pd.DataFrame(rows).assign(status="ok", step_s=[2.0, 4.0, 1.0], predicted_s_shipped=9.0,
                              error_shipped=3.5).to_csv(folder / "rows.csv", index=False)
    write_json(folder / "env.json", {"gpu_name": "NVIDIA H200", "command": "x"})
    h200 = tvg.load_profile("h200").path
    (folder / "profile.json").write_text(open(h200).read())
    seconds = {"shipped": 2.2, "calibrated": 1.8, "extra": 4.0}
    kernels = []
    monkeypatch.setattr(tvg, "predict", lambda cell, profiles: kernels.append(cell.kernel) or {
        "emulated_peak_bytes": 1, **{f"predicted_s_{p}": seconds[p] for p in profiles}})
    # rows from before the kernel column: the kernel they ran must be named
    with pytest.raises(ValueError, match="has no kernel column.*--kernel"):
        tvg.reprice(folder, {"extra": h200}, progress=False)
    summary = tvg.reprice(folder, {"extra": h200}, kernel="cudnn", progress=False)
    assert kernels == ["cudnn", "cudnn"]  # the gone cell is not priced
    rows = pd.read_csv(folder / "rows.csv")
    assert rows.kernel.tolist() == ["cudnn"] * 3  # filled: the next reprice needs no --kernel
    assert rows.step_s.tolist() == [2.0, 4.0, 1.0]
    assert rows.error_shipped.tolist()[:2] == [pytest.approx(0.1), pytest.approx(-0.45)]
    assert rows.error_extra.tolist()[:2] == [pytest.approx(1.0), pytest.approx(0.0)]
    assert "not repriced" in rows.error.iloc[2] and pd.isna(rows.error_shipped.iloc[2])
    assert set(summary) >= {"shipped", "calibrated", "extra"}
    env = json.loads((folder / "env.json").read_text())
    assert env["command"] == "x" and set(env["repriced"]["profiles"]) == set(seconds)
    # a run with the column: each row's cell is priced with its own kernel, matched by the id
    # the named kernel gives it
    cell = tvg.with_kernel(cells[0][0], "sdpa")
    pd.DataFrame([cells[0][1] | {"kernel": "sdpa", "cell_id": cell.cell_id(), "status": "ok",
                                 "step_s": 2.0}]).to_csv(folder / "rows.csv", index=False)
    kernels.clear()
    tvg.reprice(folder, progress=False)
    assert kernels == ["sdpa"] and pd.read_csv(folder / "rows.csv").error_shipped[0] == \
        pytest.approx(0.1)


def test_reprice_and_profile_are_refused_where_they_mean_nothing(tmp_path, capsys):
    assert cli.main(["validate-time", "--reprice", "--out", str(tmp_path)]) == 2
    assert "--reprice, --profile and --kernel are for --device cuda" in capsys.readouterr().err
    assert cli.main(["validate-time", "--device", "cuda", "--profile", f"x={tmp_path}/p.json",
                     "--out", str(tmp_path)]) == 2
    assert "give --reprice too" in capsys.readouterr().err
    assert cli.main(["validate-time", "--device", "cuda", "--kernel", "cudnn",
                     "--out", str(tmp_path)]) == 2
    assert "give --reprice too" in capsys.readouterr().err
    assert cli.main(["validate-time", "--device", "cuda", "--reprice", "--profile", "p.json",
                     "--out", str(tmp_path)]) == 2
    assert "--profile: must be NAME=PATH.json" in capsys.readouterr().err


def test_an_unchanged_prediction_keeps_the_revision_that_made_it(tmp_path):
    """The main job re-running the CPU validation on unchanged numbers leaves comparison.csv
    byte-identical (it re-stamped all 58 rows with each new revision); a changed number takes
    the new revision."""
    from experiments.runner.time_validation import _same_revision_if_unchanged

    table = pd.DataFrame({"cell_id": ["a", "b"], "predicted_s": [1.0, 2.0 / 3],
                          "predicted_git_rev": ["old", "old"]})
    path = tmp_path / "comparison.csv"
    path.write_text(table.to_csv(index=False, float_format="%.6g"))
    again = table.assign(predicted_git_rev="new", predicted_s=[1.0, 2.0 / 3 + 1e-9])
    assert _same_revision_if_unchanged(again, path).predicted_git_rev.tolist() == ["old", "old"]
    moved = again.assign(predicted_s=[1.0, 0.7])
    assert _same_revision_if_unchanged(moved, path).predicted_git_rev.tolist() == ["new", "new"]
    assert _same_revision_if_unchanged(moved, tmp_path / "none.csv") is moved
