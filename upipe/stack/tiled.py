"""A per-token module over sequence shards (the ALST stack's tiled MLP).

DeepSpeed's ``TiledMLP`` runs ``module`` on ceil(L / dim) sequence shards without autograd in
forward and recomputes one shard at a time in backward, so the MLP's (L, ffn) intermediates exist
for one shard only. It is the library implementation (ALST, Bekman et al. 2025) and runs on CPU
and under fake tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from upipe.chunked import chunk_spans


def _call_module(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


def tiled(module: nn.Module, x: torch.Tensor,
          call: Callable[[nn.Module, torch.Tensor], torch.Tensor] = _call_module) -> torch.Tensor:
    """``call(module, x)`` (default ``module(x)``) over ceil(L / dim) sequence shards (ALST).

    Any per-token module fits (the harness tiles RMSNorm too). ``call`` lets a module whose own
    ``forward`` is this tiling (the Hugging Face stack's MLPs) pass its class's forward instead.
    x (B, L, dim) -> (B, L, dim_out); one shard runs ``call`` directly.
    """
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP  # heavy import: lazy

    shards = max(1, math.ceil(x.shape[1] / x.shape[-1]))
    if shards == 1:
        return call(module, x)
    return TiledMLP.apply(call, module, x, shards, list(module.parameters()))


class _TiledResidual(torch.autograd.Function):
    """``h + fn(h)`` over sequence shards, output and input gradient written in place.

    Hand-written rather than DeepSpeed's ``TiledMLP``/``SequenceTiledCompute`` because those
    concatenate the shards' outputs (the output exists twice while it is assembled) and leave
    the residual add outside, so under checkpointing the recomputed block holds the norm's
    output, the MLP's shards, their concatenation and the sum at once. Here ``h`` is the only
    saved tensor; forward writes ``h + fn(h)`` shard by shard into one buffer, and backward
    writes ``dh = dout + d fn`` shard by shard into one buffer (the residual's gradient needs
    no separate add). Parameter gradients accumulate in their ``.grad`` through the shards'
    own backward, as TiledMLP's do.
    """

    @staticmethod
    def forward(ctx, fn, h, shards):
        ctx.fn, ctx.shards = fn, shards
        ctx.save_for_backward(h)
        out = torch.empty_like(h)
        for a, b in _spans(h.shape[-2], shards):
            hs = h.narrow(-2, a, b - a)
            torch.add(hs, fn(hs), out=out.narrow(-2, a, b - a))
        return out

    @staticmethod
    def backward(ctx, dout):
        (h,) = ctx.saved_tensors
        dh = dout.clone(memory_format=torch.contiguous_format)  # the residual's part
        for a, b in _spans(h.shape[-2], ctx.shards):
            hs = h.narrow(-2, a, b - a).detach().requires_grad_(True)
            hs.grad = dh.narrow(-2, a, b - a)  # autograd adds fn's part into it, in place
            with torch.enable_grad():
                y = ctx.fn(hs)
            torch.autograd.backward(y, dout.narrow(-2, a, b - a))
            del hs, y
        return None, dh, None


def _spans(n: int, shards: int) -> list[tuple[int, int]]:
    """``torch.chunk``'s split of n rows into ``shards`` parts, as (start, end)."""
    return chunk_spans(n, math.ceil(n / shards))


def tiled_residual(fn: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    """``h + fn(h)`` over ceil(L / dim) sequence shards (the tiled MLP's rule), in place.

    ``fn``: a per-token function of h (B, L, dim) -> (B, L, dim), e.g. a pre-norm then an MLP;
    its parameters get their gradients through ``.grad``, as with ``tiled``.
    """
    shards = max(1, math.ceil(h.shape[-2] / h.shape[-1]))
    return _TiledResidual.apply(fn, h, shards)
