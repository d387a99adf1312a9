"""Measure a hardware profile on this machine: ``upipe-bench calibrate``
(docs/design.md#the-time-model).

``calibrate(nproc=2)`` spawns ``nproc`` ranks as a launched cell does (gloo on CPU, NCCL with one
GPU per rank on CUDA) and times on every rank at once, as the ranks of a real job share the
machine, what the time model (``time_model``) prices:

- matmul rates per dtype, of (M x x) @ (x x x) products over a grid of x;
- attention rates per kernel, dtype, head dim, pass and length, through
  ``upipe.kernels.attention_forward`` / ``attention_backward`` (the functions the methods call),
  FLOPs counted by ``profile.attention_flops``;
- memory bandwidth, kernel launch overhead and host<->device copies;
- all-to-all, all-gather, reduce-scatter, all-reduce and p2p at several sizes, fitted to
  time = latency + bus bytes / bus bandwidth (nccl-tests' PERFORMANCE.md).

It returns the profile's JSON object (schema: ``profile.py``) with every number a constant whose
source names the host, the device, torch, the date and what was timed; ``write_profile`` writes
it where ``load_profile(path)`` reads it. With one rank (CUDA only) the collectives come from a
shipped profile, their sources saying so. A single node has no inter-node links: the ``inter``
scope is taken from ``base`` when given, else copied from the intra-node fit, and says so.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from experiments.config import PROCESS_GROUP_TIMEOUT_S, format_size
from experiments.harness import ranks
from experiments.provenance import provenance
from experiments.store import write_json
from experiments.timing.calibrate_comm import (
    CALLS,
    bus_factor,
    fit_latency_bandwidth,
    measure_collectives,
)
from experiments.timing.profile import (
    HOST_COPIES,
    WARM_COPY,
    attention_flops,
    load_profile,
    shipped_profiles,
)
from upipe.kernels import (
    attention_backward,
    attention_forward,
    kernel_unavailable_reason,
)
from upipe.stack.offload import copy_to_host

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TIMEOUT_S = 1800.0  # a whole calibration's wall-clock limit; its ranks are killed past it
BASE_ON_CUDA = "h100-sxm"  # one GPU measures no collectives: they come from its shipped
# profile (``DATASHEETS``), else from this one
# torch.cuda.get_device_name() -> the shipped profile holding that GPU's datasheet peaks (exact
# names: an "NVIDIA H100 PCIe" or "NVIDIA H200 NVL" has other peaks)
DATASHEETS = {"NVIDIA H100 80GB HBM3": "h100-sxm", "NVIDIA H200": "h200",
              "NVIDIA A100-SXM4-80GB": "a100-80gb"}
HALF_ONLY = {"flash-attn", "fa3", "cudnn"}  # kernels without an fp32 path


@dataclass(frozen=True)
class Grid:
    """What one calibration times, and how often."""

    matmul_x: tuple[int, ...]
    """x of the (M x x) @ (x x x) products (the table's key is (M x x)^(1/3))"""
    matmul_m: int
    """M is max(matmul_m, x): a token count, as in a layer's projections"""
    head_dims: tuple[int, ...]
    """attention head dims"""
    seqs: tuple[int, ...]
    """attention lengths (S_q = S_k)"""
    repeats: int
    """timed repeats per point at most; their median is the point's time"""
    budget_s: float
    """fewer repeats for long calls: about this long per point (one repeat at least: after the
    untimed first call, a timed call longer than half of it is the point's only sample)"""
    min_s: float
    """a timed repeat loops a short op at least this long (timer and synchronisation cost)"""
    stream_bytes: int
    """size of the copies timed for memory bandwidth and host copies"""
    comm_bytes: tuple[int, ...]
    """collective payloads per rank (nccl-tests' "size")"""
    heads: tuple[int, ...] = ()
    """query heads per timed attention call (B = 1); empty: ``attention_heads`` (one count)"""
    max_head_tokens: int = 0
    """attention points with heads x S^2 above this are skipped (their time); 0: none"""
    narrow_widths: tuple[int, ...] = ()
    """widths w of the narrow products: (M x K) @ (K x w) ("out") and (M x w) @ (w x K)
    ("inner"), M = narrow_m, K = narrow_k; empty: not measured"""
    narrow_m: int = 0
    narrow_k: int = 0
    gqa_groups: tuple[int, ...] = ()
    """query heads per K/V head timed (causal passes, head counts of ``heads`` divisible by
    it) for the kernels of ``gqa_kernels``; empty: not measured"""
    gqa_kernels: tuple[str, ...] = ()
    """the kernels timed by GQA group: those that take fewer K/V heads than query heads and
    share each K/V head's tiles among its query heads (upipe.kernels: sdpa and math repeat K/V
    before their call, so their rate is the equal-heads one)"""


def _pow2(lo: int, hi: int, step: int = 1) -> tuple[int, ...]:
    return tuple(2**i for i in range(lo, hi + 1, step))


_NATIVE_GQA = ("cudnn", "flash-attn", "fa3")  # the kernels sharing K/V natively
GRIDS = {  # (device, quick) -> Grid; quick: for tests (seconds on 2 CPU cores)
    ("cpu", False): Grid(_pow2(4, 11), 2048, (16, 32, 64, 128), _pow2(8, 12), 5, 0.6, 2e-3,
                         256 << 20, _pow2(12, 26, 2)),
    ("cpu", True): Grid((16, 64, 256), 256, (32,), (128, 256, 512), 3, 0.05, 1e-3,
                        8 << 20, (1 << 12, 1 << 16, 1 << 20)),
    # CUDA: attention to 128K tokens and by heads per call (one head at short lengths leaves
    # SMs idle: 211 vs 343 TFLOP/s forward at 32K on an H200, results/gpu_costs_h200), and the
    # narrow products of a stage's few heads (n = 128: 456 TFLOP/s)
    # and grouped-query calls by group (cuDNN on an H200 runs them at the equal-heads rate within
    # 1% in the median, docs/gpu.md#grouped-query-attention-on-cudnn; measured, not assumed,
    # for other GPUs and kernels)
    ("cuda", False): Grid(_pow2(6, 13), 4096, (64, 128), _pow2(10, 17), 10, 0.5, 5e-3,
                          1 << 30, _pow2(16, 30, 2), (1, 2, 4, 8, 16), 64 * 2**30,
                          (128, 256, 512, 1024), 32768, 4096, (2, 4, 8), _NATIVE_GQA),
    ("cuda", True): Grid((256, 1024, 4096), 4096, (128,), (4096, 32768, 131072), 3, 0.2,
                         2e-3, 256 << 20, (1 << 16, 1 << 22, 1 << 26), (1, 4, 16),
                         64 * 2**30, (128, 512), 32768, 4096, (4,), _NATIVE_GQA),
}


def attention_heads(device: str, head_dim: int) -> int:
    """Heads per timed attention call (B = 1). CUDA: 2048 / head_dim, the FlashAttention papers'
    benchmark width (arXiv 2205.14135 §4), so that one call fills the SMs; CPU: two (a rank's
    threads are busy at any size)."""
    return max(1, 2048 // head_dim) if device == "cuda" else 2


def attention_kernels(device: str) -> tuple[str, ...]:
    """Kernels timed on ``device``: every one that runs here, math only on CPU (it is the
    reference; on a GPU its (S, S) scores at the long lengths take tens of GiB)."""
    names = ("sdpa", "math") if device == "cpu" else ("sdpa", "cudnn", "flash-attn", "fa3")
    return tuple(k for k in names if kernel_unavailable_reason(k, device) is None)


# --------------------------------------------------------------------------------------------
# timing (on each rank)


def _time(fn: Callable, sync: Callable, grid: Grid) -> float:
    """Median seconds per call of ``fn`` after a warm-up call (the rules of ``Grid``)."""
    def run(n: int) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        return (time.perf_counter() - t0) / n

    # an untimed call first: a shape's first call pays one-off costs (cuBLAS's heuristics and
    # workspace, a kernel's first load), and a call longer than half the budget is its own
    # sample below, so without it a process's first matmul was timed cold
    fn()
    once = run(1)  # sizes the loop
    if 2 * once > grid.budget_s:  # one-off costs are lost in a call this long: it is the sample
        return once
    if once < grid.min_s:  # a short op's first call pays one-off costs: size it on a second
        once = run(1)
    inner = min(100_000, math.ceil(grid.min_s / max(once, 1e-7)))
    n = max(1, min(grid.repeats, int(grid.budget_s / (once * inner))))
    return statistics.median(run(inner) for _ in range(n))


def _measure_compute(grid: Grid, device: torch.device, dtypes, kernels, barrier) -> dict:
    """This rank's rates: {("matmul", dtype, x): FLOP/s, ("attention", kernel, dtype, pass, d,
    s, heads, group): FLOP/s, ("memory_bandwidth",): bytes/s, ("launch_overhead_s",): s,
    ("host_copy", name): bytes/s}. ``barrier`` before each point keeps the ranks timing the
    same thing together."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = {}

    def timed(key, fn, work: float | None) -> None:
        barrier()
        t = _time(fn, sync, grid)
        out[key] = t if work is None else work / t

    for name in dtypes:
        for x in grid.matmul_x:
            m = max(grid.matmul_m, x)
            a = torch.randn(m, x, dtype=DTYPES[name], device=device)
            b = torch.randn(x, x, dtype=DTYPES[name], device=device)
            timed(("matmul", name, x), partial(torch.matmul, a, b), 2.0 * m * x * x)
        _narrow_points(grid, name, device, timed)
    for kernel in kernels:
        for name in dtypes:
            if kernel in HALF_ONLY and name == "fp32":
                continue
            for d in grid.head_dims:
                groups = (1, *grid.gqa_groups) if kernel in grid.gqa_kernels else (1,)
                for h in grid.heads or (attention_heads(device.type, d),):
                    for s in grid.seqs:
                        if grid.max_head_tokens and h * s * s > grid.max_head_tokens:
                            continue
                        for g in (g for g in groups if h % g == 0):
                            _attention_point(kernel, name, d, s, h, device, timed, g)
    x = torch.ones(grid.stream_bytes // 4, device=device)
    y = torch.empty_like(x)
    timed(("memory_bandwidth",), partial(y.copy_, x), 2.0 * grid.stream_bytes)  # read + write
    step, n_ops = _eager_step(device)  # the host's cost per eager op of a training step
    timed(("host_op_s",), step, None)
    out["host_op_s",] /= n_ops
    if device.type == "cpu":  # the host thread runs every op: its eager cost is the floor
        out["launch_overhead_s",] = out["host_op_s",]
    else:  # the GPU's floor per kernel, the host's cost out of it: a CUDA graph's replay
        graph, n_kernels = _tiny_kernels_graph(device)
        timed(("launch_overhead_s",), graph.replay, None)
        out["launch_overhead_s",] /= n_kernels
    if device.type == "cpu":  # no device: a memcpy, the memory-bandwidth copy (bytes copied)
        for copy in (*HOST_COPIES, WARM_COPY):
            out["host_copy", copy] = out["memory_bandwidth",] / 2
    for memory in ("pinned", "pageable") if device.type == "cuda" else ():
        # what the offload's saved-tensor hooks do (upipe.stack.offload): device to host into a
        # host tensor allocated for it (pack), host to device from that tensor (unpack). A new
        # pageable tensor of this size is fresh pages every time (PyTorch's CPU allocator does
        # not cache, and glibc maps blocks over 32 MiB anew), so its copy faults them in every
        # step: 1.8 GB/s device to host on an H200, against 18 into pages already touched
        # (results/gpu_costs_h200/kernels/host_copy.csv, 1 GiB). Pinned tensors come from
        # PyTorch's caching host allocator, so the same allocation is warm.
        pin = memory == "pinned"
        host = torch.zeros(x.shape, pin_memory=pin)
        timed(("host_copy", f"h2d_{memory}"), partial(x.copy_, host, non_blocking=pin),
              grid.stream_bytes)
        timed(("host_copy", f"d2h_{memory}"), partial(copy_to_host, x, pin), grid.stream_bytes)
    if device.type == "cuda":  # into pageable pages already written, as HostStore copies
        # into the accumulators it zeroed (``op_costs._was_written``)
        host = torch.zeros(x.shape)
        timed(("host_copy", WARM_COPY), partial(host.copy_, x), grid.stream_bytes)
    return out


class _OpCount(TorchDispatchMode):
    """Counts the aten ops a function dispatches (as the emulator's ``op_costs`` counts
    kernels: views and allocations excluded)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and not func._opname.startswith("empty"):
            self.n += 1
        return func(*args, **(kwargs or {}))


def _eager_step(device: torch.device) -> tuple[Callable, int]:
    """(a tiny training step, the ops it dispatches): eight 8 x 8 linear + tanh layers with
    autograd, forward and backward. On a CPU every op of a step costs the host thread its eager
    overhead (Python, the dispatcher, autograd's bookkeeping) beside its work; on tensors this
    small the overhead is all there is, so time / ops is the cost per op the time model adds to
    each kernel of a CPU step."""
    x = torch.randn(8, 8, device=device, requires_grad=True)
    ws = [torch.randn(8, 8, device=device, requires_grad=True) for _ in range(8)]

    def step():
        # as a training step's zero_grad(set_to_none=True): every call dispatches the ops
        # counted below (left set, the gradients of later calls were summed by 9 more add_ ops
        # that the count, taken on the first call, did not see: host_op_s 51/42 too high)
        for t in (x, *ws):
            t.grad = None
        y = x
        for w in ws:
            y = torch.tanh(y @ w)
        y.sum().backward()

    with _OpCount() as count:
        step()
    return step, count.n


def _narrow_points(grid: Grid, dtype: str, device, timed) -> None:
    """The narrow products of ``Grid.narrow_widths``: keys ("narrow", side, dtype, w)."""
    m, k = grid.narrow_m, grid.narrow_k
    for w in grid.narrow_widths:
        big = torch.randn(m, k, dtype=DTYPES[dtype], device=device)
        thin = torch.randn(m, w, dtype=DTYPES[dtype], device=device)
        timed(("narrow", "out", dtype, w), partial(
            torch.mm, big, torch.randn(k, w, dtype=DTYPES[dtype], device=device)), 2.0 * m * k * w)
        timed(("narrow", "inner", dtype, w), partial(
            torch.mm, thin, torch.randn(w, k, dtype=DTYPES[dtype], device=device)),
            2.0 * m * k * w)


def _tiny_kernels_graph(device) -> tuple:
    """(a CUDA graph of tiny adds, their count): its replay runs the kernels back to back
    with no host work between them, so time / count is the GPU's own floor per kernel."""
    one = torch.ones(1, device=device)
    out = torch.empty_like(one)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up outside capture, as torch.cuda.graphs asks
        torch.add(one, one, out=out)
    torch.cuda.current_stream(device).wait_stream(side)
    graph, n = torch.cuda.CUDAGraph(), 200
    with torch.cuda.graph(graph):
        for _ in range(n):
            torch.add(one, one, out=out)
    return graph, n


def _attention_point(kernel: str, dtype: str, d: int, s: int, h: int, device, timed,
                     group: int = 1) -> None:
    """Time the four passes of one (kernel, dtype, head dim, length, heads) point; with
    ``group`` > 1, K/V of h / group heads and the causal passes only (a training step's)."""
    q = torch.randn(1, s, h, d, dtype=DTYPES[dtype], device=device)
    k, v = (torch.randn(1, s, h // group, d, dtype=DTYPES[dtype], device=device)
            for _ in range(2))
    for causal in (False, True) if group == 1 else (True,):
        fwd = partial(attention_forward, q, k, v, causal=causal, kernel=kernel)
        out, lse = fwd()
        bwd = partial(attention_backward, torch.randn_like(out), q, k, v, out, lse,
                      causal=causal, kernel=kernel)
        for pass_, fn in (("fwd", fwd), ("bwd", bwd)):
            pass_ += "_causal" if causal else ""
            timed(("attention", kernel, dtype, pass_, d, s, h, group), fn,
                  attention_flops(1, h, s, s, d, pass_))


# --------------------------------------------------------------------------------------------
# ranks


def _rank_main(rank: int, world: int, port: int, threads: int, device: str, dtypes, kernels,
               grid: Grid, results) -> None:
    ranks.enter_rank(threads)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S))
    try:
        dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
        compute = _measure_compute(grid, dev, dtypes, kernels, dist.barrier)
        comm = measure_collectives(grid.comm_bytes, grid.repeats, dev, rank, world)
        every = [None] * world if rank == 0 else None
        dist.gather_object(compute, every, dst=0)
        if rank == 0:
            results.put((every, comm))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    ranks.exit_without_finalizing(0)


def _spawn(world: int, device: str, dtypes, kernels, grid: Grid, threads: int):
    """(every rank's compute rates, the collective timings) from ``world`` spawned ranks."""
    results = mp.get_context("spawn").SimpleQueue()
    args = (world, ranks.free_port(), threads, device, dtypes, kernels, grid, results)
    with ranks.started_ranks(_rank_main, args, world) as pc:
        done, got = ranks.join_draining(pc, time.monotonic() + TIMEOUT_S, results)
        if not done:
            raise TimeoutError(f"calibrate ran past {TIMEOUT_S:.0f} s; its ranks were killed")
    if not got:
        raise RuntimeError("calibrate: rank 0 exited without its measurements")
    return got[0]


# --------------------------------------------------------------------------------------------
# the profile


def _c(value, source: str) -> dict:
    return {"value": value, "source": source}


@dataclass(frozen=True)
class _Sources:
    """Source strings naming this calibration: where, and how points were timed."""

    where: str  # "<host>, <device name>, torch <version>, <date>"
    how: str  # repeats, ranks and threads of the compute points

    def measured(self, what: str, how: str | None = None) -> str:
        return f"measured by upipe-bench calibrate on {self.where}: {what}; {how or self.how}"

    def fact(self, what: str) -> str:
        return f"upipe-bench calibrate on {self.where}: {what}"

    def borrowed(self, const: dict, name: str, why: str) -> dict:
        return _c(const["value"], f"not measured by upipe-bench calibrate on {self.where} "
                                  f"({why}): from profile {name} ({const['source']})")


def _borrow(tree, src: _Sources, name: str, why: str):
    """``tree`` of a profile's raw JSON with each constant's source saying where it came from."""
    if isinstance(tree, dict) and "value" in tree:
        return src.borrowed(tree, name, why)
    return {k: _borrow(v, src, name, why) for k, v in tree.items()}


def _raw_profile(name: str) -> tuple[str, dict]:
    """(name, raw JSON with its sources) of a profile, validated by ``load_profile``."""
    profile = load_profile(name)
    return profile.name, json.loads(Path(profile.path).read_text())


def _compute_fields(rates: dict, src: _Sources, grid: Grid, device: str, dtypes) -> dict:
    tf32 = (f"; TF32 {'on' if torch.backends.cuda.matmul.allow_tf32 else 'off'} for fp32"
            if device == "cuda" else "")
    # keyed as the time model reads the table: the side of the cube of the same work
    side = {x: round((max(grid.matmul_m, x) * x * x) ** (1 / 3)) for x in grid.matmul_x}
    matmul = {name: _c([[side[x], rates["matmul", name, x]] for x in grid.matmul_x],
                       src.measured(f"(M x x) @ (x x x) {name} matmuls, M = max({grid.matmul_m}"
                                    f", x), 2*M*x*x FLOPs, key (M x x)^(1/3){tf32}"))
              for name in dtypes}
    tables: dict = {}
    gqa: dict = {}  # kernel -> dtype -> pass -> head dim -> group -> heads -> [[s, rate]]
    for key, rate in rates.items():
        if key[0] == "attention":
            _, kernel, dtype, pass_, d, s, h, g = key
            by_pass = (tables if g == 1 else gqa).setdefault(kernel, {}).setdefault(dtype, {})
            by_heads = by_pass.setdefault(pass_, {}).setdefault(str(d), {})
            if g > 1:
                by_heads = by_heads.setdefault(str(g), {})
            by_heads.setdefault(str(h), []).append([s, rate])
    for by_dtype in tables.values():  # one head count: one table (heads-independent)
        for by_pass in by_dtype.values():
            for by_dim in by_pass.values():
                for d, by_heads in by_dim.items():
                    if len(by_heads) == 1:
                        by_dim[d] = next(iter(by_heads.values()))
    heads = (f"heads per call {list(grid.heads)} (heads x S^2 <= {grid.max_head_tokens:.3g})"
             if grid.heads else
             "2048 / head_dim heads" if device == "cuda"
             else f"{attention_heads(device, grid.head_dims[0])} heads")
    attention = {kernel: {dtype: {pass_: _c(by_dim, src.measured(
        f"upipe.kernels.attention_forward/attention_backward, kernel {kernel}, {dtype}, "
        f"{pass_}, B = 1, {heads}, S_q = S_k = seq_k, FLOPs by profile.attention_flops"))
        for pass_, by_dim in by_pass.items()} for dtype, by_pass in by_dtype.items()}
        for kernel, by_dtype in tables.items()}
    attention_gqa = {kernel: {dtype: {pass_: _c(by_dim, src.measured(
        f"upipe.kernels.attention_forward/attention_backward, kernel {kernel}, {dtype}, "
        f"{pass_}, B = 1, K/V of heads / group heads, groups {list(grid.gqa_groups)}, {heads}, "
        "S_q = S_k = seq_k, FLOPs by profile.attention_flops"))
        for pass_, by_dim in by_pass.items()} for dtype, by_pass in by_dtype.items()}
        for kernel, by_dtype in gqa.items()}
    size = format_size(grid.stream_bytes) + "B"
    if device == "cpu":
        copy = {c: _c(rates["host_copy", c], src.measured(
            f"no device on CPU: a memcpy between two CPU tensors ({size}, the memory-bandwidth "
            "copy), bytes copied / time, for every direction and host memory"))
            for c in (*HOST_COPIES, WARM_COPY)}
    else:
        copy = {c: _c(rates["host_copy", c], src.measured(
            f"{c}: a {size} copy between a {c.split('_')[1]} host tensor and the GPU as the "
            "offload's hooks make it (device to host into a host tensor allocated for it, host "
            "to device from it), bytes / time")) for c in HOST_COPIES}
        copy[WARM_COPY] = _c(rates["host_copy", WARM_COPY], src.measured(
            f"{WARM_COPY}: a {size} copy from the GPU into a pageable host tensor zeroed "
            "before (its pages written), as upipe.host.HostStore copies into its accumulators, "
            "bytes / time"))
    narrow = {}
    for name in dtypes:
        sides = {side: [[w, rates["narrow", side, name, w]] for w in grid.narrow_widths]
                 for side in ("out", "inner")}
        if grid.narrow_widths:
            narrow[name] = _c(sides, src.measured(
                f"{name} torch.mm of (M x K) @ (K x w) (out) and (M x w) @ (w x K) (inner), M "
                f"= {grid.narrow_m}, K = {grid.narrow_k}, 2 M K w FLOPs"))
    host = _c(rates["host_op_s",], src.measured(
        "a tiny eager training step (eight 8 x 8 linear + tanh layers, forward and backward "
        "with autograd) per aten op it dispatches: the host's cost per op"))
    return {
        "matmul": matmul, "attention": attention, "host_copy": copy, "host_op_s": host,
        **({"matmul_narrow": narrow} if narrow else {}),
        **({"attention_gqa": attention_gqa} if attention_gqa else {}),
        "memory_bandwidth": _c(rates["memory_bandwidth",], src.measured(
            f"Tensor.copy_ of a {size} fp32 tensor, bytes read + written / time")),
        "launch_overhead_s": _c(rates["launch_overhead_s",], src.measured(
            "a tiny eager training step (eight 8 x 8 linear + tanh layers, forward and backward "
            "with autograd) per aten op it dispatches: the host thread's cost per op on a CPU"
            if device == "cpu" else
            "a CUDA graph of 200 torch.add of 1-element tensors, replayed: seconds per kernel "
            "with no host work between them (the GPU's floor)")),
    }


def _peak_flops(matmul: dict, src: _Sources, device: str, device_name: str) -> dict:
    """The datasheet peak where a shipped profile is this GPU's, else the best measured rate."""
    sheet = DATASHEETS.get(device_name) if device == "cuda" else None
    sheet = sheet if sheet in shipped_profiles() else None
    raw = _raw_profile(sheet)[1]["peak_flops"] if sheet else {}
    out = {}
    for dtype, table in matmul.items():
        if dtype in raw:
            out[dtype] = src.borrowed(raw[dtype], sheet, f"the datasheet peak of {device_name}")
        else:
            why = "CPU: no datasheet peak" if device == "cpu" else "no shipped datasheet peak"
            out[dtype] = _c(max(r for _, r in table["value"]), src.measured(
                f"{why}; the best rate of matmul.{dtype} (see its source)"))
    return out


def _collective_fields(comm: dict | None, world: int, backend: str, src: _Sources, grid: Grid,
                       base: tuple[str, dict] | None) -> dict:
    if comm is None:  # one rank: nothing to measure
        name, raw = base
        return _borrow(raw["collectives"], src, name, "one rank: no collectives to time")
    how = (f"median of {grid.repeats} repeats of back-to-back calls, the slowest of the "
           f"{world} ranks' times")
    intra = {}
    for op, pts in comm.items():
        latency, bandwidth, resolved = fit_latency_bandwidth(
            [(b * bus_factor(op, world), t) for b, t in pts])
        points = ", ".join(f"{format_size(b)}B: {t:.3g} s" for b, t in pts)
        unresolved = "" if resolved else (
            "; the times did not grow with size: latency fitted alone, bus bandwidth the least "
            "the points allow (a lower bound: calibrate with larger sizes to measure it)")
        intra[op] = _c({"bus_bandwidth": bandwidth, "latency_s": latency}, src.measured(
            f"{op}: {CALLS[op]}, on {world} {backend} ranks, fp32 payloads per rank ({points}); "
            "time = latency + bus bytes / bus bandwidth fitted by least squares on the relative "
            f"error, bus bytes = {bus_factor(op, world):.3g} x payload (nccl-tests "
            f"PERFORMANCE.md){unresolved}",
            how))
    if base is not None:
        name, raw = base
        inter = _borrow(raw["collectives"]["inter"], src, name, "one node: no inter-node link")
    else:
        inter = {op: _c(c["value"], f"not measured by upipe-bench calibrate (one node: no "
                                    f"inter-node link): a copy of collectives.intra.{op}, "
                                    f"{c['source']}") for op, c in intra.items()}
    return {"intra": intra, "inter": inter}


def _device_fields(device: str, src: _Sources) -> dict:
    if device == "cuda":
        mem = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        return {
            "device": _c("cuda", src.fact("rates timed on the CUDA kernel paths")),
            "side_streams": _c(True, src.fact("CUDA streams: copies and collectives issued on "
                                              "side streams run beside the compute stream")),
            "gpu_mem_gib": _c(mem / 2**30, src.fact("torch.cuda.get_device_properties()."
                                                    "total_memory of GPU 0")),
            # what "auto" picks on an emulated GPU of this profile (kernel_models.auto_on)
            "compute_capability": _c("{}.{}".format(*torch.cuda.get_device_capability()),
                                     src.fact("torch.cuda.get_device_capability() of GPU 0")),
        }
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "device": _c("cpu", src.fact("rates timed on the CPU kernel paths")),
        "side_streams": _c(False, src.fact("CPU ops run on the calling thread; there are no "
                                           "streams")),
        "gpu_mem_gib": _c(mem / 2**30, src.fact("the host's physical memory (sysconf), shared "
                                                "by its ranks")),
    }


