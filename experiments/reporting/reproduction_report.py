"""The reproduction report (``reproduction``'s tables) as Markdown, CSVs and figures: what
``python -m experiments.reporting.paper_grid`` writes into ``results/paper_grid/`` beside the grid
of outcomes."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments.reporting.paper_setups import findings_md
from experiments.reporting.paper_tables import TABLES
from experiments.reporting.reproduction import (
    SWEEPS,
    TWO_NODE_SWEEP,
    WALL_SWEEP,
    memory_wall,
    summary,
    throughput,
    two_node,
    upipe_ratios,
    wall_in_table3,
)
from experiments.reporting.reproduction_plots import (
    plot_ratio_by_length,
    plot_two_node,
    plot_vs_paper,
)


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


def _approx(v, fmt: str) -> str:
    """A value read off the paper's chart: "~" before it, "—" where the figure has none."""
    return "—" if pd.isna(v) else "~" + fmt.format(v)


def _two_node_md(two: pd.DataFrame) -> list[str]:
    lines = [f"## The two-node figure: Llama3-8B on 16 H100s, USP 8x2 against UPipe 8x2 "
             f"(`{TWO_NODE_SWEEP}`)", "",
             "Peak GiB per GPU and fit / OOM of each method, and UPipe's tokens/s per GPU over "
             "USP's. The paper's values are read off its chart (`paper_tables.PAPER_TWO_NODE`), "
             "so approximate (~); it gives no peak for an OOM run. An emulated OOM row shows the "
             "peak it would need, over the emulated budget; a ratio is given where both fit. "
             "The sweep also runs 1M tokens (not in the figure): its rows and plots are in "
             f"`results/{TWO_NODE_SWEEP}/`.", "",
             "![The two-node figure, emulated beside the paper's](two_node.png)", "",
             "| length | USP paper | USP emulated | USP paper GiB | USP emulated GiB | UPipe "
             "paper | UPipe emulated | UPipe paper GiB | UPipe emulated GiB | UPipe / USP paper "
             "| UPipe / USP emulated | budget GiB | rows (USP, UPipe) | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    g, x = "{:.1f}", "{:.3f}"
    for r in two.itertuples():
        lines.append(f"| {r.length} | {r.paper_usp_status} | {r.emulated_usp_status} | "
                     f"{_approx(r.paper_usp_peak_gib, g)} | {_f(r.emulated_usp_peak_gib, g)} | "
                     f"{r.paper_upipe_status} | {r.emulated_upipe_status} | "
                     f"{_approx(r.paper_upipe_peak_gib, g)} | "
                     f"{_f(r.emulated_upipe_peak_gib, g)} | {_approx(r.paper_upipe_vs_usp, x)} "
                     f"| {_f(r.emulated_upipe_vs_usp, x)} | {_f(r.budget_gib)} | "
                     f"{r.usp_rows}, {r.upipe_rows} | {r.note} |")
    return lines + [""]


def to_markdown(tp: pd.DataFrame, rt: pd.DataFrame, wall: pd.DataFrame, same: str,
                two: pd.DataFrame) -> str:
    """The report: how rows are chosen, the summary, each table's cells, the UPipe ratios, the
    memory wall, the two-node figure, the figures, and the disagreements' mechanisms."""
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
    lines += _ratios_md(rt) + _wall_md(wall, same) + _two_node_md(two) + findings_md()
    return "\n".join(lines).rstrip("\n") + "\n"


FILES = ("reproduction.md", "throughput_vs_paper.csv", "upipe_ratios.csv", "memory_wall_3m.csv",
         "two_node.csv")
FIGURES = ("throughput_vs_paper.png", "ratio_by_length.png", "two_node.png")


def write(results: Path, out: Path) -> list[Path]:
    """Write ``FILES`` and ``FIGURES`` into ``out`` from the sweeps under ``results``."""
    tp = throughput(results)
    rt = upipe_ratios(results)
    wall = memory_wall(results)
    two = two_node(results)
    out.mkdir(parents=True, exist_ok=True)
    tp.to_csv(out / "throughput_vs_paper.csv", index=False)
    rt.to_csv(out / "upipe_ratios.csv", index=False)
    wall.to_csv(out / "memory_wall_3m.csv", index=False)
    two.to_csv(out / "two_node.csv", index=False)
    (out / "reproduction.md").write_text(
        to_markdown(tp, rt, wall, wall_in_table3(results, wall), two))
    plots = ((plot_vs_paper, tp), (plot_ratio_by_length, tp), (plot_two_node, two))
    drawn = [out / f for f, (plot, df) in zip(FIGURES, plots, strict=True) if plot(df, out / f)]
    return [out / f for f in FILES] + drawn
