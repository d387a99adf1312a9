"""Plots of a sweep: a pure function of its two tables (rows.csv, max_context.csv;
docs/conventions.md#plots-are-functions-of-the-tables).

Every plot reads only the CSVs that ``tables`` writes, so a figure can be redrawn or restyled
without rerunning anything, and each shows its reference: the device-memory (or budget) line,
or Ulysses = 1.0. No torch here: drawing needs no accelerator stack.

Lengths are global tokens in binary units (128K = 131072), as the sweeps declare them. Tables
whose rows are all emulated (``mode`` column, an emulated sweep) draw the same figures with
"(emulated)" in the titles and axes and the emulated device budget as the reference line.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MultipleLocator, NullLocator

from experiments.config.sizes import GiB, MiB
from experiments.config.stack import paper_stack
from experiments.config.status import Status
from experiments.reporting.paper_tables import PAPER_LADDER_3M, paper_peaks, paper_row
from experiments.reporting.reproduction import PAPER_KERNEL, VERSUS, mesh, overlapped
from experiments.reporting.tables import MAXCTX, MAXCTX_COLUMNS, ROW_COLUMNS, ROWS

STACK_ORDER = ("none", "ac", "offload", "alst", "native")
DPI = 120
TICK_GAP = 0.05  # the least distance between two length ticks, as a share of the log2 axis
PAPER_MARK = {"marker": "D", "s": 55, "linewidths": 2, "facecolors": "none", "zorder": 4}
SETTINGS = ("model", "nproc", "stack")  # a label names one of these only when it varies


# -- formatting ------------------------------------------------------------------------------


def format_tokens(n: float) -> str:
    """131072 -> '128K', 2**20 -> '1M', 5.5 * 2**20 -> '5.5M', 1392640 -> '1.33M'."""
    n = int(n)
    for unit, mult in (("M", 2**20), ("K", 2**10)):
        if n >= mult:
            v = n / mult
            return (f"{v:.0f}" if v.is_integer() or v >= 100 else f"{v:.3g}") + unit
    return str(n)


def _given(v) -> bool:
    return v is not None and not pd.isna(v)


# Methods whose registry name alone would mislead a reader of the paper's tables: our fpdt is a
# stronger FPDT than the paper's (per-chunk output projection and RoPE tables, dK/dV accumulated
# on host, the ALST stack; baselines/fpdt.py), the paper's is DeepSpeed's (ds-fpdt).
METHOD_NAMES = {"fpdt": "fpdt (upipe's, ALST stack)", "ds-fpdt": "ds-fpdt (DeepSpeed's)"}


def variant_label(method: str, heads_per_stage: float | None = None,
                  ring_degree: float | None = None, chunk_size: float | None = None,
                  nproc: float | None = None, doc_len: float | None = None,
                  overlap: bool | None = None, *, names: bool = True,
                  chunk: bool = True) -> str:
    """A method and the options that make it a distinct variant (NaN/None: not set).

    ('upipe', 8.0) -> 'upipe U=8'; ('ulysses', nan) -> 'ulysses'; hybrids as Ulysses x ring
    degrees, the paper's notation: ('usp', nan, 2, nan, 16) -> 'usp 8x2'; FPDT's chunk in
    tokens: ('fpdt', nan, 1, 1024) -> 'fpdt c=1K'; packed documents by their length:
    ('upipe', nan, 1, nan, 4, 2048) -> 'upipe doc=2K'; UPipe's blocking schedule:
    ('upipe', nan, 1, nan, 8, nan, False) -> 'upipe no-overlap'. Without ``names`` (METHOD_NAMES'
    descriptions) and ``chunk``, a short name for an axis: 'fpdt'.
    """
    parts = [METHOD_NAMES.get(str(method), str(method)) if names else str(method)]
    if _given(ring_degree) and ring_degree > 1:
        ring = int(ring_degree)
        parts.append(f"{int(nproc) // ring}x{ring}" if _given(nproc) else f"ring={ring}")
    if _given(heads_per_stage):
        parts.append(f"U={int(heads_per_stage)}")
    if _given(chunk_size) and chunk:
        parts.append(f"c={format_tokens(chunk_size)}")
    if _given(doc_len):
        parts.append(f"doc={format_tokens(doc_len)}")
    if _given(overlap):
        parts.append("overlap" if bool(overlap) else "no-overlap")
    return " ".join(parts)


# what variant_label reads, in its order (nproc between: a setting, not a variant's option)
VARIANT = ("method", "heads_per_stage", "ring_degree", "chunk_size")
VARIANT_LAST = ("nproc", "doc_len", "overlap")


def _column(df: pd.DataFrame, col: str) -> pd.Series:
    """``df[col]``, or NaN where the table has no such column (the ``hw_*`` columns exist in
    emulated tables only)."""
    return df[col] if col in df.columns else pd.Series(np.nan, index=df.index)


def _plain(col: str, v) -> str:
    if col in ("seq_len", "max_seq_len"):
        return format_tokens(v)
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def _number(v: float) -> str:
    """3 significant digits without exponents: 0.123, 12.3, 1,234."""
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def memory_unit(values: pd.Series) -> tuple[int, str]:
    """GiB when the largest value reaches 1 GiB (GPU-size numbers), else MiB: one unit a plot."""
    top = pd.to_numeric(values, errors="coerce").max()
    return (GiB, "GiB") if top >= GiB else (MiB, "MiB")


def _emulated(df: pd.DataFrame) -> bool:
    """Every row says ``mode`` emulated (an emulated sweep's tables)."""
    return set(df["mode"].dropna()) == {"emulated"}


def _titled(title: str, df: pd.DataFrame) -> str:
    """'Peak memory' -> 'Peak memory (emulated)' for emulated rows."""
    return f"{title} (emulated)" if _emulated(df) else title


def _context(df: pd.DataFrame, cols: Iterable[str] = (*SETTINGS, "device")) -> str:
    """The settings every row shares, for a title: 'llama3-8b · nproc 8 · stack alst · H100'."""
    parts = []
    for col in cols:
        vals = df[col].dropna().unique()
        if len(vals) == 1:
            parts.append(_plain(col, vals[0]) if col in ("model", "device")
                         else f"{col} {_plain(col, vals[0])}")
    return " · ".join(parts)


# -- tables and figures ----------------------------------------------------------------------


def _read(path: Path, columns: list[str]) -> pd.DataFrame:
    """The CSV with every column of `columns` (absent ones NaN); empty when the file is absent.
    Only empty cells are missing values: the stack 'none' stays a string."""
    try:
        df = pd.read_csv(path, keep_default_na=False, na_values=[""])
    except (FileNotFoundError, pd.errors.EmptyDataError):
        df = pd.DataFrame()
    return df.reindex(columns=list(dict.fromkeys([*columns, *df.columns])))


def _labelled(df: pd.DataFrame, vary: Sequence[str] = SETTINGS
              ) -> tuple[pd.DataFrame, list[str]]:
    """`df` with a `detail` column (the variant, plus each `vary` column that takes several
    values) and a `label` column, a short name for an axis: the variant without METHOD_NAMES'
    descriptions and the chunk, with the chunk where that names two variants, the detail where
    that still does; sorted Ulysses first, then by method and U; returns it and the label order.

    A `vary` column that is one value per variant (torch-cp on the ``native`` stack, the rest on
    ``alst``) is named only on the variants that differ from the most common value."""
    cols = [_column(df, c) for c in (*VARIANT, *VARIANT_LAST)]
    shorter = [pd.Series([variant_label(*v, names=False, chunk=chunk)
                          for v in zip(*cols, strict=True)], index=df.index)
               for chunk in (False, True)]
    df = df.assign(label=[variant_label(*v) for v in zip(*cols, strict=True)])
    variant = df["label"].copy()
    for col in vary:
        if df[col].nunique() < 2:
            continue
        marked = pd.Series(True, index=df.index)
        if (df.groupby(variant)[col].nunique(dropna=False) == 1).all():
            marked = df[col] != df[col].mode().iloc[0]
        df.loc[marked, "label"] += [f", {col} {_plain(col, v)}" for v in df.loc[marked, col]]
    short = shorter[0]
    for longer in (shorter[1], df["label"]):  # where a short label names several variants
        shared = df.groupby(short)["label"].transform("nunique") > 1
        short = short.where(~shared, longer)
    df = df.assign(detail=df["label"], label=short)
    keys = df.assign(_first=df["method"] != "ulysses", _u=df["heads_per_stage"].fillna(-1),
                     _r=df["ring_degree"].fillna(1), _c=df["chunk_size"].fillna(-1),
                     _d=_column(df, "doc_len").fillna(-1),
                     stack=df["stack"].map(_stack_rank))
    df = df.loc[keys.sort_values(["_first", "method", "_u", "_r", "_c", "_d", *vary],
                                 kind="stable").index]
    return df.reset_index(drop=True), list(dict.fromkeys(df["label"]))


def _details(df: pd.DataFrame, labels: list[str]) -> list[str]:
    """The detail (``_labelled``) of each label, for a legend."""
    detail = df.drop_duplicates("label").set_index("label")["detail"]
    return [detail[lb] for lb in labels]


def _stack_rank(stack: str) -> int:
    return STACK_ORDER.index(stack) if stack in STACK_ORDER else len(STACK_ORDER)


def _palette(labels: list[str]) -> dict[str, tuple]:
    """A colour per label; colorblind-safe up to its 10 colours, then evenly spaced hues."""
    name = "colorblind" if len(labels) <= 10 else "husl"
    return dict(zip(labels, sns.color_palette(name, len(labels)), strict=True))


def _focus_length(df: pd.DataFrame, cols: list[str]) -> int:
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


def _legend(ax, df: pd.DataFrame, **kw) -> None:
    """The legend outside the axes, right of them, each variant named by its detail."""
    detail = dict(zip(df["label"], df["detail"], strict=True))
    handles, names = ax.get_legend_handles_labels()
    ax.legend(handles, [detail.get(n, n) for n in names], fontsize=8, loc="upper left",
              bbox_to_anchor=(1.01, 1), **kw)


def _length_ticks(df: pd.DataFrame) -> list[int]:
    """The sweep's lengths (its timed cells', not a max-context search's probes, when it has
    timed cells), thinned left to right to ticks at least TICK_GAP of the log2 axis apart."""
    timed = df[_column(df, "iters") != 0]
    lengths = sorted({int(s) for s in (timed if len(timed) else df)["seq_len"]})
    span = np.log2(df["seq_len"].max() / df["seq_len"].min()) or 1.0
    ticks = lengths[:1]
    for n in lengths[1:]:
        if np.log2(n / ticks[-1]) >= TICK_GAP * span:
            ticks.append(n)
    return ticks


def _finish_lines(ax, df: pd.DataFrame, ylabel: str, title: str) -> None:
    """log2 length axis with a tick at each length of the sweep (2K, 4K, 1M; ``_length_ticks``),
    y from 0, and the legend outside the axes, clear of the lines."""
    ticks = _length_ticks(df)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [format_tokens(t) for t in ticks])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set(xlabel="sequence length (global tokens, log2 scale)", ylabel=ylabel, ylim=(0, None),
           title=f"{_titled(title, df)} · {_context(df)}")
    _legend(ax, df)


