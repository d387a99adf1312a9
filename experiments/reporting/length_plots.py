"""The figures of the paper's Tables 3 and 4, variants across sequence lengths: the longest
context each trains (``plot_max_context``), peak device memory and tokens/s per GPU against
length (``plot_memory_vs_seq``, ``plot_throughput_vs_seq``), and tokens/s per GPU over
Ulysses' at each length (``plot_throughput_vs_ulysses``). Each reads the sweep's tables only
and returns False (draws nothing) when they lack its data; ``plots.draw_plots`` draws them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.ticker import FuncFormatter, MultipleLocator

from experiments.config.sizes import GiB
from experiments.config.status import Status
from experiments.reporting.paper_tables import paper_peaks, paper_row
from experiments.reporting.plot_common import (
    PAPER_MARK,
    draw_legend,
    draw_memory_line,
    figure,
    finish_line_plot,
    palette_for,
    paper_name,
    paper_rows_by_label,
    paper_runs,
    ratio_reference,
    reference_name,
    throughput_rows,
    vs_ulysses,
)
from experiments.reporting.plot_labels import (
    SETTINGS,
    column_of,
    format_tokens,
    is_emulated,
    label_variants,
    mark_emulated,
    memory_unit,
    plain_value,
    shared_settings,
)
from experiments.reporting.reproduction import VERSUS


def _token_axis(axis, top: float) -> None:
    """Ticks at whole binary steps of tokens (1M, 2M, ...), labelled 128K / 1M."""
    axis.set_major_locator(MultipleLocator(2 ** max(0, int(np.log2(max(top, 4) / 4)))))
    axis.set_major_formatter(FuncFormatter(lambda v, _: format_tokens(v)))


def plot_max_context(rows: pd.DataFrame, maxctx: pd.DataFrame, path: Path) -> bool:
    """Bar per variant at max_seq_len, the longest length that fit, with a whisker up to
    first_failing_seq_len, the shortest that failed (the true limit lies between); no failing
    length means the search limit passed. Reads max_context.csv: method, heads_per_stage,
    model, nproc, stack, budget_mib, status, max_seq_len, first_failing_seq_len, device."""
    if maxctx.empty:
        return False
    df, labels = label_variants(maxctx, (*SETTINGS, "budget_mib"))
    df = df.drop_duplicates("label", keep="last")
    paper = paper_rows_by_label(df)
    df = df.set_index("label").loc[labels]
    fits, fails = df["max_seq_len"].fillna(0), df["first_failing_seq_len"]
    gap = (fails - fits).fillna(0)
    marks = pd.Series([paper[lb]["max_context"] if lb in paper else np.nan for lb in labels])
    pal, x = palette_for(labels), np.arange(len(labels))
    with figure(path, width=max(6.0, 1.1 * len(labels) + 4.5)) as (fig, (ax,)):
        ax.bar(x, fits, color=[pal[lb] for lb in labels], width=0.6)
        for lb, detail in zip(labels, df["detail"], strict=True):  # what a short label leaves out
            if detail != lb:
                ax.bar(0, 0, color=pal[lb], label=detail)
        has = fails.notna().to_numpy()  # no whisker where the search limit passed
        ax.errorbar(x[has], fits[has], yerr=[np.zeros(has.sum()), gap[has]], fmt="none",
                    color="0.2", capsize=5, label="up to the first failing length")
        if paper:
            ax.scatter(x, marks, edgecolors="black", label=f"{paper_name(paper)}: the longest "
                       "length it trains", **PAPER_MARK)
        for i, (fit, fail, status) in enumerate(zip(fits, fails, df["status"], strict=True)):
            text = format_tokens(fit) if fit else (
                "nothing fits" if status in Status.RESULTS else str(status))
            if pd.notna(fail):
                text += f"\n(max < {format_tokens(fail)})"
            elif fit:  # passed at the search's upper limit: the true max may be longer
                text += "\n(search limit)"
            if pd.notna(marks[i]):
                text += f"\npaper {format_tokens(marks[i])}"
            ax.annotate(text, (i, np.nanmax([fit + gap.iloc[i], marks[i]])), ha="center",
                        va="bottom", fontsize=9, xytext=(0, 6), textcoords="offset points")
        top = 1.3 * max((fits + gap).max(), marks.max() if paper else 0, 1)
        ax.set(xticks=x, xticklabels=labels, ylim=(0, top),
               ylabel=mark_emulated("longest trainable context (global tokens)", df))
        _token_axis(ax.yaxis, top)
        budget = df["budget_mib"].dropna().unique()
        where = [f"budget {plain_value('', budget[0])} MiB/rank"] if len(budget) == 1 else []
        ax.set_title(" · ".join(t for t in [mark_emulated("Max context", df),
                                            shared_settings(df.reset_index()), *where] if t))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    return True


def plot_memory_vs_seq(rows: pd.DataFrame, maxctx: pd.DataFrame, path: Path) -> bool:
    """Peak device memory against length, a line per variant (ok rows); OOM cells as crosses at
    the peak they reached, or as triangles at the lower bound that put a search's probe over the
    device (``peak_device_is_lower_bound``); the device-memory or budget line. Rows of the
    sweep's cells' budget only (``_one_budget``: a probe under another is left out, said in the
    title). Reads rows.csv:
    method, heads_per_stage, model, nproc, stack, seq_len, status, iters, budget_mib,
    peak_device_bytes, peak_device_is_lower_bound (when present), device_memory_bytes, device."""
    df = rows[rows["status"].isin(Status.RESULTS) & rows["peak_device_bytes"].notna()]
    df, left_out = _one_budget(df)
    if not (df["status"] == Status.OK).any():
        return False
    df, labels = label_variants(df)
    scale, unit = memory_unit(pd.concat([df["peak_device_bytes"], df["device_memory_bytes"]]))
    df = df.assign(mem=df["peak_device_bytes"] / scale)
    pal = palette_for(labels)
    with figure(path) as (fig, (ax,)):
        sns.lineplot(df[df["status"] == Status.OK], x="seq_len", y="mem", hue="label", palette=pal,
                     hue_order=labels, marker="o", estimator="median", errorbar=None, ax=ax)
        oom = df[df["status"] == Status.OOM]
        # a search probe that a lower bound put over the device has no peak of its own, only
        # that bound: drawn apart ("at least"), never as a peak reached
        bound = column_of(oom, "peak_device_is_lower_bound").map(
            lambda v: v is True or v == "True").astype(bool)
        for part, marker, what in ((oom[~bound], "x", "OOM (peak reached)"),
                                   (oom[bound], "^", "OOM (its peak at least)")):
            if len(part):  # the legend's mark in grey: each in its variant's colour
                ax.scatter(part["seq_len"], part["mem"], marker=marker, s=80, linewidths=2,
                           zorder=3, color=[pal[lb] for lb in part["label"]])
                ax.scatter([], [], marker=marker, s=80, linewidths=2, color="0.3", label=what)
        figures = set()
        for label, run in paper_runs(df).items():
            peaks = [p for p in paper_peaks(*run) if p["seq_len"] in set(df["seq_len"])]
            ax.scatter([p["seq_len"] for p in peaks], [p["gib"] * GiB / scale for p in peaks],
                       edgecolors=pal[label], **PAPER_MARK)
            figures |= {p["figure"] for p in peaks}
        if figures:
            ax.scatter([], [], edgecolors="black", label=f"paper ({'; '.join(sorted(figures))})"
                       ": its peak per GPU", **PAPER_MARK)
        draw_memory_line(ax, df, scale, unit)
        finish_line_plot(ax, df, mark_emulated(f"peak device memory per rank ({unit})", df),
                         "Peak memory")
        if left_out:
            ax.set_title(f"{ax.get_title()}\n{left_out}", fontsize=9)
    return True


def _one_budget(df: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The rows run under the budget(s) of the sweep's timed cells (``iters`` > 0), and a note
    on the rest ('' when none is left out).

    A CPU grid runs without a budget and its max-context probes under ``budget_mib``: pooled,
    one cell could be drawn as fitting and as over the budget line. The probes are the max
    context plot's. An emulated sweep's cells and probes share the device budget: all stay."""
    budget = column_of(df, "budget_mib").fillna(-1)  # -1: no budget, a setting of its own
    timed = column_of(df, "iters") != 0
    if not timed.any() or budget.nunique() < 2:
        return df, ""
    keep = budget.isin(set(budget[timed]))
    dropped = sorted(budget[~keep].unique())
    note = (f"left out: {int((~keep).sum())} max-context probes under "
            + ", ".join(f"{plain_value('', b)} MiB" for b in dropped)
            + " per rank (see max_context)")
    return df[keep], note


