"""Kernel ``cudnn`` against ``sdpa`` in a whole training step, on one GPU.

    python -m experiments.gpu.kernels_gpu --out results/kernels_gpu [--quick]

For each method in ``METHODS`` (``--quick``: ``QUICK_METHODS``) one Llama3-8B-shaped step (4
layers, bf16, the ALST stack: ``gpu_costs.cell_of`` of ``STEP_CELLS``' 8-rank entry, its options
too) at 128K tokens on 8 ranks (``--quick``: 32K), with the attention kernel ``cudnn`` (PyTorch's
cuDNN attention ops) and with ``sdpa`` (PyTorch's flash kernel), each cell as rank 0 of its 8 on
the ``fake`` process group (real kernels and host copies, no communication), a warm-up step then
``ITERS`` timed ones, the allocator cleaned before each cell (``gpu_costs.measure_steps``).
Written under ``--out``:

- ``rows.csv``: one row per cell (method, seq_len, nproc, kernel, status, step seconds, allocator
  peak, error): a cell that fails, runs out of memory or whose kernel cannot run here is a row
  with its status and error, and the other cells go on; rewritten after every cell, so a run cut
  short keeps what it measured;
- ``speedup.csv``: per method, ``sdpa_step_s / cudnn_step_s`` and whether it reaches ``TARGET``
  (the issue's 1.25x);
- ``env.json``: the command, the GPU, its compute capability, cuDNN's version and the provenance;
- ``README.md``: the table and what it shows, generated from the numbers.

Without a CUDA GPU it says why and exits 2; otherwise it exits 0 when every cell ran, 1 when one
did not (its row says why). ``--small`` is the CPU smoke test (tests only): ``cell_of``'s tiny
sizes on the CPU, with ``--kernels`` naming kernels the CPU runs (e.g. ``sdpa,math``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from experiments.config import Status
from experiments.gpu.gpu_costs import STEP_CELLS, cell_of, measure_steps
from experiments.provenance import provenance
from experiments.store import write_json, write_text
from upipe.kernels import kernel_unavailable_reason

METHODS = ("ulysses", "upipe", "zigzag-ring", "usp", "fpdt", "ds-ulysses")
QUICK_METHODS = ("ulysses", "upipe", "zigzag-ring")
NPROC = 8
SEQ_LEN, QUICK_SEQ_LEN = 2**17, 2**15
KERNELS = ("cudnn", "sdpa")  # (the kernel measured, the baseline it is compared with)
TARGET = 1.25  # the issue's: a step with cuDNN's attention at least 1.25x as fast as with sdpa
ITERS = 2  # timed steps per cell, after one warm-up step
COLUMNS = ("method", "nproc", "seq_len", "extra", "kernel", "status", "step_s",
           "allocator_peak_bytes", "error")


class NoGPU(RuntimeError):
    """No CUDA device: the comparison cannot run here."""


def _extra(method: str) -> dict:
    """The method's options in ``STEP_CELLS``' 8-rank 128K entry (fpdt's chunk, usp's ring
    degree); none for a method without one."""
    for m, nproc, seq_len, extra, _ in STEP_CELLS:
        if (m, nproc, seq_len) == (method, NPROC, SEQ_LEN):
            return dict(extra)
    return {}


def _status(row: dict) -> str:
    """``measure_steps``' status, ``oom`` for an allocator's out-of-memory error."""
    if row.get("status") == Status.ERROR and "OutOfMemoryError" in str(row.get("error", "")):
        return Status.OOM
    return row.get("status", Status.ERROR)


def measure_cell(method: str, seq_len: int, kernel: str, device: torch.device,
                 small: bool) -> dict:
    """One row: the cell's identity, then ``measure_steps``' figures, or its status and error
    (also when the cell cannot be built, or its kernel cannot run here: ``skipped``)."""
    ident = {"method": method, "nproc": NPROC, "seq_len": seq_len, "extra": "",
             "kernel": kernel}
    try:
        cell, ident0 = cell_of(method, NPROC, seq_len, _extra(method), small=small)
        cell = dataclasses.replace(cell, kernel=kernel)
        ident |= {k: ident0[k] for k in ("seq_len", "extra")} | {"cell_id": cell.cell_id()}
        cfg = cell.validate()
        reason = kernel_unavailable_reason(kernel, device.type, cell.dtype, cfg.head_dim)
        if reason is not None:
            return ident | {"status": Status.SKIPPED, "error": reason}
        row, _, _ = measure_steps(cell, device, ITERS)
    except Exception as e:  # noqa: BLE001 -- a failed cell is a row; the others go on
        row = {"status": Status.ERROR, "error": f"{type(e).__name__}: {e}"[:400]}
    if "times" in row:  # one CSV field
        row["times"] = ";".join(f"{t:.6g}" for t in row["times"])
    return ident | row | {"status": _status(row)}


def rows_table(rows: list[dict]) -> pd.DataFrame:
    """The rows with ``COLUMNS`` first (present even when no row has them), the rest after."""
    table = pd.DataFrame(rows)
    for c in COLUMNS:
        if c not in table:
            table[c] = None
    return table[list(COLUMNS) + [c for c in table.columns if c not in COLUMNS]]


def speedups(table: pd.DataFrame, kernels: tuple[str, str] = KERNELS) -> pd.DataFrame:
    """Per method (and length): both kernels' step seconds and allocator peaks, the speedup
    ``baseline / candidate`` and whether it reaches ``TARGET``; ``note`` says why a ratio is
    missing (a cell not ok)."""
    cand, base = kernels
    out = []
    for (method, nproc, seq_len), g in table.groupby(["method", "nproc", "seq_len"], sort=False):
        rec = {"method": method, "nproc": nproc, "seq_len": seq_len}
        notes = []
        for k in (base, cand):
            r = g[g["kernel"] == k]
            ok = len(r) == 1 and r["status"].iloc[0] == Status.OK
            rec[f"{k}_step_s"] = float(r["step_s"].iloc[0]) if ok else math.nan
            peak = r["allocator_peak_bytes"].iloc[0] if ok else None
            rec[f"{k}_peak_bytes"] = peak if peak is not None and not pd.isna(peak) else math.nan
            if not ok:
                why = (f"{r['status'].iloc[0]}: {r['error'].iloc[0]}" if len(r) == 1
                       else "not measured")
                notes.append(f"{k} {why}")
        rec["speedup"] = rec[f"{base}_step_s"] / rec[f"{cand}_step_s"]
        rec["target"] = TARGET
        rec["meets_target"] = bool(rec["speedup"] >= TARGET)  # NaN: False
        rec["note"] = "; ".join(notes)
        out.append(rec)
    return pd.DataFrame(out)


def _fmt(x, spec: str) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def readme(table: pd.DataFrame, ratios: pd.DataFrame, env: dict,
           kernels: tuple[str, str] = KERNELS) -> str:
    """README.md from the numbers: what ran, the ratio per method against the target, the
    median, and the cells that did not run."""
    cand, base = kernels
    where = (f"one {env['gpu_name']} (compute capability {env['capability']}, cuDNN "
             f"{env['cudnn_version']})" if env.get("gpu_name") else "the CPU at the smoke sizes")
    model = "Llama3-8B-shaped" if env.get("model") == "llama3-8b" else f"{env.get('model')}-model"
    lines = [f"# Kernel `{cand}` against `{base}` in a training step "
             f"(`{env['command']}`)", "",
             f"One run on {where}, torch {env['torch_version']}, {env['date_utc'][:10]}, "
             f"revision {env['git_rev']}, {env['wall_s']} s in all. Each cell is one {model} "
             f"step (4 layers, bf16, ALST) as rank 0 of {NPROC} on the fake process group (real "
             "kernels and host copies, no communication): a warm-up step, then the median of "
             f"{env['iters']} timed ones (`gpu_costs.measure_steps`). `rows.csv` holds every "
             f"cell, `speedup.csv` the ratios; the target is a step {TARGET}x as fast with "
             f"`{cand}` as with `{base}`.",
             "", f"| method | tokens | `{base}` step (s) | `{cand}` step (s) | speedup | "
             f"≥ {TARGET} | `{base}` peak (GiB) | `{cand}` peak (GiB) |",
             "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for r in ratios.to_dict("records"):
        met = "yes" if r["meets_target"] else ("no" if not math.isnan(r["speedup"]) else "—")
        lines.append(
            f"| {r['method']} | {r['seq_len']} | {_fmt(r[f'{base}_step_s'], '.3f')} | "
            f"{_fmt(r[f'{cand}_step_s'], '.3f')} | {_fmt(r['speedup'], '.3f')} | {met} | "
            f"{_fmt(r[f'{base}_peak_bytes'] / 2**30, '.2f')} | "
            f"{_fmt(r[f'{cand}_peak_bytes'] / 2**30, '.2f')} |")
    measured = ratios["speedup"].dropna()
    lines.append("")
    if len(measured):
        lines.append(f"{int(ratios['meets_target'].sum())} of {len(ratios)} methods reach "
                     f"{TARGET}x; the speedup ranges from {measured.min():.3f} to "
                     f"{measured.max():.3f}, median {statistics.median(measured):.3f}.")
    else:
        lines.append("No method has both cells measured: no speedup.")
    failed = table[table["status"] != Status.OK]
    if len(failed):
        lines += ["", "Cells that did not run:", ""]
        lines += [f"- {r['method']} with `{r['kernel']}`: {r['status']}: {r['error']}"
                  for r in failed.to_dict("records")]
    return "\n".join(lines) + "\n"


def compare_kernels(out: Path, *, quick: bool = False, small: bool = False,
                    kernels: tuple[str, str] = KERNELS, methods: tuple[str, ...] | None = None,
                    progress: bool = True) -> pd.DataFrame:
    """The comparison of the module's docstring into ``out``; the speedup table. ``kernels``:
    (the kernel measured, the baseline); ``small``: the CPU smoke test (tests only)."""
    if not torch.cuda.is_available() and not small:
        raise NoGPU("kernels_gpu needs a CUDA GPU, and torch sees none here "
                    "(torch.cuda.is_available() is False)")
    t0 = time.monotonic()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    methods = methods or (QUICK_METHODS if quick else METHODS)
    seq_len = QUICK_SEQ_LEN if quick else SEQ_LEN
    env = {"command": "python -m experiments.gpu.kernels_gpu" + (" --quick" if quick else "")
           + (" --small" if small else "") + (f" --kernels {','.join(kernels)}"
                                              if kernels != KERNELS else ""),
           "kernels": list(kernels), "methods": list(methods), "iters": ITERS,
           "model": "tiny" if small else "llama3-8b",
           "capability": (".".join(map(str, torch.cuda.get_device_capability()))
                          if device.type == "cuda" else None),
           "cudnn_version": torch.backends.cudnn.version() if device.type == "cuda" else None,
           **provenance()}
    rows = []
    for method in methods:
        for kernel in kernels:
            rows.append(measure_cell(method, seq_len, kernel, device, small))
            if progress:
                print({k: v for k, v in rows[-1].items() if k != "times"}, file=sys.stderr,
                      flush=True)
            write_text(out / "rows.csv", rows_table(rows).to_csv(index=False,
                                                                 float_format="%.6g"))
    table = rows_table(rows)
    ratios = speedups(table, kernels)
    write_text(out / "speedup.csv", ratios.to_csv(index=False, float_format="%.6g"))
    env["wall_s"] = round(time.monotonic() - t0, 1)
    write_json(out / "env.json", env)
    write_text(out / "README.md", readme(table, ratios, env, kernels))
    return ratios


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK_SEQ_LEN} tokens and {len(QUICK_METHODS)} methods")
    p.add_argument("--small", action="store_true", help="tiny sizes on the CPU (a smoke test)")
    p.add_argument("--kernels", default=",".join(KERNELS), metavar="CANDIDATE,BASELINE",
                   help="the kernel measured and its baseline (default %(default)s)")
    a = p.parse_args(argv)
    kernels = tuple(a.kernels.split(","))
    if len(kernels) != 2:
        p.error(f"--kernels takes two kernel names, got {a.kernels!r}")
    try:
        compare_kernels(a.out, quick=a.quick, small=a.small, kernels=kernels)
    except NoGPU as e:
        print(f"kernels_gpu: {e}", file=sys.stderr)
        return 2
    table = pd.read_csv(a.out / "rows.csv")
    return 0 if (table["status"] == Status.OK).all() else 1


if __name__ == "__main__":
    sys.exit(main())
