"""The selective-recomputation tables of docs/results.md, rendered from the committed rows.

For each emulated selective-recomputation sweep (``experiments.sweeps.selective_recompute``:
the result folders ``selective_recompute_*-emulated``), one table: a row per method (and mesh)
and length, a column per memory-stack level with the emulated tokens/s per GPU (or the status,
and what ran out: the device or the host budget) and the device / host peaks per rank, a column
per level kept in the last k blocks only where the sweep has such cells (``keep_blocks``), and
the fastest level that fits with its tokens/s over the paper's level (``alst``). Rendered from
``rows.csv``, never typed; written between two markers in docs/results.md, which
``./run_all.sh`` rewrites after the results index.

    python -m experiments.reporting.selective_table          # rewrite the section
    python -m experiments.reporting.selective_table --check  # exit 1 when it is stale (a test)
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from experiments.reporting.ablation_plots import stack_level
from experiments.reporting.plot_labels import format_tokens
from experiments.reporting.sections import GeneratedSection

BEGIN, END = "<!-- selective-table:begin -->", "<!-- selective-table:end -->"
COMMAND = "python -m experiments.reporting.selective_table"
ROOT = Path(__file__).resolve().parents[2]
BASELINE = "alst"  # the paper's level: every method recomputes each block whole
GiB = 2**30


PATTERN = "selective_recompute_*-emulated"  # the emulated sweeps' result folders


def emulated_sweeps(results: Path) -> list[str]:
    """The emulated sweeps' result folders under ``results`` that hold rows, by name."""
    return sorted(p.parent.name for p in results.glob(f"{PATTERN}/rows.csv"))


def _variant(r: dict) -> str:
    ring = int(r["ring_degree"]) if pd.notna(r.get("ring_degree")) else 1
    return r["method"] if ring == 1 else f"{r['method']} {int(r['nproc']) // ring}x{ring}"


def _kept(r: dict) -> int | None:
    """The blocks a row keeps the attention in, when only some (``keep_blocks``), else None."""
    k = r.get("keep_blocks")
    return None if k is None or pd.isna(k) else int(k)


def level(r: dict) -> str:
    """A row's column (``ablation_plots.stack_level``): its stack, or ``<stack>, last k``."""
    return stack_level(r["stack"], r.get("keep_blocks"))


def _over(r: dict) -> str:
    """What an oom cell ran out of: the device budget, the host budget, or both."""
    over = [k for k, peak, budget in (("device", "peak_device_bytes", "device_budget_bytes"),
                                       ("host", "peak_host_bytes", "host_budget_bytes"))
            if pd.notna(r.get(peak)) and pd.notna(r.get(budget)) and r[peak] > r[budget]]
    return " and ".join(over) or "?"


def cell(r: dict | None) -> str:
    """One level's cell: ``426 tok/s; 31.3 / 30 GiB`` (device / host peak per rank), or the
    status in place of the speed (``oom (host)``); ``—`` where the sweep has no row."""
    if r is None:
        return "—"
    if _kept(r) is not None:  # k first: "k=18: 171 tok/s; ..."
        return f"k={_kept(r)}: " + cell({k: v for k, v in r.items() if k != "keep_blocks"})
    if r["status"] == "ok":
        head = f"{r['tokens_per_s_per_gpu']:,.0f} tok/s"
    elif r["status"] == "oom":
        head = f"oom ({_over(r)})"
    else:
        return str(r["status"])
    if pd.isna(r.get("peak_device_bytes")) or pd.isna(r.get("peak_host_bytes")):
        return head
    return f"{head}; {r['peak_device_bytes'] / GiB:.1f} / {r['peak_host_bytes'] / GiB:.0f} GiB"


def best(cells: dict[str, dict]) -> str:
    """The fastest level that fits and its tokens/s over ``alst``'s, or ``—``."""
    fits = {s: r for s, r in cells.items() if r["status"] == "ok"}
    if not fits:
        return "—"
    stack = max(fits, key=lambda s: fits[s]["tokens_per_s_per_gpu"])
    base = fits.get(BASELINE)
    ratio = (f"{fits[stack]['tokens_per_s_per_gpu'] / base['tokens_per_s_per_gpu']:.3f}"
             if base else "alst does not fit")
    k = _kept(fits[stack])
    return f"{fits[stack]['stack']}{'' if k is None else f' k={k}'}, {ratio}"


def table(rows: pd.DataFrame) -> list[str]:
    """The markdown lines of one sweep's table."""
    records = rows.to_dict("records")
    # the sweep's order (rows follow its axes; the cells keeping some blocks come after them)
    stacks = list(dict.fromkeys(level(r) for r in records))
    head = ["method", "tokens", *[s + (" (the paper's)" if s == BASELINE else "")
                                  for s in stacks], "fastest that fits, / alst"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    variants = list(dict.fromkeys(_variant(r) for r in records))
    for v in variants:
        mine = [r for r in records if _variant(r) == v]
        for n in sorted({int(r["seq_len"]) for r in mine}):
            cells = {level(r): r for r in mine if int(r["seq_len"]) == n}
            lines.append("| " + " | ".join([v, format_tokens(n),
                                            *[cell(cells.get(s)) for s in stacks],
                                            best(cells)]) + " |")
    return lines


def render(results: Path) -> str:
    """The generated section, markers included: one table per emulated sweep with rows."""
    body = []
    for name in emulated_sweeps(results):
        rows = pd.read_csv(results / name / "rows.csv")
        first = rows.iloc[0]
        body += [f"`{name}`: {first['model']} on {int(first['world_size'])} GPUs "
                 f"({first['kernel']}, the `{first['hardware_profile']}` profile; "
                 f"{first['device_budget_bytes'] / GiB:.2f} GiB of device and "
                 f"{first['host_budget_bytes'] / GiB:.0f} GiB of host memory per rank)", "",
                 *table(rows), ""]
    return SECTION.text(body)


SECTION = GeneratedSection(
    begin=BEGIN, end=END, command=COMMAND, doc=ROOT / "docs" / "results.md", render=render,
    what="the selective-recomputation tables", description=__doc__.splitlines()[0],
    results=ROOT / "results")
stale, main = SECTION.stale, SECTION.main


if __name__ == "__main__":
    sys.exit(main())
