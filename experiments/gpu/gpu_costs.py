"""What a training step's kernels cost on a real GPU, beside what the time model prices
(``time_model``; docs/emulation.md#emulated-time-and-the-planner): the measurements the
time model's per-kernel mechanisms rest on.

One process, one GPU; every cell on the ``fake`` process group (one GPU plays rank 0 of P: real
kernels and host copies, no-op collectives), the allocator cleaned between cells as
``gpu_check`` does. Written under ``--out`` (each a CSV unless named):

- ``steps``: step seconds (median of ``--iters`` after a warm-up step), allocator peak and
  counters of ``STEP_CELLS``, Llama3-8B-shaped (4 layers, bf16, ALST): Ulysses and UPipe on one
  rank at 32K with U = 1 .. 32 (32 .. 1 stages: a stage's cost is the slope), every method on
  8 ranks at 128K, and 256K, 512K (``--only-profiled``: the four profiled cells); the profiled
  ones also count PyTorch's host-device synchronisations in one more step;
- ``ops``: for the profiled cells, the GPU time of each aten op by input shapes (one step under
  ``torch.profiler``): what each kind of kernel really costs in the step;
- ``timeline``: per profiled cell, the step's wall time, its kernels' summed time and the time
  the GPU was busy (the union of kernel intervals): the rest is the GPU waiting for the host;
- ``attention``: forward and backward seconds of the flash and cuDNN SDPA kernels (causal, head
  dim 128) by heads, length and, for cuDNN, query heads per K/V head;
- ``matmul``: seconds of the projections' three products (forward, input and weight gradients)
  by tokens and width;
- ``memory``: seconds of copy / add kernels by bytes (the per-kernel floor and the bandwidth);
- ``dispatch``: the host's cost to issue one eager op (with and without autograd) against the
  GPU's time for it;
- ``host_copy``: host<->device copies, pinned and pageable, first touch and warm;
- ``profile_quick.json`` / ``profile_full.json``: ``calibrate`` on this GPU as it stands.

``--merge-into PROFILE`` measures nothing: it writes the profile constants a run's CSVs give
(``profile_constants``: flash and cuDNN attention by heads, narrow-matmul caps, the host's cost
per op) into a profile JSON, as the shipped ``h200`` and ``h100-sxm`` took them.

    python -m experiments.gpu.gpu_costs --out results/gpu_costs   # needs a GPU
    python -m experiments.gpu.gpu_costs --out /tmp/x --small       # CPU smoke test
    python -m experiments.gpu.gpu_costs --out results/gpu_costs_h200/kernels \
        --merge-into experiments/timing/profiles/h200.json --where "..."
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile

from experiments.config import PRESETS, Cell
from experiments.emulation.fake_step import fake_world
from experiments.gpu.loopback import loopback_collectives
from experiments.harness.train import build
from experiments.provenance import provenance
from experiments.store import write_json
from experiments.timing.calibrate import calibrate, write_profile
from experiments.timing.profile import attention_flops
from upipe.kernels import attention_backward, attention_forward

#: (method, ranks, tokens, extra cell fields, profiled): Llama3-8B shapes, 4 layers, bf16, ALST
STEP_CELLS = [
    ("ulysses", 1, 2**15, {}, True), ("upipe", 1, 2**15, {"heads_per_stage": 1}, True),
    ("ulysses", 8, 2**17, {}, True), ("upipe", 8, 2**17, {}, True),
    ("upipe", 1, 2**15, {"heads_per_stage": 2}, False),
    ("upipe", 1, 2**15, {"heads_per_stage": 4}, False),
    ("upipe", 1, 2**15, {"heads_per_stage": 8}, False),
    ("upipe", 1, 2**15, {"heads_per_stage": 32}, False),
    ("upipe", 8, 2**17, {"heads_per_stage": 16}, False),
    # profiled: at 128K with cuDNN one stage (Ulysses' kernels) took 83 ms more than Ulysses'
    # 1.203 s, U = C 112 ms, the overlapped stages 18 ms (results/time_validation_gpu, on
    # unwritten all-to-all outputs: torch 2.11's fake backend; experiments/gpu/loopback.py)
    ("upipe", 8, 2**17, {"heads_per_stage": 32}, True),
    ("upipe", 8, 2**17, {"overlap": True}, True),
    ("zigzag-ring", 8, 2**17, {}, False), ("fpdt", 8, 2**17, {"chunk_size": 2**15}, False),
    ("usp", 8, 2**17, {"ring_degree": 2}, False), ("ds-ulysses", 8, 2**17, {}, False),
    ("ulysses", 8, 2**18, {}, False), ("upipe", 8, 2**18, {}, False),
    ("upipe", 8, 2**19, {"stack": "long", "chunk_size": 2**16}, False),
]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _clean(device: torch.device) -> None:
    """Collect earlier cells' tensors and hand the cached blocks back (``gpu_check``'s rule)."""
    gc.collect()
    if device.type == "cuda":
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()


def bench(fn: Callable, device: torch.device, reps: int = 5, min_s: float = 2e-3) -> float:
    """Median seconds per call of ``fn`` after two warm-up calls; calls shorter than ``min_s``
    are looped inside one timed repeat (the timer's and the synchronisation's cost)."""
    fn()
    fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    once = time.perf_counter() - t0
    inner = max(1, min(10_000, int(min_s / max(once, 1e-7))))
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device)
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


# -- steps -------------------------------------------------------------------------------------


def _cell(method, nproc, seq_len, extra, n_layers: int, model: str) -> Cell:
    # extra: cell fields and the method's options side by side (Cell.from_dict)
    return Cell.from_dict(dict(method=method, model=model, nproc=nproc, seq_len=seq_len,
                               dtype="bf16", overrides=(("n_layers", str(n_layers)),), warmup=1,
                               iters=0) | extra)


def _busy(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _alloc_stats(device) -> dict:
    """The caching allocator's counters that a step can move: cudaMalloc / cudaFree calls (each
    cudaFree synchronises the device) and retries after a failed allocation."""
    if device.type != "cuda":
        return {}
    st = torch.cuda.memory_stats()
    return {k: st.get(k, 0) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries",
                                      "num_sync_all_streams")}


def _kernel_kind(name: str) -> str:
    """A CUDA kernel's kind by its name: matmul (cuBLAS / CUTLASS GEMMs), attention (flash and
    cuDNN SDPA), copy (host<->device and device memcpy), else memory (elementwise, reductions)."""
    n = name.lower()
    if "memcpy" in n or "memset" in n:
        return "copy"
    if "flash" in n or "fmha" in n or "cudnn" in n or "attention" in n:
        return "attention"
    if "gemm" in n or "nvjet" in n or "cutlass" in n or "xmma" in n or "sm90_" in n:
        return "matmul"
    return "memory"


def _profiled_step(state, device) -> tuple[dict, list[dict]]:
    """(timeline figures, per-op rows) of one step under torch.profiler."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    with profile(activities=acts, record_shapes=True) as prof:
        t0 = time.perf_counter()
        state.step()
        _sync(device)
        wall = time.perf_counter() - t0
    events = prof.events()
    dev = [e for e in events if e.device_type != torch.autograd.DeviceType.CPU]
    kernels = [(e.time_range.start, e.time_range.end) for e in dev]
    memcpy = sum(e.time_range.elapsed_us() for e in dev if "memcpy" in e.name.lower()
                 or "Memcpy" in e.name)
    by_kind: dict[str, float] = {}
    for e in dev:
        kind = _kernel_kind(e.name)
        by_kind[kind] = by_kind.get(kind, 0.0) + e.time_range.elapsed_us() / 1e6
        by_kind[kind + "_n"] = by_kind.get(kind + "_n", 0) + 1
    timeline = {"profiled_wall_s": wall, "kernels": len(dev), **by_kind,
                "kernel_sum_s": sum(e - s for s, e in kernels) / 1e6,
                "gpu_busy_s": _busy(kernels) / 1e6, "memcpy_s": memcpy / 1e6,
                "cpu_ops": sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CPU)}
    ops = []
    for a in prof.key_averages(group_by_input_shape=True):
        if a.device_type != torch.autograd.DeviceType.CPU:
            continue
        ops.append({"op": a.key, "input_shapes": str(a.input_shapes), "count": a.count,
                    "self_device_s": a.self_device_time_total / 1e6,
                    "self_cpu_s": a.self_cpu_time_total / 1e6})
    return timeline, ops


