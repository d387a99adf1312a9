"""Run one cell on this rank and measure it (docs/design.md#measurement); every rank calls
``measure_cell``.

Order: AdamW's states are made first (``TrainState.make_optimizer_states``: the training is
unchanged), so every step is a steady-state one; ``warmup`` steps and one memory step run under
the ``MemoryTracker`` (its peak is the max over them); then ``iters`` timed steps run untracked,
each after a barrier, timed as the slowest rank. Memory:

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

import torch
import torch.distributed as dist

from experiments.config import Cell, ModelConfig, Status
from experiments.harness.flops import step_flops
from experiments.harness.stats import (
    Progress,
    budget_status,
    gather,
    memory_figures,
    progress_printer,
    reset_device_peaks,
    set_device_budget,
    summarise,
    timed,
)
from experiments.harness.train import TrainState, build
from experiments.instruments.labels import label_fsdp_model_states, label_modules
from experiments.instruments.memory import MemoryTracker


def memory_steps(state: TrainState, steps: int, device: torch.device,
                 progress: Progress | None = None, total_extra: int = 0) -> tuple[dict, list]:
    """Run ``steps`` steps under the tracker; returns this rank's memory figures and losses.
    ``progress`` numbers its lines out of ``steps + total_extra`` (the timed steps to come)."""
    backend = dist.get_backend() if dist.is_initialized() else None
    reset_device_peaks(device)
    # Settling waits for gloo's comm thread to drop its buffers (experiments/instruments/memory.py);
    # NCCL holds them until the stream is done, which the allocator figure accounts for.
    tracker = MemoryTracker(settle_comm=backend == "gloo", namespace_categories={"fsdp": "model"})
    # the losses are kept in a buffer made before tracking: a kept loss tensor would add its
    # bytes to the next step's peak (the emulator, which runs one step, has none)
    losses = torch.zeros(steps, device=device)
    model, opt = state.model, state.optimizer
    states = state.make_optimizer_states()
    handles = label_modules(model.attention_modules, tracker, "attention")
    handles += label_fsdp_model_states(model, tracker)
    model.set_offload(host_context=tracker.host)
    try:
        with tracker:
            state.track(tracker, *states)
            for i in range(steps):
                loss_sum = state.loss_sum()
                (loss_sum / state.n_label_tokens).backward()
                with tracker.category("model"):  # AdamW's states
                    opt.step()
                opt.zero_grad(set_to_none=True)
                losses[i] = loss_sum.detach()
                del loss_sum
                if progress is not None:
                    progress(f"step {i + 1}/{steps + total_extra} (warm-up and memory, tracked)")
    finally:
        for h in handles:
            h.remove()
        model.set_offload(host_context=contextlib.nullcontext)
    return memory_figures(tracker, device), list(losses.unbind())


def measure_cell(cell: Cell, cfg: ModelConfig, progress: bool = False) -> dict:
    """Build, run and measure ``cell`` on this rank; returns the row's metrics (every rank).
    ``progress``: rank 0 prints a line per step on stderr."""
    say = progress_printer(progress)
    state = build(cell, cfg, distributed=dist.is_initialized())
    device = state.tokens.device
    set_device_budget(cell, device)
    mem, losses = memory_steps(state, cell.warmup + 1, device, say, cell.iters)
    status, error = budget_status(cell, mem, device)
    iters = cell.iters if status == Status.OK else 0
    more: list[torch.Tensor] = []
    times = timed(lambda: more.append(state.step()), iters, device, say,
                  first=cell.warmup + 1, total=cell.warmup + 1 + iters)
    # one collective for every step's loss: the mean token loss over every replica's sequence
    loss = torch.stack(losses + more).float().to(device)
    if dist.is_initialized():
        dist.all_reduce(loss)
    per_rank = gather({"times": times, **mem})
    flops = cell.dp * step_flops(cfg, cell.seq_len, state.cu_seqlens)
    row = summarise(cell, cfg, per_rank, device, flops)
    row.update(status=status, error=error,
               losses=[float(v) / state.n_label_tokens for v in loss.cpu()])
    return row
