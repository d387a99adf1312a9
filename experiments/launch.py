"""Launch one cell in its own process group and turn whatever happens into a row.

``run_cell(cell)`` validates the cell (``invalid`` rows never start a process), spawns
``cell.nproc`` ranks (gloo on CPU; NCCL with one GPU per rank when CUDA is present), runs
``experiments.measure.measure_cell`` on each and returns rank 0's row. A fresh process group per
cell means an OOM leaves no damaged allocator behind (STYLE.md §10). Outcomes:

- ``ok`` (or ``oom`` over a CPU budget, decided by the ranks together);
- ``oom``: a rank raised an out-of-memory error, or was SIGKILLed (the kernel's OOM killer);
- ``timeout``: the cell ran past ``timeout_s``; its ranks are killed;
- ``error``: anything else, with the failing rank's traceback as ``error``;
- ``skipped``: the method cannot run on this machine (its ``unavailable_reason``, e.g. a
  CUDA-only adapter on CPU); nothing is launched.

Under torchrun (``WORLD_SIZE`` set, ``dist`` initialised by the caller) cells run in that one
process group instead, one after another; a cell whose ``nproc`` differs from the world size is
``skipped``. Multi-node runs go through torchrun (DESIGN.md §2).
"""

from __future__ import annotations

import datetime
import os
import queue as queue_mod
import signal
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from experiments.config import Cell, ModelConfig
from experiments.measure import measure_cell
from experiments.provenance import provenance
from upipe.registry import get_method

_OOM_MARKERS = ("out of memory", "OutOfMemoryError", "MemoryError")


def threads_per_rank(nproc: int) -> int:
    """OMP_NUM_THREADS if set, else the cores shared out over the ranks."""
    return int(os.environ.get("OMP_NUM_THREADS", 0)) or max(1, (os.cpu_count() or 1) // nproc)


def describe(cell: Cell, cfg: ModelConfig | None) -> dict:
    """The row's identity and config columns (flat, CSV-friendly)."""
    d = cell.to_dict()
    extra = d.pop("extra")
    d["overrides"] = ";".join(f"{k}={v}" for k, v in cell.overrides)
    d["cell_id"] = cell.cell_id()
    if cfg is not None:
        d |= {f"model_{k}": v for k, v in cfg.__dict__.items()}
    return d | extra


def _rank_main(rank: int, cell: Cell, cfg: ModelConfig, port: int, threads: int, results):
    # Ranks talk on stderr only: the parent's stdout carries its output (``--json``).
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    torch.set_num_threads(threads)
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
        backend = "nccl"
    else:  # DeepSpeed (tiled MLP, ds-ulysses) would probe for accelerators and warn
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=cell.nproc, timeout=datetime.timedelta(hours=2))
    try:
        row = measure_cell(cell, cfg)
        if rank == 0:
            results.put(row | provenance())
        # Tear down together: a rank that destroys its group while a peer's gloo thread still
        # expects bytes from it makes that peer abort ("terminate called without an active
        # exception"), seen in about 1 of 10 short cells without this barrier.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(cell: Cell, cfg: ModelConfig, timeout_s: float | None, threads: int) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    pc = mp.start_processes(_rank_main, (cell, cfg, _free_port(), threads, results),
                            nprocs=cell.nproc, join=False, start_method="spawn")
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while not pc.join(timeout=1.0):
            if deadline is not None and time.monotonic() > deadline:
                for p in pc.processes:
                    if p.is_alive():
                        os.kill(p.pid, signal.SIGKILL)
                return {"status": "timeout", "error": f"cell ran past timeout_s={timeout_s}"}
    except mp.ProcessExitedException as e:  # a rank died without a Python exception
        return {"status": "oom" if e.signal_name == "SIGKILL" else "error", "error": str(e)}
    except mp.ProcessRaisedException as e:  # a rank raised: its traceback is the message
        text = str(e)
        status = "oom" if any(m in text for m in _OOM_MARKERS) else "error"
        return {"status": status, "error": text[-4000:]}
    try:
        return results.get() if not results.empty() else {
            "status": "error", "error": "rank 0 exited without a result"}
    except queue_mod.Empty:
        return {"status": "error", "error": "rank 0 exited without a result"}


def _in_process(cell: Cell, cfg: ModelConfig) -> dict:
    world = dist.get_world_size()
    if world != cell.nproc:
        return {"status": "skipped", "error": f"nproc {cell.nproc} != torchrun world {world}"}
    try:
        return measure_cell(cell, cfg) | provenance()
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {"status": "oom", "error": traceback.format_exc()[-4000:]}
    except Exception:
        return {"status": "error", "error": traceback.format_exc()[-4000:]}


def unavailable_reason(cell: Cell) -> str | None:
    """Why the cell's method cannot run on this machine (e.g. a CUDA-only adapter on a CPU
    machine), or None; decided by the method class before anything is launched."""
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return get_method(cell.method).unavailable_reason(device_type)


def run_cell(cell: Cell, timeout_s: float | None = None) -> dict:
    """Run ``cell`` once; always returns a row (see the module docstring for the statuses),
    with ``mode`` ``measured`` (``experiments.emulate.emulate_cell``'s rows say ``emulated``)."""
    try:
        cfg = cell.validate()
    except ValueError as e:
        return describe(cell, None) | {"status": "invalid", "error": str(e), "mode": "measured"}
    reason = unavailable_reason(cell)
    if reason is not None:  # nothing to launch: a row saying why
        return describe(cell, cfg) | {"status": "skipped", "error": reason, "mode": "measured"}
    torchrun = dist.is_initialized()
    threads = threads_per_rank(cell.nproc)
    t0, load0 = time.monotonic(), os.getloadavg()[0]
    res = _in_process(cell, cfg) if torchrun else _spawn(cell, cfg, timeout_s, threads)
    res.setdefault("error", "")
    # load averages flag other work on the machine during the cell (timing noise)
    return describe(cell, cfg) | res | {
        "mode": "measured", "wall_s": round(time.monotonic() - t0, 2), "load_1m_start": load0,
        "load_1m_end": os.getloadavg()[0], "threads_per_rank": threads,
        "launcher": "torchrun" if torchrun else "spawn"}