def _checked(nproc: int, device: str | None, dtypes) -> str:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda': no CUDA device is available here")
    unknown = sorted(set(dtypes) - set(DTYPES))
    if unknown or not dtypes:
        raise ValueError(f"dtypes must be a non-empty subset of {list(DTYPES)}, got {dtypes!r}")
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    if nproc == 1 and device == "cpu":
        raise ValueError("calibrate on CPU needs nproc >= 2: the collectives are timed between "
                         "gloo ranks on this host, and no shipped profile has CPU collectives")
    if device == "cuda" and nproc > torch.cuda.device_count():
        raise ValueError(f"nproc ({nproc}) must be at most the GPUs here "
                         f"({torch.cuda.device_count()}): one rank per GPU")
    return device


def calibrate(nproc: int = 1, device: str | None = None, dtypes=("fp32", "bf16"),
              quick: bool = False, base: str | None = None) -> dict:
    """A hardware profile (``profile.py``'s JSON object) measured on this machine.

    Args:
        nproc: ranks timed at once (one per GPU on CUDA; gloo ranks sharing the cores on CPU,
            ``threads_per_rank(nproc)`` threads each); collectives are measured among them. One
            rank (CUDA only) takes the collectives from ``base``.
        device: "cuda" or "cpu"; default cuda when available.
        dtypes: names from ``DTYPES`` for the matmul and attention rates.
        quick: a small grid (seconds; for tests).
        base: a shipped profile (name or path) for what one node cannot measure: the inter-node
            collectives, and with one rank all collectives (default: the GPU's shipped profile,
            ``DATASHEETS``, else ``BASE_ON_CUDA``).
    """
    device = _checked(nproc, device, dtypes)
    dtypes = tuple(dtypes)
    if nproc == 1:  # the collectives of this GPU's own shipped profile, where there is one
        base = base or DATASHEETS.get(torch.cuda.get_device_name()) or BASE_ON_CUDA
    base_raw = _raw_profile(base) if base else None  # fails before minutes of timing
    t0, load0 = time.monotonic(), os.getloadavg()[0]
    grid, kernels = GRIDS[device, quick], attention_kernels(device)
    threads = ranks.threads_per_rank(nproc) if nproc > 1 else torch.get_num_threads()
    if nproc == 1:
        dev = torch.device("cuda", torch.cuda.current_device())
        rates, comm = _measure_compute(grid, dev, dtypes, kernels, lambda: None), None
    else:
        every, comm = _spawn(nproc, device, dtypes, kernels, grid, threads)
        rates = {k: statistics.median(r[k] for r in every) for k in every[0]}
    prov = provenance()
    name = prov["gpu_name"] or prov["cpu_model"]
    where = f"{prov['hostname']}, {name}, torch {prov['torch_version']}, {prov['date_utc']}"
    src = _Sources(where, f"median of up to {grid.repeats} repeats after a warm-up call (short "
                          f"ops looped for {grid.min_s * 1e3:g} ms per repeat, calls over "
                          f"{grid.budget_s / 2:g} s timed once); {nproc} rank(s) timing at once, "
                          f"{threads} thread(s) each, median over ranks")
    compute = _compute_fields(rates, src, grid, device, dtypes)
    backend = "nccl" if device == "cuda" else "gloo"
    # load averages flag other work on the machine while it was timed (noise in every rate)
    settings = (f"nproc={nproc} threads_per_rank={threads} quick={quick} dtypes={list(dtypes)} "
                f"kernels={list(kernels)} base={base} wall_s={time.monotonic() - t0:.0f} "
                f"load_avg_1min={load0:.2f}->{os.getloadavg()[0]:.2f}")
    return {
        "name": f"calibrated-{prov['hostname']}",
        "description": f"measured by upipe-bench calibrate on {where} ({nproc} rank(s))",
        **_device_fields(device, src),
        "peak_flops": _peak_flops(compute["matmul"], src, device, name),
        **compute,
        "collectives": _collective_fields(comm, nproc, backend, src, grid, base_raw),
        "provenance": {k: None if v is None else str(v) for k, v in prov.items()}
        | {"calibrate": settings},
    }


