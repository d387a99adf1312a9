"""What the plots (experiments.reporting.plots) draw with, beyond the names ``plot_labels``
gives: the figure, palette, length axis, legend and device-memory line; the cells a plot
compares (one length, the timed rows); the ratio to Ulysses and the rows it divides by; and the
paper's own values for the variants that run as the paper's runs do, drawn beside ours.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure
from matplotlib.ticker import NullLocator

from experiments.config.stack import paper_stack
from experiments.config.status import Status
from experiments.reporting.paper_tables import paper_row
from experiments.reporting.plot_labels import (
    column_of,
    format_tokens,
    is_emulated,
    is_given,
    mark_emulated,
    shared_settings,
)
from experiments.reporting.reproduction import PAPER_KERNEL, VERSUS, mesh, overlapped

DPI = 120
TICK_GAP = 0.05  # the least distance between two length ticks, as a share of the log2 axis
PAPER_MARK = {"marker": "D", "s": 55, "linewidths": 2, "facecolors": "none", "zorder": 4}


# -- figures and axes ------------------------------------------------------------------------


def palette_for(labels: list[str]) -> dict[str, tuple]:
    """A colour per label; colorblind-safe up to its 10 colours, then evenly spaced hues."""
    name = "colorblind" if len(labels) <= 10 else "husl"
    return dict(zip(labels, sns.color_palette(name, len(labels)), strict=True))


@contextmanager
def figure(path: Path, ncols: int = 1, width: float = 9.5, height: float = 4.8):
    """Axes in a row on a whitegrid figure, saved to `path` on exit.

    A bare ``Figure`` (matplotlib's object API, not pyplot): saving needs no backend and no
    display, so sweeps draw on headless machines without selecting a backend for the process
    (a notebook importing this module keeps its inline backend), and nothing stays open.
    """
    with sns.axes_style("whitegrid"), sns.plotting_context("notebook", font_scale=0.9):
        fig = Figure(figsize=(width, height))
        axes = fig.subplots(1, ncols, squeeze=False)
        yield fig, list(axes[0])
        fig.tight_layout()
        fig.savefig(path, dpi=DPI, bbox_inches="tight")  # keeps outside legends


def draw_legend(ax, df: pd.DataFrame, **kw) -> None:
    """The legend outside the axes, right of them, each variant named by its detail."""
    detail = dict(zip(df["label"], df["detail"], strict=True))
    handles, names = ax.get_legend_handles_labels()
    ax.legend(handles, [detail.get(n, n) for n in names], fontsize=8, loc="upper left",
              bbox_to_anchor=(1.01, 1), **kw)


def _length_ticks(df: pd.DataFrame) -> list[int]:
    """The sweep's lengths (its timed cells', not a max-context search's probes, when it has
    timed cells), thinned left to right to ticks at least TICK_GAP of the log2 axis apart."""
    timed = df[column_of(df, "iters") != 0]
    lengths = sorted({int(s) for s in (timed if len(timed) else df)["seq_len"]})
    span = np.log2(df["seq_len"].max() / df["seq_len"].min()) or 1.0
    ticks = lengths[:1]
    for n in lengths[1:]:
        if np.log2(n / ticks[-1]) >= TICK_GAP * span:
            ticks.append(n)
    return ticks


def finish_line_plot(ax, df: pd.DataFrame, ylabel: str, title: str) -> None:
    """log2 length axis with a tick at each length of the sweep (2K, 4K, 1M; ``_length_ticks``),
    y from 0, and the legend outside the axes, clear of the lines."""
    ticks = _length_ticks(df)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [format_tokens(t) for t in ticks])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set(xlabel="sequence length (global tokens, log2 scale)", ylabel=ylabel, ylim=(0, None),
           title=f"{mark_emulated(title, df)} · {shared_settings(df)}")
    draw_legend(ax, df)


def draw_memory_line(ax, df: pd.DataFrame, scale: int, unit: str) -> None:
    """Dashed line at the device memory (GPU), the per-rank budget (CPU) or the emulated
    device's budget (its memory less the reserve), when rows name it."""
    mem = pd.to_numeric(df["device_memory_bytes"], errors="coerce").dropna()
    if mem.empty:
        return
    devices = df["device"].dropna().astype(str)
    name = "budget" if len(devices) and devices.iloc[0].startswith("cpu") else "device memory"
    if is_emulated(df):
        gpu, reserve = (pd.to_numeric(column_of(df, c), errors="coerce").dropna()
                        for c in ("hw_gpu_mem_gib", "hw_reserve_gib"))
        name = "emulated device budget" + (
            f": {gpu.iloc[0]:g} GiB - {reserve.iloc[0]:g} GiB reserve"
            if len(gpu) and len(reserve) and mem.nunique() == 1 else "")
    ax.axhline(mem.max() / scale, ls="--", lw=1.3, color="0.25",
               label=f"{name} ({mem.max() / scale:.3g} {unit})")


# -- the cells a plot compares ---------------------------------------------------------------


def focus_length(df: pd.DataFrame, cols: list[str]) -> int:
    """The length with the most distinct `cols` values (ties: the longest): bar plots compare
    variants at one length, and a sweep may hold several."""
    counts = df.drop_duplicates(["seq_len", *cols]).groupby("seq_len").size()
    return counts[counts == counts.max()].index.max()


def is_ulysses(df: pd.DataFrame) -> pd.Series:
    """The rows of upipe's own Ulysses (no heads per stage): the default ratio reference."""
    return (df["method"] == "ulysses") & df["heads_per_stage"].isna()