def _paper(df: pd.DataFrame) -> dict[str, dict]:
    """label -> the row of the paper's Table 3 or 4 that the variant runs (``paper_tables.
    paper_row``): its model on as many GPUs, its method on the table's mesh (``_paper_runs``).
    Variants of other sweeps (another model, CPU scale) have none."""
    out = {label: paper_row(*run[:4]) for label, run in _paper_runs(df).items()}
    return {label: row for label, row in out.items() if row}


def _paper_run(r: pd.Series) -> tuple[str, int, str, str, str] | None:
    """(model, GPUs, method, mesh, stack) of a row that runs as the paper's runs do: the
    paper's kernel (or none named) and stack for the method (``paper_stack``), blocking stages
    of the Ulysses degree's heads (UPipe's default U), no packed documents; else None."""
    kernel, u = r.get("kernel"), r.get("heads_per_stage")
    if (overlapped(r.get("overlap")) or _given(r.get("doc_len"))
            or (_given(kernel) and kernel != PAPER_KERNEL) or not _given(r["nproc"])
            or str(r["stack"]) != paper_stack(str(r["method"]))):
        return None
    ring = int(r["ring_degree"]) if _given(r["ring_degree"]) else 1
    if _given(u) and int(u) != int(r["nproc"]) // ring:
        return None
    return (str(r["model"]), int(r["nproc"]), str(r["method"]),
            mesh(str(r["method"]), int(r["nproc"]), ring), str(r["stack"]))