def check_profile_path(path) -> None:
    """Raise ValueError (naming the path and the rule) unless ``write_profile`` can write at
    ``path``: a file there, if any, is a regular file, and the nearest folder above it that
    exists is a writable folder (the missing ones are created, as ``store.write_text`` does).
    Checked before ``calibrate`` measures, so that a bad path costs nothing, not the
    measurements."""
    path = Path(path).absolute()
    try:
        if path.is_dir():
            raise ValueError(f"{path} is a directory; give the path of a file to write the "
                             "profile (JSON) to")
        if path.exists() and not path.is_file():
            raise ValueError(f"{path} exists and is not a regular file")
        above = next(p for p in path.parents if p.exists())  # the root exists
    except OSError as e:  # a folder above it this user may not look into
        raise ValueError(f"{path} cannot be written: {e}") from None
    if not above.is_dir():
        raise ValueError(f"{above} is a file, not a directory: a profile cannot be written "
                         "under it")
    if not os.access(above, os.W_OK | os.X_OK):
        raise ValueError(f"{above} is not writable by this user: the profile cannot be "
                         "written there")


def write_profile(profile: dict, path) -> None:
    """Write ``profile`` (from ``calibrate``) as JSON at ``path``, atomically, after checking
    that ``load_profile`` accepts it (a profile that would not load is never written)."""
    with tempfile.TemporaryDirectory() as tmp:
        check = Path(tmp) / "profile.json"
        check.write_text(json.dumps(profile))
        load_profile(str(check))  # a fresh path: never in load_profile's cache
    write_json(Path(path), profile)
