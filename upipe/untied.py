"""UPipe ("Untied Ulysses", arXiv 2602.21196): Ulysses attention run head-stage by head-stage.

Forward, per KV block (upipe.staging): project + RoPE + all-to-all the block's K/V once; then per
stage project + RoPE the stage's U query heads from the layer input, all-to-all them to head
layout (U/C heads per rank over the full sequence), run the attention kernel (keeping its LSE),
all-to-all back and write the U heads into one persistent (B, L, H, D) output buffer at their own
head indices; the output projection runs once after the loop. Only the layer input, the buffer and
the per-stage LSEs are saved for backward.

On a 2-D (ring, ulysses) mesh the all-to-alls run over the ulysses axis and each stage's attention
is zigzag ring attention over the ring axis (``upipe.ring.SequenceAttention``): the paper's
multi-node configuration; a stage then also holds the K/V block in flight on the ring.

Backward walks the same schedule: recompute K/V and Q from the saved input, form the stage's
output-gradient heads from dy and the stage's columns of wo (so the full (B, L, H, D) output
gradient never exists), all-to-all them and the stage's output heads, run the kernel backward
with the saved LSE, accumulate dK/dV over the block's stages, all-to-all dQ (and, at the end of a
block, dK/dV) back, undo RoPE, and accumulate dx in place and the weight-row gradients. Peak
attention memory covers U heads plus three (B, L, ~dim) tensors: x, the buffer, dx.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from upipe.comm import group_size, head_to_seq, seq_to_head
from upipe.module import ContextParallelAttention, check_ulysses_heads
from upipe.registry import register_method
from upipe.ring import SequenceAttention
from upipe.rope import apply_rope, apply_rope_inverse
from upipe.staging import StagePlan, check_heads_per_stage, make_stage_plan


def _rows(w: torch.Tensor, heads: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The projection rows of ``heads`` from w (n*head_dim, dim) -> (len(heads)*head_dim, dim)."""
    return w.view(-1, head_dim, w.shape[-1]).index_select(0, heads).flatten(0, 1)


def _project(x, w_rows, head_dim, cos, sin, rope: bool) -> torch.Tensor:
    """x (B, L, dim) @ rows^T -> (B, L, n, head_dim), rotated when ``rope``."""
    y = (x @ w_rows.t()).unflatten(-1, (-1, head_dim))
    return apply_rope(y, cos, sin) if rope else y


def _accumulate(dy, x2, w_rows, heads, dw, dx2, head_dim):
    """Gradients of y = x @ rows^T for a head subset: dw[heads] += dy^T x; dx += dy @ rows.

    dy (B, L, n, D) unrotated; x2 (B*L, dim); dw (H*D, dim) and dx2 (B*L, dim) accumulators.
    ``index_add_`` sums KV replicas' rows; ``addmm_`` accumulates dx without an (L, dim) temporary.
    """
    dy2 = dy.reshape(x2.shape[0], -1)
    dw.view(-1, head_dim, dw.shape[-1]).index_add_(
        0, heads, (dy2.t() @ x2).view(-1, head_dim, x2.shape[-1])
    )
    dx2.addmm_(dy2, w_rows)


class _OutputGrad:
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
        cols = self.wo.view(self.wo.shape[0], -1, self.d).index_select(1, heads).flatten(1)
        return (self.grad2 @ cols).view(*self.grad.shape[:-1], -1, self.d)


class _UPipeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, wq, wk, wv, wo, cos, sin, plan, group, core):
        b, l, _ = x.shape
        d = wq.shape[0] // plan.n_heads
        out = x.new_empty(b, l, plan.n_heads, d)
        lses = []
        for block in plan.blocks:
            kv_idx = torch.tensor(block.kv_heads, device=x.device)
            k = seq_to_head(_project(x, _rows(wk, kv_idx, d), d, cos, sin, True), group)
            v = seq_to_head(_project(x, _rows(wv, kv_idx, d), d, cos, sin, False), group)
            for stage in block.stages:
                q_idx = torch.tensor(stage, device=x.device)
                q = seq_to_head(_project(x, _rows(wq, q_idx, d), d, cos, sin, True), group)
                o, lse = core.forward(q, k, v)
                del q  # free before the all-to-all back allocates
                out.index_copy_(2, q_idx, head_to_seq(o, group))
                lses.append(lse)
                del o
            del k, v
        ctx.save_for_backward(x, wq, wk, wv, wo, cos, sin, out, *lses)
        ctx.plan, ctx.group, ctx.core = plan, group, core
        if wo is None:
            return out
        return out.flatten(2) @ wo.t()

    @staticmethod
    def backward(ctx, grad):
        x, wq, wk, wv, wo, cos, sin, out, *lses = ctx.saved_tensors
        plan, group = ctx.plan, ctx.group
        d = wq.shape[0] // plan.n_heads
        dout = _OutputGrad(grad, out, wo, d)
        # dK/dV sum over a block's stages along the full sequence: fp32 for low-precision inputs
        # ("bf16 with fp32 reductions"); they are only U/C heads wide. dx and the weight rows are
        # accumulated in the input dtype, as autograd would, to keep dx a single (L, dim) tensor.
        acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        x2 = x.reshape(-1, x.shape[-1])
        dx2 = torch.zeros_like(x2)
        dwq, dwk, dwv = (torch.zeros_like(w) for w in (wq, wk, wv))
        lse_it = iter(lses)
        for block in plan.blocks:
            kv_idx = torch.tensor(block.kv_heads, device=x.device)
            wk_rows, wv_rows = _rows(wk, kv_idx, d), _rows(wv, kv_idx, d)
            k = seq_to_head(_project(x, wk_rows, d, cos, sin, True), group)
            v = seq_to_head(_project(x, wv_rows, d, cos, sin, False), group)
            dk = torch.zeros(k.shape, dtype=acc, device=k.device)
            dv = torch.zeros(v.shape, dtype=acc, device=v.device)
            for stage in block.stages:
                q_idx = torch.tensor(stage, device=x.device)
                wq_rows = _rows(wq, q_idx, d)
                q = seq_to_head(_project(x, wq_rows, d, cos, sin, True), group)
                o = seq_to_head(out.index_select(2, q_idx), group)
                do = seq_to_head(dout.stage(q_idx), group)
                dq, dk_s, dv_s = ctx.core.backward(do, q, k, v, o, next(lse_it))
                del q, o, do
                dk.add_(dk_s)
                dv.add_(dv_s)
                del dk_s, dv_s
                dq = apply_rope_inverse(head_to_seq(dq, group), cos, sin)
                _accumulate(dq, x2, wq_rows, q_idx, dwq, dx2, d)
                del dq
            del k, v
            dk = apply_rope_inverse(head_to_seq(dk.to(x.dtype), group), cos, sin)
            _accumulate(dk, x2, wk_rows, kv_idx, dwk, dx2, d)
            del dk
            dv = head_to_seq(dv.to(x.dtype), group)
            _accumulate(dv, x2, wv_rows, kv_idx, dwv, dx2, d)
            del dv
        return dx2.view(x.shape), dwq, dwk, dwv, dout.dwo, *([None] * 5)


