"""A per-token module over sequence shards (the ALST stack's tiled MLP).

ALST's tiled MLP (DeepSpeed's ``TiledMLP``, Bekman et al. 2025) runs ``module`` on ceil(L / dim)
sequence shards without autograd in forward and recomputes one shard at a time in backward, so
the MLP's (L, ffn) intermediates exist for one shard only. ``tiled`` is that algorithm, written
here so that each shard's forward and each shard's recompute-and-backward is one metadata-pure
call (``upipe.pure``): the emulator records a shard once and replays the other shards of the
same shape (at 5M tokens on 8 ranks each tiled call has 160 shards, and DeepSpeed's loop made
the tiled MLP and norms most of an emulated step's ops). What it keeps is DeepSpeed's, but for
one shard output: ``TiledMLP``'s backward holds the previous shard's output while it
recomputes the next one; here it is freed with its shard. The device peak, which is in the
shard's backward, is the same (tests/test_model.py compares both under the memory tracker,
values, gradients and peaks). Runs on CPU and under fake tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from upipe.chunked import chunk_spans
from upipe.pure import metadata_pure


def _call_module(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


@metadata_pure
def _shard_forward(call: Callable, module: nn.Module, xs: torch.Tensor) -> torch.Tensor:
    """One shard's output, ``call(module, xs)`` (autograd off: inside the Function's forward)."""
    return call(module, xs)


@metadata_pure
def _shard_backward(call: Callable, module: nn.Module, xs: torch.Tensor, dxs: torch.Tensor,
                    dys: torch.Tensor, input_grad: bool, grads_exist: bool) -> None:
    """One shard's backward: ``call(module, xs)`` recomputed with autograd and backpropagated
    from dys; xs's gradient added into dxs in place (with ``input_grad``), the parameters' into
    their ``.grad``. xs, dxs, dys: (n, dim) rows of the input, its gradient and the output's.
    ``grads_exist``: whether the parameters' ``.grad`` exist already (then they are added into
    in place; else this call makes them and keeps them, which the emulator does not replay):
    a fact about the call the tensors' metadata does not tell."""
    del grads_exist  # in the signature only
    xs = xs.detach().requires_grad_(input_grad)
    if input_grad:
        # a fresh view as .grad (no other reference): autograd then adds into it in place
        xs.grad = dxs.view_as(xs)
    with torch.enable_grad():
        y = call(module, xs)
    torch.autograd.backward(y, dys)


class _Tiled(torch.autograd.Function):
    """``call(module, x)`` over ``shards`` sequence shards (see the module); only x is saved."""

    @staticmethod
    def forward(ctx, call, module, x, shards, *params):
        ctx.call, ctx.module, ctx.shards = call, module, shards
        ctx.save_for_backward(x)
        outs = [_shard_forward(call, module, xs) for xs in torch.chunk(x, shards, dim=-2)]
        return torch.cat(outs, dim=-2)

    @staticmethod
    def backward(ctx, dout):
        (x,) = ctx.saved_tensors
        input_grad = ctx.needs_input_grad[2]
        # rows of (B * L, dim): a shard of a batch > 1 is then one slice (reshape copies a
        # non-contiguous x or gradient, as TiledMLP's does)
        x2 = x.detach().reshape(-1, x.shape[-1])
        dout2 = dout.reshape(-1, dout.shape[-1])
        dx2 = torch.zeros_like(x2)
        params = [p for p in ctx.module.parameters() if p.requires_grad]
        # forward's shards (torch.chunk), each tensor's views made by one op, not a slice each
        shards = (torch.chunk(t, ctx.shards) for t in (x2, dx2, dout2))
        for xs, dxs, dys in zip(*shards, strict=True):
            _shard_backward(ctx.call, ctx.module, xs, dxs, dys, input_grad,
                            all(p.grad is not None for p in params))
        return (None, None, dx2.view(x.shape) if input_grad else None, None,
                *(None for _ in ctx.needs_input_grad[4:]))


def tiled(module: nn.Module, x: torch.Tensor,
          call: Callable[[nn.Module, torch.Tensor], torch.Tensor] = _call_module) -> torch.Tensor:
    """``call(module, x)`` (default ``module(x)``) over ceil(L / dim) sequence shards (ALST).

    Any per-token module fits (the harness tiles RMSNorm too). ``call`` lets a module whose own
    ``forward`` is this tiling (the Hugging Face stack's MLPs) pass its class's forward instead.
    x (B, L, dim) -> (B, L, dim_out); one shard runs ``call`` directly.
    """
    shards = max(1, math.ceil(x.shape[1] / x.shape[-1]))
    if shards == 1:
        return call(module, x)
    # the parameters are inputs so the Function's output requires grad when only they do
    return _Tiled.apply(call, module, x, shards, *module.parameters())


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
