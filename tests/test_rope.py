"""RoPE: rotate-half convention against an independent pairwise rotation, and its inverse."""

from __future__ import annotations

import math

import torch

from upipe.rope import apply_rope, apply_rope_inverse, rope_tables


def _rotate_pairs(x, positions, theta):
    """Independent formulation: pair (x[i], x[i + d/2]) rotated by p * theta^(-2i/d)."""
    d = x.shape[-1]
    out = x.clone()
    for i in range(d // 2):
        ang = positions.double() * theta ** (-2 * i / d)
        c, s = torch.cos(ang)[None, :, None], torch.sin(ang)[None, :, None]
        a, b = x[..., i], x[..., i + d // 2]
        out[..., i], out[..., i + d // 2] = a * c - b * s, a * s + b * c
    return out


def test_matches_pairwise_rotation_at_global_positions():
    pos = torch.arange(100, 113)  # a shard that does not start at 0
    x = torch.randn(2, 13, 3, 8, dtype=torch.float64)
    cos, sin = rope_tables(pos, 8, 500000.0, torch.float64)
    torch.testing.assert_close(apply_rope(x, cos, sin), _rotate_pairs(x, pos, 500000.0))


def test_inverse_is_transpose_and_undoes_rotation():
    pos = torch.arange(0, 17)
    x, y = torch.randn(2, 2, 17, 4, 16, dtype=torch.float64)
    cos, sin = rope_tables(pos, 16, 10000.0, torch.float64)
    torch.testing.assert_close(apply_rope_inverse(apply_rope(x, cos, sin), cos, sin), x)
    lhs = (apply_rope(x, cos, sin) * y).sum()
    rhs = (x * apply_rope_inverse(y, cos, sin)).sum()
    assert math.isclose(lhs.item(), rhs.item(), rel_tol=1e-12)
