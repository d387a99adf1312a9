"""Run one cell on this rank and measure it (DESIGN.md §7); every rank calls ``measure_cell``.

Order: ``warmup`` steps and one memory step run under the ``MemoryTracker`` (its peak is the
max over them, i.e. the steady state with AdamW's states allocated); then ``iters`` timed steps
run untracked, each after a barrier, timed as the slowest rank. Memory:

- device: on CPU the tracked live tensor bytes (deterministic), on GPU the allocator's peak
  allocated and reserved bytes (the tracked figure is reported beside them);
- host: tracked offloaded bytes;
- breakdown at the device peak: ``model`` (parameters sharded and all-gathered, gradients,
  optimizer states), ``attention`` (everything the attention modules allocate in forward and
  backward), ``other`` (activations, checkpoints, MLP, norms, loss).

A CPU budget (``budget_mib``) is checked after the memory steps, on every rank's tracked peak
(one all-reduce, so all ranks agree): over budget is status ``oom`` and the timed steps are
skipped.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from experiments.config import Cell, MiB, ModelConfig
from experiments.flops import mfu, step_flops
from experiments.memory import MemoryTracker
from experiments.train import TrainState, build


class _OnBackward(torch.autograd.Function):
    """Identity whose backward calls ``fn`` first: marks where a module's backward starts/ends."""

    @staticmethod
    def forward(ctx, x, fn):
        ctx.fn = fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.fn()
        return grad, None


def label_modules(
    modules: list[nn.Module], tracker: MemoryTracker, name: str, *,
    push: Callable[[str], None] | None = None, pop: Callable[[], None] | None = None,
    backward_name: str | None = None,
) -> list:
    """Label everything ``modules`` allocate, in forward and backward; returns the hook handles.

    By default the label is the tracker's category ``name``. ``push``/``pop`` replace the
    tracker's ``push_category``/``pop_category`` (e.g. ``push_phase``/``pop_phase`` to record
    each module's forward and backward peaks); ``backward_name`` (default ``name``) is the label
    pushed while a module's backward runs, ``name`` the one while its forward runs.

    Forward: pre/post hooks push and pop the label. Backward: an identity node on the output
    pushes it (the module's backward starts there) and one on the input pops it (it ends
    there). Under activation checkpointing the nodes of the original forward are the ones
    backward runs, so recomputation does not unbalance the labels: a recomputed forward pushes
    and pops ``name`` again, nested in whatever label is current then (e.g. inside its own
    backward's label when the checkpoint wraps the labelled module itself).
    """
    push = tracker.push_category if push is None else push
    pop = tracker.pop_category if pop is None else pop
    bwd_name = name if backward_name is None else backward_name

    def pre(_, args):
        push(name)
        return (_OnBackward.apply(args[0], pop), *args[1:])

    def post(_, args, out):
        pop()
        if out is None:  # the forward raised; nothing to mark
            return None
        return _OnBackward.apply(out, lambda: push(bwd_name))

    handles = []
    for m in modules:
        # always_call: a non-reentrant checkpoint stops its recomputation with an exception as
        # soon as the last saved tensor is recomputed (early stop), possibly inside the module;
        # without the pop then, the pushed label would stay on for the rest of the backward.
        handles += [m.register_forward_pre_hook(pre),
                    m.register_forward_hook(post, always_call=True)]
    return handles


class _Restore:
    """A handle whose ``remove()`` drops an instance attribute that shadows a method."""

    def __init__(self, obj, name: str):
        self.obj, self.name = obj, name

    def remove(self) -> None:
        self.obj.__dict__.pop(self.name, None)


def label_fsdp_reductions(model: nn.Module, tracker: MemoryTracker) -> list:
    """Count what FSDP2's post-backward allocates as model states (category "model").

    FSDP2 makes the sharded gradients (the reduce-scatter's output) with plain ops in each
    unit's post-backward, where no label of ours is active; running the post-backward under the
    "model" category attributes them when they are allocated, so the breakdown is right at every
    moment (and in every phase of the emulator), not only at one peak. Returns handles whose
    ``remove()`` restores FSDP2's method. Reaches into FSDP2's per-module state (private API,
    stable from torch 2.5 to 2.13).
    """
    from torch.distributed.fsdp import FSDPModule

    handles = []
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        group = m._get_fsdp_state()._fsdp_param_group
        if group is None:
            continue
        original = group.post_backward

        def post_backward(*args, _original=original, **kwargs):
            with tracker.category("model"):
                return _original(*args, **kwargs)

        group.post_backward = post_backward
        handles.append(_Restore(group, "post_backward"))
    return handles


