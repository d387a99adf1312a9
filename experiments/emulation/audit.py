"""The fit's committed rows against exact emulation: does a fitted row's peak equal the step's?

A row with ``emulation == "fit"`` has its peaks from lines through small exact emulations,
certified around its length (``emulation.fit``, ``emulation.certify``). The certificate rests on
every allocation being affine in the length on the fit's lattice; where a kernel model rounds a
size to blocks the lattice does not hold (FA3's 80- and 96-row blocks, docs/emulation.md's known
errors), it can be wrong. An audit settles it for committed rows: it emulates each selected
fitted row's cell exactly (every layer at the row's length, memory only: no FLOP or byte
counters) on the row's hardware and records both peaks, device and host, and the status each
gives. An exact memory-only step of a paper cell takes 9 s to a minute on one core here
(Llama3-8B's 32 layers, Qwen3-32B's 64, to 8M tokens) and minutes for the FPDTs at millions of
tokens (docs/emulation.md#how-exact-it-is), so most sweeps' fitted rows take an hour or two.

    python -m experiments.emulation.audit results/table3_llama3_8b_h100x8-emulated \\
        --kernel fa3 --method zigzag-ring --method fpdt

writes (or updates, row by row, as each is audited) ``results/fit_audit/rows.csv``, each row
with the code and machine that audited it, and exits 1 when a peak or a status differs.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from experiments.config import Cell, Hardware
from experiments.emulation.emulate import emulate_cell
from experiments.provenance import provenance
from experiments.store import CELL_FILE, read_json, read_row, write_text

OUT = Path(__file__).resolve().parents[2] / "results" / "fit_audit"
KEY = ("sweep", "cell_id")
# the hardware a row was emulated on: its hw_* columns (``Hardware.columns``), the reserve
# resolved, which gives the same budget when passed back
HW_FIELDS = ("gpu_mem_gib", "host_mem_gib", "gpus_per_node", "reserve_gib", "device", "profile")


def fitted_runs(sweep: Path, kernel: str | None = None,
                methods: Iterable[str] = ()) -> list[Path]:
    """The ``row.json`` files of ``sweep``'s runs whose row was fitted, with ``kernel`` and one
    of ``methods`` when given, shortest first (the cheapest audits first)."""
    methods = set(methods)
    rows = []
    for path in sorted((sweep / "runs").glob("*/row.json")):
        row = read_row(path)
        if row.get("emulation") != "fit":
            continue
        if (kernel and row.get("kernel") != kernel) or (methods and row["method"] not in methods):
            continue
        rows.append((row["seq_len"], path))
    return [p for _, p in sorted(rows)]


def audit_run(path: Path, measure=None) -> dict:
    """One fitted row (``runs/<cell_id>/row.json``) against the exact emulation of its cell:
    the audit's row. ``measure(cell, hardware, count=False, exact=True)`` -> a row; default
    ``emulate_cell``."""
    measure = measure or emulate_cell
    row = read_row(path)
    if missing := [f"hw_{k}" for k in HW_FIELDS if f"hw_{k}" not in row]:
        raise ValueError(f"{path}: the row has no {', '.join(missing)}: it does not say which "
                         "hardware it was emulated on, so it cannot be emulated again")
    cell = Cell.from_dict(read_json(path.with_name(CELL_FILE)))
    hw = Hardware(**{k: row[f"hw_{k}"] for k in HW_FIELDS})
    t0 = time.monotonic()
    exact = measure(cell, hw, count=False, exact=True)
    seconds = time.monotonic() - t0
    out = {"sweep": path.parents[2].name, "cell_id": row["cell_id"], "method": row["method"],
           "ring_degree": row.get("ring_degree"), "kernel": row.get("kernel"),
           "model": row["model"], "nproc": row["nproc"], "seq_len": row["seq_len"],
           "row_git_rev": row.get("git_rev"), "row_status": row["status"],
           "exact_status": exact["status"]}
    for kind in ("device", "host"):
        got, want = row.get(f"peak_{kind}_bytes"), exact.get(f"peak_{kind}_bytes")
        out |= {f"row_peak_{kind}_bytes": got, f"exact_peak_{kind}_bytes": want,
                f"{kind}_diff_bytes": None if got is None or want is None else want - got}
    same = all(out[f"row_peak_{k}_bytes"] == out[f"exact_peak_{k}_bytes"]
               for k in ("device", "host"))
    out["match"] = "yes" if same and out["row_status"] == out["exact_status"] else "no"
    prov = provenance()
    return out | {"audit_s": round(seconds, 1), "git_rev": prov["git_rev"],
                  "torch_version": prov["torch_version"], "cpu_model": prov["cpu_model"],
                  "date_utc": prov["date_utc"]}


def merge(old: pd.DataFrame | None, new: list[dict]) -> pd.DataFrame:
    """``old``'s rows with ``new``'s in place of those of the same (sweep, cell_id), sorted."""
    fresh = pd.DataFrame(new)
    if old is not None and len(old):
        keep = ~old.set_index(list(KEY)).index.isin(fresh.set_index(list(KEY)).index)
        fresh = pd.concat([old[keep], fresh], ignore_index=True)
    return fresh.sort_values(["sweep", "method", "seq_len", "cell_id"], ignore_index=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.emulation.audit",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("sweeps", nargs="+", type=Path, help="emulated sweep folders (results/<name>)")
    p.add_argument("--kernel", help="only rows with this kernel (e.g. fa3)")
    p.add_argument("--method", action="append", default=[], help="only this method (repeatable)")
    p.add_argument("--out", type=Path, default=OUT, help=f"the audit's folder (default {OUT})")
    a = p.parse_args(argv)
    for sweep in a.sweeps:
        if not (sweep / "runs").is_dir():
            p.error(f"sweeps: {sweep} has no runs/ folder (not a sweep's results)")
    paths = [r for s in a.sweeps for r in fitted_runs(s, a.kernel, a.method)]
    if not paths:
        p.error("no fitted row matches (--kernel, --method)")
    rows, csv = [], a.out / "rows.csv"
    for path in paths:
        rows.append(r := audit_run(path))
        # written row by row: an audit stopped part way keeps what it measured
        write_text(csv, merge(pd.read_csv(csv) if csv.exists() else None, [r]).to_csv(index=False))
        diff = r["device_diff_bytes"]  # None where a peak is missing (an unrun cell)
        print(f"{r['sweep']} {r['cell_id']}: {r['match']} (device "
              f"{'?' if diff is None else f'{diff:+}'} B, status {r['row_status']} / "
              f"{r['exact_status']}, {r['audit_s']} s)", flush=True)
    bad = [r for r in rows if r["match"] != "yes"]
    print(f"{len(rows) - len(bad)} of {len(rows)} fitted rows equal their exact emulation "
          f"-> {csv}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