def upipe_attention(
    x: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    wv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    wo: torch.Tensor | None = None,
    *,
    n_heads: int,
    n_kv_heads: int,
    group: ProcessGroup | None = None,
    heads_per_stage: int | None = None,
    causal: bool = True,
    scale: float | None = None,
    kernel: str = "auto",
    ring_group: ProcessGroup | None = None,
) -> torch.Tensor:
    """UPipe attention for callers that keep their own projection weights.

    Args:
        x: (B, L, dim) this rank's contiguous sequence shard (tokens [rank*L, (rank+1)*L)).
        wq: (n_heads*D, dim); wk, wv: (n_kv_heads*D, dim) -- nn.Linear weights, head-major rows.
        cos, sin: (L, D) RoPE tables of this rank's global positions (``upipe.rope.rope_tables``).
        wo: optional (dim_out, n_heads*D) output projection weight. Given, it is fused: the
            backward then builds the output gradient stage by stage, never for all heads at once.
        n_heads, n_kv_heads: head counts; group: CP process group (size C).
        heads_per_stage: U, a multiple of C dividing n_heads; default C.
        ring_group: optional ring axis of a 2-D (ring, ulysses) mesh (``group`` is then the
            ulysses axis): each stage's attention is zigzag ring attention over it, and x must
            be in the hybrid layout (``SeqLayout("zigzag", inner=C)``).

    Returns:
        (B, L, dim_out) when ``wo`` is given, else the (B, L, n_heads, D) attention output before
        the output projection, heads in model order.
    """
    cp = group_size(group)
    check_ulysses_heads(n_heads, n_kv_heads, cp)
    plan = make_stage_plan(n_heads, n_kv_heads, cp, heads_per_stage or cp)
    return _UPipeFunction.apply(
        x, wq, wk, wv, wo, cos, sin, plan, group,
        SequenceAttention(causal=causal, scale=scale, kernel=kernel, ring_group=ring_group),
    )


@register_method("upipe")
class UPipeAttention(ContextParallelAttention):
    """UPipe attention module, a drop-in for the reference Llama attention under CP.

    Extra option: ``heads_per_stage`` (U), default the CP degree; it must be a multiple of the CP
    degree and divide ``n_heads``. forward(x_local (B, L, dim)) -> (B, L, dim).

    With ``mesh`` (2-D, axes ``ring`` x ``ulysses``; the paper's multi-node 8 x 2) the stages'
    all-to-alls run over the ulysses axis, U is a multiple of its size, and each stage's attention
    is zigzag ring attention over the ring axis (sequence layout: zigzag over the ring ranks,
    contiguous within a ring rank's ulysses group).
    """

    supports_mesh = True

    def __init__(self, *args, heads_per_stage: int | None = None, **kwargs):
        self.heads_per_stage = heads_per_stage
        super().__init__(*args, **kwargs)
        self.heads_per_stage = heads_per_stage or self.ulysses_degree
        self.plan: StagePlan = make_stage_plan(
            self.n_heads, self.n_kv_heads, self.ulysses_degree, self.heads_per_stage
        )

    def options(self) -> dict:
        return {"heads_per_stage": self.heads_per_stage}

    @classmethod
    def check_heads(cls, n_heads, n_kv_heads, ulysses_degree, *, heads_per_stage=None, **_):
        super().check_heads(n_heads, n_kv_heads, ulysses_degree)
        check_heads_per_stage(n_heads, ulysses_degree, heads_per_stage or ulysses_degree)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.check_input(x)
        cos, sin = self.rope(x.shape[1], x)
        return _UPipeFunction.apply(
            x, self.wq.weight, self.wk.weight, self.wv.weight, self.wo.weight, cos, sin,
            self.plan, self.group,
            SequenceAttention(causal=self.causal, kernel=self.kernel, ring_group=self.ring_group),
        )

    def extra_repr(self) -> str:
        return super().extra_repr() + f", heads_per_stage={self.heads_per_stage}"
