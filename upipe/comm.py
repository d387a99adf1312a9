"""Sequence <-> head all-to-all for (batch, seq, heads, head_dim) tensors.

Layout contract (contiguous sequence sharding, rank r holds tokens [r*L, (r+1)*L)):

* ``seq_to_head``: (B, L, n, D) on each rank -> (B, C*L, n/C, D); rank r receives heads
  [r*n/C, (r+1)*n/C) over the full sequence, tokens in rank order.
* ``head_to_seq``: the exact inverse, (B, S, m, D) -> (B, S/C, C*m, D).

Both are pure data movement (bit-exact round trip). ``seq_to_head_start`` / ``head_to_seq_start``
issue the same all-to-alls asynchronously (``async_op=True``) and return a ``Transfer`` to wait
on later: UPipe's overlapped stages (``upipe.untied``). The autograd wrappers' backward is the
opposite all-to-all. Written by hand (rather than with DeepSpeed's ``_SeqAllToAll``) because it
must run under FakeTensorMode with the ``fake`` process group and take an explicit group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from upipe.pure import metadata_pure


def group_size(group: ProcessGroup | None) -> int:
    """World size of ``group``; 1 when torch.distributed is not initialised. A ValueError
    when this rank is not in ``group`` (torch answers -1, which the methods took for a size)."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return _member(dist.get_world_size(group))


def group_rank(group: ProcessGroup | None) -> int:
    """Rank within ``group``; 0 when torch.distributed is not initialised. A ValueError when
    this rank is not in ``group``."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return _member(dist.get_rank(group))


def _member(value: int) -> int:
    if value < 0:
        raise ValueError(f"group must contain this rank (global rank {dist.get_rank()}): a "
                         "rank outside it has no place in its sequence shards; give each rank "
                         "the group it belongs to (every rank calls dist.new_group for every "
                         "group, and keeps its own)")
    return value


def check_mesh_axes(group: ProcessGroup | None, ring_group: ProcessGroup) -> None:
    """Refuse a (ring, ulysses) pair of groups that are not two axes of one mesh: they must
    meet at this rank only (the same group twice made a hybrid that took the sequence for
    ring x ulysses shards of what it was, and mixed heads held by different ranks)."""
    if not dist.is_available() or not dist.is_initialized():
        return
    ulysses = set(dist.get_process_group_ranks(group or dist.group.WORLD))
    ring = set(dist.get_process_group_ranks(ring_group))
    if ulysses & ring != {dist.get_rank()}:
        raise ValueError(f"ring_group and group must be two axes of one mesh, meeting at this "
                         f"rank only: they share global ranks {sorted(ulysses & ring)} (use "
                         "DeviceMesh's two dimensions: upipe.module.mesh_groups)")


def _all_to_all(chunks: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """all_to_all_single over dim 0 of a contiguous (C, ...) tensor: chunk i goes to rank i."""
    if group_size(group) == 1:
        return chunks
    out = torch.empty_like(chunks)
    dist.all_to_all_single(out, chunks, group=group)
    return out


def _all_to_all_async(chunks: torch.Tensor, group: ProcessGroup | None):
    """``_all_to_all`` issued with ``async_op=True``: (recv buffer, work handle). The emulator
    tells these from the blocking ones by this function's name (``op_costs``): they run beside
    the compute stream (NCCL's stream on CUDA, gloo's worker thread on CPU)."""
    out = torch.empty_like(chunks)
    return out, dist.all_to_all_single(out, chunks, group=group, async_op=True)


def _pack_seq_to_head(x: torch.Tensor, c: int) -> torch.Tensor:
    """(B, L, n, D), or a (B, L, C, *, D) view already split by destination rank (e.g.
    ``upipe.staging.stage_heads``), -> the contiguous (C, B, L, n/C, D) send buffer: chunk i
    holds the heads destined for rank i."""
    if x.dim() == 4:
        b, l, n, d = x.shape
        if n % c:
            raise ValueError(f"heads ({n}) must be divisible by the CP degree ({c})")
        x = x.unflatten(2, (c, n // c))
    return x.movedim(2, 0).contiguous().flatten(3, -2)


def _unpack_seq_to_head(recv: torch.Tensor) -> torch.Tensor:
    """(C_src, B, L, m, D), chunk i = rank i's tokens -> (B, C*L, m, D)."""
    c, b, l, m, d = recv.shape
    return recv.permute(1, 0, 2, 3, 4).reshape(b, c * l, m, d)