def _syncs(fn) -> int:
    """Host-device synchronisations while ``fn()`` runs (PyTorch's sync debug mode, which
    warns at each: a copy from pageable memory, ``.item()``, ``nonzero``)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def measure_steps(cell: Cell, device, iters: int, profiled: bool = False
                  ) -> tuple[dict, dict | None, list[dict]]:
    """(row, timeline or None, per-op rows) of ``cell`` on this GPU as rank 0 of its P on the
    ``fake`` process group, its collectives writing their outputs (``loopback``): a warm-up
    step, then ``iters`` timed steps (median; the allocator's peak over them and the warm-up),
    and with ``profiled`` one step under ``torch.profiler`` and one counting host-device
    synchronisations. A failure is a row with status error."""
    row: dict = {}
    timeline, ops = None, []
    _clean(device)
    try:  # the collectives write their outputs: no kernel reads unwritten memory (loopback)
        with fake_world(cell.world), loopback_collectives() as wrapped:
            state = build(cell, cell.validate(), distributed=True, device=device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            state.step()  # warm-up: optimizer states, cuBLAS handles, allocator pools
            times, alloc0 = [], _alloc_stats(device)
            for _ in range(iters):
                _sync(device)
                t0 = time.perf_counter()
                state.step()
                _sync(device)
                times.append(time.perf_counter() - t0)
            alloc = {k: v - alloc0.get(k, 0) for k, v in _alloc_stats(device).items()}
            peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
            row = {"step_s": statistics.median(times), "times": times, "status": "ok",
                   "allocator_peak_bytes": peak, "loopback": ",".join(wrapped)} | alloc
            if profiled:
                timeline, ops = _profiled_step(state, device)
                timeline = {"step_s": row["step_s"]} | timeline
                if device.type == "cuda":
                    row["syncs_per_step"] = _syncs(state.step)
            del state
    except Exception as e:  # noqa: BLE001 -- a failed cell is a row; the others go on
        row = {"status": "error", "error": f"{type(e).__name__}: {e}"[:400]}
    return row, timeline, ops


def cell_of(method: str, nproc: int, seq_len: int, extra: dict, n_layers: int = 4,
            small: bool = False) -> tuple[Cell, dict]:
    """(the cell, its identifying columns) of a ``STEP_CELLS`` entry; ``small``: 1/256 of the
    tokens on the ``tiny`` model (a CPU smoke test), a stage of more heads than it has taking
    them all (one stage, as 32 heads are for Llama3-8B)."""
    if small:
        seq_len //= 256
        cap = {"chunk_size": lambda v: v // 256,
               "heads_per_stage": lambda v: min(v, PRESETS["tiny"].n_heads)}
        extra = {k: cap.get(k, lambda v: v)(v) for k, v in extra.items()}
    cell = _cell(method, nproc, seq_len, extra, n_layers, "tiny" if small else "llama3-8b")
    ident = {"method": method, "nproc": nproc, "seq_len": seq_len,
             "extra": ";".join(f"{k}={v}" for k, v in sorted(extra.items()))}
    return cell, ident


def steps(device, n_layers: int, iters: int, small: bool, save=None,
          only_profiled: bool = False) -> tuple[list, list, list]:
    """``measure_steps`` of every ``STEP_CELLS`` entry (one timed step at 512K tokens), or of
    the profiled ones only."""
    rows, timelines, ops = [], [], []
    for method, nproc, seq_len, extra, profiled in STEP_CELLS:
        if only_profiled and not profiled:
            continue
        cell, ident = cell_of(method, nproc, seq_len, extra, n_layers, small)
        row, timeline, by_op = measure_steps(cell, device, iters if seq_len < 2**19 else 1,
                                             profiled)
        rows.append(ident | row)
        if timeline is not None:
            timelines.append(ident | timeline)
            ops += [ident | r for r in by_op]
        print(rows[-1], flush=True)
        if save is not None:  # after every cell: a run cut short keeps what it measured
            save("steps", rows), save("timeline", timelines), save("ops", ops)
    return rows, timelines, ops


# -- kernels -----------------------------------------------------------------------------------


#: query heads per K/V head timed for the kernels that share K/V natively (cuDNN here): Llama3
#: has 4 (32 / 8), Qwen3-32B 8 (64 / 8); a UPipe stage's one query head per rank has 1
GQA_GROUPS = (2, 4, 8)


def attention(device, small: bool) -> list[dict]:
    """Flash (the project's ``sdpa``, which repeats K/V to every query head before its call) and
    cuDNN (``cudnn``, K/V shared natively), causal, D = 128, B = 1, each through
    ``upipe.kernels``' forward and backward (what the methods call), by query heads per call,
    length and, for cuDNN, query heads per K/V head (``group``: 1, then ``GQA_GROUPS``)."""
    seqs = (256, 512) if small else (4096, 16384, 32768, 65536, 131072)
    heads = (1, 2, 4) if small else (1, 2, 4, 8, 16, 32)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    groups = (1, *GQA_GROUPS) if device.type == "cuda" else (1,)
    rows = []
    for s in seqs:
        for h in heads:
            if h * s * s > 64 * 32768**2:  # keep every point under ~0.3 s
                continue
            for g in groups:
                if h % g:
                    continue
                q, do = (torch.randn(1, s, h, 128, device=device, dtype=dtype) for _ in range(2))
                k, v = (torch.randn(1, s, h // g, 128, device=device, dtype=dtype)
                        for _ in range(2))
                row = {"seq": s, "heads": h, "group": g}
                kernels = (("flash", "sdpa"),) if g == 1 else ()
                if device.type == "cuda":
                    kernels += (("cudnn", "cudnn"),)
                for col, kernel in kernels:
                    try:
                        row |= _attention_times(q, k, v, do, kernel, col, device)
                    except RuntimeError as e:  # a shape the kernel refuses: a row saying so
                        row[f"{col}_error"] = str(e)[:200]
                rows.append(row)
                print(row, flush=True)
                del q, k, v, do
                _clean(device)
    return rows


def _attention_times(q, k, v, do, kernel: str, col: str, device) -> dict:
    """``{col}_fwd_s``, ``{col}_bwd_s``: seconds of ``upipe.kernels``' causal forward and
    backward with ``kernel`` on (B, S, H, D) q and (B, S, H_kv, D) k, v."""
    fwd = partial(attention_forward, q, k, v, causal=True, kernel=kernel)
    out, lse = fwd()
    bwd = partial(attention_backward, do, q, k, v, out, lse, causal=True, kernel=kernel)
    return {f"{col}_fwd_s": bench(fwd, device, 3), f"{col}_bwd_s": bench(bwd, device, 3)}


def matmul(device, small: bool) -> list[dict]:
    """A linear layer's three products, (m x i) @ (i x o) forward, (m x o) @ (o x i) input
    gradient, (o x m) @ (m x i) weight gradient, as nn.Linear runs them (weight (o, i))."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ms = (64, 256) if small else (2048, 4096, 16384, 32768)
    widths = ((64, 16), (64, 64)) if small else (
        (4096, 128), (4096, 256), (4096, 512), (4096, 1024), (4096, 4096), (4096, 14336),
        (14336, 4096), (128, 4096), (512, 4096))
    rows = []
    for m in ms:
        for i, o in widths:
            x = torch.randn(m, i, device=device, dtype=dtype)
            w = torch.randn(o, i, device=device, dtype=dtype)
            dy = torch.randn(m, o, device=device, dtype=dtype)
            rows.append({"m": m, "in": i, "out": o,
                         "fwd_s": bench(partial(torch.mm, x, w.t()), device),
                         "dgrad_s": bench(partial(torch.mm, dy, w), device),
                         "wgrad_s": bench(partial(torch.mm, dy.t(), x), device)})
    return rows


def memory(device, small: bool) -> list[dict]:
    """copy_, add and a conversion to fp32 of contiguous bf16 (fp32 on CPU) tensors by bytes of
    the input. Looped back to back, so a small op's figure is the host's issue cost, not the
    kernel's (``dispatch``)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for p in range(12, 24 if small else 31, 2):
        n = (1 << p) // dtype.itemsize
        a, b = torch.randn(n, device=device, dtype=dtype), torch.randn(n, device=device,
                                                                         dtype=dtype)
        c = torch.empty_like(a)
        rows.append({"bytes": 1 << p, "copy_s": bench(partial(c.copy_, a), device),
                     "add_s": bench(partial(torch.add, a, b, out=c), device),
                     "to_fp32_s": bench(partial(a.to, torch.float32), device)})
    return rows


def dispatch(device) -> list[dict]:
    """The host's issue cost per eager op (host clock, no synchronisation inside the loop)
    against the wall time per op with the GPU's work included."""
    rows = []
    x = torch.ones(1024, device=device)
    w = torch.ones(1024, device=device, requires_grad=True)
    cases = {"add": partial(torch.add, x, x), "add_out": partial(torch.add, x, x, out=x),
             "mul_autograd": partial(torch.mul, x, w),
             "view_transpose": lambda: x.view(32, 32).t()}
    for name, fn in cases.items():
        for _ in range(100):
            fn()
        _sync(device)
        n = 5000
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        issued = time.perf_counter() - t0
        _sync(device)
        total = time.perf_counter() - t0
        rows.append({"op": name, "n": n, "host_issue_s": issued / n, "wall_s": total / n})
    return rows


def host_copies(device) -> list[dict]:
    if device.type != "cuda":
        return []
    rows = []
    for nbytes in (16 << 20, 256 << 20, 1 << 30):
        x = torch.randn(nbytes // 2, device=device, dtype=torch.bfloat16)
        for pinned in (True, False):
            host = torch.empty(x.shape, dtype=x.dtype, pin_memory=pinned)
            _sync(device)
            t0 = time.perf_counter()
            host.copy_(x)  # the first touch of the host pages (pageable: page faults)
            _sync(device)
            first = time.perf_counter() - t0
            rows.append({"bytes": nbytes, "pinned": pinned, "d2h_first_s": first,
                         "d2h_s": bench(partial(host.copy_, x), device, 3, 0),
                         "h2d_s": bench(partial(x.copy_, host), device, 3, 0),
                         "h2d_nonblocking_s": bench(partial(x.copy_, host, non_blocking=True),
                                                    device, 3, 0)})
            del host
        del x
    return rows


# -- the profile's constants from a measurement folder ------------------------------------------


NARROW_MAX = 1024  # the widest "narrow" side: eight heads of 128 (wider runs at the square rate)


def _median_rate(samples: list[float]) -> float:
    return float(statistics.median(samples))


#: attention.csv's (forward, backward) seconds columns per profile kernel, and what they time
ATTENTION_COLUMNS = {
    "sdpa": (("flash_fwd_s", "flash_bwd_s"),
             "upipe.kernels attention_forward / attention_backward, kernel sdpa (PyTorch's flash "
             "backend), bf16, causal, B = 1, head dim 128, by query heads per call and S_q = "
             "S_k"),
    "cudnn": (("cudnn_fwd_s", "cudnn_bwd_s"),
              "upipe.kernels attention_forward / attention_backward, kernel cudnn (PyTorch's "
              "cuDNN attention ops, K/V shared natively), bf16, causal, B = 1, head dim 128, "
              "by query heads per call, query heads per K/V head (group) and S_q = S_k"),
}
#: what an attention.csv without a ``group`` column (the first H200 run) timed as cudnn
CUDNN_BEFORE_GQA = (
    "cudnn_fwd_s / cudnn_bwd_s: PyTorch's cuDNN SDPA backend (F.scaled_dot_product_attention "
    "under sdpa_kernel(SDPBackend.CUDNN_ATTENTION)), bf16, causal, B = 1, head dim 128, q, k "
    "and v with the query heads per call each, by those heads and S_q = S_k; the forward under "
    "torch.no_grad, the backward torch.autograd.grad through a kept forward")


def _attention_constants(att: pd.DataFrame, kernel: str, where: str,
                         group: int = 1) -> dict | None:
    """``attention.<kernel>.bf16.{fwd,bwd}_causal`` by heads (``group`` 1), or its
    ``attention_gqa`` table of one larger ``group``, from attention.csv's columns for ``kernel``
    (rows without a time skipped); None when the run has no such times."""
    cols, how = ATTENTION_COLUMNS[kernel]
    if not set(cols) <= set(att.columns):
        return None
    if "group" in att.columns:
        att = att[att.group == group]
    elif group != 1:
        return None
    else:
        how = CUDNN_BEFORE_GQA if kernel == "cudnn" else how
    tables: dict = {"fwd_causal": {}, "bwd_causal": {}}
    for (h, s), r in att.set_index(["heads", "seq"]).sort_index().iterrows():
        for pass_, col in zip(("fwd_causal", "bwd_causal"), cols, strict=True):
            if pd.isna(r[col]):  # the kernel failed on this shape (<kernel>_error)
                continue
            rate = attention_flops(1, int(h), int(s), int(s), 128, pass_) / r[col]
            tables[pass_].setdefault(str(int(h)), []).append([int(s), float(f"{rate:.4g}")])
    if not all(tables.values()):
        return None
    return {pass_: {"value": {"128": by_heads}, "source": (
        f"measured: {where}, attention.csv{f' (group {group})' if group > 1 else ''}: {how}; "
        "FLOPs by profile.attention_flops; median of 3 timed calls after two warm-ups")}
        for pass_, by_heads in tables.items()}


def _gqa_constants(att: pd.DataFrame, kernel: str, where: str) -> dict | None:
    """``attention_gqa.<kernel>.bf16.{fwd,bwd}_causal``: {"128": {group: by heads}} of every
    group above 1 the run timed, one constant per pass; None when it timed none."""
    groups = sorted(int(g) for g in att.get("group", pd.Series([1])).unique() if g > 1)
    per_group = {g: _attention_constants(att, kernel, where, g) for g in groups}
    per_group = {g: c for g, c in per_group.items() if c is not None}
    if not per_group:
        return None
    _, how = ATTENTION_COLUMNS[kernel]
    return {pass_: {"value": {"128": {str(g): c[pass_]["value"]["128"]
                                      for g, c in per_group.items()}},
                    "source": (f"measured: {where}, attention.csv, groups "
                               f"{', '.join(map(str, per_group))}: {how}; FLOPs by "
                               "profile.attention_flops; median of 3 timed calls after two "
                               "warm-ups")}
            for pass_ in ("fwd_causal", "bwd_causal")}


def profile_constants(folder: Path, where: str) -> dict:
    """The hardware-profile constants (``profile.py``'s schema) that ``kernels/`` of a
    ``gpu_costs`` run measures, of the CSVs the folder holds: from ``attention.csv``,
    ``attention.sdpa.bf16.{fwd,bwd}_causal`` and, when the run timed cuDNN,
    ``attention.cudnn.bf16.{fwd,bwd}_causal`` by heads and ``attention_gqa.cudnn.bf16`` by
    group; from ``matmul.csv`` the bf16 ``matmul_narrow`` caps; from ``dispatch.csv``
    ``host_op_s``. ``where`` names the run in each source."""
    out: dict = {}
    if (folder / "attention.csv").is_file():
        att = pd.read_csv(folder / "attention.csv")
        out["attention_sdpa_bf16"] = _attention_constants(att, "sdpa", where)
        out["attention_cudnn_bf16"] = _attention_constants(att, "cudnn", where)
        out["attention_gqa_cudnn_bf16"] = _gqa_constants(att, "cudnn", where)
    if (folder / "matmul.csv").is_file():
        out["matmul_narrow"] = _narrow_constants(pd.read_csv(folder / "matmul.csv"), where)
    if (folder / "dispatch.csv").is_file():
        disp = pd.read_csv(folder / "dispatch.csv").set_index("op")
        out["host_op_s"] = {
            "value": float(f"{disp.loc['mul_autograd', 'host_issue_s']:.4g}"), "source": (
                f"measured: {where}, dispatch.csv: host seconds to issue one eager op with "
                "autograd (x * w, w requiring grad, 1024 floats), 5000 issued back to back "
                "without synchronising; the op of a training step at the least (module code "
                "adds to it)")}
    return {k: v for k, v in out.items() if v is not None}


def _narrow_constants(mm: pd.DataFrame, where: str) -> dict:
    """The bf16 ``matmul_narrow`` caps of matmul.csv's longest products."""
    rows = mm[mm.m == mm.m.max()]
    out_side: dict = {}
    inner: dict = {}
    for r in rows[(rows.out <= NARROW_MAX) | (rows["in"] <= NARROW_MAX)].itertuples():
        flops = 2.0 * r.m * r._2 * r.out  # in = r._2 (a keyword as a column name)
        if r.out < r._2:  # the output width w is narrow: (m x in) @ (in x w), (w x m) @ (m x in)
            out_side.setdefault(r.out, []).extend([flops / r.fwd_s, flops / r.wgrad_s])
            inner.setdefault(r.out, []).append(flops / r.dgrad_s)  # (m x w) @ (w x in)
        elif r._2 < r.out:  # the input width w is narrow
            inner.setdefault(r._2, []).append(flops / r.fwd_s)  # (m x w) @ (w x out)
            out_side.setdefault(r._2, []).extend([flops / r.dgrad_s, flops / r.wgrad_s])
    return {"bf16": {"value": {
        "out": [[w, float(f"{_median_rate(v):.4g}")] for w, v in sorted(out_side.items())],
        "inner": [[w, float(f"{_median_rate(v):.4g}")] for w, v in sorted(inner.items())]},
        "source": (f"measured: {where}, matmul.csv: bf16 torch.mm of a linear layer's three "
                   f"products at m = {int(rows.m.max())} tokens (forward, input and weight "
                   "gradients), the median rate of the products whose output's narrow side "
                   "(out) or inner dimension (inner) is w wide; 2 m n k FLOPs, median of 5 "
                   "timed repeats after two warm-ups")}}


def merge_into_profile(profile_path: Path, folder: Path, where: str) -> None:
    """Write ``profile_constants(folder)`` (the CSVs the folder holds) into the profile JSON at
    ``profile_path``."""
    raw = json.loads(profile_path.read_text())
    c = profile_constants(folder, where)
    for kernel in ("sdpa", "cudnn"):
        if f"attention_{kernel}_bf16" in c:
            raw["attention"].setdefault(kernel, {}).setdefault("bf16", {}).update(
                c[f"attention_{kernel}_bf16"])
    if "attention_gqa_cudnn_bf16" in c:
        raw.setdefault("attention_gqa", {}).setdefault("cudnn", {})["bf16"] = c[
            "attention_gqa_cudnn_bf16"]
    for field in ("matmul_narrow", "host_op_s"):
        if field in c:
            raw[field] = c[field]
    profile_path.write_text(_profile_json(raw))


def _profile_json(raw: dict) -> str:
    """JSON as the shipped profiles are written: indent 2, each [x, value] pair on one line,
    large numbers in e-notation."""
    text = json.dumps(raw, indent=2)
    text = re.sub(r"\[\s+(-?[\d.e+]+),\s+(-?[\d.e+]+)\s+\]", r"[\1, \2]", text)
    return re.sub(r"\b(\d{7,})\.0\b",
                  lambda m: f"{float(m.group(1)):.6g}".replace("e+", "e"), text) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--small", action="store_true", help="tiny sizes (a CPU smoke test)")
    p.add_argument("--skip", default="", help="comma-separated parts to skip")
    p.add_argument("--only-profiled", action="store_true",
                   help="steps: only the cells that are also profiled")
    p.add_argument("--merge-into", type=Path, metavar="PROFILE",
                   help="no measuring: write the constants of the run in --out (its kernels/ "
                        "folder's CSVs) into this profile JSON")
    p.add_argument("--where", default="",
                   help="with --merge-into: the run the sources name (device, date, folder)")
    args = p.parse_args(argv)
    if args.merge_into is not None:
        present = [f for f in ("attention.csv", "matmul.csv", "dispatch.csv")
                   if (args.out / f).is_file()]
        if not present or not args.merge_into.is_file():
            p.error(f"--merge-into needs the profile JSON ({args.merge_into}) and a run's "
                    f"kernels folder as --out; {args.out} holds none of attention.csv, "
                    "matmul.csv, dispatch.csv"
                    if not present else f"--merge-into: no profile file {args.merge_into}")
        merge_into_profile(args.merge_into, args.out, args.where or str(args.out))
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.small:
        p.error("needs a CUDA device (none present); --small runs a CPU smoke test")
    args.out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    t_start = time.monotonic()

    def save(name: str, rows: list[dict]) -> None:
        pd.DataFrame(rows).to_csv(args.out / f"{name}.csv", index=False)
        print(f"== {name}: {len(rows)} rows, {time.monotonic() - t_start:.0f} s", flush=True)

    parts = {"dispatch": lambda: dispatch(device), "memory": lambda: memory(device, args.small),
             "matmul": lambda: matmul(device, args.small),
             "attention": lambda: attention(device, args.small),
             "host_copy": lambda: host_copies(device)}
    for name, fn in parts.items():
        if name not in skip:
            save(name, fn())
            _clean(device)
    if "steps" not in skip:
        steps(device, args.layers, args.iters, args.small, save, args.only_profiled)
    if "calibrate" not in skip and device.type == "cuda":
        for quick in (True, False):
            _clean(device)
            t0 = time.monotonic()
            prof = calibrate(nproc=1, device="cuda", dtypes=("bf16",), quick=quick, base="h200")
            write_profile(prof, args.out / f"profile_{'quick' if quick else 'full'}.json")
            print(f"== calibrate quick={quick}: {time.monotonic() - t0:.0f} s", flush=True)
    write_json(args.out / "env.json", {
        "command": "python -m experiments.gpu.gpu_costs " + " ".join(
            sys.argv[1:] if argv is None else argv),
        "wall_s": time.monotonic() - t_start, **provenance()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
