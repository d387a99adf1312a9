"""Plots are a pure function of the tables: synthetic rows.csv / max_context.csv in, PNGs out.

CPU only and fast: no benchmark runs; the tables mimic what experiments.reporting.tables writes
(every status, NaN metrics on failed cells, the stack named 'none', a CPU budget line).
"""

import math

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from PIL import Image

from experiments.reporting.paper_tables import (
    PAPER_LADDER_3M,
    PAPER_MAX_CONTEXT,
    PAPER_THROUGHPUT,
    PAPER_TWO_NODE,
    paper_peaks,
    paper_row,
)
from experiments.reporting.plot_common import paper_rows_by_label, throughput_rows, vs_ulysses
from experiments.reporting.plot_labels import format_tokens, label_variants, variant_label
from experiments.reporting.plots import PLOTS, _read, draw_plots
from experiments.reporting.tables import MAXCTX, MAXCTX_COLUMNS, ROW_COLUMNS, ROWS

MiB = 2**20
VARIANTS = [("ulysses", None, 1.0), ("ds-ulysses", None, 1.1), ("upipe", None, 0.7),
            ("upipe", 4, 0.6), ("upipe", 8, 0.8)]  # method, U, memory factor


def _row(method, u, seq_len, stack="alst", status="ok", mem_factor=1.0):
    """One rows.csv row; only ok rows carry times, oom rows carry just their peak."""
    row = {"method": method, "heads_per_stage": u, "model": "tiny", "seq_len": seq_len,
           "nproc": 4, "stack": stack, "status": status, "budget_mib": 96,
           "device_memory_bytes": 96 * MiB, "device": "cpu (x86_64)"}
    peak = mem_factor * (8 + seq_len / 128) * MiB
    if status in ("ok", "oom"):
        row.update(peak_device_bytes=peak, peak_model_bytes=0.2 * peak,
                   peak_attention_bytes=0.5 * peak, peak_other_bytes=0.3 * peak,
                   peak_host_bytes=peak if stack in ("offload", "alst") else 0.0)
    if status == "ok":
        t = seq_len / 4 / (3000 / mem_factor)
        row.update(time_median_s=t, time_p20_s=0.95 * t, time_p80_s=1.1 * t,
                   tokens_per_s_per_gpu=seq_len / 4 / t)
    return row


def _rows() -> list[dict]:
    rows = [_row(m, u, s, mem_factor=f) for m, u, f in VARIANTS for s in (2048, 4096, 8192)]
    rows += [_row(m, None, 4096, stack=st, mem_factor=f)
             for m, _, f in VARIANTS[:3:2] for st in ("none", "ac", "offload")]
    rows += [_row("ulysses", None, 16384, status="oom"),
             _row("upipe", None, 16384, stack="none", status="error"),
             _row("ds-ulysses", None, 16384, status="timeout"),
             _row("upipe", 8, 16384, status="skipped")]
    return rows


def _maxctx() -> list[dict]:
    base = {"model": "tiny", "nproc": 4, "stack": "alst", "budget_mib": 96, "status": "ok",
            "device": "cpu (x86_64)"}
    return [base | {"method": "ulysses", "max_seq_len": 10240, "first_failing_seq_len": 12288},
            base | {"method": "upipe", "heads_per_stage": 4, "max_seq_len": 65536},
            base | {"method": "ds-ulysses", "first_failing_seq_len": 4096}]  # nothing fits


def _write(d, rows=None, maxctx=None):
    """The two tables as report.write_tables lays them out (column order, empty for NaN)."""
    if rows is not None:
        pd.DataFrame(rows).reindex(columns=ROW_COLUMNS).to_csv(d / ROWS, index=False)
    if maxctx is not None:
        pd.DataFrame(maxctx).reindex(columns=MAXCTX_COLUMNS).to_csv(d / MAXCTX, index=False)
    return d


def _assert_png(path):
    """A real picture: a PNG of plausible size that is not one flat colour."""
    with Image.open(path) as im:
        assert im.format == "PNG"
        assert im.width >= 400 and im.height >= 300, im.size
        assert np.asarray(im.convert("L")).std() > 5  # axes, bars and text, not a blank canvas


