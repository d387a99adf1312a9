"""Rotary position embedding, Llama 3 / Hugging Face "rotate-half" convention.

A head vector x of size d is split into halves (x1, x2); position p rotates pair (x1[i], x2[i])
by angle p * theta**(-2i/d). With cos/sin tables duplicated over both halves this is
``x * cos + rotate_half(x) * sin`` (the form used by Hugging Face's ``apply_rotary_pos_emb``).

The rotation is orthogonal, so its inverse (used in UPipe's backward, which undoes RoPE on dQ/dK
without autograd) is the rotation by the negative angle: ``x * cos - rotate_half(x) * sin``.
"""

from __future__ import annotations

import torch

from upipe.pure import metadata_pure


def default_inv_freq(head_dim: int, theta: float, device=None,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """theta**(-2i/d) for i < d/2: the (d/2,) inverse frequencies of plain RoPE."""
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=dtype) / head_dim))


def rope_tables(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
    inv_freq: torch.Tensor | None = None, scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for the given global token positions.

    Args:
        positions: (seq,) integer global token indices.
        head_dim: d, must be even.
        theta: RoPE base (500000 for Llama 3).
        dtype: dtype of the returned tables (that of the activations they multiply).
        inv_freq: optional (d/2,) inverse frequencies replacing theta's, e.g. a Hugging Face
            model's ``rotary_emb.inv_freq``, which carries its rope scaling (Llama 3.1's
            "llama3", "linear", "yarn").
        scaling: factor on cos and sin (Hugging Face's ``attention_scaling``; 1 unless yarn).

    Returns:
        (cos, sin), each (seq, head_dim), computed in fp32 (fp64 if ``dtype`` is fp64) and cast,
        as Hugging Face does.
    """
    work = torch.float64 if dtype == torch.float64 else torch.float32
    if inv_freq is None:
        inv_freq = default_inv_freq(head_dim, theta, positions.device, work)
    elif inv_freq.shape != (head_dim // 2,):
        raise ValueError(
            f"inv_freq must have shape ({head_dim // 2},), got {tuple(inv_freq.shape)}"
        )
    freqs = positions.to(work)[:, None] * inv_freq.to(positions.device, work)[None, :]  # (seq, d/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (seq, d)
    cos, sin = emb.cos(), emb.sin()
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x of shape (batch, seq, heads, d) by tables of shape (seq, d)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + rotate_half(x) * sin


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           inverse: bool = False, split: int | None = None) -> torch.Tensor:
    """:func:`apply_rope` (``inverse``: its inverse) of x (batch, seq, heads, d), outside autograd.

    For the hand-written forward and backward passes (UPipe's projections, FPDT's backward),
    which need no graph: one product and two half-width fused multiply-adds into a new tensor
    (``x * cos``, then ``-/+ x2 * sin`` on the first half, ``+/- x1 * sin`` on the second),
    instead of :func:`apply_rope`'s five kernels and three temporaries (its form is Hugging
    Face's, which the models differentiate through). Each fused multiply-add rounds once, so
    results agree with :func:`apply_rope` to the dtype's rounding, not bit for bit.

    The output is contiguous even when x is a strided view (an all-to-all's unpacked result),
    so the caller's reshape of it is a view. With ``split`` (a CP degree C dividing heads) it is
    instead the (batch, seq, C, heads/C, d) view of a contiguous (C, batch, seq, heads/C, d)
    tensor: the sequence-to-head all-to-all's send buffer (``upipe.comm``), which then needs no
    packing copy.
    """
    h = x.shape[-1] // 2
    cos, sin = cos[:, None, :], sin[:, None, :]
    if split is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        b, s, n, d = x.shape
        x = x.unflatten(2, (split, n // split))
        cos, sin = cos[:, None], sin[:, None]
        out = torch.empty(split, b, s, n // split, d, dtype=x.dtype,
                          device=x.device).permute(1, 2, 0, 3, 4)
    sign = -1.0 if inverse else 1.0
    torch.mul(x, cos, out=out)
    out[..., :h].addcmul_(x[..., h:], sin[..., :h], value=-sign)
    out[..., h:].addcmul_(x[..., :h], sin[..., h:], value=sign)
    return out


@metadata_pure
def apply_rope_inverse(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse (= transpose) of :func:`apply_rope`; maps d(rotated) to d(unrotated) (outside
    autograd: :func:`rotate`)."""
    return rotate(x, cos, sin, inverse=True)
