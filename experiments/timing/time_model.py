"""The emulated step's duration: work priced on a hardware profile, overlapped as the code runs
it (docs/design.md#the-time-model).

Prices (``profile.Profile``): a matmul takes FLOPs / rate(dtype, (m n k)^(1/3)), the rate
capped where a side is narrow (``matmul_narrow``), or its bytes (A, B and C once) / memory
bandwidth where that is longer, and an accumulating one (C += A @ B) also reads C as
memory-bound work; an attention kernel FLOPs / rate(kernel, dtype, pass, head dim,
key length, heads in the call); a memory-bound kernel bytes / memory bandwidth; every kernel also
occupies its stream for the launch overhead; a collective latency x calls + bus bytes / bus
bandwidth of its op within or across nodes (an all-to-all across nodes: its bytes for other
nodes at the NIC's rate, beside its bytes for this node at NVLink's, the longer of the two:
each GPU has a NIC of its own, and an all-to-all cannot use another's, NVIDIA/nccl-tests
issue #267); a host copy bytes / the PCIe rate of its direction,
pinned or pageable. The host issues a window's ops at ``host_op_s`` each while the GPU runs: a
window takes at least that long (the GPU waits on the host), which the step's overhead
includes. The model assumes no host-device synchronisation inside the step (none in the
methods' code: ``upipe.staging.plan_indices``), so the host's lead carries within a window.

Overlap, per mechanism (``op_costs`` sorts the work by mechanism), on a profile with side
streams (CUDA); without them (a CPU) everything runs one after the other:

- the compute stream runs a window's kernels, its ``blocking`` collectives (the Ulysses and
  UPipe all-to-alls, ``upipe/comm.py``: issued and waited on the compute stream) and its
  ``sync`` copies (the ALST stack's offloaded checkpoints, ``upipe/stack/offload.py``:
  ``copy_`` / ``.to`` on the current stream);
- ring P2P (``upipe/ring.py``: the next block's K/V are sent with ``batch_isend_irecv`` before
  the current block's attention, waited on after it) runs beside the window's attention kernels:
  only what exceeds them is exposed (a ring of P steps has P - 1 transfers beside P kernels, so
  this pools one kernel more than the transfers run beside: optimistic only for a window whose
  transfers exceed its kernels). The backward's dK/dV exchange is waited for before the next
  step's kernel and so is blocking;
- torch's CP ring (``baselines/torch_cp.py``, functional collectives, ``async``): each exchange
  runs beside the kernels issued between it and its wait (its ``cover``, ``op_costs``), on its
  own: the all-gather rotation's one gather of every rank's K/V beside the first step's
  attention only, a per-step exchange beside its step's. Each collective's excess over its
  cover is exposed, not the window's sum over the window's attention as for the ring P2P above
  (whose steps are alike, so the two differ only by the one kernel noted there): a large
  gather beside a short kernel is not hidden by later steps' kernels;
- UPipe's overlapped all-to-alls (``upipe/untied.py``, ``overlap=True``: the next stage's inputs
  are issued before the current stage's attention kernel, the previous stage's outputs waited
  on after it) also run beside the window's attention kernels, which they share with the ring's
  P2P (the two are summed: conservative where they use different links, the ring across nodes
  and the all-to-all inside one). The window's sums stand for the stages': exact when every
  stage's transfers fit under its kernel or none do. A layer's first stage's inputs and last
  stage's outputs have no kernel beside them and run blocking. Contention for the SMs between
  NCCL's kernels and the attention kernel is not modelled;
- ``side`` copies (``upipe/host.py``: FPDT's chunk offload and prefetch on a side stream) run
  beside the window's compute: only what exceeds it is exposed;
- FSDP2 (``torch.distributed.fsdp``, separate all-gather and reduce-scatter streams): a unit's
  all-gather runs beside the window before it in execution order (forward: the CPU issues it
  while the previous block computes; backward: FSDP2's default backward prefetch), its
  reduce-scatter beside the window after it; the first all-gather and last reduce-scatter of a
  stage, and the root unit's, have nothing to hide behind.

The step time is the sum of the windows' compute-stream times plus the exposed FSDP time: the
critical path of the emulated rank, which the emulator picks to be the slowest one
(``critical_rank``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from experiments.timing.op_costs import DTYPE_BYTES, Window
from experiments.timing.profile import Profile


@dataclass(frozen=True)
class WindowTime:
    """Seconds of one window's work by kind, before overlap."""

    matmul: float = 0.0
    attention: float = 0.0
    memory: float = 0.0
    overhead: float = 0.0  # launch overhead of the window's kernels
    host: float = 0.0  # the host's time to issue the window's ops (``Profile.host_op_s``)
    blocking: float = 0.0  # collectives on the compute stream
    p2p: float = 0.0  # ring rotation
    ring_async: float = 0.0  # torch's ring's exchanges
    ring_async_exposed: float = 0.0  # what of them exceeds each one's cover (after overlap)
    overlap: float = 0.0  # UPipe's all-to-alls issued beside the attention kernels
    fsdp_gather: float = 0.0
    fsdp_reduce: float = 0.0
    copy_sync: float = 0.0
    copy_side: float = 0.0

    @property
    def compute(self) -> float:
        return self.matmul + self.attention + self.memory


