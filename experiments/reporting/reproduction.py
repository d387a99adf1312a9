"""The emulated Tables 3 and 4 beside the paper's published numbers (``paper_tables``).

For every cell of the paper's Tables 3 and 4: the emulated tokens/s per GPU beside the published
value and their ratio, and the emulated fit / OOM beside the paper's; per length, UPipe over
Ulysses (Table 4: USP 8x2) and UPipe over FPDT (DeepSpeed's), emulated beside the paper's; the
memory wall at 3M tokens, emulated model / attention / other GiB beside the paper's figure; and
two figures: emulated against published tokens/s (one point per cell, log-log, y = x) and their
ratio per length. Written by ``python -m experiments.reporting.paper_grid`` beside the grid of
outcomes, into ``results/paper_grid/``.

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
from experiments.reporting.reproduction_plots import plot_ratio_by_length, plot_vs_paper

SWEEPS = {"table3": "table3_llama3_8b_h100x8-emulated",
          "table4": "table4_qwen3_32b_h100x16-emulated"}
WALL_SWEEP = "memory_wall_llama3_8b_h100x8-emulated"
OUT_DIR = "paper_grid"
PAPER_KERNEL = "fa3"
WALL_SEQ_LEN = SEQ_LEN_TOKENS["3M"]
# methods whose heads are never split: the paper writes their mesh 1 x N (ring degree N)
RING_STYLE = frozenset({"ring", "zigzag-ring", "torch-cp", "rfa-zigzag"})
# what UPipe is compared with in each table: (method, mesh) of the paper's Ulysses and FPDT rows
UPIPE = {"table3": ("upipe", "8x1"), "table4": ("upipe", "8x2")}
VERSUS = {"table3": (("ulysses", "8x1"), ("ds-fpdt", "8x1")),
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


def wall_in_table3(results: Path, wall: pd.DataFrame) -> str:
    """Whether the Table 3 sweep's own 3M rows of ALST (ulysses) and UPipe give the memory
    wall's split (to 0.01 GiB), as a sentence."""
    t3 = paper_cells(_read_rows(results / SWEEPS["table3"] / "rows.csv"))
    same = []
    for method in ("ulysses", "upipe"):
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


# -- the report ------------------------------------------------------------------------------


def _f(v, fmt: str = "{:,.2f}") -> str:
    return "—" if v is None or pd.isna(v) else fmt.format(v)


TOKENS = ("Token counts: each row's `seq_len` is the global tokens of its one sequence per step "
          "(batch 1), in binary units as the paper's scripts label them (128K = 131072, 1M = "
          "1048576, 3M = 3145728 = 3 x 2^20); tokens/s per GPU = seq_len / GPUs / step time "
          "(torchtitan's metric, the paper's).")
RULE = ("Which emulated row stands for a paper cell: in the table's emulated sweep, the timed "
        "rows (`iters` > 0; max-context probes time no step) on the paper's kernel (`fa3`), "
        "UPipe's blocking stages (the `overlap` rows are beyond the paper) and no packing, with "
        "the cell's method, mesh (<Ulysses degree>x<ring degree>) and length; of several, the "
        "first in `rows.csv` order (`rows` counts them). Emulated tokens/s are shown where the "
        "emulated cell fits; a ratio where both fit.")


