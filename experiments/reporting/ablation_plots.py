"""The ablations' figures, variants at one length: the memory ladder (the device peak split by
kind, and host bytes, per stack level; ``plot_memory_ladder``), heads per stage (UPipe's U
against Ulysses; ``plot_heads_per_stage``) and the memory wall (the paper's rungs from FSDP only
to UPipe; ``plot_memory_wall``). Each reads the sweep's tables only and returns False (draws
nothing) when they lack its data; ``plots.draw_plots`` draws them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns

from experiments.config.status import Status
from experiments.reporting.paper_tables import PAPER_LADDER_3M
from experiments.reporting.plot_common import (
    draw_memory_line,
    figure,
    focus_length,
    palette_for,
    throughput_rows,
    vs_ulysses,
)
from experiments.reporting.plot_labels import (
    SETTINGS,
    format_number,
    format_tokens,
    is_emulated,
    label_variants,
    mark_emulated,
    memory_unit,
    shared_settings,
    stack_rank,
)

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
            ax.annotate(format_number(bottom[i]), (i - 0.2, bottom[i]), ha="center", va="bottom",
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
    df, labels = label_variants(rows[rows["seq_len"] == focus_length(ok, ["stack"])],
                                ("model", "nproc"))
    stacks = sorted(df["stack"].dropna().unique(), key=lambda s: (stack_rank(s), s))
    cols = ["peak_device_bytes", "peak_host_bytes"]
    scale, unit = memory_unit(df.loc[df["status"] == Status.OK, cols].stack())
    panel = max(3.2, 0.75 * len(stacks) + 0.2)  # inches: room for each level's two bars
    with figure(path, ncols=len(labels), width=panel * len(labels) + 2.2) as (fig, axes):
        for ax, label in zip(axes, labels, strict=True):
            _ladder_panel(ax, df[df["label"] == label], stacks, scale)
            ax.set(title=label, xlabel="memory stack")
        axes[0].set_ylabel(mark_emulated(f"peak per rank ({unit})", df))
        top = max(ax.get_ylim()[1] for ax in axes)
        for ax in axes:
            ax.set_ylim(0, top * 1.05)
        handles, names = axes[0].get_legend_handles_labels()
        fig.legend(handles, names, loc="upper center", bbox_to_anchor=(0.5, 0), ncol=4,
                   fontsize=8)  # below the panels, clear of every bar
        fig.suptitle(f"{mark_emulated('Memory ladder', df)} · "
                     f"{shared_settings(df, ('model', 'nproc', 'seq_len', 'device'))}")
    return True


def plot_heads_per_stage(rows: pd.DataFrame, maxctx: pd.DataFrame, path: Path) -> bool:
    """Bars per variant (Ulysses, then UPipe by U), each annotated with its ratio to Ulysses:
    peak device memory, and tokens/s per GPU beside it when the rows are timed (measured, or
    emulated by the time model: titled so). Reads rows.csv: method, heads_per_stage, model, nproc,
    stack, seq_len, status, peak_device_bytes, and the throughput columns."""
    df = rows[(rows["status"] == Status.OK) & rows["method"].isin(["ulysses", "upipe"])]
    timed = throughput_rows(df)
    df = timed if len(timed) else df[df["peak_device_bytes"].notna()]
    if df.empty:
        return False
    keys = [*SETTINGS, "seq_len"]
    df = df[df["seq_len"] == focus_length(df, ["method", "heads_per_stage"])]
    df, labels = label_variants(df, keys)
    scale, unit = memory_unit(df["peak_device_bytes"])
    df = df.assign(mem=df["peak_device_bytes"] / scale)
    panels = [("mem", mark_emulated(f"peak device memory per rank ({unit})", df))]
    if len(timed):
        panels.append(("tps", mark_emulated("tokens/s per GPU", df)))
    width = max(4.5 * len(panels), 0.8 * len(panels) * len(labels) + 2 * len(panels))
    with figure(path, ncols=len(panels), width=width) as (fig, axes):
        for ax, (col, name) in zip(axes, panels, strict=True):
            agg = df.groupby(["label", "method", "heads_per_stage", *keys], dropna=False,
                             sort=False)[col].median().reset_index()
            agg = agg.assign(ratio=vs_ulysses(agg, col, keys)).set_index("label").loc[labels]
            sns.barplot(agg.reset_index(), x="label", y=col, hue="label", order=labels,
                        hue_order=labels, palette=palette_for(labels), legend=False, ax=ax)
            for i, (v, r) in enumerate(zip(agg[col], agg["ratio"], strict=True)):
                text = format_number(v) + ("" if pd.isna(r) else f"\n{r:.2f}× Ulysses")
                ax.annotate(text, (i, 0 if pd.isna(v) else v), ha="center", va="bottom",
                            xytext=(0, 2), textcoords="offset points", fontsize=8)
            ax.set(xlabel="variant", ylabel=name, ylim=(0, 1.25 * max(agg[col].max(), 1e-9)))
            ax.tick_params(axis="x", rotation=20 if len(labels) > 4 else 0)
        fig.suptitle(f"{mark_emulated('Heads per stage', df)} · "
                     f"{shared_settings(df, (*keys, 'device'))}")
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
        ours_kind = "emulated" if is_emulated(df) else "measured"
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
            text = f"{format_number(total)} {unit}" + (" OOM" if status == Status.OOM else "")
            ax.annotate(text, (i - 0.18, min(total, top * 0.93)), ha="center", va="bottom",
                        fontsize=8, xytext=(0, 2), textcoords="offset points",
                        color="firebrick" if status == Status.OOM else "0.1",
                        bbox={"facecolor": "white", "alpha": 0.85, "linewidth": 0})
            if pbottom[i]:
                ax.annotate(format_number(pbottom[i]), (i + 0.18, pbottom[i]), ha="center",
                            va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
        draw_memory_line(ax, df, scale, unit)
        ax.set_ylim(0, top)
        ax.set_xticks(x, df["rung"])
        ax.set(ylabel=mark_emulated(f"peak device memory per rank ({unit})", df),
               title=mark_emulated(f"Memory wall at {format_tokens(df['seq_len'].iloc[0])} tokens "
                                   "(hatched: over the budget; bars cut at the top)", df))
        ax.legend(fontsize=8, loc="upper right", ncol=2)
    return True