@dataclass(frozen=True)
class StepTime:
    """The step's critical path and where it goes (seconds); the four parts sum to the step."""

    step_s: float
    compute_s: float  # kernels' work (matmul, attention, memory-bound)
    comm_exposed_s: float  # collectives not hidden behind compute
    offload_exposed_s: float  # host<->device copies not hidden behind compute
    overhead_s: float  # kernel launch overhead and the GPU's waits on the host (``host_wait``)
    detail: dict  # seconds by kind before overlap (matmul, attention, ..., copy_side; host:
    # the host's issue time, host_wait: what of it the GPU waited for)


def _add_comm(t: Counter, ring_async: Counter, call: tuple, seconds: float) -> None:
    """Add a collective's ``seconds`` to its slot of ``t`` (``call``: its mechanism, op and,
    for torch's ring's, its number n, whose seconds go to ``ring_async[n]``)."""
    mechanism, op = call[:2]
    if mechanism == "async":
        ring_async[call[2]] += seconds
        return
    slot = {"p2p": "p2p", "blocking": "blocking", "overlap": "overlap"}.get(mechanism)
    if slot is None:  # fsdp
        slot = "fsdp_gather" if op == "all_gather" else "fsdp_reduce"
    t[slot] += seconds


def price(work: Counter, profile: Profile, pinned: bool) -> WindowTime:
    """The seconds of a window's work (keys of ``op_costs``) on ``profile``; ``pinned``: host
    buffers are pinned (the harness pins up to ``PIN_MAX_TOKENS`` tokens:
    ``upipe.stack.pin_host_memory``)."""
    t: Counter = Counter()
    ring_async: Counter = Counter()  # torch's ring's n-th collective: its seconds, its cover's
    cover: Counter = Counter()
    # cross-node all-to-alls by (mechanism, op[, n]): seconds on NVLink, seconds on the NIC
    node: Counter = Counter()
    nic: Counter = Counter()
    for key, amount in work.items():
        kind = key[0]
        if kind == "matmul":
            _, dtype, (m, n, k) = key
            # a roofline: the product's FLOPs at its rate, or its operands and result moved
            # once through memory, whichever is longer (a product of a stage's one head, n =
            # 128, reads its (m x k) input at memory speed)
            rate = profile.matmul_rate(dtype, m, n, k)  # a dtype without rates fails here
            nbytes = amount / (2.0 * m * n * k) * (m * k + k * n + m * n) * DTYPE_BYTES[dtype]
            t["matmul"] += max(amount / rate, nbytes / profile.memory_bandwidth)
        elif kind == "attention":
            _, kernel, dtype, pass_, d, (s_k, heads, group) = key
            t["attention"] += amount / profile.attention_rate(kernel, dtype, pass_, d, s_k,
                                                              heads, group)
        elif kind == "memory":
            t["memory"] += amount / profile.memory_bandwidth
        elif kind == "kernels":
            t["overhead"] += amount * profile.launch_overhead_s
            t["host"] += amount * profile.host_op_s
        elif kind in ("comm", "comm_calls"):
            mechanism, op, scope = key[1:4]
            call = key[1:3] + key[4:]
            if scope == "node":  # a cross-node all-to-all's bytes for this node, over NVLink
                node[call] += amount / profile.collective(op, "intra")[0]
                continue
            bandwidth, latency = profile.collective(op, scope)
            seconds = amount / bandwidth if kind == "comm" else amount * latency
            if scope == "inter" and op == "all_to_all":
                nic[call] += seconds
            _add_comm(t, ring_async, call, seconds)
        elif kind == "cover":  # the GPU time of the kernels an async collective ran beside
            w = price(Counter({key[2:]: amount}), profile, pinned)
            cover[key[1]] += w.compute + w.overhead
        elif kind == "copy":
            _, mechanism, direction, *flags = key
            rate = profile.host_copy(direction, pinned or "pinned" in flags, "warm" in flags)
            t[f"copy_{mechanism}"] += amount / rate
        else:
            raise ValueError(f"unknown work key {key!r}")
    # a cross-node all-to-all's bytes for this node's peers cross NVLink while the rest cross
    # the NIC: the call takes the longer of the two, so only NVLink's excess adds
    for call, seconds in node.items():
        _add_comm(t, ring_async, call, max(0.0, seconds - nic[call]))
    t["ring_async"] = sum(ring_async.values())
    t["ring_async_exposed"] = sum(max(0.0, s - cover[n]) for n, s in ring_async.items())
    return WindowTime(**t)


