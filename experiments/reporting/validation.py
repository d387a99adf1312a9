"""The time model's validation against real runs: its summary and plot (DESIGN.md §9).

``write_time_validation(dir, table)`` writes ``comparison.csv`` (the table as given: one row per
cell, measured and predicted step seconds and ``error`` = predicted / measured - 1),
``summary.json`` (median and worst |error| against the targets) and
``predicted_vs_measured.png`` (predicted against measured step time, log-log, the y = x line
and the +-15% band), all pure functions of the table.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from experiments.store import write_json, write_text

# issue 14's targets for the CPU validation: median |error| <= 15%, worst <= 35%
TARGET_MEDIAN, TARGET_WORST = 0.15, 0.35


def summarize_errors(table: pd.DataFrame) -> dict:
    """Median and worst |error| of the table's cells, and whether they meet the targets."""
    err = table["error"].abs()
    worst = int(err.idxmax())
    return {
        "cells": len(table), "median_abs_error": float(err.median()),
        "worst_abs_error": float(err.max()), "worst_cell": table.loc[worst, "cell_id"],
        "mean_error": float(table["error"].mean()),
        "target_median_abs_error": TARGET_MEDIAN, "target_worst_abs_error": TARGET_WORST,
        "meets_targets": bool(err.median() <= TARGET_MEDIAN and err.max() <= TARGET_WORST),
        "by_method": {m: float(g["error"].abs().median())
                      for m, g in table.groupby("method")},
    }


def plot_predicted_vs_measured(table: pd.DataFrame, path: Path) -> None:
    """Predicted against measured step seconds per cell, a marker per method."""
    fig = Figure(figsize=(7, 6), layout="constrained")
    ax = fig.subplots()
    sns.scatterplot(table, x="measured_s", y="predicted_s", hue="method", style="model", ax=ax)
    lo = 0.8 * min(table["measured_s"].min(), table["predicted_s"].min())
    hi = 1.25 * max(table["measured_s"].max(), table["predicted_s"].max())
    xs = np.geomspace(lo, hi, 50)
    ax.plot(xs, xs, color="black", lw=1, label="predicted = measured")
    ax.fill_between(xs, xs * (1 - TARGET_MEDIAN), xs * (1 + TARGET_MEDIAN), color="grey",
                    alpha=0.2, label=f"+-{TARGET_MEDIAN:.0%}")
    ax.set(xscale="log", yscale="log", xlabel="measured step time (s, median of timed steps)",
           ylabel="emulated step time (s)",
           title="Emulated vs measured step time (CPU, 2 gloo ranks)")
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def write_time_validation(out: Path, table: pd.DataFrame) -> dict:
    """comparison.csv, summary.json and predicted_vs_measured.png in ``out``; the summary."""
    if table.empty:
        raise ValueError("no cell has both a measured and a predicted step time")
    write_text(out / "comparison.csv", table.to_csv(index=False, float_format="%.6g"))
    summary = summarize_errors(table)
    write_json(out / "summary.json", summary)
    plot_predicted_vs_measured(table, out / "predicted_vs_measured.png")
    return summary
