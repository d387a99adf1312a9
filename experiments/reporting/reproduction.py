"""The emulated Tables 3 and 4 beside the paper's published numbers (``paper_tables``).

For every cell of the paper's Tables 3 and 4: the emulated tokens/s per GPU beside the published
value and their ratio, and the emulated fit / OOM beside the paper's; per length, UPipe over
Ulysses (Table 4: USP 8x2) and UPipe over FPDT (DeepSpeed's), emulated beside the paper's; the
memory wall at 3M tokens, emulated model / attention / other GiB beside the paper's figure; the
two-node figure (Llama3-8B on 16 H100s, USP 8x2 against UPipe 8x2), each method's emulated peak
GiB and fit / OOM and UPipe's tokens/s over USP's beside the figure's (read off a chart, so
approximate); and three figures: emulated against published tokens/s (one point per cell,
log-log, y = x), their ratio per length, and the two-node figure's peaks and ratio. Written by
``python -m experiments.reporting.paper_grid`` beside the grid of outcomes, into
``results/paper_grid/``. The two-node rows are chosen as a table's (below), from
``TWO_NODE_SWEEP`` on the 8x2 mesh.

Which emulated row stands for a paper cell (``paper_cells``): in the table's emulated sweep
(``SWEEPS``), the timed rows (``iters`` > 0: a max-context probe times no step) of the paper's
configuration -- the FlashAttention-3 kernel (``fa3``, the paper's), UPipe's blocking stages
(an ``overlap`` row is beyond the paper), no document packing -- with the cell's method, mesh
(``mesh``) and length. Where several rows match (a sweep resumed or rerun), the first in
``rows.csv`` order is taken and the count is reported; where none does, the cell says so and
carries no number.

Token counts: a row's ``seq_len`` is the global tokens of its one sequence per step (batch 1),
in binary units as the paper's scripts label them (128K = 131072, 3M = 3145728 = 3 x 2^20);
tokens/s per GPU is ``seq_len / nproc / step time``, torchtitan's metric, as the paper reports.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from experiments.config import GiB, format_size
from experiments.reporting.paper_tables import (
    PAPER_LADDER_3M,
    PAPER_THROUGHPUT,
    PAPER_TWO_NODE,
    SEQ_LEN_TOKENS,
    TABLES,
)

SWEEPS = {"table3": "table3_llama3_8b_h100x8-emulated",
          "table4": "table4_qwen3_32b_h100x16-emulated"}
WALL_SWEEP = "memory_wall_llama3_8b_h100x8-emulated"
TWO_NODE_SWEEP = "two_node_llama3_8b_h100x16-emulated"
TWO_NODE_METHODS = ("usp", "upipe")  # the figure's two, both on its 8x2 mesh
OUT_DIR = "paper_grid"
PAPER_KERNEL = "fa3"
WALL_SEQ_LEN = SEQ_LEN_TOKENS["3M"]
# methods whose heads are never split: the paper writes their mesh 1 x N (ring degree N)
RING_STYLE = frozenset({"ring", "zigzag-ring", "torch-cp", "rfa-zigzag"})
# what UPipe is compared with in each table: (method, mesh) of the paper's Ulysses and FPDT rows
UPIPE = {"table3": ("upipe", "8x1"), "table4": ("upipe", "8x2")}
VERSUS = {"table3": (("usp-ulysses", "8x1"), ("ds-fpdt", "8x1")),
          "table4": (("usp", "8x2"), ("ds-fpdt", "16x1"))}
THROUGHPUT_COLUMNS = ["table", "paper_method", "method", "mesh", "seq_len", "length",
                      "paper_status", "paper_tokens_per_s", "emulated_status",
                      "emulated_tokens_per_s", "ratio", "agree", "rows", "note"]
RATIO_COLUMNS = ["table", "seq_len", "length", "ratio", "emulated", "paper",
                 "emulated_over_paper", "note"]
WALL_PARTS = ("model", "attention", "other")
WALL_COLUMNS = (["rung", "method", "stack", "nproc", "emulated_status"]
                + [f"emulated_{p}_gib" for p in (*WALL_PARTS, "peak")]
                + ["paper_status"] + [f"paper_{p}_gib" for p in WALL_PARTS]
                + ["paper_oom_gib", "paper_oom_part"])
TWO_NODE_COLUMNS = (["seq_len", "length"]
                    + [f"{side}_{m}_{what}" for m in TWO_NODE_METHODS
                       for what in ("status", "peak_gib") for side in ("paper", "emulated")]
                    + ["paper_upipe_vs_usp", "emulated_upipe_vs_usp", "budget_gib"]
                    + [f"{m}_rows" for m in TWO_NODE_METHODS] + ["note"])


def mesh(method: str, nproc: int, ring_degree: int) -> str:
    """The paper's "<Ulysses degree>x<ring degree>" of a cell."""
    if method in RING_STYLE:
        return f"1x{nproc}"
    return f"{nproc // ring_degree}x{ring_degree}"


