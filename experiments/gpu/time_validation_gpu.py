"""The time model against one real GPU: ``upipe-bench validate-time --device cuda``
(docs/gpu.md#validating-the-time-model-on-a-gpu).

On any single CUDA GPU, in one process:

1. ``calibrate`` this GPU (one rank; ``--quick``: the small grid) into ``profile.json`` (a
   failed calibration is reported in ``env.json``, and the cells are priced on the shipped
   profile alone);
2. measure the grid ``gpu_costs.STEP_CELLS`` (Llama3-8B shapes, 4 layers, bf16, ALST: Ulysses,
   UPipe at U = 1 .. 4C, with overlap and on the long stack with chunks, zigzag ring, FPDT, USP,
   DeepSpeed Ulysses; 1 rank at 32K, 8 ranks at 128K to 512K), each cell as rank 0 of its P on
   the ``fake`` process group (real kernels and host copies, no communication), the allocator
   cleaned between cells (``gpu_costs.measure_steps``);
3. emulate each cell exactly (fake tensors, ``Hardware(device="cuda")``) as the rank it ran
   as (rank 0, not the emulator's critical rank) and with the attention kernel it ran (what
   ``"auto"`` picks on this GPU, named in the cell and the ``kernel`` column: left to
   ``"auto"``, the emulator would pick the emulated profile's GPU's), and price its step on
   the shipped profile of this GPU (``calibrate.DATASHEETS``; none for another GPU) and on the
   calibration of step 1, without communication, as the cells ran;
4. write ``<out>/time_validation_gpu/``: ``rows.csv`` (measured step and allocator peak beside
   each profile's predicted step, its error, and the emulated peak), ``summary.json`` (median
   and worst |error| per profile against the targets, UPipe / Ulysses step ratios measured and
   predicted), ``predicted_vs_measured.png``, ``profile.json`` and ``env.json``.

Nothing is fitted to the measured steps. Without a CUDA device it says so and exits 2.

``reprice`` (``validate-time --device cuda --reprice``, no GPU needed) prices the measured
cells of a finished run again with the code and profiles as they stand, and with more profiles
(a full calibration made on the same GPU): the measured columns stay as they were.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from experiments.config import Hardware, Status
from experiments.emulation.emulate import time_columns
from experiments.emulation.fake_step import measure_fake
from experiments.gpu.gpu_costs import STEP_CELLS, cell_of, measure_steps
from experiments.provenance import provenance
from experiments.reporting.validation import plot_gpu_validation, summarize_gpu_validation
from experiments.store import write_json, write_text
from experiments.timing.calibrate import DATASHEETS, calibrate, write_profile
from experiments.timing.profile import load_profile
from upipe.kernels import check_kernel, machine_auto_kernel

FOLDER = "time_validation_gpu"
ITERS = 2  # timed steps per cell (one at 512K tokens), after a warm-up step


class NoGPU(RuntimeError):
    """No CUDA device: the GPU validation cannot run here."""


def predict(cell, profiles: dict) -> dict:
    """The cell emulated once and priced on each profile: predicted step seconds (without
    exposed communication: the measured cells ran on the fake process group) and the peak."""
    cfg = cell.validate()
    m = measure_fake(cell, cfg, Hardware(device="cuda"), rank=0)  # the rank measured_steps ran
    out = {"emulated_peak_bytes": m.peak_device_bytes}
    for name, profile in profiles.items():
        t = time_columns(cell, cfg, profile, m)
        out[f"predicted_s_{name}"] = t["step_time_s"] - t["time_comm_exposed_s"]
    return out


def kernel_run(device: torch.device, head_dim: int) -> str:
    """The attention kernel the cells' bf16 attention runs on ``device`` (``"auto"``'s choice
    on this machine: ``upipe.kernels.machine_auto_kernel``; ``sdpa`` off CUDA)."""
    if device.type != "cuda":
        return "sdpa"
    return machine_auto_kernel(torch.cuda.current_device(), torch.bfloat16, head_dim)


def with_kernel(cell, kernel: str):
    """``cell`` with its attention kernel named (``"auto"``: unchanged)."""
    return cell if kernel == "auto" else dataclasses.replace(cell, kernel=kernel)


def shipped_profile(device: torch.device, small: bool) -> dict:
    """{"shipped": the shipped profile of this GPU} (``calibrate.DATASHEETS``; {} for a GPU
    without one); ``small``, the CPU smoke test: the ``h200`` profile."""
    name = torch.cuda.get_device_name() if device.type == "cuda" else None
    if DATASHEETS.get(name) or small:
        return {"shipped": load_profile(DATASHEETS.get(name, "h200"))}
    return {}


def validate_gpu(out: Path, *, quick: bool = False, small: bool = False,
                 progress: bool = True) -> dict:
    """The validation of the module's docstring into ``out / FOLDER``; its summary. ``small``:
    the CPU smoke test (tests only): ``gpu_costs.cell_of``'s sizes, measured on the CPU and
    priced on the shipped ``h200`` profile, no calibration."""
    if not torch.cuda.is_available() and not small:
        raise NoGPU("validate-time --device cuda needs a CUDA GPU, and torch sees none here "
                    "(torch.cuda.is_available() is False); validate-time without --device "
                    "runs the CPU validation")
    t0 = time.monotonic()
    folder = out / FOLDER
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    profiles = shipped_profile(device, small)
    calibration_error = None
    if device.type == "cuda":
        try:  # fp32 too: the chunked loss's logits products run in fp32
            write_profile(calibrate(nproc=1, device="cuda", quick=quick), folder / "profile.json")
            profiles["calibrated"] = load_profile(str(folder / "profile.json"))
        except Exception as e:  # noqa: BLE001 -- the cells are still measured and priced
            calibration_error = f"{type(e).__name__}: {e}"[:1000]
            print(f"calibration failed: {calibration_error}", file=sys.stderr)
    rows = []
    kernel = None
    for method, nproc, seq_len, extra, _ in STEP_CELLS:
        cell, ident = cell_of(method, nproc, seq_len, extra, small=small)
        kernel = kernel or kernel_run(device, cell.validate().head_dim)
        cell = with_kernel(cell, kernel)
        row, _, _ = measure_steps(cell, device, ITERS if seq_len < 2**19 else 1)
        row = ident | {"kernel": kernel, "cell_id": cell.cell_id()} | row
        if row["status"] == Status.OK:
            try:
                row |= predict(cell, profiles)
            except Exception as e:  # noqa: BLE001 -- the measurement stays; the row says why
                row["error"] = f"prediction failed: {type(e).__name__}: {e}"[:400]
        for p in profiles:
            if f"predicted_s_{p}" in row:
                row[f"error_{p}"] = row[f"predicted_s_{p}"] / row["step_s"] - 1
        rows.append(row)
        if progress:
            print({k: v for k, v in row.items() if k != "times"}, file=sys.stderr, flush=True)
        write_text(folder / "rows.csv", pd.DataFrame(rows).to_csv(index=False,
                                                                 float_format="%.6g"))
    summary = _write_summary(folder, pd.DataFrame(rows), list(profiles))
    write_json(folder / "env.json", {
        "command": "upipe-bench validate-time --device cuda" + (" --quick" if quick else ""),
        "profiles": {p: prof.path for p, prof in profiles.items()},
        "calibration_error": calibration_error,
        "wall_s": round(time.monotonic() - t0, 1), **provenance()})
    return summary


def _write_summary(folder: Path, table: pd.DataFrame, profiles: list[str]) -> dict:
    """summary.json and the error plot of ``table``'s predictions on ``profiles``."""
    summary = summarize_gpu_validation(table, profiles)
    write_json(folder / "summary.json", summary)
    if any(f"error_{p}" in table for p in profiles):
        plot_gpu_validation(table, profiles, folder / "predicted_vs_measured.png")
    return summary