def _paper_runs(df: pd.DataFrame) -> dict[str, tuple[str, int, str, str, str]]:
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


def _paper_name(paper: dict[str, dict]) -> str:
    """'paper (Table 3)': the legend entry of the paper's values."""
    return f"paper ({', '.join(sorted({p['name'] for p in paper.values()}))})"


def _memory_line(ax, df: pd.DataFrame, scale: int, unit: str) -> None:
    """Dashed line at the device memory (GPU), the per-rank budget (CPU) or the emulated
    device's budget (its memory less the reserve), when rows name it."""
    mem = pd.to_numeric(df["device_memory_bytes"], errors="coerce").dropna()
    if mem.empty:
        return
    devices = df["device"].dropna().astype(str)
    name = "budget" if len(devices) and devices.iloc[0].startswith("cpu") else "device memory"
    if _emulated(df):
        gpu, reserve = (pd.to_numeric(_column(df, c), errors="coerce").dropna()
                        for c in ("hw_gpu_mem_gib", "hw_reserve_gib"))
        name = "emulated device budget" + (
            f": {gpu.iloc[0]:g} GiB - {reserve.iloc[0]:g} GiB reserve"
            if len(gpu) and len(reserve) and mem.nunique() == 1 else "")
    ax.axhline(mem.max() / scale, ls="--", lw=1.3, color="0.25",
               label=f"{name} ({mem.max() / scale:.3g} {unit})")