def _read_rows(path: Path) -> pd.DataFrame:
    """A sweep's rows.csv, with the columns the selection reads present (NaN if absent)."""
    rows = pd.read_csv(path, low_memory=False) if path.exists() else pd.DataFrame()
    for col in ("iters", "kernel", "overlap", "doc_len", "ring_degree", "nproc", "method",
                "seq_len", "status"):
        if col not in rows:
            rows[col] = np.nan
    return rows


def overlapped(v) -> bool:
    """Whether a row's ``overlap`` cell (bool, "True", 1.0 or empty) says UPipe's stages
    overlap."""
    return str(v).strip().lower() in ("true", "1", "1.0")


def paper_cells(rows: pd.DataFrame) -> pd.DataFrame:
    """The timed rows of the paper's configuration (module docstring), in file order, with
    their ``mesh``."""
    keep = ((pd.to_numeric(rows["iters"], errors="coerce") > 0)
            & (rows["kernel"].isna() | (rows["kernel"] == PAPER_KERNEL))
            & ~rows["overlap"].map(overlapped) & rows["doc_len"].isna())
    rows = rows[keep].copy()
    rows["mesh"] = [mesh(m, int(n), int(r) if pd.notna(r) else 1)
                    for m, n, r in zip(rows["method"], rows["nproc"], rows["ring_degree"],
                                       strict=True)]
    return rows


def _matches(results: Path) -> dict[tuple, list[dict]]:
    """(table, method, mesh, seq_len) -> the matching rows of that table's sweep, file order."""
    out: dict[tuple, list[dict]] = {}
    for table, sweep in SWEEPS.items():
        for r in paper_cells(_read_rows(results / sweep / "rows.csv")).to_dict("records"):
            out.setdefault((table, r["method"], r["mesh"], int(r["seq_len"])), []).append(r)
    return out


def throughput(results: Path) -> pd.DataFrame:
    """One row per cell of the paper's Tables 3 and 4 (``THROUGHPUT_COLUMNS``), in the tables'
    order: the published and emulated tokens/s per GPU, ``ratio`` (emulated / published, where
    both fit), both outcomes and whether they agree, and how many emulated rows matched."""
    found = _matches(results)
    out = []
    for c in PAPER_THROUGHPUT:
        hits = found.get((c["table"], c["method"], c["mesh"], c["seq_len"]), [])
        row = hits[0] if hits else {}
        status = row.get("status", "")
        ours = row["tokens_per_s_per_gpu"] if status == "ok" else float("nan")
        paper = c["tokens_per_s_per_gpu"] if c["status"] == "ok" else float("nan")
        note = ("no emulated row: the sweep lacks this cell" if not hits else
                f"{len(hits)} timed rows match; the first in rows.csv is taken"
                if len(hits) > 1 else "")
        out.append({"table": c["table"], "paper_method": c["paper_method"],
                    "method": c["method"], "mesh": c["mesh"], "seq_len": c["seq_len"],
                    "length": format_size(c["seq_len"]), "paper_status": c["status"],
                    "paper_tokens_per_s": paper, "emulated_status": status or "missing",
                    "emulated_tokens_per_s": ours, "ratio": ours / paper,
                    "agree": ("yes" if status == c["status"] else "no") if hits else "—",
                    "rows": len(hits), "note": note})
    return pd.DataFrame(out, columns=THROUGHPUT_COLUMNS)


def _values(results: Path) -> dict[str, dict[tuple, float | str]]:
    """(table, method, mesh, seq_len) -> tokens/s per GPU where the cell fits, else its status:
    "paper" from the tables, "emulated" from the first matching row (``paper_cells``) of every
    emulated cell, a cell of the paper's tables or not."""
    paper = {(c["table"], c["method"], c["mesh"], c["seq_len"]):
             c["tokens_per_s_per_gpu"] if c["status"] == "ok" else c["status"]
             for c in PAPER_THROUGHPUT}
    emulated = {k: float(r[0]["tokens_per_s_per_gpu"]) if r[0]["status"] == "ok"
                else str(r[0]["status"]) for k, r in _matches(results).items()}
    return {"paper": paper, "emulated": emulated}