def plot_throughput_vs_seq(rows: pd.DataFrame, maxctx: pd.DataFrame, path: Path) -> bool:
    """Tokens/s per GPU against length, a line per variant, whiskers from the p80 to the p20
    step time (measured rows; an emulated one has its time model's step only). Reads rows.csv:
    method, heads_per_stage, model, nproc, stack, seq_len, status, tokens_per_s_per_gpu,
    time_median_s, time_p20_s, time_p80_s, device."""
    df = throughput_rows(rows)
    if df.empty:
        return False
    df, labels = label_variants(df)
    pal = palette_for(labels)
    agg = df.groupby(["label", "seq_len"])[["tps", "lo", "hi"]].median()
    with figure(path) as (fig, (ax,)):
        for label in labels:
            g = agg.loc[label]
            err = [(g["tps"] - g["lo"]).clip(lower=0).fillna(0),
                   (g["hi"] - g["tps"]).clip(lower=0).fillna(0)]
            ax.errorbar(g.index, g["tps"], yerr=err, marker="o", capsize=3, color=pal[label],
                        label=label)
        paper = paper_rows_by_label(df)
        lengths = set(df["seq_len"])
        for label, row in paper.items():  # at the sweep's lengths
            cells = {n: v for n, v in row["tokens_per_s_per_gpu"].items() if n in lengths}
            ax.scatter(list(cells), list(cells.values()), edgecolors=pal[label], **PAPER_MARK)
        if paper:  # one legend entry for the marks, in black: each in its variant's colour
            ax.scatter([], [], edgecolors="black", **PAPER_MARK,
                       label=f"{paper_name(paper)}: its tokens/s per GPU")
        # an emulated step is one number from the time model: no spread to draw
        ylabel = ("tokens/s per GPU (time model)" if is_emulated(df)
                  else "tokens/s per GPU (whiskers: p20-p80 step)")
        finish_line_plot(ax, df, ylabel, "Throughput")
    return True