def _token_axis(axis, top: float) -> None:
    """Ticks at whole binary steps of tokens (1M, 2M, ...), labelled 128K / 1M."""
    axis.set_major_locator(MultipleLocator(2 ** max(0, int(np.log2(max(top, 4) / 4)))))
    axis.set_major_formatter(FuncFormatter(lambda v, _: format_tokens(v)))


# -- the plots: each returns False (draws nothing) when the tables lack its data --------------


def plot_max_context(rows: pd.DataFrame, maxctx: pd.DataFrame, path: Path) -> bool:
    """Bar per variant at max_seq_len, the longest length that fit, with a whisker up to
    first_failing_seq_len, the shortest that failed (the true limit lies between); no failing
    length means the search limit passed. Reads max_context.csv: method, heads_per_stage,
    model, nproc, stack, budget_mib, status, max_seq_len, first_failing_seq_len, device."""
    if maxctx.empty:
        return False
    df, labels = _labelled(maxctx, (*SETTINGS, "budget_mib"))
    df = df.drop_duplicates("label", keep="last")
    paper = _paper(df)
    df = df.set_index("label").loc[labels]
    fits, fails = df["max_seq_len"].fillna(0), df["first_failing_seq_len"]
    gap = (fails - fits).fillna(0)
    marks = pd.Series([paper[lb]["max_context"] if lb in paper else np.nan for lb in labels])
    pal, x = _palette(labels), np.arange(len(labels))
    with figure(path, width=max(6.0, 1.1 * len(labels) + 4.5)) as (fig, (ax,)):
        ax.bar(x, fits, color=[pal[lb] for lb in labels], width=0.6)
        for lb, detail in zip(labels, df["detail"], strict=True):  # what a short label leaves out
            if detail != lb:
                ax.bar(0, 0, color=pal[lb], label=detail)
        has = fails.notna().to_numpy()  # no whisker where the search limit passed
        ax.errorbar(x[has], fits[has], yerr=[np.zeros(has.sum()), gap[has]], fmt="none",
                    color="0.2", capsize=5, label="up to the first failing length")
        if paper:
            ax.scatter(x, marks, edgecolors="black", label=f"{_paper_name(paper)}: the longest "
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
               ylabel=_titled("longest trainable context (global tokens)", df))
        _token_axis(ax.yaxis, top)
        budget = df["budget_mib"].dropna().unique()
        where = [f"budget {_plain('', budget[0])} MiB/rank"] if len(budget) == 1 else []
        ax.set_title(" · ".join(t for t in [_titled("Max context", df),
                                            _context(df.reset_index()), *where] if t))
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
    df, labels = _labelled(df)
    scale, unit = memory_unit(pd.concat([df["peak_device_bytes"], df["device_memory_bytes"]]))
    df = df.assign(mem=df["peak_device_bytes"] / scale)
    pal = _palette(labels)
    with figure(path) as (fig, (ax,)):
        sns.lineplot(df[df["status"] == Status.OK], x="seq_len", y="mem", hue="label", palette=pal,
                     hue_order=labels, marker="o", estimator="median", errorbar=None, ax=ax)
        oom = df[df["status"] == Status.OOM]
        # a search probe that a lower bound put over the device has no peak of its own, only
        # that bound: drawn apart ("at least"), never as a peak reached
        bound = _column(oom, "peak_device_is_lower_bound").map(
            lambda v: v is True or v == "True").astype(bool)
        for part, marker, what in ((oom[~bound], "x", "OOM (peak reached)"),
                                   (oom[bound], "^", "OOM (its peak at least)")):
            if len(part):  # the legend's mark in grey: each in its variant's colour
                ax.scatter(part["seq_len"], part["mem"], marker=marker, s=80, linewidths=2,
                           zorder=3, color=[pal[lb] for lb in part["label"]])
                ax.scatter([], [], marker=marker, s=80, linewidths=2, color="0.3", label=what)
        figures = set()
        for label, run in _paper_runs(df).items():
            peaks = [p for p in paper_peaks(*run) if p["seq_len"] in set(df["seq_len"])]
            ax.scatter([p["seq_len"] for p in peaks], [p["gib"] * GiB / scale for p in peaks],
                       edgecolors=pal[label], **PAPER_MARK)
            figures |= {p["figure"] for p in peaks}
        if figures:
            ax.scatter([], [], edgecolors="black", label=f"paper ({'; '.join(sorted(figures))})"
                       ": its peak per GPU", **PAPER_MARK)
        _memory_line(ax, df, scale, unit)
        _finish_lines(ax, df, _titled(f"peak device memory per rank ({unit})", df),
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
    budget = _column(df, "budget_mib").fillna(-1)  # -1: no budget, a setting of its own
    timed = _column(df, "iters") != 0
    if not timed.any() or budget.nunique() < 2:
        return df, ""
    keep = budget.isin(set(budget[timed]))
    dropped = sorted(budget[~keep].unique())
    note = (f"left out: {int((~keep).sum())} max-context probes under "
            + ", ".join(f"{_plain('', b)} MiB" for b in dropped) + " per rank (see max_context)")
    return df[keep], note


def _throughput(rows: pd.DataFrame) -> pd.DataFrame:
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


def plot_throughput_vs_seq(rows: pd.DataFrame, maxctx: pd.DataFrame, path: Path) -> bool:
    """Tokens/s per GPU against length, a line per variant, whiskers from the p80 to the p20
    step time (measured rows; an emulated one has its time model's step only). Reads rows.csv:
    method, heads_per_stage, model, nproc, stack, seq_len, status, tokens_per_s_per_gpu,
    time_median_s, time_p20_s, time_p80_s, device."""
    df = _throughput(rows)
    if df.empty:
        return False
    df, labels = _labelled(df)
    pal = _palette(labels)
    agg = df.groupby(["label", "seq_len"])[["tps", "lo", "hi"]].median()
    with figure(path) as (fig, (ax,)):
        for label in labels:
            g = agg.loc[label]
            err = [(g["tps"] - g["lo"]).clip(lower=0).fillna(0),
                   (g["hi"] - g["tps"]).clip(lower=0).fillna(0)]
            ax.errorbar(g.index, g["tps"], yerr=err, marker="o", capsize=3, color=pal[label],
                        label=label)
        paper = _paper(df)
        lengths = set(df["seq_len"])
        for label, row in paper.items():  # at the sweep's lengths
            cells = {n: v for n, v in row["tokens_per_s_per_gpu"].items() if n in lengths}
            ax.scatter(list(cells), list(cells.values()), edgecolors=pal[label], **PAPER_MARK)
        if paper:  # one legend entry for the marks, in black: each in its variant's colour
            ax.scatter([], [], edgecolors="black", **PAPER_MARK,
                       label=f"{_paper_name(paper)}: its tokens/s per GPU")
        # an emulated step is one number from the time model: no spread to draw
        ylabel = ("tokens/s per GPU (time model)" if _emulated(df)
                  else "tokens/s per GPU (whiskers: p20-p80 step)")
        _finish_lines(ax, df, ylabel, "Throughput")
    return True


RATIO_KEYS = ["seq_len", *SETTINGS, "doc_len"]  # a ratio's reference runs the same cell


def plot_throughput_vs_ulysses(rows: pd.DataFrame, maxctx: pd.DataFrame, path: Path) -> bool:
    """Tokens/s per GPU of each variant over the reference's (``ratio_reference``: the paper's
    own Ulysses in a paper table's sweep, else upipe's Ulysses; named on the axis) at the same
    ``RATIO_KEYS``, bars grouped by length, a line at 1.0. Packed rows without a reference of
    their document length are left out, named under the axis. Reads rows.csv: method,
    heads_per_stage, model, nproc, stack, doc_len, seq_len, status, tokens_per_s_per_gpu,
    time_*_s, device."""
    df = _throughput(rows)
    df = df.assign(doc_len=_column(df, "doc_len"))
    reference, key = ratio_reference(df)
    df = df.assign(ratio=vs_ulysses(df, "tps", RATIO_KEYS, reference))[~reference]
    left = df[df["ratio"].isna() & df["doc_len"].notna()]
    unpaired = _labelled(left)[1] if len(left) else []
    df = df[df["ratio"].notna()]
    if df.empty:
        return False
    df, labels = _labelled(df)
    lengths = sorted(df["seq_len"].unique())
    df = df.assign(length=df["seq_len"].map(format_tokens))
    name = reference_name(key)
    width = min(16.0, max(7.5, 0.4 * len(lengths) * len(labels) + 3))
    with figure(path, width=width) as (fig, (ax,)):
        sns.barplot(df, x="length", y="ratio", hue="label", hue_order=labels,
                    order=[format_tokens(n) for n in lengths], palette=_palette(labels),
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
               title=f"{_titled(f'Throughput vs {name}', df)} · {_context(df)}")
        _legend(ax, df)
    return True


def _paper_ratios(ax, df: pd.DataFrame, labels: list[str], lengths: list[int],
                  reference: tuple[str, str] | None) -> None:
    """Across each bar of a variant the paper runs (``_paper``), a black line at the paper's
    tokens/s over the paper's Ulysses' (its row in ``reproduction.VERSUS``) at that length;
    only where the bars' ``reference`` (``ratio_reference``) is that same Ulysses: a mark is
    never beside a bar with another denominator."""
    paper, runs, first = _paper(df), _paper_runs(df), True
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
                              f"{_paper_name(paper)}: its tokens/s over its Ulysses' "
                              f"({' '.join(ulysses)})" if first else None))
                first = False


