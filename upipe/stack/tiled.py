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

from upipe.amp import autocast_state, recompute_autocast
from upipe.chunked import spans
from upipe.pure import Span, metadata_pure


def _call_module(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


@metadata_pure
def _shard_forward(call: Callable, module: nn.Module, x: torch.Tensor,
                   shard: Span) -> torch.Tensor:
    """One shard's output, ``call(module, shard.of(x))`` (autograd off: inside the Function's
    forward). x: (B, L, dim); shard: rows of L."""
    return call(module, shard.of(x))


def _grads_exist(modules) -> bool:
    """Whether every trainable parameter of ``modules`` has its ``.grad`` (a shard's backward
    then adds into them in place; else it makes them and keeps them, which the emulator does
    not replay): a fact about the call that its tensors' metadata does not tell, so the shard
    functions take it as an argument."""
    return all(p.grad is not None for m in modules for p in m.parameters() if p.requires_grad)


@metadata_pure
def _shard_backward(call: Callable, module: nn.Module, x: torch.Tensor, dx: torch.Tensor,
                    dout: torch.Tensor, shard: Span, input_grad: bool,
                    grads_exist: bool) -> None:
    """One shard's backward: ``call(module, xs)`` recomputed with autograd on the shard's rows xs
    of x and backpropagated from dout's; xs's gradient added into dx's rows in place (with
    ``input_grad``), the parameters' into their ``.grad``. x, dx, dout: (B * L, dim) rows of the
    input, its gradient and the output's gradient; shard: rows. ``grads_exist``:
    ``_grads_exist((module,))``."""
    del grads_exist  # in the signature only
    xs = shard.of(x).detach().requires_grad_(input_grad)
    if input_grad:
        # a fresh view as .grad (no other reference): autograd then adds into it in place
        xs.grad = shard.of(dx).view_as(xs)
    with torch.enable_grad():
        y = call(module, xs)
    torch.autograd.backward(y, shard.of(dout))


class _Tiled(torch.autograd.Function):
    """``call(module, x)`` over ``shards`` sequence shards (see the module); only x is saved."""

    @staticmethod
    def forward(ctx, call, module, x, shards, *params):
        ctx.call, ctx.module, ctx.shards = call, module, shards
        ctx.amp = autocast_state(x.device.type)  # the recompute runs as the forward did
        ctx.save_for_backward(x)
        outs = [_shard_forward(call, module, x, s) for s in _shards(x.shape[-2], shards, -2)]
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
        # forward's shards (torch.chunk's), each a span of the whole tensors: no view is made
        # outside the shard's call, which the emulator replays
        with recompute_autocast(ctx.amp):
            for s in _shards(x2.shape[0], ctx.shards, 0):
                _shard_backward(ctx.call, ctx.module, x2, dx2, dout2, s, input_grad,
                                _grads_exist((ctx.module,)))
        return (None, None, dx2.view(x.shape) if input_grad else None, None,
                *(None for _ in ctx.needs_input_grad[4:]))


def _shards(n: int, shards: int, dim: int) -> list[Span]:
    """``torch.chunk``'s split of n rows of ``dim`` into ``shards`` parts, as spans."""
    return spans(n, math.ceil(n / shards), dim)


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


def _compose(modules: tuple[nn.Module, ...], x: torch.Tensor) -> torch.Tensor:
    for m in modules:
        x = m(x)
    return x


@metadata_pure
def _residual_forward(modules: tuple[nn.Module, ...], h: torch.Tensor, out: torch.Tensor,
                      shard: Span) -> None:
    """One shard of ``h + modules(h)`` written into out's rows (autograd off). h, out: (B, L,
    dim); shard: rows of L."""
    hs = shard.of(h)
    torch.add(hs, _compose(modules, hs), out=shard.of(out))


@metadata_pure
def _residual_backward(modules: tuple[nn.Module, ...], h: torch.Tensor, dh: torch.Tensor,
                       dout: torch.Tensor, shard: Span, grads_exist: bool) -> None:
    """One shard's backward: ``modules(hs)`` recomputed on h's rows and backpropagated from
    dout's; its input gradient added into dh's rows in place (dh holds the residual's part,
    dout, already), the parameters' into their ``.grad``. h, dh, dout: (B, L, dim).
    ``grads_exist``: ``_grads_exist(modules)``."""
    del grads_exist  # in the signature only
    hs = shard.of(h).detach().requires_grad_(True)
    hs.grad = shard.of(dh)  # autograd adds the modules' part into it, in place
    with torch.enable_grad():
        y = _compose(modules, hs)
    torch.autograd.backward(y, shard.of(dout))


class _TiledResidual(torch.autograd.Function):
    """``h + modules(h)`` over sequence shards, output and input gradient written in place.

    Hand-written rather than DeepSpeed's ``TiledMLP``/``SequenceTiledCompute`` because those
    concatenate the shards' outputs (the output exists twice while it is assembled) and leave
    the residual add outside, so under checkpointing the recomputed block holds the norm's
    output, the MLP's shards, their concatenation and the sum at once. Here ``h`` is the only
    saved tensor; forward writes ``h + modules(h)`` shard by shard into one buffer, and backward
    writes ``dh = dout + d modules`` shard by shard into one buffer (the residual's gradient
    needs no separate add). Parameter gradients accumulate in their ``.grad`` through the
    shards' own backward, as TiledMLP's do. Each shard is one metadata-pure call, replayed by
    the emulator as ``tiled``'s are.
    """

    @staticmethod
    def forward(ctx, modules, h, shards, *params):
        ctx.modules, ctx.shards = modules, shards
        ctx.amp = autocast_state(h.device.type)  # the recompute runs as the forward did
        ctx.save_for_backward(h)
        out = torch.empty_like(h)
        for s in _shards(h.shape[-2], shards, -2):
            _residual_forward(modules, h, out, s)
        return out

    @staticmethod
    def backward(ctx, dout):
        (h,) = ctx.saved_tensors
        dh = dout.clone(memory_format=torch.contiguous_format)  # the residual's part
        with recompute_autocast(ctx.amp):
            for s in _shards(h.shape[-2], ctx.shards, -2):
                _residual_backward(ctx.modules, h, dh, dout, s, _grads_exist(ctx.modules))
        return None, dh, None, *(None for _ in ctx.needs_input_grad[3:])


def tiled_residual(modules: tuple[nn.Module, ...], h: torch.Tensor) -> torch.Tensor:
    """``h + modules[-1](... modules[0](h))`` over ceil(L / dim) sequence shards (the tiled MLP's
    rule), in place.

    ``modules``: per-token modules of h (B, L, dim) -> (B, L, dim), applied in turn, e.g. a
    pre-norm then an MLP; their parameters get their gradients through ``.grad``, as with
    ``tiled``.
    """
    if not (isinstance(modules, (tuple, list)) and modules
            and all(isinstance(m, nn.Module) for m in modules)):
        raise TypeError("tiled_residual: modules must be a non-empty tuple of nn.Module, "
                        f"applied in turn (e.g. (norm, mlp)); got {modules!r}")
    modules = tuple(modules)
    shards = max(1, math.ceil(h.shape[-2] / h.shape[-1]))
    # the parameters are inputs so the output requires grad when only they do (as ``tiled``'s)
    params = [p for m in modules for p in m.parameters()]
    return _TiledResidual.apply(modules, h, shards, *params)
