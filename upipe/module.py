"""The interface every CP attention method shares (DESIGN.md §4).

``ContextParallelAttention`` owns what is common: the constructor signature and its validation,
the reference parameter names (``wq``, ``wk``, ``wv``, ``wo``; bias-free), the CP group, the
sequence layout with its shard/unshard helpers, and RoPE tables for this rank's global positions.
Subclasses implement ``forward(x_local) -> y_local`` with x_local (batch, seq_local, dim).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from torch.distributed import ProcessGroup

from upipe.comm import group_rank, group_size
from upipe.kernels import check_kernel
from upipe.layout import check_layout, local_positions, shard_sequence, unshard_sequence
from upipe.reference import resolve_head_dim
from upipe.rope import apply_rope, rope_tables


def check_ulysses_heads(n_heads: int, n_kv_heads: int, cp: int) -> None:
    """Head rules of the all-to-all methods, raised before any collective.

    Query heads split evenly over the CP ranks; KV heads either split evenly too or, when there
    are fewer KV heads than ranks, are replicated, which needs ``cp % n_kv_heads == 0``.
    """
    if n_kv_heads <= 0 or n_heads % n_kv_heads:
        raise ValueError(
            f"n_heads ({n_heads}) must be a positive multiple of n_kv_heads ({n_kv_heads})"
        )
    if n_heads % cp:
        raise ValueError(f"n_heads ({n_heads}) must be divisible by the CP degree ({cp})")
    if n_kv_heads % cp and cp % n_kv_heads:
        raise ValueError(
            f"n_kv_heads ({n_kv_heads}) must divide or be divisible by the CP degree ({cp})"
        )


def replicate_kv_heads(t: torch.Tensor, cp: int) -> torch.Tensor:
    """(B, L, Hkv, D) -> (B, L, cp, D) when Hkv < cp, else ``t`` unchanged.

    Each KV head is repeated cp/Hkv times, so after the sequence->head all-to-all rank r holds KV
    head r // (cp/Hkv) -- the one its query heads h // (H/Hkv) use. Under autograd the copies'
    gradients are summed back.
    """
    n_kv = t.shape[2]
    return t.repeat_interleave(cp // n_kv, dim=2) if n_kv < cp else t


class ContextParallelAttention(nn.Module):
    """Base class: common constructor, parameters, layout and RoPE for CP attention methods.

    Args:
        dim: model width.
        n_heads, n_kv_heads: query and KV head counts (GQA when they differ).
        head_dim: per-head width, default ``dim // n_heads``.
        group: the CP process group (None: the default group, or a single process when
            torch.distributed is not initialised).
        causal: causal masking.
        rope_theta: RoPE base.
        kernel: attention kernel name (:data:`upipe.kernels.KERNELS`).
    """

    registry_name: ClassVar[str] = ""
    layout: ClassVar[str] = "contiguous"

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int | None = None,
        *,
        group: ProcessGroup | None = None,
        causal: bool = True,
        rope_theta: float = 500000.0,
        kernel: str = "auto",
    ):
        super().__init__()
        self.head_dim = resolve_head_dim(dim, n_heads, head_dim)
        self.kernel = check_kernel(kernel)
        check_layout(self.layout)
        self.dim, self.n_heads, self.n_kv_heads = dim, n_heads, n_kv_heads
        self.causal, self.rope_theta = causal, rope_theta
        self.group = group
        self.cp = group_size(group)
        self.rank = group_rank(group)
        self.validate_heads()
        d = self.head_dim
        self.wq = nn.Linear(dim, n_heads * d, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * d, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * d, bias=False)
        self.wo = nn.Linear(n_heads * d, dim, bias=False)

    def validate_heads(self) -> None:
        """Method-specific head rules; the all-to-all rules by default."""
        check_ulysses_heads(self.n_heads, self.n_kv_heads, self.cp)

    # -- layout -------------------------------------------------------------------------------

    def shard(self, x_full: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of a full-sequence tensor (inputs, labels, output gradients)."""
        return shard_sequence(x_full, self.rank, self.cp, self.layout, dim)

    def unshard(self, x_local: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The full sequence gathered from every rank's part (a collective)."""
        return unshard_sequence(x_local, self.group, self.layout, dim)

    # -- helpers for subclasses ---------------------------------------------------------------

    def check_input(self, x: torch.Tensor) -> None:
        """Shape rules for ``x_local``; raised before any collective."""
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(
                f"x_local must have shape (batch, seq_local, dim={self.dim}), got {tuple(x.shape)}"
            )
        if x.shape[1] == 0:
            raise ValueError("x_local must hold at least one token (seq_local > 0)")

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """All heads' projections of x (B, L, dim), the way every all-heads method starts.

        Returns q (B, L, H, D) and k (B, L, Hkv, D) rotated at this rank's global positions,
        and v (B, L, Hkv, D).
        """
        b, l, _ = x.shape
        d = self.head_dim
        cos, sin = self.rope(l, x)
        q = apply_rope(self.wq(x).view(b, l, self.n_heads, d), cos, sin)
        k = apply_rope(self.wk(x).view(b, l, self.n_kv_heads, d), cos, sin)
        return q, k, self.wv(x).view(b, l, self.n_kv_heads, d)

    def rope(self, seq_local: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables (seq_local, head_dim) for this rank's global token positions."""
        pos = local_positions(seq_local, self.rank, self.cp, self.layout, device=x.device)
        return rope_tables(pos, self.head_dim, self.rope_theta, x.dtype)

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
            f"head_dim={self.head_dim}, cp={self.cp}, causal={self.causal}, kernel={self.kernel}"
        )