KEPT_SUFFIX = ", last k"  # a level keeping the attention in its last k blocks only


def stack_level(stack: str, keep_blocks) -> str:
    """A row's memory level: its stack, or ``<stack>, last k`` when it keeps the attention in
    some blocks only (``keep_blocks`` set: not None or NaN)."""
    return stack if keep_blocks is None or pd.isna(keep_blocks) else stack + KEPT_SUFFIX


def _ladder_panel(ax, df: pd.DataFrame, stacks: list[str], scale: int) -> None:
    """One variant's stacked device bars (model / attention / other) and hatched host bars."""
    ok = df[df["status"] == Status.OK].groupby("stack").median(numeric_only=True)
    x = np.arange(len(stacks))
    bottom = np.zeros(len(stacks))
    parts = (("peak_model_bytes", "model states"), ("peak_attention_bytes", "attention"),
             ("peak_other_bytes", "other"))
    for (col, name), color in zip(parts, sns.color_palette("muted", 3), strict=True):
        h = ok.reindex(stacks)[col].fillna(0).to_numpy() / scale
        ax.bar(x - 0.2, h, 0.38, bottom=bottom, color=color, label=f"device: {name}")
        bottom += h
    host = ok.reindex(stacks)["peak_host_bytes"].fillna(0).to_numpy() / scale
    ax.bar(x + 0.2, host, 0.38, color="white", edgecolor="0.4", hatch="//",
           label="host (offloaded)")
    for i, stack in enumerate(stacks):
        status = df.loc[df["stack"] == stack, "status"]
        if stack not in ok.index and len(status):  # the cell ran but measured nothing
            ax.annotate(status.iloc[0], (i, 0), ha="center", va="bottom", color="firebrick")
        elif bottom[i]:
            ax.annotate(_number(bottom[i]), (i - 0.2, bottom[i]), ha="center", va="bottom",
                        xytext=(0, 2), textcoords="offset points", fontsize=8)
        if stack in ok.index and "keep_blocks" in ok and pd.notna(ok.loc[stack, "keep_blocks"]):
            ax.annotate(f"k={int(ok.loc[stack, 'keep_blocks'])}", (i + 0.2, host[i]),
                        ha="center", va="bottom", xytext=(0, 2), textcoords="offset points",
                        fontsize=8)
    # the selective levels' names broken at their suffixes, so that neighbours never touch
    names = [s.replace("-attn", "\n-attn").replace(KEPT_SUFFIX, "\nlast k") for s in stacks]
    ax.set_xticks(x, names, **({"fontsize": 8} if names != stacks else {}))


