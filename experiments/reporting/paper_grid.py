"""Each emulated grid outcome of Tables 3 and 4 beside the paper's (``paper_tables``), and the
reproduction report (``reproduction``): one entry point for both.

For every cell of the emulated Table 3 and Table 4 sweeps (method, mesh, length): whether the
emulator says it trains on the paper's H100s (``ok``) or runs out of memory (``oom``), its peak
and budget, and the paper's outcome from its Tables 3 and 4 (``PAPER_OUTCOMES``). A row the
paper's tables have no cell for says why: a method the paper did not run (our ``fpdt``,
DeepSpeed's and upipe's Ulysses beside yunchang's), UPipe's overlapped stages (beyond the
paper), a mesh the table does not run the method on (Ulysses on 16 GPUs: the paper's Table 4
Ulysses is USP 8x2), or a length past the paper row's first OOM (the source leaves those cells
blank; no outcome is invented for them). Every disagreement gets a sentence made from the
numbers: by how much the emulated peak misses or clears the budget, and whether that margin is
inside the spread of the allocator reserve measured on an H100
(``experiments.config.hardware``), in which case the reserve, not the method's memory, decides
the cell.

    python -m experiments.reporting.paper_grid [--results results]

writes ``<results>/paper_grid/grid_vs_paper.csv`` and ``grid_vs_paper.md``, and the report of
tokens/s and memory beside the paper's (``reproduction_report.FILES`` and ``FIGURES``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from experiments.config import GiB, format_size
from experiments.config.hardware import RESERVE_SOURCE
from experiments.reporting import reproduction_report
from experiments.reporting.paper_tables import PAPER_OUTCOMES, SEQ_LEN_TOKENS, TABLES
from experiments.reporting.reproduction import OUT_DIR, SWEEPS, mesh, overlapped

# SWEEPS, OUT_DIR and mesh live in reproduction (the report shares them); the notebooks read
# them from here.
# our methods that are not the paper's baselines, and what they are
NOT_IN_PAPER = {
    "fpdt": "not the paper's FPDT: upipe's own FPDT on the ALST stack (the paper's is ds-fpdt)",
    "ds-ulysses": "not in the paper: DeepSpeed's Ulysses (the paper's Ulysses is yunchang's, "
                  "our usp-ulysses)",
    "ulysses": "not the paper's Ulysses: upipe's own (the paper's is yunchang's USP at ring "
               "degree 1, our usp-ulysses, whose ring of one keeps fp32 gradient copies)",
    "ring": "not in the paper: contiguous ring (the paper's Ring is zigzag)",
}
OVERLAP = "beyond the paper: UPipe's overlapped stages (the paper's are blocking)"
COLUMNS = ["table", "method", "overlap", "mesh", "seq_len", "length", "stack", "emulated_status",
           "emulated_peak_gib", "budget_gib", "paper_status", "paper_peak_gib", "agree", "note",
           "paper_source"]


def reserve_spread() -> tuple[float, float] | None:
    """(min, max) GiB of reserved minus allocated measured on an H100 (the repository's
    committed measurements), fpdt aside (its own reserve is measured apart), or None without
    them."""
    path = Path(__file__).resolve().parents[2] / RESERVE_SOURCE
    if not path.exists():
        return None
    rows = pd.read_csv(path)
    rows = rows[(rows.status == "ok") & (rows.method != "fpdt")]
    slack = (rows.allocator_peak_reserved_bytes - rows.allocator_peak_allocated_bytes) / GiB
    return float(slack.min()), float(slack.max())


def _note(r: dict, spread: tuple[float, float] | None) -> str:
    """Why an emulated outcome differs from the paper's, from the numbers."""
    peak, budget = r["emulated_peak_gib"], r["budget_gib"]
    if pd.isna(peak) or pd.isna(budget):
        return f"the emulated cell did not finish: {r['emulated_status']}"
    margin = abs(peak - budget)
    if r["emulated_status"] == "oom":
        text = f"emulated peak {peak:.2f} GiB exceeds the {budget:.2f} GiB budget by {margin:.2f}"
    else:
        text = f"emulated peak {peak:.2f} GiB fits the {budget:.2f} GiB budget by {margin:.2f}"
    text += " GiB; the paper's run " + ("trains" if r["paper_status"] == "ok" else "runs out")
    if not pd.isna(r["paper_peak_gib"]):
        text += f" at {r['paper_peak_gib']:g} GiB allocated"
    if spread is not None:
        width = spread[1] - spread[0]
        text += (f"; the margin is {'inside' if margin <= width else 'outside'} the spread of the "
                 f"allocator reserve measured on an H100 ({spread[0]:.1f}-{spread[1]:.1f} GiB"
                 f", width {width:.1f})")
        if margin <= width:
            text += ", so the reserve, not the method's memory, decides this cell"
    return text


def _paper_rows() -> tuple[set[tuple], dict[tuple, int]]:
    """The (table, method, mesh) rows of the paper's tables, and the first OOM length of each
    row that has one (the source leaves the lengths past it blank)."""
    rows, first_oom = set(), {}
    for c in PAPER_OUTCOMES:
        key = (c["table"], c["method"], c["mesh"])
        rows.add(key)
        if c["status"] == "oom":
            first_oom[key] = min(first_oom.get(key, c["seq_len"]), c["seq_len"])
    return rows, first_oom


