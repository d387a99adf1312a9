"""Sequence layouts: which global tokens each CP rank holds, and shard/unshard helpers.

Only the contiguous layout exists so far (rank r holds tokens [r*L, (r+1)*L)); the zigzag layout
for load-balanced causal ring attention plugs in here. Tests and the harness always go through
these helpers (via a method's ``shard``/``unshard``) so no caller special-cases a method.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from upipe.comm import group_rank, group_size

LAYOUTS = ("contiguous",)


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def check_seq_len(seq_len: int, cp: int) -> None:
    """The global sequence must split evenly over the CP ranks."""
    if seq_len % cp:
        raise ValueError(
            f"seq_len ({seq_len}) must be divisible by the CP degree ({cp}); pad the sequence"
        )


def shard_sequence(
    x: torch.Tensor, rank: int, world: int, layout: str = "contiguous", dim: int = 1
) -> torch.Tensor:
    """This rank's shard (a view) of the full sequence ``x`` along ``dim``."""
    check_layout(layout)
    check_seq_len(x.shape[dim], world)
    return x.chunk(world, dim=dim)[rank]


def unshard_sequence(
    x_local: torch.Tensor, group: ProcessGroup | None, layout: str = "contiguous", dim: int = 1
) -> torch.Tensor:
    """Gather every rank's shard back into the full sequence (all_gather; no autograd)."""
    check_layout(layout)
    world = group_size(group)
    if world == 1:
        return x_local
    parts = [torch.empty_like(x_local) for _ in range(world)]
    dist.all_gather(parts, x_local.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def local_positions(
    seq_local: int, rank: int, world: int, layout: str = "contiguous", device=None
) -> torch.Tensor:
    """Global token indices (seq_local,) of this rank's shard, used for RoPE."""
    check_layout(layout)
    return torch.arange(rank * seq_local, (rank + 1) * seq_local, device=device)


def group_shard(x: torch.Tensor, group: ProcessGroup | None, layout: str, dim: int = 1):
    """:func:`shard_sequence` for the calling rank of ``group``."""
    return shard_sequence(x, group_rank(group), group_size(group), layout, dim)