def _world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gather(obj) -> list:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def memory_steps(state: TrainState, steps: int, device: torch.device) -> tuple[dict, list]:
    """Run ``steps`` steps under the tracker; returns this rank's memory figures and losses."""
    backend = dist.get_backend() if dist.is_initialized() else None
    if device.type == "cuda":
        # blocks cached while building (the unsharded init, FSDP's set-up) would otherwise
        # count in the reserved peak of the steps
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    # Settling waits for gloo's comm thread to drop its buffers (experiments/memory.py); NCCL
    # holds them until the stream is done, which the allocator figure accounts for.
    tracker = MemoryTracker(settle_comm=backend == "gloo", namespace_categories={"fsdp": "model"})
    # the losses are kept in a buffer made before tracking: a kept loss tensor would add its
    # bytes to the next step's peak (the emulator, which runs one step, has none)
    losses = torch.zeros(steps, device=device)
    model, opt = state.model, state.optimizer
    handles = label_modules(model.attention_modules, tracker, "attention")
    handles += label_fsdp_reductions(model, tracker)
    model.set_offload(host_context=tracker.host)
    try:
        with tracker:
            tracker.track(model, state.tokens, state.labels, category="model")
            for i in range(steps):
                loss_sum = model(state.tokens, state.labels)
                (loss_sum / state.n_label_tokens).backward()
                with tracker.category("model"):  # AdamW's states
                    opt.step()
                opt.zero_grad(set_to_none=True)
                losses[i] = loss_sum.detach()
                del loss_sum
    finally:
        for h in handles:
            h.remove()
        model.set_offload(host_context=contextlib.nullcontext)
    breakdown = dict(tracker.breakdown_at_peak)
    mem = {
        "tracked_peak_device_bytes": tracker.peak_device_bytes,
        "peak_host_bytes": tracker.peak_host_bytes,
        "peak_model_bytes": breakdown.get("model", 0),
        "peak_attention_bytes": breakdown.get("attention", 0),
        "peak_other_bytes": sum(v for k, v in breakdown.items() if k not in ("model", "attention")),
        # the attention layers' own peak working set, wherever the step's peak is
        "attention_peak_bytes": tracker.peak_by_category.get("attention", 0),
    }
    if device.type == "cuda":
        mem["allocator_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        mem["allocator_peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    return mem, list(losses.unbind())


def timed_steps(state: TrainState, iters: int, device: torch.device) -> tuple[list, list]:
    """``iters`` untracked steps; this rank's wall times (barrier before each) and losses."""
    times, losses = [], []
    for _ in range(iters):
        _barrier()
        _sync(device)
        t0 = time.perf_counter()
        losses.append(state.step())
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times, losses


def measure_cell(cell: Cell, cfg: ModelConfig) -> dict:
    """Build, run and measure ``cell`` on this rank; returns the row's metrics (every rank)."""
    rank, world = _world()
    state = build(cell, cfg, distributed=dist.is_initialized())
    device = state.tokens.device
    if device.type == "cuda" and cell.budget_mib is not None:  # a real OOM under the budget
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cell.budget_mib * MiB / total), device)
    mem, losses = memory_steps(state, cell.warmup + 1, device)
    status, error = "ok", ""
    if device.type == "cpu" and cell.budget_mib is not None:
        peak = torch.tensor([float(mem["tracked_peak_device_bytes"])])
        if dist.is_initialized():
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        if peak.item() > cell.budget_mib * MiB:
            status = "oom"
            error = (f"tracked peak {peak.item() / MiB:.1f} MiB > budget_mib {cell.budget_mib}"
                     " on the fullest rank")
    times, more = timed_steps(state, cell.iters if status == "ok" else 0, device)
    losses += more
    # one collective for every step's loss: the global mean token loss
    loss = torch.stack(losses).float().to(device)
    if dist.is_initialized():
        dist.all_reduce(loss)
    per_rank = _gather({"times": times, **mem})
    row = _summarise(cell, cfg, per_rank, device, world)
    row.update(status=status, error=error,
               losses=[float(v) / state.n_label_tokens for v in loss.cpu()])
    return row


def _summarise(cell: Cell, cfg: ModelConfig, per_rank: list[dict], device, world: int) -> dict:
    """Cross-rank figures: the slowest rank per step, the fullest rank's memory."""
    row = {"world_size": world, "device": _device_name(device),
           "memory_source": "allocator" if device.type == "cuda" else "tracked"}
    for key in per_rank[0]:
        if key != "times":
            row[key] = max(r[key] for r in per_rank)
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
                   tokens_per_s_per_gpu=cell.seq_len / cell.nproc / med)
        flops = step_flops(cfg, cell.seq_len)
        row["model_tflops_per_step"] = flops / 1e12
        if device.type == "cuda":
            row["mfu"] = mfu(flops, med, cell.nproc, torch.cuda.get_device_name(device),
                             cell.dtype)
    return row


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.machine()})"
