"""The reproduction report's figures (``reproduction``): emulated against published tokens/s
per GPU, one point per cell, and their ratio per length, a panel per table of the paper; and the
two-node figure, each method's peak GiB and UPipe's tokens/s over USP's per length, emulated
beside the paper's (approximate: read off its chart)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.ticker import FuncFormatter, NullLocator

from experiments.reporting.paper_tables import TABLES
from experiments.reporting.plot_common import figure
from experiments.reporting.plot_labels import format_tokens


def _palette(tp: pd.DataFrame) -> dict[str, tuple]:
    """One colour per method across both tables (the paper's Ulysses in Table 4 is usp)."""
    methods = list(dict.fromkeys(tp["method"]))
    return dict(zip(methods, sns.color_palette("deep", len(methods)), strict=True))


def _label(method: str, mesh_: str) -> str:
    return f"{method} {mesh_}"


# a marker and a line style per line of a panel: lines that coincide (upipe 8x1 on the paper's
# Ulysses, usp-ulysses 8x1, in Table 3) stay apart where colour alone would hide one
LINE_STYLES = (("o", "-"), ("s", "--"), ("^", ":"), ("D", "-."), ("v", (0, (5, 1, 1, 1))))


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
    """Emulated over published tokens/s per GPU against the length, a line per method (its own
    colour, hollow marker and line style: ``LINE_STYLES``), a panel per table, with the
    reference line at 1.0."""
    both = tp.dropna(subset=["ratio"])
    if both.empty:
        return False
    colors = _palette(tp)
    tables = sorted(both["table"].unique())
    top = max(1.2, 1.1 * both["ratio"].max())
    with figure(path, ncols=len(tables), width=6.0 * len(tables), height=4.6) as (_, axes):
        for ax, table in zip(axes, tables, strict=True):
            g = both[both["table"] == table]
            for i, ((method, m), d) in enumerate(g.groupby(["method", "mesh"], sort=False)):
                marker, ls = LINE_STYLES[i % len(LINE_STYLES)]
                ax.plot(d["seq_len"], d["ratio"], marker=marker, ls=ls, ms=5, mfc="none",
                        color=colors[method], label=_label(method, m))
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


TWO_NODE_LABELS = {"usp": "USP 8x2", "upipe": "UPipe 8x2"}


def _two_node_peaks(ax, two: pd.DataFrame, x: np.ndarray) -> None:
    """Peak GiB per length: emulated (solid; an OOM row's peak as a cross) and the paper's
    (dashed, approximate), a colour per method, the emulated budget as the reference line."""
    colors = dict(zip(TWO_NODE_LABELS, sns.color_palette("deep", 2), strict=True))
    for m, label in TWO_NODE_LABELS.items():
        ours, oom = two[f"emulated_{m}_peak_gib"], two[f"emulated_{m}_status"] == "oom"
        ax.plot(x, ours.where(~oom), marker="o", color=colors[m], label=f"{label}, emulated")
        ax.scatter(x[oom], ours[oom], marker="x", s=60, color=colors[m], zorder=3,
                   label=f"{label}, emulated OOM (peak it would need)" if oom.any() else None)
        ax.plot(x, two[f"paper_{m}_peak_gib"], ls="--", marker="s", mfc="none",
                color=colors[m], label=f"{label}, paper (approx.)")
        for xi in x[(two[f"paper_{m}_status"] == "oom").to_numpy()]:
            ax.annotate(f"paper: {label} OOM", (xi, 0), xytext=(-4, 4),
                        textcoords="offset points", ha="right", fontsize=8, color=colors[m])
    budget = two["budget_gib"].dropna()
    if len(budget):
        ax.axhline(budget.iloc[0], ls=":", lw=1.3, color="firebrick",
                   label=f"emulated budget ({budget.iloc[0]:.2f} GiB)")
    ax.set(ylabel="peak GiB per GPU", ylim=(0, None), title="Peak memory per GPU")


def _two_node_ratio(ax, two: pd.DataFrame, x: np.ndarray) -> None:
    """UPipe's tokens/s over USP's per length, emulated and the paper's, USP = 1.0; a length
    without either ratio (USP out of memory) says so."""
    ax.plot(x, two["emulated_upipe_vs_usp"], marker="o", color="0.15", label="emulated")
    ax.plot(x, two["paper_upipe_vs_usp"], ls="--", marker="s", mfc="none", color="0.45",
            label="paper (approx.)")
    ax.axhline(1.0, ls=":", lw=1.3, color="firebrick", label="USP = 1.0")
    none = (two["emulated_upipe_vs_usp"].isna() & two["paper_upipe_vs_usp"].isna()).to_numpy()
    for xi in x[none]:
        ax.annotate("no ratio\n(USP OOM)", (xi, 1.0), xytext=(-4, -6), textcoords="offset points",
                    ha="right", va="top", fontsize=8, color="0.3")
    vals = pd.concat([two["emulated_upipe_vs_usp"], two["paper_upipe_vs_usp"]]).dropna()
    lo = min(0.9, vals.min() - 0.02) if len(vals) else 0.9
    ax.set(ylabel="UPipe / USP tokens/s per GPU", ylim=(lo, 1.05),
           title="UPipe tokens/s relative to USP")


def plot_two_node(two: pd.DataFrame, path: Path) -> bool:
    """The paper's two-node figure (Llama3-8B, 16 H100s, USP 8x2 against UPipe 8x2) with the
    emulated values beside it: peak GiB per length, and UPipe's tokens/s over USP's. Reads
    ``reproduction.two_node``'s table; nothing drawn when no emulated row matched."""
    if not (two["usp_rows"].sum() + two["upipe_rows"].sum()):
        return False
    x = two["seq_len"].to_numpy() / 2**20  # a linear axis: memory grows linearly in length
    with figure(path, ncols=2, width=13.0, height=4.8) as (fig, axes):
        _two_node_peaks(axes[0], two, x)
        _two_node_ratio(axes[1], two, x)
        for ax in axes:
            ax.set_xticks(x, two["length"])
            ax.set(xlabel="sequence length (global tokens)", xlim=(0, 1.05 * x.max()))
            ax.legend(fontsize=7, loc="upper left")
        fig.suptitle("Llama3-8B on 16 H100s (two nodes): emulated beside the paper's figure")
    return True
