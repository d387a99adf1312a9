"""docs/results.md's selective-recomputation tables come from the committed rows
(``experiments.reporting.selective_table``): up to date, and rendered as the rows say."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from experiments.config import STACKS, Cell
from experiments.harness.model import block_offloads
from experiments.reporting import selective_table
from experiments.runner.plan_keep import device_keep_blocks, host_keep_blocks
from experiments.runner.plan_spec import KEEP_ON_DEVICE, KEEP_ON_HOST
from experiments.sweeps import SWEEPS

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30


def test_the_committed_tables_are_up_to_date():
    assert not selective_table.stale(ROOT / "results", ROOT / "docs" / "results.md"), (
        f"docs/results.md's selective-recomputation tables are stale: run "
        f"`{selective_table.COMMAND}` and commit docs/results.md")


def _row(method, stack, seq_len, status, tok, dev_gib, host_gib, ring=1, keep=None):
    return {"method": method, "stack": stack, "keep_blocks": keep, "seq_len": seq_len,
            "status": status,
            "tokens_per_s_per_gpu": tok, "peak_device_bytes": dev_gib * GiB,
            "peak_host_bytes": host_gib * GiB, "device_budget_bytes": 70 * GiB,
            "host_budget_bytes": 256 * GiB, "ring_degree": ring, "nproc": 8, "world_size": 8,
            "model": "llama3-8b", "kernel": "fa3", "hardware_profile": "h100-sxm"}


def test_a_small_sweep_renders_each_level_and_the_fastest_that_fits(tmp_path):
    """One sweep's rows: a length where a kept level fits and is fastest, one where it runs
    out of host memory, one level has no row and keeping the attention in the last 18 blocks
    fits (its own column), and a mesh variant where only a kept level fits."""
    name = "selective_recompute_llama3_8b_h100x8-emulated"
    rows = [
        _row("upipe", "alst", 2**20, "ok", 400.0, 30.0, 30.0),
        _row("upipe", "alst-attn", 2**20, "oom", 500.0, 120.0, 30.0),
        _row("upipe", "alst-attn-host", 2**20, "ok", 500.0, 31.0, 125.0),
        _row("upipe", "alst", 3 * 2**20, "ok", 150.0, 48.0, 90.0),
        _row("upipe", "alst-attn-host", 3 * 2**20, "oom", 180.0, 54.0, 369.0),
        _row("upipe", "alst", 2**20, "oom", 420.0, 71.0, 30.0, ring=2),
        _row("upipe", "alst-attn-host", 2**20, "ok", 520.0, 60.0, 120.0, ring=2),
        _row("upipe", "alst-attn-host", 3 * 2**20, "ok", 170.0, 50.0, 250.0, keep=18),
    ]
    (tmp_path / name).mkdir()
    pd.DataFrame(rows).to_csv(tmp_path / name / "rows.csv", index=False)
    lines = [line for line in selective_table.render(tmp_path).splitlines()
             if line.startswith("| upipe")]
    assert lines == [
        "| upipe | 1M | 400 tok/s; 30.0 / 30 GiB | oom (device); 120.0 / 30 GiB "
        "| 500 tok/s; 31.0 / 125 GiB | — | alst-attn-host, 1.250 |",
        "| upipe | 3M | 150 tok/s; 48.0 / 90 GiB | — | oom (host); 54.0 / 369 GiB "
        "| k=18: 170 tok/s; 50.0 / 250 GiB | alst-attn-host k=18, 1.133 |",
        "| upipe 4x2 | 1M | oom (device); 71.0 / 30 GiB | — | 520 tok/s; 60.0 / 120 GiB | — "
        "| alst-attn-host, alst does not fit |",
    ]
    assert "| alst-attn-host, last k | fastest that fits" in selective_table.render(tmp_path)
    assert "70.00 GiB of device and 256 GiB of host memory per rank" in (
        selective_table.render(tmp_path))


def test_without_rows_the_section_is_empty(tmp_path):
    text = selective_table.render(tmp_path)
    assert text.startswith(selective_table.BEGIN) and text.endswith(selective_table.END)
    assert "|" not in text


KEEPING = [s for s in SWEEPS.values()
           if s.name.startswith("selective_recompute_") and s.scale == "emulated"]


@pytest.mark.parametrize("sweep", KEEPING, ids=[s.name for s in KEEPING])
def test_the_sweeps_keep_the_blocks_the_planner_picks(sweep):
    """Each committed cell keeping the attention in its last k blocks keeps the k that the
    plan's rule (``host_keep_blocks``) picks from the same sweep's rows of the level without
    keeping and the level keeping it everywhere, fits, and has the host peak that rule
    predicts: the level without keeping plus k - 1 blocks' share (to 1 MiB: those two rows
    are the fit's predictions, rounded to the byte). Each cell keeping whole blocks
    (``KEEP_ON_DEVICE``) keeps the k of the plan's device rule (``device_keep_blocks``), fits,
    and its device peak is at most that rule's chord."""
    rows = pd.read_csv(ROOT / "results" / sweep.name / "rows.csv")
    partial = [c for c in sweep.cells() if c.keep_blocks is not None]
    assert partial
    for cell in partial:
        def row(stack: str, keep=None, cell: Cell = cell) -> dict:
            mine = rows[(rows["method"] == cell.method) & (rows["seq_len"] == cell.seq_len)
                        & (rows["ring_degree"] == cell.ring_degree) & (rows["stack"] == stack)]
            mine = mine[mine["keep_blocks"].isna() if keep is None
                        else mine["keep_blocks"] == keep].to_dict("records")
            assert len(mine) == 1, (cell.cell_id(), stack, keep)
            return mine[0]

        whole = Cell.from_dict(cell.to_dict() | {"keep_blocks": None})
        kept = row(cell.stack, cell.keep_blocks)
        assert kept["status"] == "ok" and kept["emulation"] == "exact", kept["error"]
        n = cell.validate().n_layers
        if cell.stack in KEEP_ON_DEVICE:
            light, full = row(KEEP_ON_DEVICE[cell.stack]), row(cell.stack)
            assert device_keep_blocks(light, full, whole, sweep.hardware) == cell.keep_blocks
            chord = light["peak_device_bytes"] + cell.keep_blocks * (
                full["peak_device_bytes"] - light["peak_device_bytes"]) / n
            assert kept["peak_device_bytes"] <= chord, cell.cell_id()
            continue
        light, full = row(KEEP_ON_HOST[cell.stack]), row(cell.stack)
        assert host_keep_blocks(light, full, whole, sweep.hardware) == cell.keep_blocks
        n_offloading = sum(block_offloads(STACKS[cell.stack], i, n) for i in range(n))
        share = (full["peak_host_bytes"] - light["peak_host_bytes"]) / n_offloading
        expected = light["peak_host_bytes"] + (cell.keep_blocks - 1) * share
        assert abs(kept["peak_host_bytes"] - expected) < 2**20, cell.cell_id()
