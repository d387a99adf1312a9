"""Emulated peak vs the CUDA allocator's peak on a real GPU (docs/design.md#emulation: "on a GPU,
emulated and allocator peaks are compared and the difference reported").

Each cell runs twice in this process, on the ``fake`` process group of its P ranks: once with
real CUDA tensors (collectives are shape-correct no-ops, the memory is real; one GPU plays rank
0 of P) and once emulated (fake tensors, ``Hardware(device="cuda")``, exact, as rank 0 with
the attention kernel the real run's ``"auto"`` picked on this GPU, named). Written to
``<out>/rows.csv`` and ``<out>/env.json``:

    python -m experiments.gpu.gpu_check --out results/emulate_vs_allocator     # needs a GPU
    python -m experiments.gpu.gpu_check --set beyond --out results/emulate_vs_allocator_beyond

Before each real run the previous cell's tensors are collected and the allocator must hold
nothing: a leftover (a reference cycle not yet collected) would inflate the peak.
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import pandas as pd
import torch

from experiments.config import Cell, Hardware, Status
from experiments.emulation.emulate import emulate_cell
from experiments.emulation.fake_step import fake_world
from experiments.gpu.time_validation_gpu import kernel_run, with_kernel
from experiments.harness.measure import measure_cell
from experiments.provenance import provenance
from experiments.store import write_json

#: (method, ranks, tokens, extra cell fields): Llama3-8B shapes with 4 layers, bf16, ALST stack
CELLS = [
    ("upipe", 1, 2**15, {}), ("ulysses", 1, 2**15, {}),
    ("upipe", 8, 2**17, {}), ("ulysses", 8, 2**17, {}), ("zigzag-ring", 8, 2**17, {}),
    ("fpdt", 8, 2**17, {"chunk_size": 2**15}), ("usp", 8, 2**17, {"ring_degree": 2}),
    ("upipe", 8, 2**18, {}), ("ulysses", 8, 2**18, {}),
]
#: UPipe beyond the paper, beside its paper schedule at the same cell: overlapped stages, and the
#: ``long`` level (first block input offloaded, residual FFN tiled in place, fused input norm)
#: with the chunked attention backward (64K-token chunks, 8 per stage at 512K tokens)
BEYOND_CELLS = [
    ("upipe", 8, 2**19, {}), ("upipe", 8, 2**19, {"overlap": True}),
    ("upipe", 8, 2**19, {"stack": "long", "chunk_size": 2**16}),
]
SETS = {"paper": CELLS, "beyond": BEYOND_CELLS}


def _cell(method: str, nproc: int, seq_len: int, extra: dict) -> Cell:
    # extra: cell fields and the method's options side by side (Cell.from_dict)
    return Cell.from_dict(dict(method=method, model="llama3-8b", nproc=nproc, seq_len=seq_len,
                               dtype="bf16", overrides=(("n_layers", "4"),), warmup=1,
                               iters=0) | extra)


def _clean_allocator() -> None:
    """Collect earlier cells' tensors; the allocator must then hold nothing. cuBLAS keeps its
    workspaces (32 MiB per handle on Hopper) in the caching allocator for the process' life:
    they are dropped too, so each real run re-creates (and counts) its own."""
    gc.collect()
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is not None:
        clear_workspaces()
    torch.cuda.empty_cache()
    left = torch.cuda.memory_allocated()
    if left:
        raise RuntimeError(f"{left} bytes still allocated before a measurement")


def compare(cell: Cell) -> dict:
    """One row: the allocator's peaks (allocated, reserved), the tracker's in the same real run,
    and the emulator's, with their ratios."""
    _clean_allocator()
    with fake_world(cell.world):
        real = measure_cell(cell, cell.validate())
    _clean_allocator()
    # like with like: the rank that ran, and the kernel it ran ("auto" would be resolved on
    # the emulated profile's GPU, not this one)
    ran = with_kernel(cell, kernel_run(torch.device("cuda"), cell.validate().head_dim))
    emu = emulate_cell(ran, Hardware(device="cuda"), exact=True, rank=0)
    alloc = real["allocator_peak_allocated_bytes"]
    return {
        "method": cell.method, "nproc": cell.nproc, "seq_len": cell.seq_len,
        "ring_degree": cell.ring_degree, "chunk_size": cell.option("chunk_size"),
        "model": cell.model,
        "overrides": dict(cell.overrides), "dtype": cell.dtype, "stack": cell.stack,
        "status": emu["status"] if real["status"] == Status.OK else real["status"],
        "allocator_peak_allocated_bytes": alloc,
        "allocator_peak_reserved_bytes": real["allocator_peak_reserved_bytes"],
        "tracked_peak_device_bytes_real": real["tracked_peak_device_bytes"],
        "emulated_peak_device_bytes": emu["peak_device_bytes"],
        "emulated_peak_phase": emu.get("peak_phase"),
        "emulated_over_allocated": emu["peak_device_bytes"] / alloc,
        "tracked_over_allocated": real["tracked_peak_device_bytes"] / alloc,
        "reserved_over_allocated": real["allocator_peak_reserved_bytes"] / alloc,
        "device": real["device"], **provenance(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("results/emulate_vs_allocator"))
    p.add_argument("--set", choices=sorted(SETS), default="paper",
                   help="the cells: the paper's methods (default), or UPipe's options beyond "
                        "the paper")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device (none present)")
    rows = []
    for method, nproc, seq_len, extra in SETS[args.set]:
        cell = _cell(method, nproc, seq_len, extra)
        try:
            rows.append(compare(cell))
        except Exception as e:  # a failed cell is a row with its status; the others go on
            rows.append({"method": method, "nproc": nproc, "seq_len": seq_len, **extra,
                         "status": Status.ERROR, "error": f"{type(e).__name__}: {e}"[:500]})
            torch.cuda.empty_cache()
        r = rows[-1]
        print(f"{method:12s} P={nproc} S={seq_len:>7d}: emulated/allocated "
              f"{r.get('emulated_over_allocated', float('nan')):.4f}  tracked/allocated "
              f"{r.get('tracked_over_allocated', float('nan')):.4f}  reserved/allocated "
              f"{r.get('reserved_over_allocated', float('nan')):.3f}  {r['status']}", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(rows).to_csv(args.out / "rows.csv", index=False)
    write_json(args.out / "env.json", {"command": "python -m experiments.gpu.gpu_check "
                                       f"--set {args.set} --out {args.out}", **provenance()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
