"""A cell's real run and its exact CPU emulation, each done once per test session.

Several tests hold the same small cell's real gloo run to the emulator's bytes (``equality_cell``:
Ulysses on the tiny preset with three layers, 512 tokens a rank, in tests/test_emulate.py among
every method and in tests/test_ds_fpdt.py as the reference for FPDT's growth with depth); a real
run costs seconds of multi-rank work on 2 cores, so the second test reads the first one's
numbers. Both are deterministic (the tracker settles collectives; the emulator runs no real
kernel).
"""

from __future__ import annotations

from experiments.config import Cell, Hardware
from experiments.emulation.emulate import emulate_cell
from experiments.harness.measure import measure_cell

# the row's memory columns (its fullest rank's), which the emulator reproduces to the byte
KEYS = ("tracked_peak_device_bytes", "peak_host_bytes", "peak_model_bytes",
        "peak_attention_bytes", "peak_other_bytes")

_REAL: dict[Cell, dict] = {}
_EMULATED: dict[Cell, dict] = {}


def equality_cell(method: str, stack: str, options: dict, ranks: int, n_layers: int = 3) -> Cell:
    """A cell of tests/test_emulate.py's ``CASES``: tiny, 512 tokens a rank, fp32, one warm-up
    step and no timed ones."""
    return Cell.from_dict(dict(method=method, model="tiny", seq_len=512 * ranks, nproc=ranks,
                               stack=stack, dtype="fp32", warmup=1, iters=0,
                               overrides=(("n_layers", str(n_layers)),)) | options)


def _real_run(cell_dict: dict) -> dict:
    """One rank of the real gloo run (runs in the DistPool's worker processes)."""
    cell = Cell.from_dict(cell_dict)
    row = measure_cell(cell, cell.validate())
    return {k: row[k] for k in KEYS}


def real_run(dist_pool, cell: Cell) -> dict:
    """``KEYS`` of ``cell``'s row run on the session's ranks (each rank returns the row: every
    figure the max over ranks, as the emulator's is)."""
    if cell not in _REAL:
        _REAL[cell] = dist_pool(cell.world).run(_real_run, cell.to_dict())[0]
    return dict(_REAL[cell])


def emulated_on_cpu(cell: Cell) -> dict:
    """``cell``'s row emulated exactly on a CPU device, memory only (``count=False``: the same
    allocations, a third fewer dispatch layers)."""
    if cell not in _EMULATED:
        _EMULATED[cell] = emulate_cell(cell, Hardware(device="cpu"), exact=True, count=False)
    return dict(_EMULATED[cell])