def plot_memory_ladder(rows: pd.DataFrame, maxctx: pd.DataFrame, path: Path) -> bool:
    """A panel per variant; per stack level (none, ac, offload, alst; a level keeping the
    attention in the last k blocks only is one of its own, its k written on its host bar) a bar
    of the device peak split into model states / attention / other, and a hatched bar of host
    bytes. Reads
    rows.csv: method, heads_per_stage, model, nproc, seq_len, stack, status, peak_model_bytes,
    peak_attention_bytes, peak_other_bytes, peak_host_bytes, peak_device_bytes, device."""
    if "keep_blocks" in rows:  # the attention kept in the last k blocks only: a level of its own
        rows = rows.assign(stack=[stack_level(s, k) for s, k in zip(
            rows["stack"], rows["keep_blocks"], strict=True)])
    ok = rows[rows["status"] == Status.OK]
    if ok.empty:
        return False
    df, labels = _labelled(rows[rows["seq_len"] == _focus_length(ok, ["stack"])],
                           ("model", "nproc"))
    stacks = sorted(df["stack"].dropna().unique(), key=lambda s: (_stack_rank(s), s))
    cols = ["peak_device_bytes", "peak_host_bytes"]
    scale, unit = memory_unit(df.loc[df["status"] == Status.OK, cols].stack())
    panel = max(3.2, 0.75 * len(stacks) + 0.2)  # inches: room for each level's two bars
    with figure(path, ncols=len(labels), width=panel * len(labels) + 2.2) as (fig, axes):
        for ax, label in zip(axes, labels, strict=True):
            _ladder_panel(ax, df[df["label"] == label], stacks, scale)
            ax.set(title=label, xlabel="memory stack")
        axes[0].set_ylabel(_titled(f"peak per rank ({unit})", df))
        top = max(ax.get_ylim()[1] for ax in axes)
        for ax in axes:
            ax.set_ylim(0, top * 1.05)
        handles, names = axes[0].get_legend_handles_labels()
        fig.legend(handles, names, loc="upper center", bbox_to_anchor=(0.5, 0), ncol=4,
                   fontsize=8)  # below the panels, clear of every bar
        fig.suptitle(f"{_titled('Memory ladder', df)} · "
                     f"{_context(df, ('model', 'nproc', 'seq_len', 'device'))}")
    return True


