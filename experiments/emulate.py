"""Paper-scale emulation: one process plays rank 0 of a P-rank job (DESIGN.md §8).

The same model, method, memory stack and training step as a real run (``experiments.train``),
built under ``FakeTensorMode`` on the ``fake`` process group with a DeviceMesh of the emulated
shape (1-D, or 2-D (ring, ulysses) for hybrids): nothing is computed, and the ``MemoryTracker``
sees every allocation and free. On top of what the CPU code path allocates, the emulated device
adds what differs on a GPU (``Hardware.device == "cuda"``):

- attention kernels take their CUDA path and allocate what the CUDA kernels allocate
  (``experiments.kernel_models``);
- device allocations are counted in 512-byte blocks, as the CUDA caching allocator's
  ``max_memory_allocated`` counts them (c10/cuda/CUDACachingAllocator.cpp, ``round_size``).

With ``device="cpu"`` neither applies, and the emulated peak is the peak the tracker measures
in a real gloo run of the same cell (tests/test_emulate.py asserts equality).

One step is emulated after the optimizer states exist (they are made by one AdamW step on zero
gradients before tracking), so the peak is the steady state's, as the real run's peak over its
warm-up and memory steps is. Per step the FLOPs (torch's per-op FLOP formulas,
``experiments.flops.CountedFlops``; this rank) and the bytes this rank sends
(``experiments.comm_counter``) are counted from the same run.

Emulating a paper-scale step op by op costs about 0.15 ms per op on 2 cores, and the tiled MLP
and chunked loss make the op count grow with the sequence (about 2.5M ops for Llama3-8B at 5M
tokens on 8 ranks), so ``emulate_cell`` predicts from a fit of exact runs on the same code at
a few small sizes by default (``experiments.emulate_fit``); ``exact=True`` runs the target size
itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from experiments.comm_counter import CollectiveCounter
from experiments.config import Cell, MiB, ModelConfig
from experiments.flops import CountedFlops, step_flops
from experiments.launch import describe
from experiments.measure import label_fsdp_reductions, label_modules
from experiments.memory import MemoryTracker
from experiments.offload import PIN_MAX_TOKENS
from experiments.provenance import provenance
from experiments.train import build, make_meshes
from upipe.registry import get_method

GiB = 2**30

# Headroom kept off the device budget: an "80 GB" H100 shows 81559 MiB (79.6 GiB) in nvidia-smi;
# the CUDA context, cuBLAS workspaces and NCCL's buffers take about 1.5-2.5 GiB of it outside
# the allocator's tensor bytes, and the rest absorbs fragmentation (small with
# expandable_segments). 4 GiB leaves 76 GiB of tensors on an 80 GiB device.
DEFAULT_RESERVE_GIB = 4.0


@dataclass(frozen=True)
class Hardware:
    """The emulated cluster, per rank: device memory, host memory, headroom."""

    gpu_mem_gib: float = 80.0
    """device memory per GPU (H100: 80)"""
    host_mem_gib: float = 2048.0
    """host RAM per node (DGX H100: 2 TB), shared by the node's ranks"""
    gpus_per_node: int = 8
    """ranks per node (the host budget of a rank is host_mem / ranks on its node)"""
    reserve_gib: float = DEFAULT_RESERVE_GIB
    """device memory outside tensor bytes: CUDA context, library workspaces, fragmentation"""
    device: str = "cuda"
    """kernel paths and allocator emulated: "cuda", or "cpu" (exactly a gloo run's tracking)"""

    def validate(self) -> None:
        for name in ("gpu_mem_gib", "host_mem_gib", "gpus_per_node"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.reserve_gib < self.gpu_mem_gib:
            raise ValueError(f"reserve_gib must be >= 0 and below gpu_mem_gib "
                             f"({self.gpu_mem_gib}), got {self.reserve_gib}")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {self.device!r}")

    def device_budget(self, cell: Cell) -> int:
        """Bytes of tensors one rank may hold: the cell's ``budget_mib`` if set, else the GPU's
        memory minus the reserve."""
        if cell.budget_mib is not None:
            return int(cell.budget_mib * MiB)
        return int((self.gpu_mem_gib - self.reserve_gib) * GiB)

    def host_budget(self, world: int) -> int:
        """Host bytes per rank: the node's RAM over the ranks on the node."""
        return int(self.host_mem_gib * GiB / min(self.gpus_per_node, world))


@dataclass
class Measurement:
    """What one emulated step allocated, sent and computed (rank 0; bytes, FLOPs)."""

    peak_device_bytes: int
    peak_host_bytes: int
    breakdown: dict[str, int]  # category -> device bytes at the peak
    phase_peaks: dict[tuple[str, ...], int]  # phase key -> its peak device bytes
    phase_breakdowns: dict[tuple[str, ...], dict[str, int]]
    flops: int | None  # None: not counted
    comm_bytes: dict[str, int] | None  # c10d op -> bytes sent; None: not counted


@contextlib.contextmanager
def fake_world(world: int):
    """The ``fake`` process group of ``world`` ranks, this process rank 0 (made and destroyed
    here unless one of that size is already initialised)."""
    if dist.is_initialized():
        if dist.get_backend() != "fake" or dist.get_world_size() != world:
            raise ValueError(f"emulation needs the fake process group of {world} ranks; this "
                             f"process already has a {dist.get_backend()!r} group of "
                             f"{dist.get_world_size()}")
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _kernels(hw: Hardware):
    if hw.device == "cuda":
        from experiments.kernel_models import cuda_kernels

        return cuda_kernels()
    return contextlib.nullcontext()


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


def _init_optimizer_states(state) -> None:
    """AdamW's states exist from the first step on; make them now (zero gradients) so the one
    tracked step is a steady-state step."""
    for p in state.model.parameters():
        p.grad = torch.zeros_like(p)
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)