def vs_ulysses(df: pd.DataFrame, value: str, keys: list[str],
               reference: pd.Series | None = None) -> np.ndarray:
    """`value` of each row over the reference rows' (median) at the same `keys`; NaN where the
    reference has none. ``reference``: a mask of `df`'s rows (default: ``is_ulysses``).

    A key may be NaN (``doc_len`` of an unpacked row) and NaN matches only NaN, so a packed row
    is only ever over a reference with its document length. A method measured on a stack of
    its own (torch-cp on ``native``, as the paper runs it) is compared with the reference at
    the other keys when the reference ran on one stack there."""
    ref = df[is_ulysses(df) if reference is None else reference]

    def ratio(on: list[str], ref: pd.DataFrame) -> pd.Series:
        # dropna=False: a NaN key (no documents) is a setting of its own, not a missing one
        med = ref.groupby(on, dropna=False)[value].median().rename("_ref").reset_index()
        merged = df[on + [value]].merge(med, on=on, how="left")  # a left merge keeps row order
        return merged[value] / merged["_ref"]

    out = ratio(keys, ref)
    if "stack" in keys:
        loose = [k for k in keys if k != "stack"]
        one_stack = ref.groupby(loose, dropna=False)["stack"].transform("nunique") == 1
        out = out.fillna(ratio(loose, ref[one_stack]))
    return out.to_numpy()


def throughput_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """ok rows with `tps` (tokens/s per GPU) and its p20/p80 bounds `lo`/`hi`, the median of
    repetitions; tokens/s per GPU = seq_len / nproc / step time. Max-context probes (``iters``
    0) are left out: they are the search's, not the sweep's cells (emulated ones have times)."""
    df = rows[rows["status"] == Status.OK]
    if "iters" in df:
        df = df[df["iters"] != 0]
    per_gpu = df["seq_len"] / df["nproc"]
    df = df.assign(tps=df["tokens_per_s_per_gpu"].fillna(per_gpu / df["time_median_s"]),
                   lo=per_gpu / df["time_p80_s"], hi=per_gpu / df["time_p20_s"])
    return df[df["tps"].notna()]


# -- the paper's values beside ours ----------------------------------------------------------


def paper_rows_by_label(df: pd.DataFrame) -> dict[str, dict]:
    """label -> the row of the paper's Table 3 or 4 that the variant runs (``paper_tables.
    paper_row``): its model on as many GPUs, its method on the table's mesh (``paper_runs``).
    Variants of other sweeps (another model, CPU scale) have none."""
    out = {label: paper_row(*run[:4]) for label, run in paper_runs(df).items()}
    return {label: row for label, row in out.items() if row}


def _paper_run(r: pd.Series) -> tuple[str, int, str, str, str] | None:
    """(model, GPUs, method, mesh, stack) of a row that runs as the paper's runs do: the
    paper's kernel (or none named) and stack for the method (``paper_stack``), blocking stages
    of the Ulysses degree's heads (UPipe's default U), no packed documents; else None."""
    kernel, u = r.get("kernel"), r.get("heads_per_stage")
    if (overlapped(r.get("overlap")) or is_given(r.get("doc_len"))
            or (is_given(kernel) and kernel != PAPER_KERNEL) or not is_given(r["nproc"])
            or str(r["stack"]) != paper_stack(str(r["method"]))):
        return None
    ring = int(r["ring_degree"]) if is_given(r["ring_degree"]) else 1
    if is_given(u) and int(u) != int(r["nproc"]) // ring:
        return None
    return (str(r["model"]), int(r["nproc"]), str(r["method"]),
            mesh(str(r["method"]), int(r["nproc"]), ring), str(r["stack"]))


def paper_runs(df: pd.DataFrame) -> dict[str, tuple[str, int, str, str, str]]:
    """label -> (model, GPUs, method, mesh, stack) of each variant that runs as the paper's
    runs do (``_paper_run`` of its first row)."""
    runs = {label: _paper_run(g.iloc[0]) for label, g in df.groupby("label", sort=False)}
    return {label: run for label, run in runs.items() if run}


def ratio_reference(df: pd.DataFrame) -> tuple[pd.Series, tuple[str, str] | None]:
    """The rows a ratio "to Ulysses" divides by: a mask of `df`'s rows, and (method, mesh) when
    it is the paper's own reference (``reproduction.VERSUS``: yunchang's Ulysses,
    ``usp-ulysses 8x1``, in Table 3; the USP hybrid 8x2 in Table 4), else None.

    The paper's reference where the rows run a paper table's model on its GPUs and hold that
    reference's rows: a paper mark (the paper's value over its reference) is then beside a bar
    with the same denominator. Elsewhere (CPU scale, sweeps without the reference) upipe's own
    Ulysses (``is_ulysses``)."""
    runs = pd.Series([_paper_run(r) for _, r in df.iterrows()], index=df.index, dtype=object)
    tables = {row["table"] for run in runs.dropna() if (row := paper_row(*run[:4]))}
    if len(tables) == 1:
        key = VERSUS[tables.pop()][0]
        mask = runs.map(lambda run: bool(run) and tuple(run[2:4]) == key).astype(bool)
        if mask.any():
            return mask, key
    return is_ulysses(df), None


def reference_name(key: tuple[str, str] | None) -> str:
    """'usp 8x2 (the paper's Ulysses)' for ``ratio_reference``'s key; 'Ulysses' without one."""
    return "Ulysses" if key is None else f"{' '.join(key)} (the paper's Ulysses)"


def paper_name(paper: dict[str, dict]) -> str:
    """'paper (Table 3)': the legend entry of the paper's values."""
    return f"paper ({', '.join(sorted({p['name'] for p in paper.values()}))})"
