"""Single-device Llama attention: the ground truth every CP method is compared against.

Parameters ``wq``, ``wk``, ``wv``, ``wo`` are bias-free ``nn.Linear`` layers with the shapes and
names of Llama / Hugging Face (``q_proj`` etc. map one-to-one), so its ``state_dict`` loads into
every CP method. Plain autograd, public SDPA with ``enable_gqa`` (torch >= 2.5), rotate-half RoPE.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from upipe.rope import apply_rope, rope_tables


def resolve_head_dim(dim: int, n_heads: int, head_dim: int | None) -> int:
    """``head_dim`` or ``dim // n_heads``; validates the shape fields."""
    for name, val in (("dim", dim), ("n_heads", n_heads)):
        if val <= 0:
            raise ValueError(f"{name} must be positive, got {val}")
    if head_dim is None:
        if dim % n_heads:
            raise ValueError(
                f"dim ({dim}) must be divisible by n_heads ({n_heads}) when head_dim is not given"
            )
        head_dim = dim // n_heads
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be positive and even (RoPE), got {head_dim}")
    return head_dim


class LlamaAttention(nn.Module):
    """Reference causal (or full) self-attention over the whole sequence on one device.

    forward(x): x (batch, seq, dim) -> (batch, seq, dim); ``positions`` (seq,) default arange.
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int | None = None,
        *,
        causal: bool = True,
        rope_theta: float = 500000.0,
    ):
        super().__init__()
        self.head_dim = resolve_head_dim(dim, n_heads, head_dim)
        if n_kv_heads <= 0 or n_heads % n_kv_heads:
            raise ValueError(
                f"n_heads ({n_heads}) must be a positive multiple of n_kv_heads ({n_kv_heads})"
            )
        self.dim, self.n_heads, self.n_kv_heads = dim, n_heads, n_kv_heads
        self.causal, self.rope_theta = causal, rope_theta
        d = self.head_dim
        self.wq = nn.Linear(dim, n_heads * d, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * d, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * d, bias=False)
        self.wo = nn.Linear(n_heads * d, dim, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        d = self.head_dim
        if positions is None:
            positions = torch.arange(s, device=x.device)
        cos, sin = rope_tables(positions, d, self.rope_theta, x.dtype)
        q = apply_rope(self.wq(x).view(b, s, self.n_heads, d), cos, sin)
        k = apply_rope(self.wk(x).view(b, s, self.n_kv_heads, d), cos, sin)
        v = self.wv(x).view(b, s, self.n_kv_heads, d)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            is_causal=self.causal, enable_gqa=True,
        )
        return self.wo(o.transpose(1, 2).reshape(b, s, self.n_heads * d))
