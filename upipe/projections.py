"""UPipe's projections of a head subset, and their hand-written backward (``upipe.untied``).

Each stage projects only its own heads from the layer input (``Projection``: linear, optional bias
and per-head RMSNorm, RoPE), and its backward accumulates the weight rows' gradients and dx in
place; the output projection's gradient is formed stage by stage (``OutputGrad``), so no
all-heads (B, L, H, D) tensor but the output buffer ever exists.

With a fused input norm (``in_w``: the block's pre-attention RMSNorm weight over dim), the
layer input is the block's *un-normalised* x and every product with it normalises x tile by tile
(``dim`` tokens per tile, the tiled MLP's rule): the normalised (L, dim) input is never stored,
at the cost of recomputing the norm per stage. dx is then accumulated as the gradient of the
normalised input and turned into x's by ``input_norm_backward`` at the end.
"""

from __future__ import annotations

import torch

from upipe.chunked import chunk_spans
from upipe.norm import rms_norm, rms_norm_backward
from upipe.pure import metadata_pure
from upipe.rope import apply_rope_inverse, rotate


def _rows(w: torch.Tensor, heads: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The projection rows of ``heads`` from w (n*head_dim, dim) -> (len(heads)*head_dim, dim)."""
    return w.view(-1, head_dim, w.shape[-1]).index_select(0, heads).flatten(0, 1)


class Projection:
    """One of the q/k/v projections of a head subset, and its hand-written backward.

    w (n*D, dim) head-major rows; optional bias b (n*D,) (Qwen2) and per-head RMSNorm weight
    (D,) applied before RoPE (Qwen3). Without bias or norm this is ``x @ rows^T`` (+ RoPE)
    exactly, allocating nothing more.
    """

    def __init__(self, w, b, norm_w, eps: float, rope: bool, head_dim: int, in_w=None,
                 in_eps: float = 0.0):
        self.w, self.b, self.norm_w, self.eps, self.rope, self.d = w, b, norm_w, eps, rope, head_dim
        self.in_w, self.in_eps = in_w, in_eps  # the fused input norm (module docstring), or None
        self.dw = self.db = self.dnorm = None  # gradient accumulators, made by the backward

    def rows(self, heads: torch.Tensor) -> torch.Tensor:
        return _rows(self.w, heads, self.d)

    def pre_norm(self, x, heads, w_rows) -> torch.Tensor:
        """x (B, L, dim) -> (B, L, n, D): the linear part (bias included)."""
        y = input_matmul(x, w_rows, self.in_w, self.in_eps)
        if self.b is not None:
            y += self.b.view(-1, self.d).index_select(0, heads).flatten()
        return y.unflatten(-1, (-1, self.d))

    def finish(self, pre, cos, sin, split: int | None = None) -> torch.Tensor:
        """Norm (if any) and RoPE (if ``rope``; ``split``: into the all-to-all's send layout,
        ``upipe.rope.rotate``) of the linear part."""
        y = pre if self.norm_w is None else rms_norm(pre, self.norm_w, self.eps)
        return rotate(y, cos, sin, split=split) if self.rope else y

    def __call__(self, x, heads, cos, sin, w_rows=None, split: int | None = None):
        """(B, L, n, D) projection of x for ``heads``: linear, norm, RoPE; with ``split`` (the
        CP degree C) a rotated projection is the (B, L, C, n/C, D) view of the sequence-to-head
        all-to-all's send buffer (``upipe.rope.rotate``), so packing it copies nothing."""
        return _project(x, heads, cos, sin, w_rows, self.w, self.b, self.norm_w, self.eps,
                        self.rope, self.d, self.in_w, self.in_eps, split)

    def unrotate(self, dy: torch.Tensor, cos, sin) -> torch.Tensor:
        """The gradient before RoPE (the inverse rotation), or dy for V."""
        return apply_rope_inverse(dy, cos, sin) if self.rope else dy

    def backward(self, dy, x, x2, heads, w_rows, dx2, overwrite: bool = False) -> None:
        """Accumulate the gradients of ``self(x, heads)`` for dy (B, L, n, D), already unrotated.

        dw[heads] += g^T x; db[heads] += sum g; dx += g @ rows (``overwrite``: dx = g @ rows,
        the first contribution, so dx2 need not be zeroed), with g the gradient before the
        norm (its weight's gradient summed into ``dnorm``). ``index_add_`` sums KV replicas'
        rows; ``addmm_`` accumulates dx without an (L, dim) temporary.
        """
        if self.norm_w is not None:  # recompute the stage's linear part for the norm backward
            dy, dnorm = rms_norm_backward(self.pre_norm(x, heads, w_rows), self.norm_w,
                                          self.eps, dy)
            # summed over stages in fp32, as one autograd reduction over all heads would be
            self.dnorm = dnorm.float() if self.dnorm is None else self.dnorm.add_(dnorm)
        if self.db is None and self.b is not None:
            self.db = torch.zeros_like(self.b)
        dy2 = dy.reshape(x2.shape[0], -1)
        if self.db is not None:
            self.db.view(-1, self.d).index_add_(0, heads, dy2.sum(0).view(-1, self.d))
        _accumulate_rows(dy2, x2, heads, w_rows, self.dw, dx2, self.d, self.in_w, self.in_eps,
                         0.0 if overwrite else 1.0)

    def grads(self) -> tuple:
        """(dw, db, dnorm) for the autograd Function's return (every head was visited)."""
        dnorm = None if self.dnorm is None else self.dnorm.to(self.norm_w.dtype)
        return self.dw, self.db, dnorm


# The per-stage pieces below run once per head stage with the same shapes in every stage:
# marked metadata-pure (upipe.pure), so the emulator replays them instead of dispatching their
# ops again (they are most of an emulated UPipe layer's ops once the ring loop is replayed).


def _tiles(n: int, dim: int) -> list[tuple[int, int]]:
    """Row tiles of the fused input norm: ``dim`` tokens each (the tiled MLP's shard size)."""
    return chunk_spans(n, dim)


def input_matmul(x, w_rows, in_w, in_eps: float) -> torch.Tensor:
    """x (B, L, dim) @ w_rows^T -> (B, L, m); with ``in_w``, of rms_norm(x) tile by tile into
    one output (no normalised (L, dim) tensor)."""
    if in_w is None:
        return x @ w_rows.t()
    x2 = x.reshape(-1, x.shape[-1])
    y = x2.new_empty(x2.shape[0], w_rows.shape[0])
    for a, b in _tiles(x2.shape[0], x2.shape[1]):
        torch.mm(rms_norm(x2[a:b], in_w, in_eps), w_rows.t(), out=y[a:b])
    return y.view(*x.shape[:-1], -1)


def _input_t_matmul(dy2, x2, in_w, in_eps: float) -> torch.Tensor:
    """dy2^T @ x2 (m, dim); with ``in_w``, of rms_norm(x2), tile by tile summed in fp32."""
    if in_w is None:
        return dy2.t() @ x2
    acc = None
    for a, b in _tiles(x2.shape[0], x2.shape[1]):
        part = dy2[a:b].t() @ rms_norm(x2[a:b], in_w, in_eps)
        acc = part.float() if acc is None else acc.add_(part)
        del part
    return acc.to(dy2.dtype)


@metadata_pure
def input_norm_backward(x2, in_w, in_eps: float, dx2) -> torch.Tensor:
    """Turn dx2 (B*L, dim), the gradient of rms_norm(x2), into x2's, tile by tile in place;
    returns the norm weight's gradient (summed over tiles in fp32, in the weight's dtype)."""
    dw = None
    for a, b in _tiles(x2.shape[0], x2.shape[1]):
        dx_t, dw_t = rms_norm_backward(x2[a:b], in_w, in_eps, dx2[a:b])
        dx2[a:b] = dx_t
        dw = dw_t.float() if dw is None else dw.add_(dw_t)
        del dx_t, dw_t
    return dw.to(in_w.dtype)


@metadata_pure
def _project(x, heads, cos, sin, w_rows, w, b, norm_w, eps: float, rope: bool,
             head_dim: int, in_w=None, in_eps: float = 0.0, split: int | None = None):
    """``Projection(w, b, norm_w, eps, rope, head_dim, in_w, in_eps)(x, heads, cos, sin, w_rows,
    split)``: x (B, L, dim) -> (B, L, n, D) for ``heads`` (n,), with w's rows of those heads
    unless ``w_rows`` (n*D, dim) is given."""
    p = Projection(w, b, norm_w, eps, rope, head_dim, in_w, in_eps)
    return p.finish(p.pre_norm(x, heads, p.rows(heads) if w_rows is None else w_rows), cos, sin,
                    split)


@metadata_pure
def _accumulate_rows(dy2, x2, heads, w_rows, dw, dx2, head_dim: int, in_w=None,
                     in_eps: float = 0.0, dx_beta: float = 1.0) -> None:
    """dw[heads] += dy2^T x2 and dx2 = dx_beta * dx2 + dy2 @ w_rows, in place: dy2 (B*L, n*D),
    x2, dx2 (B*L, dim), w_rows (n*D, dim), dw (N*D, dim); ``index_add_`` sums KV replicas'
    rows, ``addmm_`` accumulates dx without an (L, dim) temporary (``dx_beta`` 0: dx2's
    contents, uninitialised, are ignored, as ``addmm`` ignores its input at beta 0). With
    ``in_w`` x2 is normalised tile by tile for dw, and dx2 is the normalised input's gradient."""
    dw.view(-1, head_dim, dw.shape[-1]).index_add_(
        0, heads, _input_t_matmul(dy2, x2, in_w, in_eps).view(-1, head_dim, x2.shape[-1]))
    dx2.addmm_(dy2, w_rows, beta=dx_beta)


@metadata_pure
def _wo_heads(grad2, wo, heads, head_dim: int) -> torch.Tensor:
    """grad2 (B*L, dim) @ wo's columns of ``heads`` (n,) -> (B*L, n*D)."""
    cols = wo.view(wo.shape[0], -1, head_dim).index_select(1, heads).flatten(1)
    return grad2 @ cols


class OutputGrad:
    """Per-stage slices of the attention output's gradient, (B, L, U, D) for a head subset.

    With the output projection fused (``wo`` given), they are dy @ wo[:, heads] computed stage by
    stage, and dwo = dy^T @ out; otherwise the caller's gradient of the (B, L, H, D) output is
    sliced.
    """

    def __init__(self, grad, out, wo, head_dim):
        self.grad, self.wo, self.d = grad, wo, head_dim
        if wo is None:
            self.dwo = None
        else:
            self.grad2 = grad.reshape(-1, grad.shape[-1])  # (B*L, dim)
            self.dwo = self.grad2.t() @ out.reshape(self.grad2.shape[0], -1)  # (dim, H*D)

    def stage(self, heads: torch.Tensor) -> torch.Tensor:
        if self.wo is None:
            return self.grad.index_select(2, heads)
        return _wo_heads(self.grad2, self.wo, heads, self.d).view(*self.grad.shape[:-1], -1,
                                                                  self.d)


def projections(wq, wk, wv, bq, bk, bv, q_norm, k_norm, q_eps, k_eps, d, in_w=None, in_eps=0.0):
    """The Q, K and V :class:`Projection` of a layer: Q and K rotated and normed by their own
    per-head RMSNorm (weight (D,) and epsilon, or None), V neither."""
    return (Projection(wq, bq, q_norm, q_eps, True, d, in_w, in_eps),
            Projection(wk, bk, k_norm, k_eps, True, d, in_w, in_eps),
            Projection(wv, bv, None, 0.0, False, d, in_w, in_eps))
