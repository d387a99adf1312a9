"""Plots of a sweep: a pure function of its two tables (rows.csv, max_context.csv;
docs/conventions.md#plots-are-functions-of-the-tables).

Every plot reads only the CSVs that ``tables`` writes, so a figure can be redrawn or restyled
without rerunning anything, and each shows its reference: the device-memory (or budget) line,
or Ulysses = 1.0. No torch here: drawing needs no accelerator stack.

Lengths are global tokens in binary units (128K = 131072), as the sweeps declare them. Tables
whose rows are all emulated (``mode`` column, an emulated sweep) draw the same figures with
"(emulated)" in the titles and axes and the emulated device budget as the reference line.

The figures are ``length_plots``' (max context, memory and throughput against length, throughput
vs Ulysses) and ``ablation_plots``' (memory ladder, heads per stage, memory wall), drawn with
``plot_labels``' names and ``plot_common``'s figure, axes and references. Here: their names, as
a sweep's ``plots`` lists them (``PLOTS``), and ``draw_plots``, which reads the tables and draws
them into the sweep's folder.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from experiments.reporting.ablation_plots import (
    plot_heads_per_stage,
    plot_memory_ladder,
    plot_memory_wall,
)
from experiments.reporting.length_plots import (
    plot_max_context,
    plot_memory_vs_seq,
    plot_throughput_vs_seq,
    plot_throughput_vs_ulysses,
)
from experiments.reporting.tables import MAXCTX, MAXCTX_COLUMNS, ROW_COLUMNS, ROWS


def _read(path: Path, columns: list[str]) -> pd.DataFrame:
    """The CSV with every column of `columns` (absent ones NaN); empty when the file is absent.
    Only empty cells are missing values: the stack 'none' stays a string."""
    try:
        df = pd.read_csv(path, keep_default_na=False, na_values=[""])
    except (FileNotFoundError, pd.errors.EmptyDataError):
        df = pd.DataFrame()
    return df.reindex(columns=list(dict.fromkeys([*columns, *df.columns])))


# -- the plots by name: each returns False when the tables lack its data ---------------------


PLOTS = {"max_context": plot_max_context, "memory_vs_seq": plot_memory_vs_seq,
         "throughput_vs_seq": plot_throughput_vs_seq,
         "throughput_vs_ulysses": plot_throughput_vs_ulysses,
         "memory_ladder": plot_memory_ladder, "heads_per_stage": plot_heads_per_stage,
         "memory_wall": plot_memory_wall}


def draw_plots(sweep_dir: Path, plots: Iterable[str]) -> dict[str, Path]:
    """Draw each named plot that the tables support into sweep_dir/<name>.png; returns name ->
    path. A plot whose data is missing (no ok rows, no max_context.csv) is skipped, not an
    error; an unknown name raises ValueError before anything is drawn."""
    plots = list(dict.fromkeys(plots))
    bad = [p for p in plots if p not in PLOTS]
    if bad:
        raise ValueError(f"unknown plot(s) {bad}; valid plots are {list(PLOTS)}")
    sweep_dir = Path(sweep_dir)
    rows = _read(sweep_dir / ROWS, ROW_COLUMNS)
    maxctx = _read(sweep_dir / MAXCTX, MAXCTX_COLUMNS)
    out = {}
    for name in plots:
        path = sweep_dir / f"{name}.png"
        if PLOTS[name](rows, maxctx, path):
            out[name] = path
    return out
