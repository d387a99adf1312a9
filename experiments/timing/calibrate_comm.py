"""The collectives of ``calibrate``, timed between its ranks: all-to-all, all-gather,
reduce-scatter, all-reduce and a ring step of p2p at several payloads, and the fit of time =
latency + bus bytes / bus bandwidth (nccl-tests' PERFORMANCE.md) that the profile records."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist

from experiments.timing.profile import COLLECTIVE_OPS

# torch >= 2.13 names them *_single; earlier versions *_into_tensor / *_tensor (same arguments)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
CALLS = {  # what each op times, for its source
    "all_to_all": "all_to_all_single", "all_gather": f"{_all_gather.__name__} (payload: output)",
    "reduce_scatter": f"{_reduce_scatter.__name__} (payload: input)", "all_reduce": "all_reduce",
    "p2p": "batch_isend_irecv to the next rank and from the previous, a ring step as "
           "upipe/ring.py issues it",
}


def bus_factor(op: str, world: int) -> float:
    """Bus bytes per payload byte (nccl-tests PERFORMANCE.md, the factors of
    ``instruments.collectives._sent``): 2(P-1)/P for an all-reduce, the whole tensor for p2p,
    (P-1)/P for the others."""
    if op == "all_reduce":
        return 2 * (world - 1) / world
    return 1.0 if op == "p2p" else (world - 1) / world


def fit_latency_bandwidth(points: list[tuple[float, float]]) -> tuple[float, float, bool]:
    """(latency s, bandwidth bytes/s, resolved) of time = latency + bytes / bandwidth through
    (bytes, seconds) points, by least squares on the relative error: every size weighs the same
    (plain least squares lets the largest sizes decide, and the latency can come out negative).

    A negative latency is clamped to 0 and the slope refitted through the origin. Times that do
    not grow with size (``resolved`` False: every size is latency-bound, or noise hides the
    transfer) are fitted by the latency alone, and the bandwidth is the least the points allow
    (each point's bytes over its time, the largest of them): a transfer the sizes could not
    resolve is priced no faster than measured, never as free."""
    u = [1 / t for _, t in points]  # residual_i = a * u_i + c * v_i - 1, c = 1 / bandwidth
    v = [b / t for b, t in points]
    suu, svv = sum(x * x for x in u), sum(y * y for y in v)
    suv = sum(x * y for x, y in zip(u, v, strict=True))
    det = suu * svv - suv * suv
    a = (svv * sum(u) - suv * sum(v)) / det if det > 0 else 0.0
    c = (suu * sum(v) - suv * sum(u)) / det if det > 0 else 0.0
    if c <= 0:  # the latency-only least squares: a * u_i ~ 1
        return sum(u) / suu, max(v), False
    if a < 0:
        a, c = 0.0, sum(v) / svv
    return a, 1 / c, True


def _call(op: str, numel: int, device, rank: int, world: int) -> Callable:
    """One call of ``op`` on a payload of ``numel`` fp32 elements (zeros: sums stay finite)."""
    x = torch.zeros(numel, device=device)
    if op == "all_to_all":
        return partial(dist.all_to_all_single, torch.empty_like(x), x)
    if op == "all_gather":  # the payload is the gathered output
        return partial(_all_gather, x, x[: numel // world].clone())
    if op == "reduce_scatter":  # the payload is the input
        return partial(_reduce_scatter, x[: numel // world].clone(), x)
    if op == "all_reduce":
        return partial(dist.all_reduce, x)
    y = torch.empty_like(x)  # p2p: a ring step, send to the next rank and receive from the last

    def p2p():
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, (rank + 1) % world),
                                         dist.P2POp(dist.irecv, y, (rank - 1) % world)]):
            w.wait()
    return p2p


def measure_collectives(sizes: tuple[int, ...], repeats: int, device: torch.device, rank: int,
                        world: int) -> dict:
    """{op: [(payload bytes per rank, seconds per call), ...]}: per size the median over
    repeats of the slowest rank's time (a collective ends when its last rank does), each repeat
    a few back-to-back calls as nccl-tests times them (small calls are too short alone)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = {}
    for op in COLLECTIVE_OPS:
        out[op] = []
        for nbytes in sizes:
            numel = max(world, nbytes // 4 // world * world)
            fn = _call(op, numel, device, rank, world)
            iters = max(1, min(20, (4 << 20) // nbytes))  # the same on every rank
            fn()  # warm-up: connections and buffers
            times = torch.zeros(repeats, dtype=torch.float64, device=device)
            for i in range(repeats):
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                sync()
                times[i] = (time.perf_counter() - t0) / iters
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            out[op].append((4 * numel, statistics.median(times.tolist())))
    return out
