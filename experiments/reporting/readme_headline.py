"""The README's headline table: maximum context and tokens/s per method beside the paper's.

Rendered from committed results, never typed: the emulated maximum context of each method of
the paper's Tables 3 and 4 from its emulated sweep's ``max_context.csv``, the emulated tokens/s
per GPU at 128K tokens from the rows ``experiments.reporting.reproduction`` matches to the
paper's cells, and the paper's own numbers from ``experiments.reporting.paper_tables``. Written
between two markers in ``README.md``; ``./run_all.sh`` rewrites it after the results index.

    python -m experiments.reporting.readme_headline          # rewrite the section in README.md
    python -m experiments.reporting.readme_headline --check  # exit 1 when it is stale (a test)
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from experiments.reporting.paper_tables import PAPER_MAX_CONTEXT, SEQ_LEN_TOKENS, TABLES
from experiments.reporting.plot_labels import format_tokens
from experiments.reporting.reproduction import SWEEPS, mesh, overlapped, throughput
from experiments.reporting.sections import GeneratedSection

BEGIN, END = "<!-- readme-headline:begin -->", "<!-- readme-headline:end -->"
COMMAND = "python -m experiments.reporting.readme_headline"
ROOT = Path(__file__).resolve().parents[2]
SPEED_AT = SEQ_LEN_TOKENS["128K"]  # the length whose tokens/s the table shows: every method fits
COLUMNS = ("setup", "method (paper's name)", "ours", "max context: paper", "emulated",
           "tokens/s/GPU at 128K: paper", "emulated")


def emulated_max_context(results: Path, table: str) -> dict[tuple[str, str], int]:
    """(method, mesh) -> the emulated ``max_seq_len`` of the table's sweep, UPipe's blocking
    stages only (the paper's; overlap is beyond it)."""
    path = results / SWEEPS[table] / "max_context.csv"
    rows = pd.read_csv(path) if path.exists() else pd.DataFrame()
    out = {}
    for r in rows.to_dict("records"):
        if r.get("status") == "ok" and not overlapped(r.get("overlap")):
            key = (r["method"], mesh(r["method"], int(r["nproc"]), int(r["ring_degree"])))
            out.setdefault(key, int(r["max_seq_len"]))
    return out


def _number(v: float) -> str:
    return "—" if pd.isna(v) else f"{v:,.0f}"


def rows(results: Path) -> list[list[str]]:
    """The table's cells: one row per method of the paper's Tables 3 and 4, in their order."""
    tp = throughput(results)
    speed = {(r["table"], r["method"], r["mesh"]): r
             for r in tp[tp["seq_len"] == SPEED_AT].to_dict("records")}
    out = []
    for c in PAPER_MAX_CONTEXT:
        table, key = c["table"], (c["method"], c["mesh"])
        model, gpus, _, _ = TABLES[table]
        ours = emulated_max_context(results, table).get(key)
        s = speed.get((table, *key), {})
        out.append([f"{model}, {gpus}x H100", s.get("paper_method", "—"),
                    f"`{c['method']}` {c['mesh']}", format_tokens(c["max_context"]),
                    format_tokens(ours) if ours else "—",
                    _number(s.get("paper_tokens_per_s", float("nan"))),
                    _number(s.get("emulated_tokens_per_s", float("nan")))])
    return out


def render(results: Path) -> str:
    """The generated section, markers included."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in rows(results)]
    return SECTION.text([*lines, ""])


SECTION = GeneratedSection(
    begin=BEGIN, end=END, command=COMMAND, doc=ROOT / "README.md", render=render,
    what="the headline table", description=__doc__.splitlines()[0], results=ROOT / "results")
stale, main = SECTION.stale, SECTION.main


if __name__ == "__main__":
    sys.exit(main())
