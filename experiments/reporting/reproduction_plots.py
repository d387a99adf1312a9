"""The reproduction report's two figures (``reproduction``): emulated against published tokens/s
per GPU, one point per cell, and their ratio per length; a panel per table of the paper."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.ticker import FuncFormatter, NullLocator

from experiments.reporting.paper_tables import TABLES
from experiments.reporting.plots import figure, format_tokens


def _palette(tp: pd.DataFrame) -> dict[str, tuple]:
    """One colour per method across both tables (the paper's Ulysses in Table 4 is usp)."""
    methods = list(dict.fromkeys(tp["method"]))
    return dict(zip(methods, sns.color_palette("deep", len(methods)), strict=True))


def _label(method: str, mesh_: str) -> str:
    return f"{method} {mesh_}"


def plot_vs_paper(tp: pd.DataFrame, path: Path) -> bool:
    """Emulated against published tokens/s per GPU, one point per cell where both fit, a panel
    per table, log-log with the y = x line (the reference: emulated = published)."""
    both = tp.dropna(subset=["ratio"])
    if both.empty:
        return False
    colors = _palette(tp)
    tables = sorted(both["table"].unique())
    with figure(path, ncols=len(tables), width=6.0 * len(tables), height=5.2) as (_, axes):
        for ax, table in zip(axes, tables, strict=True):
            g = both[both["table"] == table]
            for (method, m), d in g.groupby(["method", "mesh"], sort=False):
                ax.scatter(d["paper_tokens_per_s"], d["emulated_tokens_per_s"], s=28,
                           color=colors[method], label=_label(method, m), zorder=3)
            lo = 0.8 * min(g["paper_tokens_per_s"].min(), g["emulated_tokens_per_s"].min())
            hi = 1.25 * max(g["paper_tokens_per_s"].max(), g["emulated_tokens_per_s"].max())
            ax.plot([lo, hi], [lo, hi], ls="--", lw=1.2, color="0.3", label="y = x")
            ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi),
                   xlabel="published tokens/s per GPU (the paper)",
                   ylabel="emulated tokens/s per GPU",
                   title=f"{TABLES[table][2]}, {TABLES[table][0]} on {TABLES[table][1]} H100s "
                         f"({len(g)} cells both fit)")
            for axis in (ax.xaxis, ax.yaxis):
                axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
                axis.set_minor_formatter(FuncFormatter(_minor))
            ax.legend(fontsize=8, loc="upper left")
    return True


def _minor(v: float, _) -> str:
    """Minor log ticks labelled at 2 and 5 times a power of ten, in plain numbers."""
    lead = v / 10 ** np.floor(np.log10(v))
    return f"{v:,.0f}" if round(lead) in (2, 5) else ""


def plot_ratio_by_length(tp: pd.DataFrame, path: Path) -> bool:
    """Emulated over published tokens/s per GPU against the length, a line per method, a panel
    per table, with the reference line at 1.0."""
    both = tp.dropna(subset=["ratio"])
    if both.empty:
        return False
    colors = _palette(tp)
    tables = sorted(both["table"].unique())
    top = max(1.2, 1.1 * both["ratio"].max())
    with figure(path, ncols=len(tables), width=6.0 * len(tables), height=4.6) as (_, axes):
        for ax, table in zip(axes, tables, strict=True):
            g = both[both["table"] == table]
            for (method, m), d in g.groupby(["method", "mesh"], sort=False):
                ax.plot(d["seq_len"], d["ratio"], marker="o", ms=4, color=colors[method],
                        label=_label(method, m))
            ax.axhline(1.0, ls="--", lw=1.2, color="0.3", label="emulated = published")
            ticks = sorted(g["seq_len"].unique())
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [format_tokens(t) for t in ticks])
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set(ylim=(0, top), xlabel="sequence length (global tokens, log2 scale)",
                   ylabel="emulated / published tokens/s per GPU",
                   title=f"{TABLES[table][2]}, {TABLES[table][0]} on {TABLES[table][1]} H100s")
            ax.legend(fontsize=8, loc="upper right")
    return True