def test_format_helpers():
    assert format_tokens(131072) == "128K"
    assert format_tokens(2**20) == "1M"
    assert format_tokens(int(5.5 * 2**20)) == "5.5M"
    assert format_tokens(1000) == "1000"
    assert variant_label("upipe", 8.0) == "upipe U=8"
    assert variant_label("ulysses", math.nan) == "ulysses"
    assert variant_label("ulysses", None) == "ulysses"
    # hybrids as Ulysses x ring (the paper's 8x2), FPDT by its chunk; NaN = not set
    assert variant_label("usp", math.nan, 2.0, math.nan, 16) == "usp 8x2"
    assert variant_label("upipe", 4.0, 2, None, 4) == "upipe 2x2 U=4"
    assert variant_label("upipe", math.nan, 1.0, math.nan, 4) == "upipe"
    # upipe's FPDT is named for what it is (not the paper's, which is ds-fpdt)
    assert variant_label("fpdt", None, 1, 1024.0, 4) == "fpdt (upipe's, ALST stack) c=1K"


@pytest.mark.slow  # about 2 s on 2 cores (docs/testing.md)
def test_every_plot_drawn_and_closed(tmp_path):
    _write(tmp_path, _rows(), _maxctx())
    out = draw_plots(tmp_path, PLOTS)
    assert list(out) == list(PLOTS)
    for name, path in out.items():
        assert path == tmp_path / f"{name}.png"
        _assert_png(path)
    assert plt.get_fignums() == []  # every figure closed after saving


def test_plot_names_match_sweep():
    from experiments.config.sweep import (
        PLOTS as SWEEP_PLOTS,  # imports torch: only this test needs it
    )

    assert tuple(PLOTS) == SWEEP_PLOTS


@pytest.mark.slow  # about 1-2 s on 2 cores (docs/testing.md)
def test_missing_data_skipped(tmp_path):
    no_ulysses = [r for r in _rows() if r["method"] != "ulysses"]
    out = draw_plots(_write(tmp_path, no_ulysses), PLOTS)  # and no max_context.csv
    assert "throughput_vs_ulysses" not in out and "max_context" not in out
    assert {"memory_vs_seq", "throughput_vs_seq", "memory_ladder"} <= set(out)
    assert not (tmp_path / "max_context.png").exists()


def test_no_ok_rows_draws_nothing(tmp_path):
    failed = [_row("ulysses", None, 2048, status=s) for s in ("error", "timeout", "invalid")]
    assert draw_plots(_write(tmp_path, failed), PLOTS) == {}
    assert draw_plots(tmp_path / "absent", PLOTS) == {}  # no tables at all
    assert draw_plots(_write(tmp_path, [], []), PLOTS) == {}  # header-only tables
    assert list(tmp_path.glob("*.png")) == []


def test_unknown_name_raises_before_drawing(tmp_path):
    _write(tmp_path, _rows(), _maxctx())
    with pytest.raises(ValueError, match="memory_ladder.*heads_per_stage") as err:
        draw_plots(tmp_path, ["memory_vs_seq", "speedup"])
    assert "speedup" in str(err.value)
    assert list(tmp_path.glob("*.png")) == []