def _ratio(values: dict, a: tuple, b: tuple, what: str) -> tuple[float, str]:
    """values[a] / values[b], or NaN and why not (a cell out of memory, or none)."""
    none = "no row" if what == "emulated" else "blank (past its OOM)"
    missing = [f"{k[1]} {k[2]} {values.get(k, none)}" for k in (a, b)
               if not isinstance(values.get(k), float)]
    if missing:
        return float("nan"), f"{what}: " + ", ".join(missing)
    return values[a] / values[b], ""


def upipe_ratios(results: Path) -> pd.DataFrame:
    """Per table and length: UPipe over the paper's Ulysses (Table 4: USP 8x2) and over FPDT,
    emulated and published, and the emulated ratio over the published one; a note names the
    side without a ratio and why (``RATIO_COLUMNS``)."""
    sides = _values(results)
    out = []
    for table in TABLES:
        up = UPIPE[table]
        for n in SEQ_LEN_TOKENS.values():
            for other in VERSUS[table]:
                a, b = (table, *up, n), (table, *other, n)
                e, why_e = _ratio(sides["emulated"], a, b, "emulated")
                p, why_p = _ratio(sides["paper"], a, b, "paper")
                out.append({"table": table, "seq_len": n, "length": format_size(n),
                            "ratio": f"{up[0]} {up[1]} / {other[0]} {other[1]}",
                            "emulated": e, "paper": p, "emulated_over_paper": e / p,
                            "note": "; ".join(w for w in (why_e, why_p) if w)})
    return pd.DataFrame(out, columns=RATIO_COLUMNS)


def memory_wall(results: Path) -> pd.DataFrame:
    """The paper's memory-wall rungs at 3M tokens beside the emulated rows of the memory_wall
    sweep (timed, at 3M, matched by method, stack and nproc; first in file order), GiB per GPU
    (``WALL_COLUMNS``)."""
    rows = _read_rows(results / WALL_SWEEP / "rows.csv")
    rows = rows[(pd.to_numeric(rows["iters"], errors="coerce") > 0)
                & (rows["seq_len"] == WALL_SEQ_LEN) & ~rows["overlap"].map(overlapped)]
    out = []
    for rung in PAPER_LADDER_3M:
        hit = rows[(rows["method"] == rung["method"]) & (rows["stack"] == rung["stack"])
                   & (rows["nproc"] == rung["nproc"])]
        r = hit.iloc[0] if len(hit) else {}
        out.append({"rung": rung["label"], "method": rung["method"], "stack": rung["stack"],
                    "nproc": rung["nproc"], "emulated_status": r.get("status", "missing")}
                   | {f"emulated_{p}_gib": r.get(f"peak_{p}_bytes", np.nan) / GiB
                      for p in WALL_PARTS}
                   | {"emulated_peak_gib": r.get("peak_device_bytes", np.nan) / GiB,
                      "paper_status": rung["status"]}
                   | {f"paper_{p}_gib": rung[f"{p}_gib"] for p in WALL_PARTS}
                   | {"paper_oom_gib": rung["oom_gib"], "paper_oom_part": rung["oom_part"]})
    return pd.DataFrame(out, columns=WALL_COLUMNS)


def _two_node_side(rows: pd.DataFrame, c: dict, method: str) -> tuple[dict, float]:
    """One method's columns of a two-node row (figure ``c``; ``rows``: the sweep's 8x2 rows of
    the paper's configuration), and its emulated tokens/s per GPU (NaN unless it fits)."""
    found = rows[(rows["method"] == method) & (rows["seq_len"] == c["seq_len"])]
    e = found.iloc[0] if len(found) else pd.Series(dtype=object)
    status = e.get("status", "missing")
    paper_peak = c[f"{method}_peak_gib"]
    return ({f"paper_{method}_status": c[f"{method}_status"],
             f"emulated_{method}_status": status,
             f"paper_{method}_peak_gib": np.nan if paper_peak is None else paper_peak,
             f"emulated_{method}_peak_gib": e.get("peak_device_bytes", np.nan) / GiB,
             f"{method}_rows": len(found)},
            float(e["tokens_per_s_per_gpu"]) if status == "ok" else np.nan)


