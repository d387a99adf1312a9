"""The ``attention`` workload: one attention layer's forward and backward, alone.

A cell with ``workload="attention"`` runs here instead of a training step: the cell's method
(any registered one, with its options and, for hybrids, its (ring, ulysses) mesh) is built for
the model preset's heads and width, and runs forward and backward on random input, batch 1
(packed into the cell's documents when ``doc_len`` is set).
Everything else is the main harness's (``measure``): the same launcher, warm-up and tracked
memory steps, then ``iters`` timed steps after a barrier each, the slowest rank per step
(``stats.summarise``), and the same row columns, so its rows compare with sweep rows.

Per rank: x (1, L, dim) and its output gradient dy, L = seq_len / nproc, in the cell's dtype;
parameters, x and dy are tracked before the steps (the peak is absolute). Memory columns:
``peak_device_bytes`` (absolute), ``peak_attention_bytes`` (what the step allocates that is
alive at the peak, gradients included: the peak above parameters and inputs),
``peak_model_bytes`` (the parameters), ``peak_other_bytes`` (x and dy), ``peak_host_bytes``
(methods that offload, FPDT).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from experiments.config import Cell, ModelConfig, Status
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
from experiments.harness.train import (
    TORCH_DTYPES,
    attention_mesh,
    current_device,
    packed_cu_seqlens,
)
from experiments.instruments.memory import MemoryTracker
from upipe.registry import build_method


def build_attention(cell: Cell, cfg: ModelConfig, device: torch.device) -> nn.Module:
    """The cell's attention method over the launched world (or its hybrid mesh), seeded, in
    the cell's dtype."""
    hybrid = attention_mesh(cell, device) if dist.is_initialized() else None
    where = {"mesh": hybrid} if hybrid is not None else {
        "group": dist.group.WORLD if dist.is_initialized() else None}
    torch.manual_seed(cell.seed)
    with torch.device(device):
        module = build_method(cell.method, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                              causal=True, rope_theta=cfg.rope_theta, kernel=cell.kernel,
                              **where, **cell.options)
    return module.to(TORCH_DTYPES[cell.dtype])


def _step(module: nn.Module, x: torch.Tensor, dy: torch.Tensor,
          cu_seqlens: list[int] | None) -> None:
    module.zero_grad(set_to_none=True)
    x.grad = None
    module(x, cu_seqlens=cu_seqlens).backward(dy)


def memory_steps(module: nn.Module, x: torch.Tensor, dy: torch.Tensor, steps: int,
                 device: torch.device, progress: Progress | None = None,
                 total: int = 0, cu_seqlens: list[int] | None = None) -> dict:
    """``steps`` steps under the tracker; this rank's memory figures (``cu_seqlens``: packed
    documents' global bounds)."""
    reset_device_peaks(device)
    backend = dist.get_backend() if dist.is_initialized() else None
    tracker = MemoryTracker(settle_comm=backend == "gloo")
    if hasattr(module, "host_context"):  # methods that offload: their host bytes
        module.host_context = tracker.host
    with tracker:
        tracker.track(module, category="model")
        tracker.track(x, dy, category="other")
        for i in range(steps):
            with tracker.category("attention"):
                _step(module, x, dy, cu_seqlens)
            if progress is not None:
                progress(f"step {i + 1}/{total} (warm-up and memory, tracked)")
    return memory_figures(tracker, device)


def measure_attention(cell: Cell, cfg: ModelConfig, progress: bool = False) -> dict:
    """Build, run and measure the cell's attention layer on this rank; the row's metrics (every
    rank), with the columns of ``measure.measure_cell``'s rows (no losses, no model FLOPs)."""
    say = progress_printer(progress)
    device = current_device()
    module = build_attention(cell, cfg, device)
    dtype = TORCH_DTYPES[cell.dtype]
    gen = torch.Generator().manual_seed(cell.seed + 1)
    shape = (1, cell.seq_len // cell.nproc, cfg.dim)
    x = torch.randn(shape, generator=gen, dtype=dtype).to(device).requires_grad_()
    dy = torch.randn(shape, generator=gen, dtype=dtype).to(device)
    set_device_budget(cell, device)
    total = cell.warmup + 1 + cell.iters
    cu_seqlens = packed_cu_seqlens(cell.seq_len, cell.doc_len)
    mem = memory_steps(module, x, dy, cell.warmup + 1, device, say, total, cu_seqlens)
    status, error = budget_status(cell, mem, device)
    iters = cell.iters if status == Status.OK else 0
    times = timed(lambda: _step(module, x, dy, cu_seqlens), iters, device, say,
                  first=cell.warmup + 1, total=cell.warmup + 1 + iters)
    row = summarise(cell, cfg, gather({"times": times, **mem}), device, flops=None)
    return row | {"status": status, "error": error}
