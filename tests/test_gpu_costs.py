"""``experiments.gpu.gpu_costs``: its CPU smoke run, and the shipped GPU profiles holding
exactly the constants its committed H200 run gives."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from experiments.gpu import gpu_costs
from experiments.timing.profile import PROFILE_DIR, attention_flops, load_profile

KERNELS = Path(__file__).resolve().parent.parent / "results" / "gpu_costs_h200" / "kernels"


@pytest.mark.parametrize("name", ["h200", "h100-sxm"])
def test_shipped_profiles_hold_the_h200_runs_constants(name):
    """What ``--merge-into`` wrote is what the committed CSVs give, and each source names the
    run: a profile edited by hand, or a CSV changed without the profile, fails here."""
    want = gpu_costs.profile_constants(KERNELS, "x")
    raw = json.loads((PROFILE_DIR / f"{name}.json").read_text())
    where = raw["host_op_s"]["source"].split(", dispatch.csv: ")[0]
    for kernel in ("sdpa", "cudnn"):
        assert set(want[f"attention_{kernel}_bf16"]) == {"fwd_causal", "bwd_causal"}
        for pass_, const in want[f"attention_{kernel}_bf16"].items():
            got = raw["attention"][kernel]["bf16"][pass_]
            assert got["value"] == const["value"]
            assert "results/gpu_costs_h200/kernels" in got["source"]
            # every constant of the run names it in the same words (one --where)
            assert got["source"].startswith(where + ", attention.csv: ")
    assert "cuDNN SDPA backend" in raw["attention"]["cudnn"]["bf16"]["fwd_causal"]["source"]
    assert raw["matmul_narrow"]["bf16"]["value"] == want["matmul_narrow"]["bf16"]["value"]
    assert raw["host_op_s"]["value"] == want["host_op_s"]["value"]
    assert "results/gpu_costs_h200/kernels" in raw["host_op_s"]["source"]


def test_cudnn_constants_skip_failed_shapes_and_runs_without_cudnn(tmp_path):
    """A shape cuDNN refused (cudnn_error, no times) is left out of its table; a run without
    cuDNN columns (a CPU run) gives no cuDNN constants, and merging it leaves them alone."""
    for f in ("matmul.csv", "dispatch.csv"):
        (tmp_path / f).write_text((KERNELS / f).read_text())
    att = pd.read_csv(KERNELS / "attention.csv")
    failed = (att["heads"] == 32) & (att["seq"] == 32768)
    att.loc[failed, ["cudnn_fwd_s", "cudnn_bwd_s"]] = float("nan")
    att.to_csv(tmp_path / "attention.csv", index=False)
    c = gpu_costs.profile_constants(tmp_path, "x")
    for pass_ in ("fwd_causal", "bwd_causal"):
        assert [s for s, _ in c["attention_cudnn_bf16"][pass_]["value"]["128"]["32"]] == [
            4096, 16384]
        assert [s for s, _ in c["attention_sdpa_bf16"][pass_]["value"]["128"]["32"]] == [
            4096, 16384, 32768]
    att.drop(columns=["cudnn_fwd_s", "cudnn_bwd_s"]).to_csv(tmp_path / "attention.csv",
                                                            index=False)
    assert "attention_cudnn_bf16" not in gpu_costs.profile_constants(tmp_path, "x")
    profile = tmp_path / "p.json"
    profile.write_text((PROFILE_DIR / "h200.json").read_text())
    gpu_costs.merge_into_profile(profile, tmp_path, "x")
    assert (json.loads(profile.read_text())["attention"]["cudnn"] ==
            json.loads((PROFILE_DIR / "h200.json").read_text())["attention"]["cudnn"])


@pytest.mark.slow  # about 4 s on 2 cores (docs/testing.md)
def test_the_profiled_cells_run_on_cpu(tmp_path):
    """The smoke sizes on the CPU: every profiled cell a row, its op table and timeline."""
    assert gpu_costs.main(["--out", str(tmp_path), "--small", "--only-profiled", "--layers", "1",
                           "--skip", "dispatch,memory,matmul,attention,host_copy"]) == 0
    steps = pd.read_csv(tmp_path / "steps.csv")
    assert len(steps) == sum(p for *_, p in gpu_costs.STEP_CELLS)
    assert (steps["status"] == "ok").all() and (steps["step_s"] > 0).all()
    assert len(pd.read_csv(tmp_path / "timeline.csv")) == len(steps)
    ops = pd.read_csv(tmp_path / "ops.csv")
    assert {"aten::mm", "aten::_scaled_dot_product_flash_attention_for_cpu"} <= set(ops["op"])
    env = json.loads((tmp_path / "env.json").read_text())
    assert "--only-profiled" in env["command"]


def test_merge_into_refuses_a_folder_without_the_runs_csvs(tmp_path, capsys):
    profile = tmp_path / "p.json"
    profile.write_text((PROFILE_DIR / "h200.json").read_text())
    with pytest.raises(SystemExit) as e:
        gpu_costs.main(["--out", str(tmp_path / "none"), "--merge-into", str(profile)])
    assert e.value.code == 2
    assert "holds none of attention.csv, matmul.csv, dispatch.csv" in capsys.readouterr().err
    assert profile.read_text() == (PROFILE_DIR / "h200.json").read_text()  # untouched


def test_gqa_rows_give_attention_gqa_by_group_and_merge_into_a_loadable_profile(tmp_path):
    """cuDNN rows of group 4 (four query heads per K/V head) become
    ``attention_gqa.cudnn.bf16`` at group "4", the group-1 rows the plain table; the merged
    profile loads and prices a group-4 call at the measured rate."""
    rows = []
    for s in (4096, 16384):
        for h in (4, 8):
            rows.append({"seq": s, "heads": h, "group": 1, "flash_fwd_s": 2e-3,
                         "flash_bwd_s": 5e-3, "cudnn_fwd_s": 1e-3, "cudnn_bwd_s": 3e-3})
            rows.append({"seq": s, "heads": h, "group": 4, "cudnn_fwd_s": 8e-4,
                         "cudnn_bwd_s": 2.5e-3})
    pd.DataFrame(rows).to_csv(tmp_path / "attention.csv", index=False)
    c = gpu_costs.profile_constants(tmp_path, "here")
    assert set(c) == {"attention_sdpa_bf16", "attention_cudnn_bf16", "attention_gqa_cudnn_bf16"}
    gqa = c["attention_gqa_cudnn_bf16"]["fwd_causal"]
    assert set(gqa["value"]["128"]) == {"4"} and set(gqa["value"]["128"]["4"]) == {"4", "8"}
    assert "group" in gqa["source"] and gqa["source"].startswith("measured: here")
    plain = c["attention_cudnn_bf16"]["bwd_causal"]["value"]["128"]["8"]
    assert plain == [[s, float(f"{attention_flops(1, 8, s, s, 128, 'bwd_causal') / 3e-3:.4g}")]
                     for s in (4096, 16384)]
    profile = tmp_path / "p.json"
    profile.write_text((PROFILE_DIR / "h200.json").read_text())
    gpu_costs.merge_into_profile(profile, tmp_path, "here")
    p = load_profile(str(profile))
    want = attention_flops(1, 8, 16384, 16384, 128, "fwd_causal") / 8e-4
    assert p.attention_rate("cudnn", "bf16", "fwd_causal", 128, 16384, 8, 4) == \
        pytest.approx(want, rel=1e-3)
    # matmul and dispatch were not in the folder: the profile keeps its own
    assert json.loads(profile.read_text())["host_op_s"] == json.loads(
        (PROFILE_DIR / "h200.json").read_text())["host_op_s"]
