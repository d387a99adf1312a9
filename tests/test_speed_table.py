"""docs/results.md's UPipe-at-Ulysses-speed table comes from the committed rows
(``experiments.reporting.speed_table``): up to date, and rendered as the rows say."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from experiments.reporting import speed_table

ROOT = Path(__file__).resolve().parents[1]


def test_the_committed_table_is_up_to_date():
    assert not speed_table.stale(ROOT / "results", ROOT / "docs" / "results.md"), (
        f"docs/results.md's UPipe-at-Ulysses-speed table is stale: run "
        f"`{speed_table.COMMAND}` and commit docs/results.md")


def _row(method, seq_len, tps, status="ok", ring=float("nan"), overlap=float("nan"),
         iters=8, cell_id=None):
    return {"cell_id": cell_id or f"{method}-{ring}-{overlap}-{seq_len}-{iters}",
            "method": method, "heads_per_stage": float("nan"), "ring_degree": ring,
            "overlap": overlap, "model": "qwen3-32b", "nproc": 16, "stack": "alst",
            "kernel": "fa3", "seq_len": seq_len, "status": status, "iters": iters,
            "tokens_per_s_per_gpu": tps}


def test_ratios_mark_what_does_not_fit_and_leave_out_probes_and_other_methods():
    rows = pd.DataFrame([
        _row("ulysses", 1024, 100.0), _row("ulysses", 2048, 40.0, status="oom"),
        _row("upipe", 1024, 99.0), _row("upipe", 2048, 44.0),
        _row("upipe", 1024, 105.0, ring=2, overlap=True),
        _row("upipe", 4096, 1.0, iters=0),  # a search's probe: no time of its own
        _row("usp", 1024, 50.0, ring=2),  # not a UPipe variant
    ])
    got = speed_table.ratios(rows)
    by = {(r.column, r.seq_len): (round(r.ratio, 6), r.fits) for r in got.itertuples()}
    assert by == {("Qwen3-32B, 16 GPUs: upipe / ulysses", 1024): (0.99, True),
                  # Ulysses is over the device at 2K: marked, not dropped
                  ("Qwen3-32B, 16 GPUs: upipe / ulysses", 2048): (1.1, False),
                  # on 8 x 2, over the USP hybrid of that mesh (the paper's Table 4 reference)
                  ("Qwen3-32B, 16 GPUs: upipe 8x2 overlap / usp 8x2", 1024): (2.1, True)}
    lines = speed_table.table([got])
    assert lines[0] == ("| length | Qwen3-32B, 16 GPUs: upipe / ulysses "
                        "| Qwen3-32B, 16 GPUs: upipe 8x2 overlap / usp 8x2 |")
    assert lines[2:] == ["| 1K | 0.9900 | 2.1000 |", "| 2K | 1.1000 † | — |"]


def test_a_hybrid_mesh_is_over_the_usp_of_its_mesh_as_the_paper_divides():
    """UPipe 8x2 over USP 8x2 (the paper's Table 4 reference), not over a 16 x 1 Ulysses the
    paper does not have; no USP row at a length: no ratio there."""
    rows = pd.DataFrame([
        _row("ulysses", 1024, 500.0), _row("usp", 1024, 400.0, ring=2),
        _row("upipe", 1024, 388.0, ring=2), _row("ulysses", 2048, 300.0),
        _row("upipe", 2048, 200.0, ring=2)])
    got = speed_table.ratios(rows)
    assert got["column"].tolist() == ["Qwen3-32B, 16 GPUs: upipe 8x2 / usp 8x2"]
    assert got["ratio"].tolist() == [pytest.approx(0.97)] and got["fits"].tolist() == [True]


def test_without_rows_the_section_says_so(tmp_path):
    text = speed_table.render(tmp_path)
    assert text.startswith(speed_table.BEGIN) and text.endswith(speed_table.END)
    assert "No emulated Table 3 or Table 4 rows" in text