def _no_cell(table: str, method: str, mesh_: str, overlap: bool, seq_len: int) -> tuple[str, str]:
    """(paper_status, paper_source) of an emulated cell the paper's tables have no cell for."""
    if method in NOT_IN_PAPER:
        return "not in paper", NOT_IN_PAPER[method]
    if overlap:
        return "not in paper", OVERLAP
    rows, first_oom = _paper_rows()
    name = TABLES[table][2]
    oom = first_oom.get((table, method, mesh_))
    if oom is not None and seq_len > oom:
        return "past OOM", (f"blank in the paper's {name}: its {method} {mesh_} row stops at "
                            f"its OOM at {format_size(oom)}")
    meshes = sorted(m for t, a, m in rows if (t, a) == (table, method))
    return "not in table", (f"not a row of the paper's {name}: it runs {method} as "
                            f"{', '.join(meshes)}" if meshes else
                            f"not a row of the paper's {name}: it has no {method} row")


def grid(results: Path) -> pd.DataFrame:
    """The side-by-side table (``COLUMNS``) from the emulated sweeps' ``rows.csv``: every timed
    row at the paper's lengths, sorted by table, method, overlap, mesh and length."""
    known = {(c["table"], c["method"], c["mesh"], c["seq_len"]): c for c in PAPER_OUTCOMES}
    spread = reserve_spread()
    out = []
    for table, sweep in SWEEPS.items():
        path = results / sweep / "rows.csv"
        if not path.exists():
            continue
        rows = pd.read_csv(path, low_memory=False)
        # the grid's cells: timed rows (a max-context probe runs no timed step) at the paper's
        # lengths
        rows = rows[(rows.iters > 0) & rows.seq_len.isin(list(SEQ_LEN_TOKENS.values()))]
        for _, row in rows.iterrows():
            m = mesh(row["method"], int(row["nproc"]), int(row.get("ring_degree", 1) or 1))
            n, overlap = int(row["seq_len"]), overlapped(row.get("overlap"))
            paper = None if overlap else known.get((table, row["method"], m, n))
            status, source = ((paper["status"], paper["source"]) if paper else
                              _no_cell(table, row["method"], m, overlap, n))
            r = {"table": table, "method": row["method"], "overlap": overlap, "mesh": m,
                 "seq_len": n, "length": format_size(n),
                 "stack": row["stack"], "emulated_status": row["status"],
                 "emulated_peak_gib": row.get("peak_device_bytes", float("nan")) / GiB,
                 "budget_gib": row.get("device_budget_bytes", float("nan")) / GiB,
                 "paper_status": status,
                 "paper_peak_gib": (paper or {}).get("peak_memory_gib") or float("nan"),
                 "paper_source": source}
            r["agree"] = ("yes" if row["status"] == status else "no") if paper else "—"
            r["note"] = _note(r, spread) if r["agree"] == "no" else ""
            out.append(r)
    df = pd.DataFrame(out, columns=COLUMNS)
    return df.sort_values(["table", "method", "overlap", "mesh", "seq_len"], kind="stable")


def to_markdown(df: pd.DataFrame) -> str:
    """The table as Markdown: one line per cell, then the disagreements with their sentence."""
    lines = ["# Emulated grid outcomes beside the paper's (Tables 3 and 4)", "",
             "Generated by `python -m experiments.reporting.paper_grid` from the emulated "
             "sweeps' rows; do not edit. The paper's outcomes: its Tables 3 and 4 as the UPipe "
             "project page publishes them (`experiments/reporting/paper_tables.py`). Tokens/s "
             "and the memory wall beside the paper's: [reproduction.md](reproduction.md).", "",
             "| table | method | mesh | length | stack | emulated | peak GiB | budget GiB | "
             "paper | agree |", "|---|---|---|---|---|---|---|---|---|---|"]
    for _, r in df.iterrows():
        method = f"{r.method} (overlap)" if r.overlap else r.method
        lines.append(f"| {r.table} | {method} | {r.mesh} | {r.length} | {r.stack} | "
                     f"{r.emulated_status} | {r.emulated_peak_gib:.2f} | {r.budget_gib:.2f} | "
                     f"{r.paper_status} | {r.agree} |")
    dis = df[df.agree == "no"]
    lines += ["", f"## Disagreements ({len(dis)})", ""]
    lines += [f"- {r.table}, {r.method} {r.mesh}, {r.length}: {r.note}." for _, r in dis.iterrows()]
    known = df[df.agree != "—"]
    counts = ", ".join(f"{n} {s}" for s, n in df[df.agree == "—"].paper_status.value_counts()
                       .sort_index().items())
    lines += ["", f"{len(known)} of {len(df)} emulated cells are cells of the paper's tables; "
              f"{(known.agree == 'yes').sum()} agree. The others ({counts or 'none'}): "
              "`paper_source` in grid_vs_paper.csv says why. Sources: "
              "experiments/reporting/paper_tables.py (PAPER_OUTCOMES)."]
    return "\n".join(lines) + "\n"


def write(results: Path, out: Path | None = None) -> Path:
    """Write the grid's CSV and Markdown and the reproduction report (``reproduction_report.write``)
    into ``out`` (default ``results/paper_grid``) from the sweeps under ``results``; returns
    the directory."""
    df = grid(results)
    out = results / OUT_DIR if out is None else out
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "grid_vs_paper.csv", index=False)
    (out / "grid_vs_paper.md").write_text(to_markdown(df))
    reproduction_report.write(results, out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=Path("results"),
                   help="results root holding the emulated Table 3/4 sweeps (default results/)")
    out = write(p.parse_args(argv).results)
    print(f"wrote {out}/: grid_vs_paper.csv, grid_vs_paper.md, "
          + ", ".join((*reproduction_report.FILES, *reproduction_report.FIGURES)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
