"""The emulated grid beside the paper's (experiments/reporting/paper_grid.py) and the
reproduction report (experiments/reporting/reproduction.py): cells matched by the paper's mesh
notation, agreements counted, each disagreement explained from its numbers, a cell without a
paper counterpart (or without an emulated row) saying so, and the committed results/paper_grid
equal to what the generator writes from the committed rows."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from experiments.config import GiB
from experiments.reporting import paper_grid, reproduction, reproduction_report
from experiments.reporting.paper_tables import PAPER_OUTCOMES, PAPER_THROUGHPUT, SEQ_LEN_TOKENS

M = SEQ_LEN_TOKENS
RESULTS = Path(__file__).resolve().parents[1] / "results"


def _row(method, seq, status, peak_gib, nproc=8, ring_degree=1, iters=8, stack="alst",
         tokens=100.0, **kw):
    return {"method": method, "nproc": nproc, "ring_degree": ring_degree, "seq_len": seq,
            "status": status, "iters": iters, "stack": stack, "kernel": "fa3",
            "tokens_per_s_per_gpu": tokens, "peak_device_bytes": peak_gib * GiB,
            "device_budget_bytes": 73.35 * GiB, **kw}


TABLE3 = [
    _row("upipe", M["5M"], "ok", 67.3, tokens=90.0),   # the paper: 98.25 -> agrees
    _row("zigzag-ring", M["3M"], "oom", 74.0),         # trains 3M at 73.5 -> disagrees
    _row("usp-ulysses", M["4M"], "ok", 70.0),          # an OOM cell -> disagrees, by 3.35 GiB
    _row("usp-ulysses", M["5M"], "ok", 71.0),          # blank: past the row's OOM at 4M
    _row("ulysses", M["4M"], "ok", 67.7),              # upipe's Ulysses: not the paper's
    _row("fpdt", M["5M"], "ok", 50.0),                 # not the paper's FPDT
    _row("upipe", M["4M"], "ok", 60.0, overlap=True),  # beyond the paper
    _row("upipe", M["4M"], "ok", 60.0, iters=0),       # a search probe: not a grid cell
    _row("torch-cp", M["2M"], "oom", 150.0),           # an OOM cell, OOM emulated too
    _row("upipe", M["128K"], "ok", 21.0, tokens=2000.0),  # duplicates: the first is taken
    _row("upipe", M["128K"], "ok", 21.0, tokens=2500.0),
    _row("usp-ulysses", M["128K"], "ok", 21.0, tokens=2300.0),
]
TABLE4 = [
    _row("usp-ulysses", M["128K"], "ok", 41.0, nproc=16),  # Table 4's Ulysses is USP 8x2
    _row("upipe", M["128K"], "ok", 41.0, nproc=16),    # Table 4's UPipe is 8x2
]


def _write(root: Path, sweep: str, rows: list[dict]) -> None:
    (root / sweep).mkdir(parents=True)
    pd.DataFrame(rows).to_csv(root / sweep / "rows.csv", index=False)


@pytest.fixture
def results(tmp_path: Path) -> Path:
    _write(tmp_path, paper_grid.SWEEPS["table3"], TABLE3)
    _write(tmp_path, paper_grid.SWEEPS["table4"], TABLE4)
    parts = {"peak_model_bytes": 15.1 * GiB, "peak_other_bytes": 16.1 * GiB}
    _write(tmp_path, reproduction.WALL_SWEEP, [
        _row("usp-ulysses", M["3M"], "ok", 63.0, iters=4, peak_attention_bytes=31.8 * GiB,
             **parts),
        _row("upipe", M["3M"], "ok", 48.1, iters=4, peak_attention_bytes=16.9 * GiB, **parts)])
    return tmp_path


def test_meshes_are_the_papers_notation():
    assert paper_grid.mesh("zigzag-ring", 8, 1) == "1x8"
    assert paper_grid.mesh("torch-cp", 16, 1) == "1x16"
    assert paper_grid.mesh("upipe", 16, 2) == "8x2"
    assert paper_grid.mesh("ulysses", 8, 1) == "8x1"
    assert paper_grid.mesh("usp-ulysses", 8, 1) == "8x1"
    assert paper_grid.mesh("ds-fpdt", 16, 1) == "16x1"


def test_grid_matches_the_tables_and_explains_disagreements(results):
    df = paper_grid.grid(results)
    assert len(df) == 13  # every timed row at a paper length; the probe left out
    t3 = df[df.table == "table3"].set_index(["method", "overlap", "length"])
    assert t3.loc[("upipe", False, "5M"), "agree"] == "yes"
    assert t3.loc[("torch-cp", False, "2M"), "agree"] == "yes"
    assert t3.loc[("fpdt", False, "5M"), "paper_status"] == "not in paper"
    over = t3.loc[("upipe", True, "4M")]
    assert (over["paper_status"], over["agree"]) == ("not in paper", "—")
    assert "overlapped" in over["paper_source"]
    past = t3.loc[("usp-ulysses", False, "5M")]
    assert (past["paper_status"], past["agree"]) == ("past OOM", "—")
    assert "stops at its OOM at 4M" in past["paper_source"]
    ring = t3.loc[("zigzag-ring", False, "3M")]
    assert (ring["agree"], ring["paper_peak_gib"]) == ("no", 73.5)
    assert "exceeds the 73.35 GiB budget by 0.65" in ring["note"]
    assert "trains at 73.5 GiB allocated" in ring["note"]
    spread = paper_grid.reserve_spread()
    assert spread is not None and spread[1] - spread[0] > 0.65  # the committed H100 rows
    assert "inside the spread" in ring["note"] and "the reserve" in ring["note"]
    uly = t3.loc[("usp-ulysses", False, "4M")]
    assert uly["agree"] == "no" and "fits the 73.35 GiB budget by 3.35" in uly["note"]
    assert "outside the spread" in uly["note"]
    ours = t3.loc[("ulysses", False, "4M")]
    assert (ours["paper_status"], ours["agree"]) == ("not in paper", "—")
    assert "not the paper's Ulysses" in ours["paper_source"]
    t4 = df[df.table == "table4"].set_index(["method", "mesh"])
    assert t4.loc[("usp-ulysses", "16x1"), "paper_status"] == "not in table"
    assert "has no usp-ulysses row" in t4.loc[("usp-ulysses", "16x1"), "paper_source"]
    assert "runs upipe as 8x2" in t4.loc[("upipe", "16x1"), "paper_source"]
    md = paper_grid.to_markdown(df)
    assert "## Disagreements (2)" in md and "7 of 13 emulated cells" in md
    assert "| upipe (overlap) | 8x1 | 4M |" in md


def test_throughput_beside_the_paper(results):
    tp = reproduction.throughput(results)
    assert len(tp) == len(PAPER_THROUGHPUT)  # one row per cell of the paper's tables
    cell = tp.set_index(["table", "method", "mesh", "length"])
    up = cell.loc[("table3", "upipe", "8x1", "5M")]  # a cell the paper reports
    assert up["ratio"] == pytest.approx(90.0 / 98.25) and up["agree"] == "yes"
    oom = cell.loc[("table3", "torch-cp", "1x8", "2M")]  # a cell the paper marks OOM
    assert (oom["paper_status"], oom["emulated_status"], oom["agree"]) == ("oom", "oom", "yes")
    assert pd.isna(oom["ratio"]) and pd.isna(oom["paper_tokens_per_s"])
    lacks = cell.loc[("table3", "ds-fpdt", "8x1", "128K")]  # one the sweep lacks
    assert (lacks["rows"], lacks["emulated_status"], lacks["agree"]) == (0, "missing", "—")
    assert pd.isna(lacks["emulated_tokens_per_s"]) and "no emulated row" in lacks["note"]
    dup = cell.loc[("table3", "upipe", "8x1", "128K")]  # two timed rows: the first
    assert (dup["rows"], dup["emulated_tokens_per_s"]) == (2, 2000.0)
    assert "first in rows.csv" in dup["note"]
    # usp-ulysses 4M fits emulated, not in the paper: no number on either side of the ratio
    uly = cell.loc[("table3", "usp-ulysses", "8x1", "4M")]
    assert uly["agree"] == "no" and pd.isna(uly["ratio"])
    assert not ((tp.method == "fpdt") | (tp.mesh == "16x1") & (tp.method == "upipe")).any()
    s = reproduction.summary(tp).set_index("table")
    assert s.loc["table3", "both_ok"] == 3 and s.loc["table4", "both_ok"] == 0
    assert "usp-ulysses 8x1 4M (paper oom, emulated ok)" in s.loc["table3", "disagree"]


def test_upipe_ratios_and_memory_wall(results):
    rt = reproduction.upipe_ratios(results).set_index(["table", "length", "ratio"])
    r = rt.loc[("table3", "128K", "upipe 8x1 / usp-ulysses 8x1")]
    assert r["emulated"] == pytest.approx(2000.0 / 2300.0)
    assert r["paper"] == pytest.approx(2281.05 / 2320.47)
    fpdt = rt.loc[("table3", "128K", "upipe 8x1 / ds-fpdt 8x1")]
    assert pd.isna(fpdt["emulated"]) and "ds-fpdt 8x1 no row" in fpdt["note"]
    past = rt.loc[("table3", "5M", "upipe 8x1 / usp-ulysses 8x1")]  # emulated usp-ulysses 5M: ok
    assert past["emulated"] == pytest.approx(90.0 / 100.0)
    assert "paper: usp-ulysses 8x1 blank (past its OOM)" in past["note"]
    wall = reproduction.memory_wall(results).set_index("rung")
    assert wall.loc["ALST", "emulated_attention_gib"] == pytest.approx(31.8)
    assert wall.loc["UPipe", "paper_attention_gib"] == 19.5
    assert wall.loc["FSDP only", "emulated_status"] == "missing"
    md = reproduction_report.to_markdown(reproduction.throughput(results),
                                  reproduction.upipe_ratios(results),
                                  reproduction.memory_wall(results), "",
                                  reproduction.two_node(results))
    assert "3145728 = 3 x 2^20" in md and "| table3 | 35 | 3 | 29 |" in md


@pytest.mark.slow  # about 1-2 s on 2 cores (docs/testing.md)
def test_committed_report_is_what_the_generator_writes(tmp_path):
    paper_grid.write(RESULTS, tmp_path)
    committed = RESULTS / paper_grid.OUT_DIR
    for name in ("grid_vs_paper.csv", "grid_vs_paper.md", *reproduction_report.FILES):
        assert (committed / name).read_text() == (tmp_path / name).read_text(), (
            f"results/paper_grid/{name} is stale or hand-edited: run "
            "`python -m experiments.reporting.paper_grid`")
    for name in reproduction_report.FIGURES:
        assert (committed / name).stat().st_size > 0 and (tmp_path / name).exists()


def test_known_outcomes_are_well_formed():
    for c in PAPER_OUTCOMES:
        assert c["status"] in ("ok", "oom") and c["source"].startswith("UPipe project page")
        assert c["seq_len"] in SEQ_LEN_TOKENS.values()


def test_ratio_lines_that_coincide_stay_apart(tmp_path, monkeypatch):
    """Table 3's upipe 8x1 and usp-ulysses 8x1 ratios lie on one another: each line has its own
    marker and line style, so neither hides the other."""
    from matplotlib.figure import Figure

    from experiments.reporting.reproduction_plots import plot_ratio_by_length

    tp = pd.DataFrame([{"table": "table3", "method": m, "mesh": "8x1", "seq_len": n,
                        "ratio": 1.0} for m in ("usp-ulysses", "upipe") for n in (M["128K"],
                                                                                   M["256K"])])
    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
    assert plot_ratio_by_length(tp, tmp_path / "ratio_by_length.png")
    (ax,) = drawn[0].axes
    lines = [ln for ln in ax.get_lines() if ln.get_label() in ("usp-ulysses 8x1", "upipe 8x1")]
    styles = {(ln.get_marker(), str(ln.get_linestyle())) for ln in lines}
    assert len(lines) == 2 and len(styles) == 2
