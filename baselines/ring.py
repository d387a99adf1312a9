"""``ring``: ring attention with the contiguous layout (Liu et al., arXiv 2310.01889).

Project Q, K, V for the local shard, RoPE at global positions, then
:func:`upipe.ring.ring_attention` over the CP group: K/V blocks travel the ring with P2P
send/recv, each step's block is merged with the log-sum-exp merge, and the custom backward
passes dK/dV around the ring. No head rule: heads
are never split, so any head count and GQA ratio work on any number of ranks; K/V travel with
their own (GQA) head count.

With causal masking the contiguous layout is unbalanced (rank r computes r+1 blocks); the
zigzag subclass in ``baselines/zigzag_ring.py`` fixes that with a different layout only.
"""

from __future__ import annotations

import torch

from upipe.module import ContextParallelAttention
from upipe.registry import register_method
from upipe.ring import ring_attention


@register_method("ring")
class RingAttention(ContextParallelAttention):
    """Ring attention module; forward(x_local (B, L, dim), cu_seqlens=None) -> (B, L, dim)."""

    layout = "contiguous"
    p2p_exchange = "its K/V blocks travel the ring by batch_isend_irecv (upipe.ring)"

    @classmethod
    def check_heads(cls, n_heads: int, n_kv_heads: int, ulysses_degree: int, **options) -> None:
        if n_kv_heads <= 0 or n_heads % n_kv_heads:
            raise ValueError(
                f"n_heads ({n_heads}) must be a positive multiple of n_kv_heads ({n_kv_heads})"
            )

    @classmethod
    def critical_rank(cls, cp: int, ring_degree: int = 1) -> int:
        # The last rank, in both layouts. Contiguous + causal: rank r computes r + 1 blocks, the
        # last all of them. Zigzag balances the attention FLOPs, not the rest of a step: every
        # source is earlier than the last rank, so each of its steps is (all queries, first KV
        # half) (upipe.ring.block_plan), whose merge and dQ sum cover all its queries, where
        # rank 0's (second query half, all KV) cover half. The ring waits for its slowest rank.
        return cp - 1

    def forward(self, x: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
        self.check_input(x)
        docs = self.documents(cu_seqlens, x)
        q, k, v = self.project_qkv(x, docs)
        o = ring_attention(q, k, v, group=self.group, zigzag=self.layout == "zigzag",
                           causal=self.causal, kernel=self.kernel,
                           docs=self.ring_documents(docs))
        return self.wo(o.flatten(2))
