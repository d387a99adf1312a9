"""The paper's two-node figure as a sweep (experiments/sweeps/two_node_llama3_8b_h100x16.py) and
its section of the reproduction report (experiments/reporting/reproduction.py): the declarations
validate cell by cell, and the section puts hand-made emulated rows beside PAPER_TWO_NODE -- a
cell that fits, one out of memory and one without a row each say so."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from experiments.config import GiB
from experiments.reporting import reproduction, reproduction_report
from experiments.reporting.paper_tables import PAPER_TWO_NODE, SEQ_LEN_TOKENS
from experiments.reporting.reproduction_plots import plot_two_node
from experiments.sweeps import get_sweep

M = 2**20
PAPER = "two_node_llama3_8b_h100x16"


def test_paper_sweep_is_the_figure_on_two_nodes():
    """Llama3-8B on 16 ranks, USP and UPipe on the 8 (Ulysses) x 2 (ring) mesh, Table 4's stack,
    precision and timing, the figure's lengths and 1M; every cell validates."""
    sweep, t4 = get_sweep(PAPER), get_sweep("table4_qwen3_32b_h100x16")
    cells = sweep.cells()
    assert {(c.method, c.nproc, c.ring_degree) for c in cells} == {("usp", 16, 2),
                                                                   ("upipe", 16, 2)}
    assert {c.model for c in cells} == {"llama3-8b"}
    for key in ("stack", "dtype", "warmup", "iters"):
        assert sweep.base[key] == t4.base[key], key
    hybrids = {c.method: c.stack for c in t4.cells() if c.ring_degree == 2}
    assert all(c.stack == hybrids[c.method] for c in cells)  # Table 4's stack per method
    assert sorted({c.seq_len for c in cells}) == [M // 2, M, 2 * M, 4 * M, 6 * M, 8 * M]
    assert {r["seq_len"] for r in PAPER_TWO_NODE} <= {c.seq_len for c in cells}
    for cell in cells:
        cell.validate()  # raises, naming the field, on an invalid cell
    assert sweep.validate() == []


@pytest.mark.parametrize("name", [f"{PAPER}-cpu", f"{PAPER}-emulated"])
def test_counterparts_validate(name):
    sweep = get_sweep(name)
    cells = sweep.cells()
    assert cells and sweep.validate() == []
    for cell in cells:
        cell.validate()
    if name.endswith("-cpu"):  # the hybrids as 2 x 2 on 4 gloo ranks
        assert {(c.method, c.nproc, c.ring_degree, c.model) for c in cells} == {
            ("usp", 4, 2, "tiny"), ("upipe", 4, 2, "tiny")}
    else:  # the paper's kernel on the paper's H100s
        assert {c.kernel for c in cells} == {"fa3"} and sweep.scale == "emulated"


def _row(method, seq, status, peak_gib, tokens, **kw):
    return {"method": method, "nproc": 16, "ring_degree": 2, "seq_len": seq, "status": status,
            "iters": 8, "stack": "alst", "kernel": "fa3", "tokens_per_s_per_gpu": tokens,
            "peak_device_bytes": peak_gib * GiB, "device_budget_bytes": 73.35 * GiB, **kw}


@pytest.fixture
def results(tmp_path: Path) -> Path:
    """512K both fit; 8M USP out of memory (as in the figure); 4M UPipe's row only; no row at
    2M or 6M; a 2M USP row on the plain 16x1 mesh, a probe and an overlapped row, none of them
    the figure's configuration."""
    rows = [_row("usp", SEQ_LEN_TOKENS["512K"], "ok", 16.0, 800.0),
            _row("upipe", SEQ_LEN_TOKENS["512K"], "ok", 15.0, 780.0),
            _row("upipe", SEQ_LEN_TOKENS["512K"], "ok", 14.0, 999.0),  # a rerun: not taken
            _row("usp", 8 * M, "oom", 74.6, 58.0),
            _row("upipe", 8 * M, "ok", 60.5, 58.0),
            _row("upipe", 4 * M, "ok", 36.3, 115.0),
            _row("usp", 2 * M, "ok", 27.7, 226.0, ring_degree=1),
            _row("usp", 6 * M, "ok", 59.0, 77.0, iters=0),
            _row("upipe", 6 * M, "ok", 48.0, 77.0, overlap=True)]
    (tmp_path / reproduction.TWO_NODE_SWEEP).mkdir()
    pd.DataFrame(rows).to_csv(tmp_path / reproduction.TWO_NODE_SWEEP / "rows.csv", index=False)
    return tmp_path


def test_two_node_beside_the_figure(results, tmp_path):
    two = reproduction.two_node(results)
    assert list(two.columns) == reproduction.TWO_NODE_COLUMNS
    assert list(two["seq_len"]) == [r["seq_len"] for r in PAPER_TWO_NODE]  # the figure's order
    cell = two.set_index("length")
    fits = cell.loc["512K"]
    assert (fits["emulated_usp_status"], fits["emulated_upipe_status"]) == ("ok", "ok")
    assert fits["emulated_usp_peak_gib"] == pytest.approx(16.0)
    assert fits["paper_usp_peak_gib"] == 16.2 and fits["paper_upipe_vs_usp"] == 0.955
    assert fits["emulated_upipe_vs_usp"] == pytest.approx(780.0 / 800.0)  # the first row
    assert (fits["usp_rows"], fits["upipe_rows"]) == (1, 2)
    assert "first in rows.csv" in fits["note"]
    assert fits["budget_gib"] == pytest.approx(73.35)
    oom = cell.loc["8M"]  # USP out of memory: its peak kept, no ratio on either side
    assert (oom["paper_usp_status"], oom["emulated_usp_status"]) == ("oom", "oom")
    assert oom["emulated_usp_peak_gib"] == pytest.approx(74.6)
    assert pd.isna(oom["paper_usp_peak_gib"]) and pd.isna(oom["paper_upipe_vs_usp"])
    assert pd.isna(oom["emulated_upipe_vs_usp"]) and oom["note"] == "no emulated ratio: usp oom"
    half = cell.loc["4M"]  # one side only
    assert (half["emulated_usp_status"], half["emulated_upipe_status"]) == ("missing", "ok")
    assert half["note"] == "no emulated usp 8x2 row" and pd.isna(half["emulated_upipe_vs_usp"])
    for length in ("2M", "6M"):  # only rows outside the figure's configuration
        none = cell.loc[length]
        assert (none["usp_rows"], none["upipe_rows"]) == (0, 0)
        assert none["note"] == "no emulated usp 8x2 row; no emulated upipe 8x2 row"
        assert pd.isna(none["emulated_usp_peak_gib"]) and pd.isna(none["budget_gib"])
    md = "\n".join(reproduction_report._two_node_md(two))
    assert "approximate" in md and "so approximate (~)" in md
    assert "| 512K | ok | ok | ~16.2 | 16.0 | ok | ok | ~15.7 | 15.0 | ~0.955 | 0.975 |" in md
    assert "| 8M | oom | oom | — | 74.6 | ok | ok | ~69.5 | 60.5 | — | — |" in md
    assert "| 2M | ok | missing | ~28.7 | — |" in md
    assert plot_two_node(two, tmp_path / "two_node.png")
    assert (tmp_path / "two_node.png").stat().st_size > 10_000


def test_two_node_without_the_sweep(tmp_path):
    """No emulated sweep: every length says so, and no figure is drawn."""
    two = reproduction.two_node(tmp_path)
    assert len(two) == len(PAPER_TWO_NODE) and set(two["emulated_usp_status"]) == {"missing"}
    assert two["note"].str.startswith("no emulated usp 8x2 row").all()
    assert not plot_two_node(two, tmp_path / "two_node.png")