def plot_heads_per_stage(rows: pd.DataFrame, maxctx: pd.DataFrame, path: Path) -> bool:
    """Bars per variant (Ulysses, then UPipe by U), each annotated with its ratio to Ulysses:
    peak device memory, and tokens/s per GPU beside it when the rows are timed (measured, or
    emulated by the time model: titled so). Reads rows.csv: method, heads_per_stage, model, nproc,
    stack, seq_len, status, peak_device_bytes, and the throughput columns."""
    df = rows[(rows["status"] == Status.OK) & rows["method"].isin(["ulysses", "upipe"])]
    timed = _throughput(df)
    df = timed if len(timed) else df[df["peak_device_bytes"].notna()]
    if df.empty:
        return False
    keys = [*SETTINGS, "seq_len"]
    df = df[df["seq_len"] == _focus_length(df, ["method", "heads_per_stage"])]
    df, labels = _labelled(df, keys)
    scale, unit = memory_unit(df["peak_device_bytes"])
    df = df.assign(mem=df["peak_device_bytes"] / scale)
    panels = [("mem", _titled(f"peak device memory per rank ({unit})", df))]
    if len(timed):
        panels.append(("tps", _titled("tokens/s per GPU", df)))
    width = max(4.5 * len(panels), 0.8 * len(panels) * len(labels) + 2 * len(panels))
    with figure(path, ncols=len(panels), width=width) as (fig, axes):
        for ax, (col, name) in zip(axes, panels, strict=True):
            agg = df.groupby(["label", "method", "heads_per_stage", *keys], dropna=False,
                             sort=False)[col].median().reset_index()
            agg = agg.assign(ratio=vs_ulysses(agg, col, keys)).set_index("label").loc[labels]
            sns.barplot(agg.reset_index(), x="label", y=col, hue="label", order=labels,
                        hue_order=labels, palette=_palette(labels), legend=False, ax=ax)
            for i, (v, r) in enumerate(zip(agg[col], agg["ratio"], strict=True)):
                text = _number(v) + ("" if pd.isna(r) else f"\n{r:.2f}× Ulysses")
                ax.annotate(text, (i, 0 if pd.isna(v) else v), ha="center", va="bottom",
                            xytext=(0, 2), textcoords="offset points", fontsize=8)
            ax.set(xlabel="variant", ylabel=name, ylim=(0, 1.25 * max(agg[col].max(), 1e-9)))
            ax.tick_params(axis="x", rotation=20 if len(labels) > 4 else 0)
        fig.suptitle(f"{_titled('Heads per stage', df)} · {_context(df, (*keys, 'device'))}")
    return True


RUNGS = ("FSDP only", "+ Ulysses", "+ checkpointing", "+ offload", "ALST", "UPipe")


def ladder_rung(method: str, stack: str, nproc: int) -> str:
    """The paper's name for a rung of the memory wall (its figure of Llama3-8B at 3M): FSDP
    only (no CP: one rank holds the whole sequence), + Ulysses, + activation checkpointing,
    + offload, ALST (Ulysses on the full stack), UPipe; other cells as "method stack". The
    paper's Ulysses is ``usp-ulysses``; upipe's ``ulysses`` names the same rungs."""
    if nproc == 1 and stack == "none":
        return "FSDP only"
    if method in ("ulysses", "usp-ulysses"):
        return {"none": "+ Ulysses", "ac": "+ checkpointing", "offload": "+ offload",
                "alst": "ALST"}.get(stack, f"ulysses {stack}")
    return "UPipe" if (method, stack) == ("upipe", "alst") else f"{method} {stack}"