def _stream_time(w: WindowTime, overlap: bool) -> tuple[float, float, float, float]:
    """(compute-stream seconds, exposed comm, exposed copies, host-bound seconds) of one
    window, FSDP aside. The host issues the window's ops while the GPU runs earlier ones: the
    window takes at least the host's time (its ops x ``host_op_s``); what that adds beyond the
    GPU's own time is the GPU waiting on the host."""
    if not overlap:
        comm = w.blocking + w.p2p + w.overlap + w.ring_async
        copies = w.copy_sync + w.copy_side
    else:
        comm = w.blocking + max(0.0, w.p2p + w.overlap - w.attention) + w.ring_async_exposed
        copies = w.copy_sync + max(0.0, w.copy_side - (w.compute + w.overhead))
    gpu = w.compute + w.overhead + comm + copies
    waits = max(0.0, w.host - gpu)
    return gpu + waits, comm, copies, waits


def _neighbour(windows, streams, j: int, stage: str) -> float:
    """The compute-stream time of window ``j`` if it is a block of ``stage``, else 0: FSDP2
    overlaps a unit's collectives with the blocks beside it, not with the root's work."""
    if 0 <= j < len(windows) and windows[j][0][0] == stage and windows[j][0][1] is not None:
        return streams[j][0]
    return 0.0


def step_time(windows: list[tuple[Window, WindowTime]], profile: Profile) -> StepTime:
    """Overlap the priced windows (in execution order) by the rules of the module."""
    overlap = profile.side_streams
    streams = [_stream_time(w, overlap) for _, w in windows]
    fsdp = 0.0
    for i, ((stage, block), w) in enumerate(windows):
        if not overlap or block is None:
            fsdp += w.fsdp_gather + w.fsdp_reduce
            continue
        before = _neighbour(windows, streams, i - 1, stage)
        after = _neighbour(windows, streams, i + 1, stage)
        fsdp += max(0.0, w.fsdp_gather - before) + max(0.0, w.fsdp_reduce - after)
    detail: Counter = Counter()
    for _, w in windows:
        for name in WindowTime.__dataclass_fields__:
            if name != "ring_async_exposed":  # the detail is before overlap
                detail[name] += getattr(w, name)
    compute = sum(w.compute for _, w in windows)
    detail["host_wait"] = sum(s[3] for s in streams)
    overhead = sum(w.overhead for _, w in windows) + detail["host_wait"]
    comm = sum(s[1] for s in streams) + fsdp
    copies = sum(s[2] for s in streams)
    return StepTime(compute + overhead + comm + copies, compute, comm, copies, overhead,
                    dict(detail))