RATIO_KEYS = ["seq_len", *SETTINGS, "doc_len"]  # a ratio's reference runs the same cell


def plot_throughput_vs_ulysses(rows: pd.DataFrame, maxctx: pd.DataFrame, path: Path) -> bool:
    """Tokens/s per GPU of each variant over the reference's (``ratio_reference``: the paper's
    own Ulysses in a paper table's sweep, else upipe's Ulysses; named on the axis) at the same
    ``RATIO_KEYS``, bars grouped by length, a line at 1.0. Packed rows without a reference of
    their document length are left out, named under the axis. Reads rows.csv: method,
    heads_per_stage, model, nproc, stack, doc_len, seq_len, status, tokens_per_s_per_gpu,
    time_*_s, device."""
    df = throughput_rows(rows)
    df = df.assign(doc_len=column_of(df, "doc_len"))
    reference, key = ratio_reference(df)
    df = df.assign(ratio=vs_ulysses(df, "tps", RATIO_KEYS, reference))[~reference]
    left = df[df["ratio"].isna() & df["doc_len"].notna()]
    unpaired = label_variants(left)[1] if len(left) else []
    df = df[df["ratio"].notna()]
    if df.empty:
        return False
    df, labels = label_variants(df)
    lengths = sorted(df["seq_len"].unique())
    df = df.assign(length=df["seq_len"].map(format_tokens))
    name = reference_name(key)
    width = min(16.0, max(7.5, 0.4 * len(lengths) * len(labels) + 3))
    with figure(path, width=width) as (fig, (ax,)):
        sns.barplot(df, x="length", y="ratio", hue="label", hue_order=labels,
                    order=[format_tokens(n) for n in lengths], palette=palette_for(labels),
                    estimator="median", errorbar=None, ax=ax)
        for bars in ax.containers:  # upright side by side, opaque over the 1.0 and paper lines
            ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2, rotation=90,
                         bbox={"fc": "white", "ec": "none", "pad": 0.3})
        _paper_ratios(ax, df, labels, lengths, key)
        ax.axhline(1.0, ls="--", lw=1.3, color="0.25", label=f"{name} = 1.0")
        xlabel = "sequence length (global tokens)" + (
            f"\nleft out: {', '.join(unpaired)} (packed; no reference with its document length)"
            if unpaired else "")
        ax.set(xlabel=xlabel, ylim=(0, 1.3 * max(df["ratio"].max(), 1)),
               ylabel=f"tokens/s per GPU relative to {name}",
               title=f"{mark_emulated(f'Throughput vs {name}', df)} · {shared_settings(df)}")
        draw_legend(ax, df)
    return True


def _paper_ratios(ax, df: pd.DataFrame, labels: list[str], lengths: list[int],
                  reference: tuple[str, str] | None) -> None:
    """Across each bar of a variant the paper runs (``paper_rows_by_label``), a black line at
    the paper's tokens/s over the paper's Ulysses' (its row in ``reproduction.VERSUS``) at that
    length; only where the bars' ``reference`` (``ratio_reference``) is that same Ulysses: a
    mark is never beside a bar with another denominator."""
    paper, runs, first = paper_rows_by_label(df), paper_runs(df), True
    for bars, label in zip(ax.containers, labels, strict=True):
        if label not in paper:
            continue
        model, gpus, method, on = runs[label][:4]
        ulysses = VERSUS[paper[label]["table"]][0]
        if (method, on) == ulysses or ulysses != reference:
            continue  # the reference itself (1.0), or bars over another one
        ref = paper_row(model, gpus, *ulysses)["tokens_per_s_per_gpu"]
        ours = paper[label]["tokens_per_s_per_gpu"]
        for bar in bars:
            n = lengths[round(bar.get_x() + bar.get_width() / 2)]
            if n in ours and n in ref:
                ax.hlines(ours[n] / ref[n], bar.get_x(), bar.get_x() + bar.get_width(),
                          color="black", lw=2.2, zorder=2.5, label=(
                              f"{paper_name(paper)}: its tokens/s over its Ulysses' "
                              f"({' '.join(ulysses)})" if first else None))
                first = False