def plot_memory_wall(rows: pd.DataFrame, maxctx: pd.DataFrame, path: Path) -> bool:
    """The memory wall at one length: a bar per rung (``ladder_rung``), the device peak split
    into model states / attention / other; a rung over the device budget (OOM) is drawn with
    the GiB it would need, hatched and marked OOM; the budget line; and beside ALST and UPipe
    the paper's own split (``paper_tables.PAPER_LADDER_3M``) when the length is 3M. Reads
    rows.csv: method, stack, nproc, seq_len, status, peak_*_bytes, device_memory_bytes."""
    df = rows[rows["status"].isin(Status.RESULTS) & rows["peak_device_bytes"].notna()]
    if df.empty:
        return False
    df = df.groupby(["method", "stack", "nproc"], as_index=False).agg(
        {"status": "first", "seq_len": "first", "peak_model_bytes": "median",
         "peak_attention_bytes": "median", "peak_other_bytes": "median",
         "peak_device_bytes": "median", "device_memory_bytes": "max", "mode": "first",
         "device": "first"})
    df["rung"] = [ladder_rung(*v) for v in zip(df["method"], df["stack"], df["nproc"],
                                                strict=True)]
    order = {r: i for i, r in enumerate(RUNGS)}
    df = df.sort_values("rung", key=lambda c: c.map(lambda r: order.get(r, len(order))),
                        kind="stable")
    scale, unit = memory_unit(df["peak_device_bytes"])
    parts = (("peak_model_bytes", "model states", "model_gib"),
             ("peak_attention_bytes", "attention", "attention_gib"),
             ("peak_other_bytes", "other", "other_gib"))
    paper = {r["rung"]: r for r in PAPER_LADDER_3M} if df["seq_len"].iloc[0] == 3 * 2**20 else {}
    paper_x = {"ALST": "alst", "UPipe": "upipe"}
    x = np.arange(len(df))
    with figure(path, width=max(7.5, 1.3 * len(df) + 2)) as (fig, (ax,)):
        bottom, pbottom = np.zeros(len(df)), np.zeros(len(df))
        papers = [paper.get(paper_x.get(r)) for r in df["rung"]]
        ours_kind = "emulated" if _emulated(df) else "measured"
        colors = sns.color_palette("muted", 3)
        for (col, name, key), color in zip(parts, colors, strict=True):
            h = df[col].fillna(0).to_numpy() / scale
            oom = (df["status"] == Status.OOM).to_numpy()
            ax.bar(x - 0.18, h, 0.34, bottom=bottom, color=color, label=f"{ours_kind}: {name}",
                   hatch=["//" if o else "" for o in oom], edgecolor="0.3")
            bottom += h
            p = np.array([q[key] if q else 0.0 for q in papers])
            if p.any():
                ax.bar(x + 0.18, p, 0.34, bottom=pbottom, color=color, alpha=0.45,
                       edgecolor="0.3", label=f"paper: {name}")
                pbottom += p
        # the axis ends a little above the budget and what fits: a rung far over it (FSDP only
        # needs terabytes at 3M) is cut at the top, its total written there
        budget = pd.to_numeric(df["device_memory_bytes"], errors="coerce").max() / scale
        fits = bottom[(df["status"] == Status.OK).to_numpy()]
        # no budget (a CPU run without one) and nothing over it: the tallest bar sets the top
        heights = [v for v in (budget, *fits, *pbottom) if np.isfinite(v)] or list(bottom)
        top = 1.35 * max(heights)
        for i, (status, total) in enumerate(zip(df["status"], bottom, strict=True)):
            text = f"{_number(total)} {unit}" + (" OOM" if status == Status.OOM else "")
            ax.annotate(text, (i - 0.18, min(total, top * 0.93)), ha="center", va="bottom",
                        fontsize=8, xytext=(0, 2), textcoords="offset points",
                        color="firebrick" if status == Status.OOM else "0.1",
                        bbox={"facecolor": "white", "alpha": 0.85, "linewidth": 0})
            if pbottom[i]:
                ax.annotate(_number(pbottom[i]), (i + 0.18, pbottom[i]), ha="center",
                            va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
        _memory_line(ax, df, scale, unit)
        ax.set_ylim(0, top)
        ax.set_xticks(x, df["rung"])
        ax.set(ylabel=_titled(f"peak device memory per rank ({unit})", df),
               title=_titled(f"Memory wall at {format_tokens(df['seq_len'].iloc[0])} tokens "
                             "(hatched: over the budget; bars cut at the top)", df))
        ax.legend(fontsize=8, loc="upper right", ncol=2)
    return True


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
