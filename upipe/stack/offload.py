"""Offload the checkpointed block inputs to host memory (the ALST stack's activation offload).

Non-reentrant ``torch.utils.checkpoint`` keeps the block input through ``save_for_backward``
under whatever saved-tensor hooks are active around the call; these hooks copy it to host memory
in forward and back to the device when the block is recomputed in backward.

Hand-written rather than ``torch.autograd.graph.save_on_cpu`` because on a CPU run that one is a
no-op (``tensor.cpu()`` returns the tensor itself), so the CPU reproduction and the fake-tensor
emulation would show no offload; and host bytes must be attributed to host memory, which the
``host_context`` hook (the harness passes its tracker's ``host()``) does. On CUDA this is what
``save_on_cpu`` does; the caller pins host memory up to 4M tokens and uses pageable memory
above (docs/design.md#the-memory-stack, after ALST: pinning that much host memory stalls the host
allocator):
``pin_host_memory(seq_len)`` is that rule, for the harness and the Hugging Face stack alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

PIN_MAX_TOKENS = 4 * 2**20


def pin_host_memory(seq_len: int) -> bool:
    """Whether offloaded activations go to pinned host memory: up to ``PIN_MAX_TOKENS`` tokens of
    the *global* sequence (all CP ranks' shards together), pageable above."""
    return seq_len <= PIN_MAX_TOKENS


def copy_to_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """t (any shape) copied into a host tensor allocated for it: pinned (PyTorch's caching host
    allocator, non-blocking) or pageable (fresh pages each time for large tensors: the copy
    faults them in, the cost ``upipe-bench calibrate`` times as ``d2h_pageable``)."""
    packed = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    packed.copy_(t, non_blocking=pin)
    return packed


def offload_saved_inputs(
    host_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    pin_memory: bool = True,
) -> torch.autograd.graph.saved_tensors_hooks:
    """Saved-tensor hooks: pack = copy to host, unpack = copy back to the tensor's device.

    ``pin_memory`` applies to CUDA tensors only (there is no pinned memory without CUDA).
    """

    def pack(t: torch.Tensor):
        with host_context():
            return t.device, copy_to_host(t, pin_memory and t.is_cuda)

    def unpack(saved) -> torch.Tensor:
        device, packed = saved
        if device.type == "cpu":  # a device copy, as the H2D copy is on GPU
            return packed.clone()
        return packed.to(device, non_blocking=True)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
