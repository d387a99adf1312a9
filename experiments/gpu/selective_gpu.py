"""Selective recomputation on one real GPU: what each level of the memory stack saves over full
checkpointing, measured beside what the time model predicts
(docs/gpu.md#selective-recomputation-on-a-gpu).

One GPU plays rank 0 of 8 on the ``fake`` process group (real kernels and host copies, no
communication), Llama3-8B shapes with 4 layers, bf16, at 128K and 256K tokens: Ulysses and UPipe
on ``alst`` (full checkpointing: every block's forward runs again in the backward, attention
included), ``alst-attn`` (the attention's outputs kept on the device, so the recomputed forward
skips the attention kernels), ``alst-attn-host`` (kept in pinned host memory, copied back on
a side stream), ``long-attn-host`` (the same on the ``long`` level: UPipe saves its block input
once) and ``alst-block`` (no block checkpointed: nothing recomputed, nothing offloaded). Each
cell is measured as ``gpu_costs.measure_steps`` does (a warm-up step, then the median of two,
the allocator cleaned between cells) and emulated exactly, its step priced
on the GPU's shipped profile without communication (``time_validation_gpu.predict``).

Writes ``<out>/selective_recompute_gpu/``: ``rows.csv`` (measured and predicted step, allocator
and emulated peak per cell), ``speedups.csv`` (each level's speed-up over ``alst`` of the same
method and length, measured and predicted, and their difference), ``env.json``. Nothing is
fitted to the measured steps. Without a CUDA device it says so and exits 2; ``--small`` is the
CPU smoke test (the tiny model, 1/256 of the tokens, priced on ``h200``).

    python -m experiments.gpu selective --out results
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from experiments.config import Status
from experiments.gpu.gpu_costs import cell_of, measure_steps
from experiments.gpu.time_validation_gpu import (
    NoGPU,
    kernel_run,
    predict,
    shipped_profile,
    with_kernel,
)
from experiments.provenance import provenance
from experiments.store import write_json, write_text

FOLDER = "selective_recompute_gpu"
ITERS = 2  # timed steps per cell after a warm-up step
METHODS = ("ulysses", "upipe")
LENGTHS = (2**17, 2**18)
# alst first: the baseline
LEVELS = ("alst", "alst-attn", "alst-attn-host", "long-attn-host", "alst-block")
TARGET = 0.05  # the issue's: each level's measured speed-up within 5% of the emulated one


def speedups(rows: pd.DataFrame) -> pd.DataFrame:
    """Per method, length and level beyond ``alst``: step(alst) / step(level), measured and
    predicted (columns ``measured``, ``predicted``, ``difference`` = predicted / measured - 1);
    a level or baseline that did not run gives no row."""
    ok = rows[rows["status"] == Status.OK]
    out = []
    for (method, seq), group in ok.groupby(["method", "seq_len"], sort=False):
        by_level = group.set_index("stack")
        if "alst" not in by_level.index:
            continue
        base = by_level.loc["alst"]
        for level in LEVELS[1:]:
            if level not in by_level.index:
                continue
            r = by_level.loc[level]
            row = {"method": method, "seq_len": seq, "stack": level,
                   "measured": base["step_s"] / r["step_s"]}
            if "predicted_s_shipped" in by_level and pd.notna(r.get("predicted_s_shipped")):
                row["predicted"] = base["predicted_s_shipped"] / r["predicted_s_shipped"]
                row["difference"] = row["predicted"] / row["measured"] - 1
            out.append(row)
    return pd.DataFrame(out)


def run(out: Path, *, small: bool = False, progress: bool = True) -> pd.DataFrame:
    """The check of the module's docstring into ``out / FOLDER``; its speed-ups."""
    if not torch.cuda.is_available() and not small:
        raise NoGPU("the selective recomputation check needs a CUDA GPU, and torch sees none "
                    "here (torch.cuda.is_available() is False); --small runs the CPU smoke test")
    t0 = time.monotonic()
    folder = out / FOLDER
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    profiles = shipped_profile(device, small)
    rows = []
    for method in METHODS:
        for seq_len in LENGTHS:
            for stack in LEVELS:
                cell, ident = cell_of(method, 8, seq_len, {"stack": stack}, small=small)
                # measured and emulated with the kernel "auto" runs here (time_validation_gpu)
                kernel = kernel_run(device, cell.validate().head_dim)
                cell = with_kernel(cell, kernel)
                row, _, _ = measure_steps(cell, device, ITERS)
                row = ident | {"stack": stack, "kernel": kernel, "cell_id": cell.cell_id()} | row
                if row["status"] == Status.OK:
                    try:
                        row |= predict(cell, profiles)
                    except Exception as e:  # noqa: BLE001 -- the measurement stays
                        row["error"] = f"prediction failed: {type(e).__name__}: {e}"[:400]
                rows.append(row)
                if progress:
                    print({k: v for k, v in row.items() if k != "times"}, file=sys.stderr,
                          flush=True)
                write_text(folder / "rows.csv",  # after every cell: a cut run keeps its rows
                           pd.DataFrame(rows).to_csv(index=False, float_format="%.6g"))
    table = speedups(pd.DataFrame(rows))
    write_text(folder / "speedups.csv", table.to_csv(index=False, float_format="%.6g"))
    write_json(folder / "env.json", {
        "command": "python -m experiments.gpu selective" + (" --small" if small else ""),
        "profiles": {p: prof.path for p, prof in profiles.items()},
        "target_abs_difference": TARGET, "wall_s": round(time.monotonic() - t0, 1),
        **provenance()})
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("results"))
    p.add_argument("--small", action="store_true", help="the CPU smoke test (tiny sizes)")
    args = p.parse_args(argv)
    try:
        table = run(args.out, small=args.small)
    except NoGPU as e:
        print(f"selective: {e}", file=sys.stderr)
        return 2
    print(table.to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
