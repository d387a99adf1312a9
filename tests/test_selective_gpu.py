"""``python -m experiments.gpu selective``: the speed-up table, the run's rows with the GPU's
measurement and the emulator stubbed, and the refusal without a GPU."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from experiments.gpu import selective_gpu


def _rows(step: dict, predicted: dict) -> pd.DataFrame:
    return pd.DataFrame([{"method": m, "seq_len": 1024, "stack": s, "status": "ok",
                          "step_s": step[m, s], "predicted_s_shipped": predicted[m, s]}
                         for m, s in step])


def test_speedups_are_each_level_over_full_checkpointing():
    step = {("upipe", "alst"): 2.0, ("upipe", "alst-attn"): 1.6, ("upipe", "alst-attn-host"): 1.0}
    pred = {("upipe", "alst"): 3.0, ("upipe", "alst-attn"): 2.5, ("upipe", "alst-attn-host"): 2.0}
    t = selective_gpu.speedups(_rows(step, pred)).set_index("stack")
    assert t.loc["alst-attn", "measured"] == pytest.approx(1.25)
    assert t.loc["alst-attn", "predicted"] == pytest.approx(1.2)
    assert t.loc["alst-attn", "difference"] == pytest.approx(1.2 / 1.25 - 1)
    assert t.loc["alst-attn-host", "measured"] == pytest.approx(2.0)
    assert t.loc["alst-attn-host", "predicted"] == pytest.approx(1.5)


def test_a_failed_baseline_or_level_gives_no_speedup():
    step = {("ulysses", "alst"): 2.0, ("ulysses", "alst-attn"): 1.0}
    rows = _rows(step, step)
    rows.loc[rows["stack"] == "alst", "status"] = "error"
    assert selective_gpu.speedups(rows).empty


def test_the_run_measures_and_predicts_every_cell(monkeypatch, tmp_path):
    """Every method x length x level is a row; a prediction that fails keeps the measurement."""
    monkeypatch.setattr(selective_gpu, "measure_steps", lambda cell, device, iters: (
        {"step_s": {"alst": 2.0, "alst-attn": 1.6, "alst-attn-host": 1.8,
                    "long-attn-host": 1.7, "alst-block": 1.5}[cell.stack],
         "status": "ok"}, None, []))

    def predict(cell, profiles):
        if cell.method == "ulysses" and cell.stack == "alst-attn-host":
            raise ValueError("no fit")
        return {"predicted_s_shipped": {"alst": 3.0, "alst-attn": 2.5, "alst-attn-host": 2.4,
                                        "long-attn-host": 2.3, "alst-block": 2.2}[cell.stack]}

    monkeypatch.setattr(selective_gpu, "predict", predict)
    table = selective_gpu.run(tmp_path, small=True, progress=False)
    rows = pd.read_csv(tmp_path / selective_gpu.FOLDER / "rows.csv")
    assert (rows.kernel == "sdpa").all()  # the kernel that ran, named in the cells priced
    n = len(selective_gpu.METHODS) * len(selective_gpu.LENGTHS) * len(selective_gpu.LEVELS)
    assert len(rows) == n and (rows.status == "ok").all()
    failed = rows[rows.error.notna()]
    assert set(failed.method) == {"ulysses"} and set(failed["stack"]) == {"alst-attn-host"}
    assert failed.error.str.contains("prediction failed: ValueError: no fit").all()
    assert len(table) == n - len(selective_gpu.LENGTHS) * len(selective_gpu.METHODS)
    assert table.measured.tolist()[:2] == [pytest.approx(1.25), pytest.approx(2.0 / 1.8)]
    # the level without a prediction keeps its measured speed-up, no predicted one
    unpriced = table[(table.method == "ulysses") & (table["stack"] == "alst-attn-host")]
    assert len(unpriced) == 2 and unpriced.predicted.isna().all()
    assert unpriced.measured.tolist() == [pytest.approx(2.0 / 1.8)] * 2
    env = json.loads((tmp_path / selective_gpu.FOLDER / "env.json").read_text())
    assert env["command"].endswith("selective --small") and env["target_abs_difference"] == 0.05


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_without_a_gpu_it_says_so_and_exits_2(tmp_path, capsys):
    assert selective_gpu.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / selective_gpu.FOLDER).exists()
