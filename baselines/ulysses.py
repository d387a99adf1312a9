"""DeepSpeed-Ulysses-style attention (Jacobs et al., arXiv 2309.14509), written on upipe's pieces.

All heads at once: project Q, K, V for the local shard, RoPE at global positions, one
sequence->head all-to-all per tensor (rank r gets heads [r*H/C, (r+1)*H/C) over the full
sequence), attention, one all-to-all back, output projection. Plain autograd: the all-to-alls'
backward is the opposite all-to-all, and the kernel saves its Q/K/V/out/LSE, so every head's
buffers are alive at once -- the memory UPipe reduces. KV heads fewer than ranks are replicated.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed import ProcessGroup

from upipe.comm import group_size, head_to_seq_autograd, seq_to_head_autograd
from upipe.documents import RingDocuments
from upipe.kernels import attention
from upipe.module import ContextParallelAttention, check_ulysses_heads, replicate_kv_heads
from upipe.registry import register_method
from upipe.ring import ring_attention


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: ProcessGroup | None = None,
    causal: bool = True,
    scale: float | None = None,
    kernel: str = "auto",
    ring_group: ProcessGroup | None = None,
    docs: RingDocuments | None = None,
    core: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """Ulysses core on projected, rotated, sequence-sharded tensors (differentiable).

    Args:
        q: (B, L, H, D); k, v: (B, L, Hkv, D), this rank's shard (contiguous; with
            ``ring_group``, the hybrid layout ``SeqLayout("zigzag", inner=C)``).
        ring_group: USP's ring axis: after the all-to-all over ``group`` a rank holds H/C heads
            of its ring rank's zigzag pair, and attention is zigzag ring attention over it.
        core: without ``ring_group`` or ``docs``, the attention on the head-sharded tensors
            in place of upipe's kernel: ``core(q, k, v, causal=, scale=, kernel=)`` -> out
            (yunchang's ring of one rank, ``baselines.usp_ulysses``).
    Returns:
        (B, L, H, D), heads in model order.
    """
    if core is not None and (ring_group is not None or docs is not None):
        raise ValueError("ulysses_attention: core replaces the local kernel; it takes no "
                         "ring_group and no packed documents")
    cp = group_size(group)
    check_ulysses_heads(q.shape[2], k.shape[2], cp)
    k, v = replicate_kv_heads(k, cp), replicate_kv_heads(v, cp)
    qh, kh, vh = (seq_to_head_autograd(t, group) for t in (q, k, v))
    if core is not None:
        oh = core(qh, kh, vh, causal=causal, scale=scale, kernel=kernel)
    elif ring_group is None:
        oh = attention(qh, kh, vh, causal=causal, scale=scale, kernel=kernel,
                       blocks=None if docs is None else docs.docs.full_blocks())
    else:
        oh = ring_attention(qh, kh, vh, group=ring_group, zigzag=True, causal=causal,
                            scale=scale, kernel=kernel, docs=docs)
    return head_to_seq_autograd(oh, group)


@register_method("ulysses")
class UlyssesAttention(ContextParallelAttention):
    """Ulysses attention module; forward(x_local (B, L, dim), cu_seqlens=None) -> (B, L, dim)."""

    def forward(self, x: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
        self.check_input(x)
        docs = self.documents(cu_seqlens, x)
        q, k, v = self.project_qkv(x, docs)
        o = ulysses_attention(q, k, v, group=self.group, causal=self.causal, kernel=self.kernel,
                              ring_group=self.ring_group, docs=self.ring_documents(docs))
        return self.wo(o.flatten(2))