def _pack_head_to_seq(x: torch.Tensor, c: int) -> torch.Tensor:
    """(B, S, m, D) -> the contiguous (C, B, S/C, m, D) send buffer: chunk i holds rank i's
    tokens (a view, no copy, when B == 1)."""
    b, s, m, d = x.shape
    if s % c:
        raise ValueError(f"sequence ({s}) must be divisible by the CP degree ({c})")
    return x.reshape(b, c, s // c, m, d).transpose(0, 1).contiguous()


def _unpack_head_to_seq(recv: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
    """(C_src, B, L, m, D), chunk i = rank i's heads -> (B, L, C*m, D); with ``into`` (a
    (B, L, C, *, D) view, e.g. a stage's heads of an output buffer) written there in one copy
    and ``into`` returned."""
    c, b, l, m, d = recv.shape
    src = recv.permute(1, 2, 0, 3, 4)  # (B, L, C, m, D)
    if into is None:
        return src.reshape(b, l, c * m, d)
    return into.copy_(src.reshape(into.shape))


@metadata_pure
def seq_to_head(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """(B, L, n, D) sequence-sharded -> (B, C*L, n/C, D) head-sharded. No autograd.

    x may also be a (B, L, C, *, D) view split by destination rank (``_pack_seq_to_head``)."""
    c = group_size(group)
    if c == 1:
        return x if x.dim() == 4 else x.flatten(2, -2)
    return _unpack_seq_to_head(_all_to_all(_pack_seq_to_head(x, c), group))


@metadata_pure
def head_to_seq(x: torch.Tensor, group: ProcessGroup | None,
                into: torch.Tensor | None = None) -> torch.Tensor:
    """(B, S, m, D) head-sharded -> (B, S/C, C*m, D) sequence-sharded. No autograd.

    ``into``: a (B, S/C, C, *, D) view to write the result into (returned)."""
    c = group_size(group)
    if c == 1:
        return x if into is None else into.copy_(x.reshape(into.shape))
    return _unpack_head_to_seq(_all_to_all(_pack_head_to_seq(x, c), group), into)


class Transfer:
    """One all-to-all, in flight (``overlap``) or done: ``wait()`` returns its unpacked result
    once. Holding it keeps the send and receive buffers alive until then, so no buffer is
    reused while the collective may still read or write it (no ``record_stream`` needed)."""

    def __init__(self, send, recv, work, unpack):
        self._send, self._recv, self._work, self._unpack = send, recv, work, unpack

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
        out = self._unpack(self._recv)
        self._send = self._recv = self._work = self._unpack = None
        return out


def _start(x, group, overlap: bool, pack, unpack, sync) -> Transfer:
    c = group_size(group)
    if not overlap or c == 1:
        return Transfer(None, sync(), None, lambda y: y)
    send = pack(x, c)
    recv, work = _all_to_all_async(send, group)
    return Transfer(send, recv, work, unpack)


def seq_to_head_start(x: torch.Tensor, group: ProcessGroup | None, overlap: bool) -> Transfer:
    """``seq_to_head(x, group)`` as a ``Transfer``: issued asynchronously with ``overlap``,
    else run now (the blocking ``seq_to_head``)."""
    return _start(x, group, overlap, _pack_seq_to_head, _unpack_seq_to_head,
                  lambda: seq_to_head(x, group))


def head_to_seq_start(x: torch.Tensor, group: ProcessGroup | None, overlap: bool,
                      into: torch.Tensor | None = None) -> Transfer:
    """``head_to_seq(x, group, into)`` as a ``Transfer`` (see ``seq_to_head_start``)."""
    return _start(x, group, overlap, _pack_head_to_seq,
                  lambda recv: _unpack_head_to_seq(recv, into),
                  lambda: head_to_seq(x, group, into))


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
