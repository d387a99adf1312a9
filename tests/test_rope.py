"""RoPE: rotate-half convention against an independent pairwise rotation, and its inverse;
the fused form outside autograd (``rotate``) against it."""

from __future__ import annotations

import math

import pytest
import torch

from upipe.rope import apply_rope, apply_rope_inverse, rope_tables, rotate


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


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6),
                                       (torch.bfloat16, 1e-2)])
def test_fused_rotation_matches_and_is_contiguous_from_a_strided_view(dtype, tol):
    """``rotate`` is apply_rope (inverse: apply_rope_inverse) to the dtype's rounding, and writes
    a contiguous tensor when its input is a permuted view (an all-to-all's unpacked receive)."""
    pos = torch.arange(40, 51)
    cos, sin = rope_tables(pos, 16, 500000.0, dtype)
    recv = torch.randn(3, 2, 11, 1, 16, dtype=torch.float64).to(dtype)  # (C, B, L, m, D)
    x = recv.permute(1, 2, 0, 3, 4).reshape(2, 11, 3, 16)  # a strided view, as comm unpacks
    assert not x.is_contiguous()
    for inverse, reference in ((False, apply_rope), (True, apply_rope_inverse)):
        y = rotate(x, cos, sin, inverse=inverse)
        assert y.is_contiguous() and y.dtype == dtype
        want = reference(x.double(), cos.double(), sin.double())
        torch.testing.assert_close(y.double(), want, atol=tol, rtol=tol)