def _throughput_md(tp: pd.DataFrame, table: str) -> list[str]:
    lines = [f"## {TABLES[table][2]}: {TABLES[table][0]} on {TABLES[table][1]} H100s, "
             f"tokens/s per GPU (`{SWEEPS[table]}`)", "",
             "| paper row | method | mesh | length | paper | emulated | emulated / paper | "
             "paper fit | emulated fit | agree | rows | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in tp[tp["table"] == table].itertuples():
        lines.append(f"| {r.paper_method} | {r.method} | {r.mesh} | {r.length} | "
                     f"{_f(r.paper_tokens_per_s)} | {_f(r.emulated_tokens_per_s)} | "
                     f"{_f(r.ratio, '{:.3f}')} | {r.paper_status} | {r.emulated_status} | "
                     f"{r.agree} | {r.rows} | {r.note} |")
    return lines + [""]


def _summary_md(s: pd.DataFrame) -> list[str]:
    lines = ["## Summary", "", "| table | cells | both fit | no emulated row | median "
             "emulated / paper | range | outcomes that disagree |", "|---|---|---|---|---|---|---|"]
    for r in s.itertuples():
        lines.append(f"| {r.table} | {r.cells} | {r.both_ok} | {r.missing} | "
                     f"{_f(r.median_ratio, '{:.3f}')} | {_f(r.min_ratio, '{:.3f}')}-"
                     f"{_f(r.max_ratio, '{:.3f}')} | {r.disagree} |")
    return lines + [""]


def _ratios_md(rt: pd.DataFrame) -> list[str]:
    lines = ["## UPipe over Ulysses and over FPDT, per length", "",
             "Table 3: UPipe 8x1 over Ulysses 8x1; Table 4: UPipe 8x2 over the paper's Ulysses, "
             "USP 8x2; both over FPDT (DeepSpeed's). Tokens/s per GPU.", "",
             "| table | length | ratio | emulated | paper | emulated / paper | note |",
             "|---|---|---|---|---|---|---|"]
    for r in rt.itertuples():
        lines.append(f"| {r.table} | {r.length} | {r.ratio} | {_f(r.emulated, '{:.3f}')} | "
                     f"{_f(r.paper, '{:.3f}')} | {_f(r.emulated_over_paper, '{:.3f}')} | "
                     f"{r.note} |")
    return lines + [""]


def _wall_md(wall: pd.DataFrame, same: str) -> list[str]:
    lines = [f"## The memory wall at 3M tokens (3145728), Llama3-8B on 8 H100s (`{WALL_SWEEP}`)",
             "", "GiB per GPU, model states / attention / other; the paper's from its figure "
             "(an OOM rung: the GiB it writes beside OOM, and the part where it names one). "
             + same, "",
             "| rung | emulated | model | attention | other | peak | paper | model | attention "
             "| other | paper OOM GiB |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in wall.itertuples():
        part = f" ({r.paper_oom_part})" if isinstance(r.paper_oom_part, str) else ""
        lines.append(f"| {r.rung} | {r.emulated_status} | {_f(r.emulated_model_gib, '{:.1f}')} "
                     f"| {_f(r.emulated_attention_gib, '{:.1f}')} | "
                     f"{_f(r.emulated_other_gib, '{:.1f}')} | {_f(r.emulated_peak_gib, '{:.1f}')}"
                     f" | {r.paper_status} | {_f(r.paper_model_gib, '{:.1f}')} | "
                     f"{_f(r.paper_attention_gib, '{:.1f}')} | {_f(r.paper_other_gib, '{:.1f}')}"
                     f" | {_f(r.paper_oom_gib, '{:,.0f}')}{part} |")
    return lines + [""]


def to_markdown(tp: pd.DataFrame, rt: pd.DataFrame, wall: pd.DataFrame, same: str) -> str:
    """The report: how rows are chosen, the summary, each table's cells, the UPipe ratios, the
    memory wall, the figures."""
    two = ", ".join(format_size(r["seq_len"]) for r in PAPER_TWO_NODE)
    lines = ["# The emulated Tables 3 and 4 beside the paper's published numbers", "",
             "Generated by `python -m experiments.reporting.paper_grid` from the emulated "
             "sweeps' committed rows; do not edit. The paper's numbers: "
             "`experiments/reporting/paper_tables.py` (the UPipe project page's Tables 3 and 4 "
             "and figures); validation targets only, nothing is fitted to them. Fits / OOM of "
             "every emulated cell: [grid_vs_paper.md](grid_vs_paper.md).", "", TOKENS, "",
             RULE, ""]
    lines += _summary_md(summary(tp))
    lines += ["![Emulated against published tokens/s per GPU](throughput_vs_paper.png)", "",
              "![Emulated over published tokens/s per GPU, per length](ratio_by_length.png)",
              ""]
    for table in TABLES:
        lines += _throughput_md(tp, table)
    lines += _ratios_md(rt) + _wall_md(wall, same)
    lines += ["## Not reproduced", "",
              f"The two-node figure (Llama3-8B on 16 H100s, USP 8x2 against UPipe 8x2 at {two}; "
              "read off a chart, approximate; `paper_tables.PAPER_TWO_NODE`): no emulated sweep "
              "runs Llama3-8B on 16 GPUs."]
    return "\n".join(lines) + "\n"


FILES = ("reproduction.md", "throughput_vs_paper.csv", "upipe_ratios.csv", "memory_wall_3m.csv")
FIGURES = ("throughput_vs_paper.png", "ratio_by_length.png")


def write(results: Path, out: Path) -> list[Path]:
    """Write ``FILES`` and ``FIGURES`` into ``out`` from the sweeps under ``results``."""
    tp = throughput(results)
    rt = upipe_ratios(results)
    wall = memory_wall(results)
    out.mkdir(parents=True, exist_ok=True)
    tp.to_csv(out / "throughput_vs_paper.csv", index=False)
    rt.to_csv(out / "upipe_ratios.csv", index=False)
    wall.to_csv(out / "memory_wall_3m.csv", index=False)
    (out / "reproduction.md").write_text(to_markdown(tp, rt, wall, wall_in_table3(results, wall)))
    drawn = [out / f for f, plot in zip(FIGURES, (plot_vs_paper, plot_ratio_by_length),
                                         strict=True) if plot(tp, out / f)]
    return [out / f for f in FILES] + drawn