def reprice(folder: Path, more: dict[str, Path] | None = None, *, kernel: str | None = None,
            progress: bool = True) -> dict:
    """Price a finished run's measured cells (``folder``: its rows.csv, env.json and
    profile.json) again: on the shipped profile of the run's GPU as it stands now, on the run's
    own calibration and on each of ``more`` (name -> profile JSON). Each ``STEP_CELLS`` cell is
    emulated exactly as ``validate_gpu`` does and matched to its row by cell id; the measured
    columns are kept. Rewrites rows.csv, summary.json and the plot; env.json gains
    ``repriced`` (the revision, date and profiles). Each cell is emulated with the kernel of
    its row's ``kernel`` column; a run from before that column needs ``kernel``, the kernel its
    cells ran (``"auto"`` was then resolved on the h100-sxm profile, whatever the GPU), which
    then fills the column. Returns the summary. ValueError when ``folder`` holds no finished
    run, or a run without the column is given no ``kernel``."""
    missing = [f for f in ("rows.csv", "env.json") if not (folder / f).is_file()]
    if missing:
        raise ValueError(f"{folder} holds no finished GPU run to price again (no "
                         f"{' or '.join(missing)}): run validate-time --device cuda there first")
    rows = pd.read_csv(folder / "rows.csv")
    if "kernel" not in rows:
        if kernel is None:
            raise ValueError(f"{folder / 'rows.csv'} has no kernel column (a run before it): "
                             "name the attention kernel its cells ran with --kernel (its "
                             "env.json's GPU and date tell which; results/time_validation_gpu "
                             "ran cudnn, results/time_validation_gpu_sdpa sdpa)")
        # the cell ids of such rows are the "auto" cells'
        rows.insert(int(rows.columns.get_loc("cell_id")), "kernel", check_kernel(kernel))
    env = json.loads((folder / "env.json").read_text())
    profiles = {}
    shipped = DATASHEETS.get(env.get("gpu_name"))
    if shipped:
        profiles["shipped"] = load_profile(shipped)
    if (folder / "profile.json").is_file():
        profiles["calibrated"] = load_profile(str(folder / "profile.json"))
    for name, path in (more or {}).items():
        profiles[name] = load_profile(str(path))
    stale = [c for c in rows.columns if c.startswith(("predicted_s_", "error_"))]
    rows = rows.drop(columns=stale + ["emulated_peak_bytes"], errors="ignore")
    by_id = {}  # each declared cell under its id with each kernel of the rows, and "auto"
    for method, nproc, seq_len, extra, _ in STEP_CELLS:
        cell, _ = cell_of(method, nproc, seq_len, extra)
        for k in {"auto", *rows["kernel"].dropna()}:
            by_id[with_kernel(cell, k).cell_id()] = cell
    out = []
    for row in rows.to_dict("records"):
        cell = by_id.get(row["cell_id"])
        if cell is not None:
            cell = with_kernel(cell, row["kernel"])
        if cell is not None and row["status"] == Status.OK:
            row |= predict(cell, profiles)
            for p in profiles:
                row[f"error_{p}"] = row[f"predicted_s_{p}"] / row["step_s"] - 1
        elif cell is None:
            row["error"] = "not repriced: no such cell in gpu_costs.STEP_CELLS"
        out.append(row)
        if progress:
            print({k: row.get(k) for k in ("cell_id", *(f"error_{p}" for p in profiles))},
                  file=sys.stderr, flush=True)
    table = pd.DataFrame(out)
    write_text(folder / "rows.csv", table.to_csv(index=False, float_format="%.6g"))
    summary = _write_summary(folder, table, list(profiles))
    env["repriced"] = {"profiles": {p: prof.path for p, prof in profiles.items()},
                       **{k: v for k, v in provenance().items()
                          if k in ("git_rev", "date_utc", "torch_version")}}
    write_json(folder / "env.json", env)
    return summary