def measure_fake(cell: Cell, cfg: ModelConfig, hw: Hardware, count: bool = True) -> Measurement:
    """Emulate one steady-state step of ``cell`` with the model shape ``cfg`` (``count``: also
    count FLOPs and bytes sent; a memory-only search leaves them out, two dispatch layers
    fewer per op)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = torch.device("cpu")
    with fake_world(cell.nproc):
        meshes = make_meshes(cell, device)  # outside fake mode: meshes read rank values
        with FakeTensorMode(), _kernels(hw):
            state = build(cell, cfg, meshes=meshes, device=device)
            model, opt = state.model, state.optimizer
            _init_optimizer_states(state)
            tracker = MemoryTracker(settle_comm=False, namespace_categories={"fsdp": "model"},
                                    round_bytes=512 if hw.device == "cuda" else 1)
            handles = label_modules(model.attention_modules, tracker, "attention")
            handles += _label_phases(model, tracker)
            handles += label_fsdp_reductions(model, tracker)
            model.set_offload(host_context=tracker.host)
            states = [t for s in opt.state.values() for t in s.values()
                      if isinstance(t, torch.Tensor)]
            flop_counter = CountedFlops() if count else contextlib.nullcontext()
            comm = CollectiveCounter() if count else contextlib.nullcontext()
            try:
                with flop_counter, comm, tracker:
                    tracker.track(model, state.tokens, state.labels, states, category="model")
                    with tracker.phase("forward"):
                        loss_sum = model(state.tokens, state.labels)
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
        comm_bytes=dict(comm.bytes_sent) if count else None)


def emulation_unavailable(cell: Cell, hw: Hardware) -> str | None:
    """Why the cell's method cannot be emulated here, or None.

    The emulator runs the method's code on fake CPU tensors: a method whose code needs a real
    CUDA runtime or an absent library (its ``unavailable_reason`` on this machine's CPU) cannot
    run there either, whatever device is emulated.
    """
    reason = get_method(cell.method).unavailable_reason("cpu")
    return None if reason is None else f"cannot be emulated: {reason}"


def _row_metrics(cell: Cell, cfg: ModelConfig, hw: Hardware, m: Measurement) -> dict:
    b = m.breakdown
    device_budget, host_budget = hw.device_budget(cell), hw.host_budget(cell.nproc)
    over = []
    if m.peak_device_bytes > device_budget:
        over.append(f"device peak {m.peak_device_bytes / GiB:.2f} GiB > budget "
                    f"{device_budget / GiB:.2f} GiB")
    if m.peak_host_bytes > host_budget:
        over.append(f"host peak {m.peak_host_bytes / GiB:.2f} GiB > budget "
                    f"{host_budget / GiB:.2f} GiB per rank")
    return {
        "status": "oom" if over else "ok", "error": "; ".join(over),
        "mode": "emulated", "memory_source": "emulated", "world_size": cell.nproc,
        "device": f"emulated {hw.device} ({hw.gpu_mem_gib:g} GiB)",
        "peak_device_bytes": m.peak_device_bytes, "tracked_peak_device_bytes": m.peak_device_bytes,
        "peak_host_bytes": m.peak_host_bytes, "host_pinned": cell.seq_len <= PIN_MAX_TOKENS,
        # where in the step the peak is: the phase labels at that moment, outermost first
        "peak_phase": " > ".join(max(m.phase_peaks, key=m.phase_peaks.get)),
        "peak_model_bytes": b.get("model", 0), "peak_attention_bytes": b.get("attention", 0),
        "peak_other_bytes": sum(v for k, v in b.items() if k not in ("model", "attention")),
        "device_budget_bytes": device_budget, "host_budget_bytes": host_budget,
        "device_memory_bytes": device_budget,
        # this rank's FLOPs counted per op (recomputation included, attention dense, as torch's
        # formulas count it) beside the shared model-FLOPs formula over all ranks
        "rank_flops_per_step": m.flops,
        "model_tflops_per_step": step_flops(cfg, cell.seq_len) / 1e12,
        "comm_bytes_per_step": None if m.comm_bytes is None else sum(m.comm_bytes.values()),
        "comm_bytes_by_op": m.comm_bytes,
    } | {f"hw_{k}": v for k, v in dataclasses.asdict(hw).items()}


def emulate_cell(cell: Cell, hw: Hardware = Hardware(), *, exact: bool = False,
                 count: bool = True) -> dict:
    """The row of ``cell`` emulated on ``hw`` (statuses as ``run_cell``'s: ok, oom over the
    device or host budget, invalid, skipped, error). ``count=False``: memory only (FLOPs and
    bytes sent are None), for searches that need only the status."""
    try:
        cfg = cell.validate()
        hw.validate()
    except ValueError as e:
        return describe(cell, None) | {"status": "invalid", "error": str(e), "mode": "emulated"}
    reason = emulation_unavailable(cell, hw)
    if reason is not None:
        return describe(cell, cfg) | {"status": "skipped", "error": reason, "mode": "emulated"}
    t0 = time.monotonic()
    try:
        if exact:
            m, extra = measure_fake(cell, cfg, hw, count), {"emulation": "exact"}
        else:
            from experiments.emulate_fit import fitted

            fit = fitted(cell, hw, count)
            m, extra = fit.predict(cell.seq_len, cfg.n_layers), fit.summary()
    except Exception as e:  # a method that fails under fake tensors: a row, not a crash
        import traceback

        return describe(cell, cfg) | provenance() | {
            "status": "error", "mode": "emulated",
            "error": f"{type(e).__name__}: {e}\n" + traceback.format_exc()[-3000:]}
    # provenance as launched rows carry it (versions, git revision, host, date)
    return describe(cell, cfg) | _row_metrics(cell, cfg, hw, m) | extra | {
        "emulation_s": round(time.monotonic() - t0, 2)} | provenance()
