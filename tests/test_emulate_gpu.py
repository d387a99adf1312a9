"""Emulated peak vs the CUDA allocator's (docs/design.md#emulation; needs a GPU, skipped without
one).

The same cell runs twice in this process on the ``fake`` process group of P ranks: once with
real CUDA tensors (the collectives are shape-correct no-ops, the memory is real:
``torch.cuda.max_memory_allocated``), once emulated (fake tensors, ``Hardware(device="cuda")``:
CUDA kernel models and 512-byte rounding). World size 1 and an 8-rank cell; target within 5%.
``python -m experiments.gpu.gpu_check`` writes the same comparison for more cells to results/.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from experiments.config import Cell, Hardware
from experiments.emulation.emulate import emulate_cell
from experiments.emulation.fake_step import fake_world
from upipe.kernels import kernel_unavailable_reason

pytestmark = pytest.mark.gpu


def _allocator_peak(cell: Cell) -> int:
    from experiments.gpu.gpu_check import _clean_allocator
    from experiments.harness.measure import measure_cell

    _clean_allocator()  # an earlier cell's tensors held in cycles would add to this peak
    with fake_world(cell.nproc):
        row = measure_cell(cell, cell.validate())
    return row["allocator_peak_allocated_bytes"]


@pytest.mark.parametrize("method,nproc,seq_len,kernel", [
    ("upipe", 1, 2**15, "sdpa"), ("ulysses", 1, 2**15, "sdpa"), ("upipe", 8, 2**17, "sdpa"),
    ("ulysses", 8, 2**17, "sdpa"), ("zigzag-ring", 8, 2**17, "sdpa"),
    # PyTorch's cuDNN attention: its ops' outputs and the backward's workspace (kernel_models)
    ("upipe", 1, 2**15, "cudnn"), ("upipe", 8, 2**17, "cudnn"), ("ulysses", 8, 2**17, "cudnn"),
    ("zigzag-ring", 8, 2**17, "cudnn")])
def test_emulated_peak_is_within_5_percent_of_the_allocator(method, nproc, seq_len, kernel):
    if kernel == "cudnn" and (reason := kernel_unavailable_reason("cudnn", "cuda", "bf16")):
        pytest.skip(reason)
    cell = Cell(method=method, model="llama3-8b", nproc=nproc, seq_len=seq_len, dtype="bf16",
                kernel=kernel, overrides=(("n_layers", "4"),), warmup=1, iters=0)
    real = _allocator_peak(cell)
    torch.cuda.empty_cache()
    # rank 0, the rank that ran (the emulator would otherwise play a ring's fullest rank too)
    emulated = emulate_cell(dataclasses.replace(cell), Hardware(device="cuda"), exact=True,
                            rank=0)
    ratio = emulated["peak_device_bytes"] / real
    print(f"{method} {kernel} P={nproc} S={seq_len}: emulated {emulated['peak_device_bytes']} / "
          f"allocator {real} = {ratio:.4f}")
    assert abs(ratio - 1) < 0.05