def two_node(results: Path) -> pd.DataFrame:
    """One row per length of the paper's two-node figure (``PAPER_TWO_NODE``, approximate):
    USP's and UPipe's peak GiB per GPU and fit / OOM, the figure's beside the emulated (the
    first timed row of the paper's configuration, ``paper_cells``, of the method on the 8x2
    mesh at the length; an OOM row keeps the peak it would need), UPipe's tokens/s over USP's
    where both fit, the emulated budget, the matching rows per method and a note on what is
    missing (``TWO_NODE_COLUMNS``)."""
    rows = paper_cells(_read_rows(results / TWO_NODE_SWEEP / "rows.csv"))
    rows = rows[rows["mesh"] == "8x2"]
    out = []
    for c in PAPER_TWO_NODE:
        at = rows[rows["seq_len"] == c["seq_len"]]
        budget = at["device_budget_bytes"] if "device_budget_bytes" in at else at["seq_len"][:0]
        r = {"seq_len": c["seq_len"], "length": format_size(c["seq_len"]),
             "budget_gib": budget.iloc[0] / GiB if len(budget) else np.nan}
        tps = {}
        for m in TWO_NODE_METHODS:
            side, tps[m] = _two_node_side(rows, c, m)
            r |= side
        notes = [f"no emulated {m} 8x2 row" for m in TWO_NODE_METHODS if not r[f"{m}_rows"]]
        if not notes and any(pd.isna(v) for v in tps.values()):
            notes.append("no emulated ratio: " + ", ".join(
                f"{m} {r[f'emulated_{m}_status']}" for m, v in tps.items() if pd.isna(v)))
        if any(r[f"{m}_rows"] > 1 for m in TWO_NODE_METHODS):
            notes.append("several timed rows match; the first in rows.csv is taken")
        ratio = c["upipe_vs_usp_tokens_per_s"]
        out.append(r | {"paper_upipe_vs_usp": np.nan if ratio is None else ratio,
                        "emulated_upipe_vs_usp": tps["upipe"] / tps["usp"],
                        "note": "; ".join(notes)})
    return pd.DataFrame(out, columns=TWO_NODE_COLUMNS)


def wall_in_table3(results: Path, wall: pd.DataFrame) -> str:
    """Whether the Table 3 sweep's own 3M rows of ALST (usp-ulysses) and UPipe give the memory
    wall's split (to 0.01 GiB), as a sentence."""
    t3 = paper_cells(_read_rows(results / SWEEPS["table3"] / "rows.csv"))
    same = []
    for method in ("usp-ulysses", "upipe"):
        a = t3[(t3["method"] == method) & (t3["seq_len"] == WALL_SEQ_LEN)
               & (t3["mesh"] == "8x1")]
        b = wall[(wall["method"] == method) & (wall["stack"] == "alst")]
        if a.empty or b.empty:
            return "The Table 3 sweep has no 3M row of ALST and UPipe to compare."
        same.append(all(abs(a.iloc[0][f"peak_{p}_bytes"] / GiB - b.iloc[0][f"emulated_{p}_gib"])
                        < 0.01 for p in WALL_PARTS))
    return ("The Table 3 sweep's own 3M rows of Ulysses (ALST) and UPipe give the same split."
            if all(same) else "The Table 3 sweep's 3M rows differ from the memory_wall sweep's.")


def summary(tp: pd.DataFrame) -> pd.DataFrame:
    """Per table: cells, cells both fit, the median / min / max of emulated over published
    tokens/s, and the cells whose outcomes disagree."""
    out = []
    for table, g in tp.groupby("table", sort=True):
        r = g["ratio"].dropna()
        dis = g[g["agree"] == "no"]
        out.append({"table": table, "cells": len(g), "both_ok": len(r),
                    "missing": int((g["rows"] == 0).sum()),
                    "median_ratio": r.median(), "min_ratio": r.min(), "max_ratio": r.max(),
                    "disagree": "; ".join(f"{m} {x} {ln} (paper {p}, emulated {e})"
                                          for m, x, ln, p, e in zip(
                                              dis["method"], dis["mesh"], dis["length"],
                                              dis["paper_status"], dis["emulated_status"],
                                              strict=True)) or "none"})
    return pd.DataFrame(out)
