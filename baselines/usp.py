"""``usp``: the Ulysses x Ring hybrid (USP; Fang & Zhao, arXiv 2405.07719) over a 2-D mesh.

The CP ranks form a DeviceMesh with axes ``ring`` (outer) and ``ulysses`` (inner: neighbouring
ranks, one node). Each rank projects Q, K, V for its tokens and applies RoPE at their global
positions; a sequence->head all-to-all over the ``ulysses`` axis gives it H/C_u heads of its ring
rank's whole token block; zigzag ring attention over the ``ring`` axis covers the rest of the
sequence; the inverse all-to-all and the output projection follow. The paper's multi-node
configuration is 8 x 2 (Ulysses inside a node, ring across two).

Layout: zigzag over the ring ranks, each ring rank's zigzag pair split contiguously over its
ulysses ranks (``SeqLayout("zigzag", inner=C_u)``), so after the all-to-all the pair arrives in
order and causal ring work is balanced. Head rules are Ulysses' over C_u (KV heads replicated
when fewer than C_u). Without a mesh (a plain ``group``) it is Ulysses.
"""

from __future__ import annotations

from baselines.ulysses import UlyssesAttention
from upipe.registry import register_method


@register_method("usp")
class USPAttention(UlyssesAttention):
    """USP attention; construct with ``mesh=`` (axes ``ring``, ``ulysses``).

    forward(x_local (B, L, dim), cu_seqlens=None) -> (B, L, dim), x_local in the hybrid layout
    (use ``shard``). The forward is Ulysses' (``UlyssesAttention.forward`` passes the ring axis
    and, with packed documents, the ring's view of them).
    """

    supports_mesh = True
