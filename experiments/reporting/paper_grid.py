"""Each emulated grid outcome of Tables 3 and 4 beside the paper's (``paper_tables``).

For every cell of the emulated Table 3 and Table 4 sweeps (method, mesh, length): whether the
emulator says it trains on the paper's H100s (``ok``) or runs out of memory (``oom``), its peak
and budget, and the paper's outcome where it is known (``PAPER_OUTCOMES``: stated in the
abstract, quoted from the paper, or implied by the abstract), else ``unread`` -- the tables
themselves could not be read here (paper_tables' docstring). Methods the paper did not run
(our ``fpdt``, DeepSpeed's Ulysses beside yunchang's) say so. Every disagreement gets a sentence
made from the numbers: by how much the emulated peak misses or clears the budget, and whether
that margin is inside the spread of the allocator reserve measured on an H100
(``experiments.config.hardware``), in which case the reserve, not the method's memory, decides
the cell.

    python -m experiments.reporting.paper_grid [--results results]

writes ``<results>/paper_grid/grid_vs_paper.csv`` and ``grid_vs_paper.md``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from experiments.config import GiB, format_size
from experiments.config.hardware import RESERVE_SOURCE
from experiments.reporting.paper_tables import PAPER_OUTCOMES, SEQ_LEN_TOKENS

SWEEPS = {"table3": "table3_llama3_8b_h100x8-emulated",
          "table4": "table4_qwen3_32b_h100x16-emulated"}
OUT_DIR = "paper_grid"
# methods whose heads are never split: the paper writes their mesh 1 x N (ring degree N)
RING_STYLE = frozenset({"ring", "zigzag-ring", "torch-cp", "rfa-zigzag"})
# our methods that are not the paper's baselines, and what they are
NOT_IN_PAPER = {
    "fpdt": "not the paper's FPDT: upipe's own FPDT on the ALST stack (the paper's is ds-fpdt)",
    "ds-ulysses": "not in the paper: DeepSpeed's Ulysses (the paper's Ulysses is yunchang's, "
                  "our ulysses)",
    "ring": "not in the paper: contiguous ring (the paper's Ring is zigzag)",
}
COLUMNS = ["table", "method", "mesh", "seq_len", "length", "stack", "emulated_status",
           "emulated_peak_gib", "budget_gib", "paper_status", "paper_peak_gib", "agree", "note",
           "paper_source"]


def mesh(method: str, nproc: int, ring_degree: int) -> str:
    """The paper's "<Ulysses degree>x<ring degree>" of a cell."""
    if method in RING_STYLE:
        return f"1x{nproc}"
    return f"{nproc // ring_degree}x{ring_degree}"


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


def grid(results: Path) -> pd.DataFrame:
    """The side-by-side table (``COLUMNS``) from the emulated sweeps' ``rows.csv``."""
    known = {(c["table"], c["method"], c["mesh"], c["seq_len"]): c for c in PAPER_OUTCOMES}
    spread = reserve_spread()
    out = []
    for table, sweep in SWEEPS.items():
        path = results / sweep / "rows.csv"
        if not path.exists():
            continue
        rows = pd.read_csv(path)
        # the grid's cells: timed rows (a max-context probe runs no timed step) at the paper's
        # lengths
        rows = rows[(rows.iters > 0) & rows.seq_len.isin(list(SEQ_LEN_TOKENS.values()))]
        for _, row in rows.iterrows():
            m = mesh(row["method"], int(row["nproc"]), int(row.get("ring_degree", 1) or 1))
            paper = known.get((table, row["method"], m, int(row["seq_len"])))
            status = (paper["status"] if paper else
                      "not in paper" if row["method"] in NOT_IN_PAPER else "unread")
            r = {"table": table, "method": row["method"], "mesh": m,
                 "seq_len": int(row["seq_len"]), "length": format_size(int(row["seq_len"])),
                 "stack": row["stack"], "emulated_status": row["status"],
                 "emulated_peak_gib": row.get("peak_device_bytes", float("nan")) / GiB,
                 "budget_gib": row.get("device_budget_bytes", float("nan")) / GiB,
                 "paper_status": status,
                 "paper_peak_gib": (paper or {}).get("peak_memory_gib") or float("nan"),
                 "paper_source": (paper or {}).get("source", NOT_IN_PAPER.get(row["method"], ""))}
            r["agree"] = ("yes" if row["status"] == status else "no") if paper else "—"
            r["note"] = _note(r, spread) if r["agree"] == "no" else ""
            out.append(r)
    df = pd.DataFrame(out, columns=COLUMNS)
    return df.sort_values(["table", "method", "mesh", "seq_len"], kind="stable")


def to_markdown(df: pd.DataFrame) -> str:
    """The table as Markdown: one line per cell, then the disagreements with their sentence."""
    lines = ["# Emulated grid outcomes beside the paper's (Tables 3 and 4)", "",
             "Generated by `python -m experiments.reporting.paper_grid` from the emulated "
             "sweeps' rows; do not edit.", "",
             "| table | method | mesh | length | stack | emulated | peak GiB | budget GiB | "
             "paper | agree |", "|---|---|---|---|---|---|---|---|---|---|"]
    for _, r in df.iterrows():
        lines.append(f"| {r.table} | {r.method} | {r.mesh} | {r.length} | {r.stack} | "
                     f"{r.emulated_status} | {r.emulated_peak_gib:.2f} | {r.budget_gib:.2f} | "
                     f"{r.paper_status} | {r.agree} |")
    dis = df[df.agree == "no"]
    lines += ["", f"## Disagreements ({len(dis)})", ""]
    lines += [f"- {r.table}, {r.method} {r.mesh}, {r.length}: {r.note}." for _, r in dis.iterrows()]
    known = df[df.agree != "—"]
    lines += ["", f"{len(known)} of {len(df)} emulated cells have a known paper outcome; "
              f"{(known.agree == 'yes').sum()} agree. Sources: "
              "experiments/reporting/paper_tables.py (PAPER_OUTCOMES)."]
    return "\n".join(lines) + "\n"


def write(results: Path) -> Path:
    """Write the CSV and the Markdown under ``results/paper_grid``; returns the directory."""
    df = grid(results)
    out = results / OUT_DIR
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "grid_vs_paper.csv", index=False)
    (out / "grid_vs_paper.md").write_text(to_markdown(df))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=Path("results"),
                   help="results root holding the emulated Table 3/4 sweeps (default results/)")
    out = write(p.parse_args(argv).results)
    print(f"wrote {out / 'grid_vs_paper.csv'} and {out / 'grid_vs_paper.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