def test_same_tables_same_pixels(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        draw_plots(_write(d, _rows(), _maxctx()), ["max_context", "memory_vs_seq"])
    for name in ("max_context", "memory_vs_seq"):
        assert (a / f"{name}.png").read_bytes() == (b / f"{name}.png").read_bytes()


def test_tables_read_back(tmp_path):
    """'none' is a stack, not a missing value; absent columns come back as NaN."""
    rows = _read(_write(tmp_path, _rows()) / ROWS, ROW_COLUMNS + ["extra"])
    assert "none" in set(rows["stack"])
    assert rows["extra"].isna().all()
    assert rows.loc[rows["status"] == "error", "time_median_s"].isna().all()


def test_new_variants_get_their_own_labels(tmp_path):
    """Tables with hybrid and chunked variants (and old rows without those columns) draw a line
    per variant; torch-cp, on its own stack, is compared with Ulysses on the stack it ran."""
    rows = [_row("ulysses", None, s) for s in (2048, 4096)]
    rows += [_row(m, None, s, mem_factor=f) | extra for m, f, extra in (
        ("usp", 1.1, {"ring_degree": 2}), ("upipe", 0.7, {"ring_degree": 2}),
        ("upipe", 0.8, {"ring_degree": 1}), ("fpdt", 0.9, {"chunk_size": 1024}),
        ("torch-cp", 1.3, {"stack": "native"})) for s in (2048, 4096)]
    _write(tmp_path, rows)
    df, labels = label_variants(_read(tmp_path / ROWS, ROW_COLUMNS))
    # short labels for an axis; the detail names the stack where it differs from the rest's
    assert labels == ["ulysses", "fpdt", "torch-cp", "upipe", "upipe 2x2", "usp 2x2"]
    assert list(df.drop_duplicates("label")["detail"]) == [
        "ulysses", "fpdt (upipe's, ALST stack) c=1K", "torch-cp, stack native", "upipe",
        "upipe 2x2", "usp 2x2"]
    tp = throughput_rows(_read(tmp_path / ROWS, ROW_COLUMNS))
    ratio = vs_ulysses(tp, "tps", ["seq_len", "model", "nproc", "stack"])
    assert not np.isnan(ratio).any()  # torch-cp (native) against Ulysses (alst)
    assert set(draw_plots(tmp_path, ["memory_vs_seq", "throughput_vs_ulysses"])) == {
        "memory_vs_seq", "throughput_vs_ulysses"}


def test_short_labels_keep_variants_apart(tmp_path):
    """Two variants that one short label would name get their details on the axis instead."""
    rows = [_row("ulysses", None, 2048)]
    rows += [_row("fpdt", None, 2048) | {"chunk_size": c} for c in (1024, 4096)]
    rows += [_row("upipe", None, 2048, stack=st) for st in ("alst", "offload")]
    rows += [_row("upipe", None, 2048) | {"overlap": True}]
    _write(tmp_path, rows)
    df, labels = label_variants(_read(tmp_path / ROWS, ROW_COLUMNS))
    assert labels == ["ulysses", "fpdt c=1K", "fpdt c=4K", "upipe, stack offload",
                      "upipe, stack alst", "upipe overlap"]


def test_paper_values_of_the_papers_variants():
    """A variant run as a row of the paper's Table 3 or 4 (model, GPUs, method, mesh; blocking
    stages) gets that row's values; CPU-scale and overlapped variants get none."""
    row = paper_row("llama3-8b", 8, "upipe", "8x1")
    top = next(r for r in PAPER_MAX_CONTEXT if (r["table"], r["method"]) == ("table3", "upipe"))
    assert row["max_context"] == top["max_context"] and row["name"] == "Table 3"
    assert row["tokens_per_s_per_gpu"] == {c["seq_len"]: c["tokens_per_s_per_gpu"]
                                           for c in PAPER_THROUGHPUT if c["status"] == "ok"
                                           and (c["table"], c["method"]) == ("table3", "upipe")}
    assert paper_row("qwen3-32b", 16, "upipe", "8x1") is None  # Table 4 runs UPipe 8x2
    big = [_row("usp", None, 2**17) | {"model": "qwen3-32b", "nproc": 16, "ring_degree": 2},
           _row("zigzag-ring", None, 2**17) | {"model": "qwen3-32b", "nproc": 16},
           _row("upipe", None, 2**17) | {"model": "qwen3-32b", "nproc": 16, "ring_degree": 2,
                                          "overlap": True},
           _row("upipe", None, 2**17) | {"model": "qwen3-32b", "nproc": 16, "ring_degree": 2,
                                          "kernel": "fa2"}]
    df, _ = label_variants(pd.DataFrame(big).reindex(columns=ROW_COLUMNS))
    assert {k: v["name"] for k, v in paper_rows_by_label(df).items()} == {"usp 8x2": "Table 4",
                                                                          "zigzag-ring": "Table 4"}
    df, _ = label_variants(pd.DataFrame(_rows()).reindex(columns=ROW_COLUMNS))
    assert paper_rows_by_label(df) == {}  # tiny on 4 CPU ranks


def test_paper_peaks_from_its_figures():
    """The memory wall's rungs that train (on their stack), a quoted cell, the two-node figure."""
    rung = next(r for r in PAPER_LADDER_3M if r["rung"] == "upipe")
    assert paper_peaks("llama3-8b", 8, "upipe", "8x1", "alst") == [
        {"seq_len": 3 * 2**20, "figure": "memory-wall figure",
         "gib": rung["model_gib"] + rung["attention_gib"] + rung["other_gib"]}]
    assert paper_peaks("llama3-8b", 8, "upipe", "8x1", "offload") == []
    assert [p["figure"] for p in paper_peaks("llama3-8b", 8, "zigzag-ring", "1x8", "alst")] == [
        "Table 3"]
    two = paper_peaks("llama3-8b", 16, "usp", "8x2", "alst")
    assert [p["gib"] for p in two] == [r["usp_peak_gib"] for r in PAPER_TWO_NODE
                                       if r["usp_status"] == "ok"]


def test_throughput_and_ratio_vs_ulysses():
    """tokens/s per GPU = seq_len / nproc / time; p20 time bounds it from above."""
    df = pd.DataFrame([_row("ulysses", None, 4096), _row("upipe", 4, 4096, mem_factor=2.0),
                       _row("upipe", 4, 8192), _row("ulysses", None, 2048, status="oom")])
    tp = throughput_rows(df)
    assert len(tp) == 3  # the oom row has no throughput
    assert np.allclose(tp["tps"], tp["seq_len"] / tp["nproc"] / tp["time_median_s"])
    assert (tp["lo"] < tp["tps"]).all() and (tp["hi"] > tp["tps"]).all()
    ratio = vs_ulysses(tp.reset_index(drop=True), "tps", ["seq_len", "model", "nproc", "stack"])
    assert ratio[0] == pytest.approx(1.0) and ratio[1] == pytest.approx(0.5)
    assert np.isnan(ratio[2])  # no Ulysses row at 8K


def test_memory_wall_rungs_are_the_papers():
    from experiments.reporting.ablation_plots import ladder_rung
    from experiments.sweeps.memory_ladder import WALL_RUNGS

    rungs = [ladder_rung(r["method"], r["stack"], r.get("nproc", 8)) for r in WALL_RUNGS]
    assert rungs == ["FSDP only", "+ Ulysses", "+ checkpointing", "+ offload", "ALST", "UPipe"]
    assert ladder_rung("fpdt", "alst", 8) == "fpdt alst"


def test_memory_plot_draws_a_lower_bound_apart_from_a_peak_reached(tmp_path, monkeypatch):
    """A search's probe that a lower bound put over the device (``peak_device_is_lower_bound``)
    has no peak of its own: memory_vs_seq marks it as "at least", not as the peak reached."""
    from matplotlib.figure import Figure

    probe = _row("ulysses", None, 32768, status="oom") | {"peak_device_is_lower_bound": True}
    cols = [*ROW_COLUMNS, "peak_device_is_lower_bound"]
    pd.DataFrame([*_rows(), probe]).reindex(columns=cols).to_csv(tmp_path / ROWS, index=False)
    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
    draw_plots(tmp_path, ["memory_vs_seq"])
    (ax,) = drawn[0].axes
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "OOM (peak reached)" in legend and "OOM (its peak at least)" in legend
    # each mark at its own length: the 16K cell's peak, the 32K probe's bound
    marks = [[int(x) for x, _ in c.get_offsets()] for c in ax.collections
             if len(c.get_offsets())]
    assert sorted(marks) == [[16384], [32768]], marks


@pytest.mark.parametrize("mode", ["measured", "emulated"])
def test_throughput_axis_says_where_its_times_come_from(tmp_path, monkeypatch, mode):
    """Measured rows have a spread of step times (p20-p80 whiskers); an emulated row has the
    time model's one step, and its axis says so instead of promising whiskers."""
    from matplotlib.figure import Figure

    rows = [r | {"mode": mode} | ({"time_p20_s": None, "time_p80_s": None, "time_median_s": None}
                                  if mode == "emulated" else {}) for r in _rows()]
    _write(tmp_path, rows)
    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
    draw_plots(tmp_path, ["throughput_vs_seq"])
    (ax,) = drawn[0].axes
    assert ax.get_ylabel() == {"measured": "tokens/s per GPU (whiskers: p20-p80 step)",
                               "emulated": "tokens/s per GPU (time model)"}[mode]
    assert ("(emulated)" in ax.get_title()) == (mode == "emulated")


def _paper_row(method, ring, seq_len, tps, **kw):
    """An emulated row of the paper's Table 4 configuration (Qwen3-32B on 16 GPUs, FA3)."""
    return {"method": method, "ring_degree": ring, "model": "qwen3-32b", "nproc": 16,
            "seq_len": seq_len, "stack": "alst", "kernel": "fa3", "status": "ok",
            "mode": "emulated", "iters": 8, "tokens_per_s_per_gpu": tps,
            "device": "emulated cuda"} | kw


def test_paper_marks_are_beside_bars_of_the_same_denominator(tmp_path, monkeypatch):
    """Table 4's paper marks are UPipe 8x2 over USP 8x2 (the paper's Ulysses there): the bars
    divide by the same USP 8x2, not by upipe's Ulysses on 16x1, and the axis names it."""
    from matplotlib.collections import LineCollection
    from matplotlib.figure import Figure

    n = 131072
    _write(tmp_path, [_paper_row("ulysses", 1, n, 600.0), _paper_row("usp", 2, n, 500.0),
                      _paper_row("upipe", 2, n, 480.0)])
    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
    draw_plots(tmp_path, ["throughput_vs_ulysses"])
    (ax,) = drawn[0].axes
    assert "usp 8x2" in ax.get_ylabel() and "usp 8x2" in ax.get_title()
    heights = {b.get_x(): b.get_height() for c in ax.containers for b in c}
    assert sorted(round(h, 6) for h in heights.values()) == [0.96, 1.2]  # upipe, ulysses
    marks = [seg[0][1] for c in ax.collections if isinstance(c, LineCollection)
             for seg in c.get_segments()]
    paper = paper_row("qwen3-32b", 16, "upipe", "8x2")["tokens_per_s_per_gpu"][n]
    usp = paper_row("qwen3-32b", 16, "usp", "8x2")["tokens_per_s_per_gpu"][n]
    assert marks == [pytest.approx(paper / usp)]


def test_no_paper_mark_over_another_denominator(tmp_path, monkeypatch):
    """Without the paper's Ulysses among the rows the bars divide by upipe's Ulysses: the
    paper's ratios (over its own Ulysses) are not drawn beside them."""
    from matplotlib.collections import LineCollection
    from matplotlib.figure import Figure

    _write(tmp_path, [_paper_row("ulysses", 1, 131072, 600.0),
                      _paper_row("upipe", 2, 131072, 480.0)])
    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
    draw_plots(tmp_path, ["throughput_vs_ulysses"])
    (ax,) = drawn[0].axes
    assert ax.get_ylabel() == "tokens/s per GPU relative to Ulysses"
    assert not [c for c in ax.collections if isinstance(c, LineCollection)]


def test_packed_rows_are_over_a_ulysses_of_their_document_length_only():
    df = pd.DataFrame([_row("ulysses", None, 4096), _row("upipe", None, 4096, mem_factor=2.0),
                       _row("upipe", None, 4096, mem_factor=0.5)])
    df["doc_len"] = [np.nan, np.nan, 2048.0]
    keys = ["seq_len", "model", "nproc", "stack", "doc_len"]
    ratio = vs_ulysses(df, "tokens_per_s_per_gpu", keys)
    assert ratio[1] == pytest.approx(0.5) and np.isnan(ratio[2])
    packed = pd.concat([df, df.iloc[[0]].assign(doc_len=2048.0, tokens_per_s_per_gpu=3000.0)],
                       ignore_index=True)
    assert vs_ulysses(packed, "tokens_per_s_per_gpu", keys)[2] == pytest.approx(2.0)


def test_memory_plot_leaves_out_probes_of_another_budget(tmp_path, monkeypatch):
    """A CPU grid runs without a budget, its max-context probes under one: the plot keeps the
    grid's rows, so an 8K cell is not drawn both as fitting and as over a budget line."""
    from matplotlib.figure import Figure

    grid = [_row("ulysses", None, s) | {"budget_mib": None, "device_memory_bytes": None,
                                        "iters": 2} for s in (4096, 8192)]
    probe = _row("ulysses", None, 8192, status="oom") | {"budget_mib": 48,
                                                         "device_memory_bytes": 48 * MiB,
                                                         "iters": 0}
    pd.DataFrame([*grid, probe]).reindex(columns=[*ROW_COLUMNS, "iters"]).to_csv(
        tmp_path / ROWS, index=False)
    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
    draw_plots(tmp_path, ["memory_vs_seq"])
    (ax,) = drawn[0].axes
    assert not [c for c in ax.collections if len(c.get_offsets())]  # no OOM mark
    assert not [ln for ln in ax.get_lines() if "budget" in ln.get_label()]
    assert "left out: 1 max-context probes under 48 MiB" in ax.get_title()
