"""docs/results.md's "one node to 8M tokens" ladder tables, rendered from the committed records.

One table per setting that ``runner.long_ladder`` has run (the result folders
``long_ladder_*-emulated``): a row per rung, with the emulated peak per rank at the ladder's
length (its status, phase and model / attention / other split), the host peak per rank, and the
longest context the rung's certified search fits, beside what the next length is over. Rendered
from ``ladder.csv``, never typed; written between two markers in docs/results.md, which
``./run_all.sh`` rewrites after the results index.

    python -m experiments.reporting.ladder_table          # rewrite the section
    python -m experiments.reporting.ladder_table --check  # exit 1 when it is stale (a test)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

from experiments.config import format_size
from experiments.reporting.plot_labels import format_tokens
from experiments.reporting.sections import GeneratedSection
from experiments.reporting.speed_table import MODEL_NAMES

BEGIN, END = "<!-- long-ladder-table:begin -->", "<!-- long-ladder-table:end -->"
COMMAND = "python -m experiments.reporting.ladder_table"
ROOT = Path(__file__).resolve().parents[2]
PATTERN = "long_ladder_*-emulated"  # runner.long_ladder's result folders
GiB = 2**30


def _gib(v, digits: int = 2) -> str:
    return "—" if pd.isna(v) else f"{v / GiB:.{digits}f}"


def _label(r: dict) -> str:
    """The rung's label, with the chunk of a chunked backward: '+ chunked ... (64K)'."""
    chunk = json.loads(r["options"]).get("chunk_size")
    new = chunk is not None and "chunked" in r["label"]
    return r["label"] + (f" ({format_size(chunk)})" if new else "")


def _reach(r: dict) -> str:
    """'5760K (device peak 73.86 GiB)': the certified maximum and what the next length is over
    ('at least' where a lower bound settled it), or why the search has none."""
    if pd.isna(r["max_seq_len"]):
        return f"— ({r['search_status']}: {r['search_error'] or 'no length fits'})"
    best = format_size(int(r["max_seq_len"]))
    why = str(r["failing_error"]) if pd.notna(r["failing_error"]) else ""
    why = why.split(" >")[0] or "the search limit"
    return f"{best} ({why})"


def table(rows: pd.DataFrame, source: str = "") -> list[str]:
    """One setting's markdown table (its heading line first, then the records' file
    ``source``, relative to docs/, where given). rows: a ``ladder.csv``."""
    first = rows.iloc[0]
    s = format_tokens(first["seq_len"])
    model = MODEL_NAMES.get(first["model"], first["model"])
    head = (f"**{model} on {int(first['nproc'])} GPUs** ({first['device']}; device budget "
            f"{_gib(first['device_budget_bytes'])} GiB per rank; host budget "
            f"{_gib(first['host_budget_bytes'], 0)} GiB per rank)"
            + (f", from [{source.removeprefix('../')}]({source})" if source else "") + ":")
    lines = [head, "",
             f"| rung | device peak at {s} (GiB) | peak phase | model / attention / other "
             f"(GiB) | host at {s} (GiB/rank) | max context (what the next length is over) |",
             "|---|---|---|---|---|---|"]
    uncertified = False
    for r in rows.to_dict("records"):
        mark = ""
        # False: the window's lines (an exact emulation has no fit: NaN, exact)
        if r["fit_certified"] in (False, "False"):
            mark, uncertified = " ‡", True
        split = " / ".join(_gib(r[f"peak_{k}_bytes"]) for k in ("model", "attention", "other"))
        lines.append(f"| {_label(r)} | {_gib(r['peak_device_bytes'])} ({r['status']}){mark} | "
                     f"{r['peak_phase']} | {split} | {_gib(r['peak_host_bytes'], 1)} | "
                     f"{_reach(r)} |")
    if uncertified:
        lines += ["", "‡ the step's fit is not certified at this length: its peak is the "
                  "fit window's line"]
    return lines


def render(results: Path) -> str:
    """The generated section, markers included (without records: a line saying so)."""
    paths = sorted(results.glob(f"{PATTERN}/ladder.csv"))
    body = []
    for p in paths:
        rows = pd.read_csv(p)
        if len(rows):
            # the link from docs/results.md, where the section is written
            body += [*table(rows.sort_values("rung"), f"../results/{p.parent.name}/{p.name}"),
                     ""]
    if not body:
        body = ["No ladder records: run `python -m experiments.runner.long_ladder`.", ""]
    return SECTION.text(body)


SECTION = GeneratedSection(
    begin=BEGIN, end=END, command=COMMAND, doc=ROOT / "docs" / "results.md", render=render,
    what="the long-context ladder tables", description=__doc__.splitlines()[0],
    results=ROOT / "results")
stale, main = SECTION.stale, SECTION.main


if __name__ == "__main__":
    sys.exit(main())
