"""The emulated time model against real CPU runs (docs/design.md#the-time-model; issue 14's
validation).

    upipe-bench validate-time [--out results] [--calibrate]

1. The profile: ``<out>/time_validation_cpu/profile.json``, measured on this machine by
   ``calibrate`` with 2 ranks (the cells' ranks) when missing or with ``--calibrate``.
2. The measured cells: the ``time_validation_cpu`` sweep (``experiments/sweeps``; resumable:
   cells already measured are kept), each a real 2-rank gloo run with its timed steps.
3. The predictions: every cell emulated exactly on the CPU (``Hardware(device="cpu")``, the
   CPU's kernels and allocator) with that profile, its step time priced by the time model.
4. ``comparison.csv`` (one row per cell: measured and predicted step seconds, the error, the
   predicted breakdown), ``summary.json`` (median and worst |error|, against the issue's
   targets: median <= 15%, worst <= 35%) and ``predicted_vs_measured.png``.

The profile and the measured rows must come from one CPU (provenance's ``cpu_model`` and
``cpu_count``): on another machine, validate into an empty ``--out`` (the committed
``results/time_validation_cpu/`` is one machine's profile and runs, compared as they are).
Nothing is fitted to the measured steps: the profile comes from the calibration's
micro-benchmarks only.
"""

from __future__ import annotations

import dataclasses
import io
import sys
from pathlib import Path

import pandas as pd

from experiments.config import Cell, Hardware, Status, Sweep
from experiments.emulation.emulate import emulate_cell
from experiments.reporting.validation import write_time_validation
from experiments.runner.sweep_runner import SweepRunner
from experiments.store import CELL_FILE, BadResultFile, read_json, read_row
from experiments.timing.calibrate import calibrate, write_profile

SWEEP = "time_validation_cpu"  # the sweep (experiments/sweeps) the CLI validates with
NPROC = 2  # the sweep's ranks: the calibration times as many at once


def machine(provenance: dict) -> str:
    """The CPU a row or a profile was measured on, as provenance names it (the host name is
    the same "vm" on every machine of this project's kind, so it tells nothing)."""
    return f"{provenance.get('cpu_model')} x {provenance.get('cpu_count')}"


def predictions(sweep_dir: Path, profile: Path) -> pd.DataFrame:
    """Measured against predicted step time for every measured ok row of the sweep.
    ``store.BadResultFile`` names a run folder without its ``cell.json`` (the sweep's runner
    writes it again on resume: ``validate_time`` runs the sweep first). ValueError when a
    measured row ran on another CPU than the profile was calibrated on (its step times and the
    profile's rates are of two machines: nothing to validate)."""
    hw = Hardware(device="cpu", profile=str(profile))
    calibrated_on = machine(read_json(profile).get("provenance", {}))
    records, elsewhere = [], []
    for path in sorted(sweep_dir.glob("runs/*/row.json")):
        row = read_row(path)
        if row["status"] != Status.OK or not row.get("time_median_s"):
            continue
        if machine(row) != calibrated_on:
            elsewhere.append(f"{path.parent.name} ({machine(row)})")
            continue
        cell_path = path.with_name(CELL_FILE)
        if not cell_path.is_file():
            raise BadResultFile(cell_path, "missing: a measured row is predicted from its "
                                           "cell.json (resuming the sweep writes it again)")
        cell = Cell.from_dict(read_json(cell_path))
        pred = emulate_cell(dataclasses.replace(cell, budget_mib=None), hw, exact=True)
        if pred["status"] != Status.OK:
            print(f"warning: {cell.cell_id()} could not be predicted: {pred['error']}",
                  file=sys.stderr)
            continue
        records.append({
            "cell_id": cell.cell_id(), "method": cell.method, "model": cell.model,
            "seq_len": cell.seq_len, "stack": cell.stack, "ring_degree": cell.ring_degree,
            "measured_s": row["time_median_s"], "measured_p20_s": row.get("time_p20_s"),
            "measured_p80_s": row.get("time_p80_s"), "predicted_s": pred["step_time_s"],
            "error": pred["step_time_s"] / row["time_median_s"] - 1,
            **{k: pred[k] for k in ("time_compute_s", "time_comm_exposed_s",
                                    "time_offload_exposed_s", "time_overhead_s")},
            "measured_git_rev": row.get("git_rev"), "predicted_git_rev": pred.get("git_rev"),
            "machine": calibrated_on,
        })
    if elsewhere:
        raise ValueError(
            f"{len(elsewhere)} measured row(s) of {sweep_dir} ran on another CPU than its "
            f"profile.json was calibrated on ({calibrated_on}): {', '.join(elsewhere[:3])}"
            f"{' ...' if len(elsewhere) > 3 else ''}. Measure both on one machine: "
            f"validate-time --out <an empty directory> (calibrates and runs every cell here), "
            f"or delete {sweep_dir / 'runs'} and run validate-time --calibrate")
    return pd.DataFrame.from_records(records)


def validate_time(sweep: Sweep, out: Path, *, recalibrate: bool = False,
                  progress: bool = True) -> dict:
    """The validation of the module's docstring for ``sweep`` into ``out / sweep.name``; its
    summary (``reporting.validation.summarize_errors``)."""
    sweep_dir = out / sweep.name
    profile = sweep_dir / "profile.json"
    if recalibrate or not profile.exists():
        print(f"calibrating this machine with {NPROC} ranks ...", file=sys.stderr)
        write_profile(calibrate(nproc=NPROC, device="cpu"), profile)
    SweepRunner(sweep, out, progress=progress)()
    return write_time_validation(sweep_dir, _same_revision_if_unchanged(
        predictions(sweep_dir, profile), sweep_dir / "comparison.csv"))


def _same_revision_if_unchanged(table: pd.DataFrame, previous: Path) -> pd.DataFrame:
    """``table`` with the previous comparison's ``predicted_git_rev`` where every other value
    is the same as written (the revision that first predicted these numbers stays their
    provenance, and re-running the main job on unchanged code leaves the committed file
    byte-identical instead of re-stamping every row with the newest revision)."""
    if not previous.is_file():
        return table
    old = pd.read_csv(previous)

    def text(t: pd.DataFrame) -> str:
        return t.drop(columns="predicted_git_rev").to_csv(index=False, float_format="%.6g")

    if list(old.columns) == list(table.columns) and text(old) == text(pd.read_csv(
            io.StringIO(table.to_csv(index=False, float_format="%.6g")))):
        return table.assign(predicted_git_rev=old["predicted_git_rev"].to_numpy())
    return table
