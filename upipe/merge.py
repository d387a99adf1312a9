"""Merging partial attention results with their log-sum-exps (ring, FPDT, UPipe-over-ring).

Attention of queries over a key set K = K1 u K2 is a convex combination of the attention over
each part, weighted by each part's softmax mass: with lse_i = log sum_{k in K_i} exp(s_qk),

    lse = log(exp(lse_1) + exp(lse_2)),   out = exp(lse_1 - lse) out_1 + exp(lse_2 - lse) out_2.

Written as ``lse = lse_1 + softplus(lse_2 - lse_1)`` and ``out = out_1 + sigmoid(lse_2 - lse_1)
* (out_2 - out_1)`` so no exp overflows and a part with lse = -inf (no visible key) contributes
nothing (Milakov & Gimelshein, arXiv 1805.02867, online softmax; the sigmoid form follows
zhuzilin/ring-flash-attention's utils, where it replaced an exp form that lost precision).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from upipe.pure import metadata_pure


@metadata_pure
def merge_attention(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """Fold one block's result into the running (out, lse), in place.

    Args:
        out: (B, S, H, D) fp32 running output; updated in place.
        lse: (B, H, S) fp32 running log-sum-exp; updated in place.
        block_out: (B, S, H, D) the block's output (any float dtype).
        block_lse: (B, H, S) the block's log-sum-exp (fp32).
    Views (e.g. the second half of the queries) may be passed for ``out`` and ``lse``.
    """
    diff = (block_lse - lse).transpose(1, 2).unsqueeze(-1)  # (B, S, H, 1)
    out.add_(torch.sigmoid(diff) * (block_out.to(out.dtype) - out))
    lse.add_(F.softplus(block_lse - lse))
