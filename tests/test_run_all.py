"""The main job's own rules (run_all.sh): what its environment may say, refused before the venv
or any sweep is touched, and which sweeps a GPU node runs (docs/harness.md#the-main-job-run_allsh).
Dry runs only: nothing is measured."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run_all(cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "run_all.sh")], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env=os.environ | env)


@pytest.mark.parametrize("flag, value", [("DRY_RUN", "true"), ("RETRY_FAILED", "yes"),
                                         ("NPROC_PER_NODE", "eight")])
def test_a_value_the_main_job_would_ignore_is_refused(tmp_path, flag, value):
    """DRY_RUN=true ran every sweep for real (only "1" was read); RETRY_FAILED=yes retried
    nothing, without a word."""
    r = _run_all(tmp_path, **{flag: value, "OUT": str(tmp_path / "out")})
    assert r.returncode == 2 and f"{flag} must be" in r.stderr and value in r.stderr
    assert not (tmp_path / "out").exists()


def test_a_gpu_node_runs_the_paper_sweeps_of_its_gpu_count_and_out_is_the_callers(tmp_path):
    """NPROC_PER_NODE=8: the 16-GPU sweep is left out with the command that runs it (it ran on
    8 ranks into its h100x16 folder); the 8-GPU one is planned on 8. A relative OUT is taken
    from the caller's directory, not the repository's."""
    r = _run_all(tmp_path, NPROC_PER_NODE="8", DRY_RUN="1", OUT="rel",
                 ONLY="table4_qwen3_32b_h100x16,memory_wall_llama3_8b_h100x8")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "table4_qwen3_32b_h100x16 left out: its cells run on 16 GPUs" in r.stderr
    assert "--nproc-per-node 8" in r.stderr
    assert "table4_qwen3_32b_h100x16" not in r.stdout
    assert "memory_wall_llama3_8b_h100x8: " in r.stdout
    assert f"-> {tmp_path / 'rel' / 'memory_wall_llama3_8b_h100x8'}/" in r.stdout
    assert not (ROOT / "rel").exists()


def test_the_paper_report_is_rewritten_when_any_sweep_it_reads_ran():
    """run_all.sh rewrote results/paper_grid/ after the Table 3/4 sweeps only, so a rerun of the
    memory wall or the two-node sweep left the report's copies of them stale."""
    from experiments.reporting import reproduction

    script = (ROOT / "run_all.sh").read_text()
    loop = script[script.index("for s in table3"):script.index("experiments.reporting.paper_grid")]
    read = {*reproduction.SWEEPS.values(), reproduction.WALL_SWEEP, reproduction.TWO_NODE_SWEEP}
    assert {name for name in read if name in loop} == read
