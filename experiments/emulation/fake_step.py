"""The fake-tensor step: one process plays one rank of a P-rank job for one training step.

The same model, method, memory stack and training step as a real run
(``experiments.harness.train``), built under ``FakeTensorMode`` on the ``fake`` process group
with the DeviceMeshes of the emulated shape (``train.make_meshes``: the dp x nproc world,
each replica's CP group or (ring, ulysses) mesh, FSDP2 over all ranks): nothing is computed,
and the ``MemoryTracker`` sees every allocation and free. On an emulated CUDA device
(``Hardware.device == "cuda"``) the attention kernels take their CUDA path and allocate what the
CUDA kernels allocate (``kernel_models``), and device allocations are counted in 512-byte blocks
as the CUDA caching allocator's ``max_memory_allocated`` counts them
(c10/cuda/CUDACachingAllocator.cpp, ``round_size``). With ``device="cpu"`` neither applies, and
the emulated peak is the peak the tracker measures in a real gloo run of the same cell
(tests/test_emulate.py asserts equality).

One step is emulated after the optimizer states exist (``TrainState.make_optimizer_states``,
before tracking, as a real run makes them), so the peak is the steady state's, as the real
run's is. Per step the FLOPs (``instruments.op_flops.CountedFlops``; this
rank), the bytes this rank sends (``instruments.collectives``) and the work per window of the
step that the time model prices (``op_costs``) are counted from the same run.

The rank played is the critical one (``critical_rank``) of dp replica 0 (every replica runs the
same step on its own tokens): the last rank of a ring (a contiguous causal ring's computes
every causal block; a zigzag ring's merges and sums over all its queries every step), the last
ring position of a hybrid's ring axis, else rank 0. Its model states are sharded over the
whole world. The ranks a method names in ``memory_ranks`` (torch CP's rank 0, whose ring steps
take the second query half where the last rank's take the first K/V half) are played too, memory
only: a row's memory is its fullest rank's, as a real run's is (``harness.stats.summarise``: the
max over ranks). The time is the critical rank's.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from experiments.config import Cell, Hardware, ModelConfig
from experiments.emulation.kernel_models import PYTORCH_KERNELS, cuda_kernels
from experiments.emulation.replay import CallReplay
from experiments.harness.train import build, make_meshes
from experiments.instruments.collectives import CollectiveCounter
from experiments.instruments.labels import label_fsdp_model_states, label_modules
from experiments.instruments.memory import MemoryTracker
from experiments.instruments.op_flops import CountedFlops
from experiments.timing.op_costs import StepWork, Window
from experiments.timing.profile import profile_for
from upipe.pure import metadata_pure_hook
from upipe.registry import get_method


@dataclass
class Measurement:
    """What one emulated step allocated, sent and computed (the emulated rank)."""

    peak_device_bytes: int
    peak_host_bytes: int
    breakdown: dict[str, int]  # category -> device bytes at the peak
    phase_peaks: dict[tuple[str, ...], int]  # phase key -> its peak device bytes
    phase_breakdowns: dict[tuple[str, ...], dict[str, int]]
    flops: int | None  # None: not counted
    comm_bytes: dict[str, int] | None  # c10d op -> bytes sent; None: not counted
    # the step's work per window, in execution order (``op_costs``); None: not counted
    work: list[tuple[Window, Counter]] | None = None
    # device bytes of a middle block's parameter and optimizer-state shards, live all step
    # (None: no middle block)
    block_state_bytes: int | None = None
    # some parameter's first dimension is not a multiple of the world: FSDP2's shards differ
    # by rank, the first ranks' the largest (torch.chunk's split)
    uneven_shards: bool = False


@contextlib.contextmanager
def fake_world(world: int, rank: int = 0):
    """The ``fake`` process group of ``world`` ranks, this process ``rank`` (made and destroyed
    here unless one of that size and rank is already initialised)."""
    if dist.is_initialized():
        if (dist.get_backend() != "fake" or dist.get_world_size() != world
                or dist.get_rank() != rank):
            raise ValueError(f"emulation needs the fake process group of {world} ranks as rank "
                             f"{rank}; this process already has a {dist.get_backend()!r} group "
                             f"of {dist.get_world_size()} as rank {dist.get_rank()}")
        yield
        return
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _kernels(hw: Hardware):
    if hw.device == "cuda":  # "auto" as on the profile's GPU
        return cuda_kernels(*emulated_gpu(hw))
    return contextlib.nullcontext()


def emulated_gpu(hw: Hardware) -> tuple[tuple[int, int] | None, frozenset[str]]:
    """(compute capability, PyTorch's kernels beside sdpa) of the emulated GPU: its profile's
    capability (None: not stated) and cudnn where the profile prices it (a calibration on a
    machine without cuDNN 9 has no cudnn rates, so ``"auto"`` must not pick it there)."""
    profile = profile_for(hw)
    if profile is None:
        return None, frozenset()
    priced = PYTORCH_KERNELS & set(profile.values["attention"])
    return profile.compute_capability, frozenset(priced)


def _label_phases(model, tracker: MemoryTracker) -> list:
    """Phase labels: each block and its attention/MLP/norm modules, forward and backward."""
    handles = []
    for i, block in enumerate(model.layers):
        handles += label_modules([block], tracker, f"layers.{i}:fwd", push=tracker.push_phase,
                                 pop=tracker.pop_phase, backward_name=f"layers.{i}:bwd")
        for name in ("attention_norm", "attention", "ffn_norm", "feed_forward"):
            handles += label_modules([getattr(block, name)], tracker, f"{name}:fwd",
                                     push=tracker.push_phase, pop=tracker.pop_phase,
                                     backward_name=f"{name}:bwd")
    return handles


def _block_state_bytes(model, opt, tracker: MemoryTracker) -> int | None:
    """Device bytes of a middle block's parameter shards and their optimizer states, as the
    tracker counts them (they exist before the step and after it); None with fewer than three
    blocks (no middle one)."""
    if len(model.layers) < 3:
        return None
    params = list(model.layers[1].parameters())
    states = [t for p in params for t in opt.state.get(p, {}).values()
              if isinstance(t, torch.Tensor)]
    return tracker.device_bytes(params + states)


def critical_rank(cell: Cell) -> int:
    """The rank the emulator plays: the one with the most work per step (the step waits for
    it), e.g. the last rank of a contiguous causal ring; in dp replica 0, whose CP ranks are
    the world's first ``nproc`` (dp is the outer mesh axis), so its CP rank is its rank."""
    return get_method(cell.method).critical_rank(cell.nproc, cell.ring_degree)


def measure_fake(cell: Cell, cfg: ModelConfig, hw: Hardware, count: bool = True,
                 work: bool = True, replay: bool = True, rank: int | None = None
                 ) -> Measurement:
    """Emulate one steady-state step of ``cell`` with the model shape ``cfg`` as its critical
    rank, and as each of its method's ``memory_ranks`` too (memory only; the module doc): the
    memory of the fullest, the counts of the critical one (``count``: also count FLOPs and
    bytes sent, and, with ``work``, the work per window that the time model prices, the
    dearest of the three; a memory-only search leaves them all out). ``rank``: play that rank
    alone instead, memory and counts (a measurement of one rank, such as the GPU validation's
    rank 0 on the fake process group, is compared with the same rank)."""
    if rank is not None:
        if not 0 <= rank < cell.world:
            raise ValueError(f"rank must be in [0, {cell.world}) for a world of {cell.world} "
                             f"ranks, got {rank}")
        return _play(cell, cfg, hw, rank, count, work and count, replay)
    rank = critical_rank(cell)
    m = _play(cell, cfg, hw, rank, count, work and count, replay)
    others = list(get_method(cell.method).memory_ranks(cell.nproc, cell.ring_degree))
    if m.uneven_shards:  # rank 0 holds the largest model-state shards
        others.append(0)
    for other in dict.fromkeys(others):
        if other != rank:
            m = fullest(m, _play(cell, cfg, hw, other, False, False, replay))
    return m


def fullest(m: Measurement, other: Measurement) -> Measurement:
    """``m`` with the memory figures of the fuller of two ranks, each figure's max over the two as
    a real row takes it over its ranks (``harness.stats.summarise``): the device and host peaks,
    each category of the breakdown at a rank's own peak, each phase's peak (with the breakdown
    of the rank that reached it). FLOPs, bytes sent and work stay ``m``'s."""
    phases = m.phase_peaks.keys() | other.phase_peaks.keys()
    top = {k: m if m.phase_peaks.get(k, -1) >= other.phase_peaks.get(k, -1) else other
           for k in phases}
    return dataclasses.replace(
        m, peak_device_bytes=max(m.peak_device_bytes, other.peak_device_bytes),
        peak_host_bytes=max(m.peak_host_bytes, other.peak_host_bytes),
        breakdown={c: max(m.breakdown.get(c, 0), other.breakdown.get(c, 0))
                   for c in m.breakdown.keys() | other.breakdown.keys()},
        phase_peaks={k: top[k].phase_peaks[k] for k in phases},
        phase_breakdowns={k: dict(top[k].phase_breakdowns.get(k, {})) for k in phases})


def _play(cell: Cell, cfg: ModelConfig, hw: Hardware, rank: int, count: bool, work: bool,
          replay: bool) -> Measurement:
    """One step of ``cell`` played as ``rank`` of the fake world (``measure_fake``)."""
    device = torch.device("cpu")
    with fake_world(cell.world, rank):
        meshes = make_meshes(cell, device)  # outside fake mode: meshes read rank values
        with FakeTensorMode(), _kernels(hw):
            state = build(cell, cfg, meshes=meshes, device=device)
            model, opt = state.model, state.optimizer
            states = state.make_optimizer_states()  # the one tracked step: a steady one
            tracker = MemoryTracker(settle_comm=False, namespace_categories={"fsdp": "model"},
                                    round_bytes=512 if hw.device == "cuda" else 1)
            handles = label_modules(model.attention_modules, tracker, "attention")
            handles += _label_phases(model, tracker)
            handles += label_fsdp_model_states(model, tracker)
            model.set_offload(host_context=tracker.host)
            if count:  # on the tracker's dispatch: one mode layer for all four instruments
                flop_counter, comm = CountedFlops(), CollectiveCounter()
                tracker.observers += [flop_counter, comm]
            if work:
                step_work = StepWork(tracker, hw.gpus_per_node)
                tracker.observers.append(step_work)
            try:
                with tracker, metadata_pure_hook(CallReplay(tracker) if replay else None):
                    state.track(tracker, *states)
                    block_states = _block_state_bytes(model, opt, tracker)
                    with tracker.phase("forward"):
                        loss_sum = state.loss_sum()
                    with tracker.phase("backward"):
                        (loss_sum / state.n_label_tokens).backward()
                    with tracker.phase("optimizer"), tracker.category("model"):
                        opt.step()
                        opt.zero_grad(set_to_none=True)
            finally:
                for h in handles:
                    h.remove()
    return Measurement(
        peak_device_bytes=tracker.peak_device_bytes, peak_host_bytes=tracker.peak_host_bytes,
        breakdown=dict(tracker.breakdown_at_peak),
        phase_peaks=dict(tracker.peak_by_phase),
        phase_breakdowns={k: dict(v) for k, v in tracker.breakdown_by_phase.items()},
        flops=flop_counter.total if count else None,
        comm_bytes=dict(comm.bytes_sent) if count else None,
        work=[(w, step_work.windows[w]) for w in step_work.order if w[0] != "setup"]
        if work else None, block_state_bytes=block_states,
        uneven_shards=any(p.dim() and p.shape[0] % cell.world for p in model.parameters()))
