"""``zigzag-ring``: ring attention with the load-balanced zigzag layout -- the paper's "Ring".

Same module as ``ring`` (baselines/ring.py); only the sequence layout differs: with 2W chunks,
rank r holds chunks r and 2W-1-r (``upipe.layout``), so under causal masking every ring step is
half a block of work on every rank instead of rank r doing r+1 full blocks
(zhuzilin/ring-flash-attention's zigzag_ring_flash_attn; Brandon et al., arXiv 2311.09431).
The global sequence must be divisible by 2W; ``shard``/``unshard`` do the reordering.
"""

from __future__ import annotations

from baselines.ring import RingAttention
from upipe.registry import register_method


@register_method("zigzag-ring")
class ZigzagRingAttention(RingAttention):
    """Zigzag ring attention module; forward(x_local (B, L, dim)) -> (B, L, dim)."""

    layout = "zigzag"
