"""Sequence <-> head all-to-all for (batch, seq, heads, head_dim) tensors.

Layout contract (contiguous sequence sharding, rank r holds tokens [r*L, (r+1)*L)):

* ``seq_to_head``: (B, L, n, D) on each rank -> (B, C*L, n/C, D); rank r receives heads
  [r*n/C, (r+1)*n/C) over the full sequence, tokens in rank order.
* ``head_to_seq``: the exact inverse, (B, S, m, D) -> (B, S/C, C*m, D).

Both are pure data movement (bit-exact round trip). The autograd wrappers' backward is the
opposite all-to-all. Written by hand (rather than with DeepSpeed's ``_SeqAllToAll``) because it
must run under FakeTensorMode with the ``fake`` process group and take an explicit group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from upipe.pure import metadata_pure


def group_size(group: ProcessGroup | None) -> int:
    """World size of ``group``; 1 when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """Rank within ``group``; 0 when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def _all_to_all(chunks: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """all_to_all_single over dim 0 of a contiguous (C, ...) tensor: chunk i goes to rank i."""
    if group_size(group) == 1:
        return chunks
    out = torch.empty_like(chunks)
    dist.all_to_all_single(out, chunks, group=group)
    return out


@metadata_pure
def seq_to_head(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """(B, L, n, D) sequence-sharded -> (B, C*L, n/C, D) head-sharded. No autograd."""
    c = group_size(group)
    if c == 1:
        return x
    b, l, n, d = x.shape
    if n % c:
        raise ValueError(f"heads ({n}) must be divisible by the CP degree ({c})")
    # (C, B, L, n/C, D): chunk i holds the heads destined for rank i.
    send = x.reshape(b, l, c, n // c, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = _all_to_all(send, group)  # (C_src, B, L, n/C, D): chunk i = rank i's tokens
    return recv.permute(1, 0, 2, 3, 4).reshape(b, c * l, n // c, d)


@metadata_pure
def head_to_seq(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """(B, S, m, D) head-sharded -> (B, S/C, C*m, D) sequence-sharded. No autograd."""
    c = group_size(group)
    if c == 1:
        return x
    b, s, m, d = x.shape
    if s % c:
        raise ValueError(f"sequence ({s}) must be divisible by the CP degree ({c})")
    # (C, B, S/C, m, D): chunk i holds the tokens destined for rank i.
    send = x.reshape(b, c, s // c, m, d).transpose(0, 1).contiguous()
    recv = _all_to_all(send, group)  # (C_src, B, S/C, m, D): chunk i = rank i's heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s // c, c * m, d)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return seq_to_head(x, group)

    @staticmethod
    def backward(ctx, grad):
        return head_to_seq(grad, ctx.group), None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return head_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return seq_to_head(grad, ctx.group), None


def seq_to_head_autograd(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Differentiable :func:`seq_to_head`; its backward is :func:`head_to_seq`."""
    return _SeqToHead.apply(x, group)


def head_to_seq_autograd(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Differentiable :func:`head_to_seq`; its backward is :func:`seq_to_head`."""
    return _HeadToSeq.apply(x, group)
