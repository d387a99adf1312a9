"""``python -m experiments.gpu.kernels_gpu`` (cudnn against sdpa in a step) on the CPU: it
refuses without a GPU (exit 2, nothing written), and its whole pipeline at the smoke sizes
with kernels the CPU runs (``sdpa`` measured against ``math``): every file and column, the
ratio from the rows, and a failing cell kept as a row with its error."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch

from experiments.gpu import gpu_costs
from experiments.gpu import kernels_gpu as kg


def test_without_a_gpu_it_says_why_and_exits_2(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kg.main(["--out", str(tmp_path / "k")]) == 2
    err = capsys.readouterr().err
    assert "kernels_gpu needs a CUDA GPU" in err and "torch.cuda.is_available() is False" in err
    assert not (tmp_path / "k").exists()  # nothing measured, nothing written


@pytest.mark.slow  # about 3 s on 2 cores (docs/testing.md)
def test_the_pipeline_runs_end_to_end_at_smoke_sizes(monkeypatch, tmp_path):
    """Two methods, sdpa for cudnn and math for sdpa; upipe's math cell fails inside its step
    (an injected error): its row says so, the other cells are measured, its ratio is missing
    with the reason, and the README reports both."""
    real_build = gpu_costs.build

    def build(cell, *a, **kw):
        if cell.method == "upipe" and cell.kernel == "math":
            raise RuntimeError("injected failure")
        return real_build(cell, *a, **kw)

    monkeypatch.setattr(gpu_costs, "build", build)
    ratios = kg.compare_kernels(tmp_path, small=True, kernels=("sdpa", "math"),
                                methods=("ulysses", "upipe"), progress=False)
    assert {p.name for p in tmp_path.iterdir()} == {"rows.csv", "speedup.csv", "env.json",
                                                    "README.md"}
    rows = pd.read_csv(tmp_path / "rows.csv")
    assert list(rows.columns[:len(kg.COLUMNS)]) == list(kg.COLUMNS)
    assert list(zip(rows["method"], rows["kernel"], rows["status"], strict=True)) == [
        ("ulysses", "sdpa", "ok"), ("ulysses", "math", "ok"), ("upipe", "sdpa", "ok"),
        ("upipe", "math", "error")]
    assert (rows["nproc"] == 8).all() and (rows["seq_len"] == 2**17 // 256).all()
    failed = rows.iloc[3]
    assert failed["error"] == "RuntimeError: injected failure" and math.isnan(failed["step_s"])
    assert (rows["step_s"].iloc[:3] > 0).all() and rows["error"].iloc[:3].isna().all()

    speed = pd.read_csv(tmp_path / "speedup.csv")
    assert list(speed.columns) == ["method", "nproc", "seq_len", "math_step_s",
                                   "math_peak_bytes", "sdpa_step_s", "sdpa_peak_bytes",
                                   "speedup", "target", "meets_target", "note"]
    assert list(speed["method"]) == ["ulysses", "upipe"]
    uly = speed.iloc[0]
    assert uly["speedup"] == pytest.approx(rows["step_s"][1] / rows["step_s"][0], rel=1e-4)
    assert uly["meets_target"] == (uly["speedup"] >= kg.TARGET) and uly["target"] == 1.25
    assert math.isnan(speed["speedup"][1]) and not speed["meets_target"][1]
    assert speed["note"][1] == "math error: RuntimeError: injected failure"
    assert list(ratios["method"]) == ["ulysses", "upipe"]

    env = json.loads((tmp_path / "env.json").read_text())
    assert env["kernels"] == ["sdpa", "math"] and env["methods"] == ["ulysses", "upipe"]
    assert {"git_rev", "torch_version", "date_utc", "wall_s", "iters"} <= env.keys()
    readme = (tmp_path / "README.md").read_text()
    # the README rounds the exact ratio, speedup.csv keeps 6 digits of it: either third decimal
    assert "| ulysses | 512 |" in readme and any(
        f"{uly['speedup'] + d:.3f}" in readme for d in (-5e-4, 0.0, 5e-4))
    assert "upipe with `math`: error: RuntimeError: injected failure" in readme


@pytest.mark.slow  # about 2 s on 2 cores (docs/testing.md)
def test_a_kernel_this_machine_cannot_run_is_a_skipped_row_and_exit_1(tmp_path, capsys):
    """The default kernels on the CPU (smoke sizes, --quick's methods): every cudnn cell is a
    skipped row with the kernel's reason, every sdpa cell is measured, and the exit is 1."""
    assert kg.main(["--out", str(tmp_path), "--small", "--quick"]) == 1
    rows = pd.read_csv(tmp_path / "rows.csv")
    assert list(rows["method"].unique()) == list(kg.QUICK_METHODS)
    assert (rows["seq_len"] == 2**15 // 256).all()
    cudnn, sdpa = rows[rows["kernel"] == "cudnn"], rows[rows["kernel"] == "sdpa"]
    assert (cudnn["status"] == "skipped").all() and (sdpa["status"] == "ok").all()
    assert cudnn["error"].str.contains("kernel 'cudnn' is CUDA only").all()
    speed = pd.read_csv(tmp_path / "speedup.csv")
    assert {"sdpa_step_s", "cudnn_step_s"} <= set(speed.columns)
    assert speed["speedup"].isna().all() and speed["note"].str.startswith("cudnn skipped").all()
    assert "No method has both cells measured" in (tmp_path / "README.md").read_text()
