"""What every measured workload shares: the rank's world, step timing and the cross-rank row.

One place for the statistics of docs/design.md#measurement, so a training step (``measure``) and one
attention layer (``attention_layer``) give rows with the same columns, computed the same way:
per step the slowest rank's wall time, its median and p20/p80, tokens/s per GPU from the
median; memory as the fullest rank's.
"""

from __future__ import annotations

import platform
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from experiments.config import Cell, MiB, ModelConfig, Status
from experiments.harness.flops import mfu

Progress = Callable[[str], None]


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without torch.distributed."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gather(obj) -> list:
    """Every rank's ``obj``, in rank order (one all-gather)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def progress_printer(enabled: bool) -> Progress | None:
    """A function that prints a progress line on stderr, on rank 0 only; None when disabled."""
    if not enabled or world()[0] != 0:
        return None
    return lambda text: print(f"  {text}", file=sys.stderr, flush=True)


def timed(step: Callable[[], object], iters: int, device: torch.device,
          progress: Progress | None = None, first: int = 0, total: int = 0) -> list[float]:
    """Run ``step`` ``iters`` times, a barrier before each; this rank's wall times (s).
    ``progress`` gets one line per step, numbered from ``first`` of ``total``."""
    times = []
    for i in range(iters):
        barrier()
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t0)
        if progress is not None:
            progress(f"step {first + i + 1}/{total} (timed): {times[-1]:.2f} s")
    return times


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()})"


def summarise(cell: Cell, cfg: ModelConfig, per_rank: list[dict], device: torch.device,
              flops: float | None) -> dict:
    """Cross-rank figures: the slowest rank per step, the fullest rank's memory.

    ``per_rank``: each rank's ``{"times": [s, ...], <memory key>: bytes, ...}``; ``flops``: the
    model FLOPs of one step over all ranks, every dp replica's sequence (None: not a training
    step, no MFU). Tokens/s per GPU: the dp sequences over the world's GPUs.
    """
    row = {"world_size": len(per_rank), "device": device_name(device),
           "memory_source": "allocator" if device.type == "cuda" else "tracked"}
    for key in per_rank[0]:
        if key != "times":
            row[key] = max(r[key] for r in per_rank)
    # the split of the device peak is the fullest rank's own, so its parts add up to its peak
    # (each part's max over ranks could come from different ranks)
    fullest = max(per_rank, key=lambda r: r["tracked_peak_device_bytes"])
    row.update({k: fullest[k] for k in BREAKDOWN_KEYS})
    if not row.get("unsettled_collectives"):  # a column only where the figure needs the word
        row.pop("unsettled_collectives", None)
    row["peak_device_bytes"] = row.get("allocator_peak_allocated_bytes",
                                       row["tracked_peak_device_bytes"])
    # the line memory plots draw: the GPU's memory, or the CPU budget the cell ran under
    row["device_memory_bytes"] = (
        torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
        else None if cell.budget_mib is None else int(cell.budget_mib * MiB))
    if per_rank[0]["times"]:
        step_s = np.max([r["times"] for r in per_rank], axis=0)
        med = float(np.median(step_s))
        row.update(time_median_s=med, time_p20_s=float(np.percentile(step_s, 20)),
                   time_p80_s=float(np.percentile(step_s, 80)),
                   times_s=[float(t) for t in step_s],
                   tokens_per_s_per_gpu=cell.dp * cell.seq_len / cell.world / med)
        if flops is not None:
            row["model_tflops_per_step"] = flops / 1e12
            if device.type == "cuda":
                row["mfu"] = mfu(flops, med, cell.world, torch.cuda.get_device_name(device),
                                 cell.dtype)
    return row



def reset_device_peaks(device: torch.device) -> None:
    """Before the tracked steps on CUDA: blocks cached while building (the unsharded init,
    FSDP's set-up) would otherwise count in the reserved peak of the steps."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


#: memory_figures' split of the tracked device peak (model + attention + other = the peak)
BREAKDOWN_KEYS = ("peak_model_bytes", "peak_attention_bytes", "peak_other_bytes")


def memory_figures(tracker, device: torch.device) -> dict:
    """This rank's memory columns from a ``MemoryTracker`` that ran the tracked steps (and, on
    CUDA, the allocator's peaks since ``reset_device_peaks``)."""
    breakdown = dict(tracker.breakdown_at_peak)
    mem = {
        "tracked_peak_device_bytes": tracker.peak_device_bytes,
        "peak_host_bytes": tracker.peak_host_bytes,
        "peak_model_bytes": breakdown.get("model", 0),
        "peak_attention_bytes": breakdown.get("attention", 0),
        "peak_other_bytes": sum(v for k, v in breakdown.items() if k not in ("model", "attention")),
        # the attention layers' own peak working set, wherever the step's peak is
        "attention_peak_bytes": tracker.peak_by_category.get("attention", 0),
        # collectives whose buffers gloo still held after the tracker's long wait: the tracked
        # peaks may count them (experiments/instruments/memory.py); summarise keeps it if > 0
        "unsettled_collectives": tracker.unsettled_collectives,
    }
    if device.type == "cuda":
        mem["allocator_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        mem["allocator_peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    return mem


def set_device_budget(cell: Cell, device: torch.device) -> None:
    """On CUDA, a ``budget_mib`` is the allocator's limit: a real OOM beyond it."""
    if device.type == "cuda" and cell.budget_mib is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cell.budget_mib * MiB / total), device)


def budget_status(cell: Cell, mem: dict, device: torch.device) -> tuple[str, str]:
    """(status, error) of the tracked steps against a CPU ``budget_mib``, decided on every
    rank's tracked peak with one all-reduce so all ranks agree (and run the same timed steps):
    over the budget is an OOM, the only OOM a CPU run has."""
    if device.type != "cpu" or cell.budget_mib is None:
        return Status.OK, ""
    # int64: a float32 peak rounds (by 64 B at 1000 MiB), and a peak just over the budget
    # read as within it
    peak = torch.tensor([mem["tracked_peak_device_bytes"]], dtype=torch.int64)
    if dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if peak.item() > cell.budget_mib * MiB:
        return Status.OOM, (f"tracked peak {peak.item() / MiB:.1f} MiB > budget_mib "
                            f"{cell.budget_mib} on the fullest rank")
    return Status.OK, ""
