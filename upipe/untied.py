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
from upipe.documents import RingDocuments, documents
from upipe.layout import SeqLayout
from upipe.module import ContextParallelAttention, check_ulysses_heads
from upipe.norm import norm_params, rms_norm, rms_norm_backward
from upipe.pure import metadata_pure
from upipe.registry import register_method
from upipe.ring import SequenceAttention
from upipe.rope import apply_rope, apply_rope_inverse
from upipe.staging import StagePlan, check_heads_per_stage, make_stage_plan


def _rows(w: torch.Tensor, heads: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The projection rows of ``heads`` from w (n*head_dim, dim) -> (len(heads)*head_dim, dim)."""
    return w.view(-1, head_dim, w.shape[-1]).index_select(0, heads).flatten(0, 1)


class _Proj:
    """One of the q/k/v projections of a head subset, and its hand-written backward.

    w (n*D, dim) head-major rows; optional bias b (n*D,) (Qwen2) and per-head RMSNorm weight
    (D,) applied before RoPE (Qwen3). Without bias or norm this is ``x @ rows^T`` (+ RoPE)
    exactly, allocating nothing more.
    """

    def __init__(self, w, b, norm_w, eps: float, rope: bool, head_dim: int):
        self.w, self.b, self.norm_w, self.eps, self.rope, self.d = w, b, norm_w, eps, rope, head_dim
        self.dw = self.db = self.dnorm = None  # gradient accumulators, made by the backward

    def rows(self, heads: torch.Tensor) -> torch.Tensor:
        return _rows(self.w, heads, self.d)

    def pre_norm(self, x, heads, w_rows) -> torch.Tensor:
        """x (B, L, dim) -> (B, L, n, D): the linear part (bias included)."""
        y = x @ w_rows.t()
        if self.b is not None:
            y += self.b.view(-1, self.d).index_select(0, heads).flatten()
        return y.unflatten(-1, (-1, self.d))

    def finish(self, pre, cos, sin) -> torch.Tensor:
        """Norm (if any) and RoPE (if ``rope``) of the linear part."""
        y = pre if self.norm_w is None else rms_norm(pre, self.norm_w, self.eps)
        return apply_rope(y, cos, sin) if self.rope else y

    def __call__(self, x, heads, cos, sin, w_rows=None) -> torch.Tensor:
        """(B, L, n, D) projection of x for ``heads``: linear, norm, RoPE."""
        return _project(x, heads, cos, sin, w_rows, self.w, self.b, self.norm_w, self.eps,
                        self.rope, self.d)

    def unrotate(self, dy: torch.Tensor, cos, sin) -> torch.Tensor:
        """The gradient before RoPE (the inverse rotation), or dy for V."""
        return apply_rope_inverse(dy, cos, sin) if self.rope else dy

    def backward(self, dy, x, x2, heads, w_rows, dx2) -> None:
        """Accumulate the gradients of ``self(x, heads)`` for dy (B, L, n, D), already unrotated.

        dw[heads] += g^T x; db[heads] += sum g; dx += g @ rows, with g the gradient before the
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
        _accumulate_rows(dy2, x2, heads, w_rows, self.dw, dx2, self.d)

    def grads(self) -> tuple:
        """(dw, db, dnorm) for the autograd Function's return (every head was visited)."""
        dnorm = None if self.dnorm is None else self.dnorm.to(self.norm_w.dtype)
        return self.dw, self.db, dnorm


# The per-stage pieces below run once per head stage with the same shapes in every stage:
# marked metadata-pure (upipe.pure), so the emulator replays them instead of dispatching their
# ops again (they are most of an emulated UPipe layer's ops once the ring loop is replayed).


@metadata_pure
def _project(x, heads, cos, sin, w_rows, w, b, norm_w, eps: float, rope: bool,
             head_dim: int) -> torch.Tensor:
    """``_Proj(w, b, norm_w, eps, rope, head_dim)(x, heads, cos, sin, w_rows)``: x (B, L, dim)
    -> (B, L, n, D) for ``heads`` (n,), with w's rows of those heads unless ``w_rows``
    (n*D, dim) is given."""
    p = _Proj(w, b, norm_w, eps, rope, head_dim)
    return p.finish(p.pre_norm(x, heads, p.rows(heads) if w_rows is None else w_rows), cos, sin)


@metadata_pure
def _accumulate_rows(dy2, x2, heads, w_rows, dw, dx2, head_dim: int) -> None:
    """dw[heads] += dy2^T x2 and dx2 += dy2 @ w_rows, in place: dy2 (B*L, n*D), x2, dx2
    (B*L, dim), w_rows (n*D, dim), dw (N*D, dim); ``index_add_`` sums KV replicas' rows,
    ``addmm_`` accumulates dx without an (L, dim) temporary."""
    dw.view(-1, head_dim, dw.shape[-1]).index_add_(
        0, heads, (dy2.t() @ x2).view(-1, head_dim, x2.shape[-1]))
    dx2.addmm_(dy2, w_rows)


@metadata_pure
def _wo_heads(grad2, wo, heads, head_dim: int) -> torch.Tensor:
    """grad2 (B*L, dim) @ wo's columns of ``heads`` (n,) -> (B*L, n*D)."""
    cols = wo.view(wo.shape[0], -1, head_dim).index_select(1, heads).flatten(1)
    return grad2 @ cols


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
        return _wo_heads(self.grad2, self.wo, heads, self.d).view(*self.grad.shape[:-1], -1,
                                                                  self.d)


def _projections(wq, wk, wv, bq, bk, bv, q_norm, k_norm, eps, d):
    return (_Proj(wq, bq, q_norm, eps, True, d), _Proj(wk, bk, k_norm, eps, True, d),
            _Proj(wv, bv, None, eps, False, d))


class _UPipeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, wq, wk, wv, wo, bq, bk, bv, q_norm, k_norm, cos, sin, plan, group, core,
                eps):
        b, l, _ = x.shape
        d = wq.shape[0] // plan.n_heads
        pq, pk, pv = _projections(wq, wk, wv, bq, bk, bv, q_norm, k_norm, eps, d)
        out = x.new_empty(b, l, plan.n_heads, d)
        lses = []
        for block in plan.blocks:
            kv_idx = torch.tensor(block.kv_heads, device=x.device)
            k = seq_to_head(pk(x, kv_idx, cos, sin), group)
            v = seq_to_head(pv(x, kv_idx, cos, sin), group)
            for stage in block.stages:
                q_idx = torch.tensor(stage, device=x.device)
                q = seq_to_head(pq(x, q_idx, cos, sin), group)
                o, lse = core.forward(q, k, v)
                del q  # free before the all-to-all back allocates
                out.index_copy_(2, q_idx, head_to_seq(o, group))
                lses.append(lse)
                del o
            del k, v
        ctx.save_for_backward(x, wq, wk, wv, wo, bq, bk, bv, q_norm, k_norm, cos, sin, out, *lses)
        ctx.plan, ctx.group, ctx.core, ctx.eps = plan, group, core, eps
        if wo is None:
            return out
        return out.flatten(2) @ wo.t()

    @staticmethod
    def backward(ctx, grad):
        x, wq, wk, wv, wo, bq, bk, bv, q_norm, k_norm, cos, sin, out, *lses = ctx.saved_tensors
        plan, group = ctx.plan, ctx.group
        d = wq.shape[0] // plan.n_heads
        pq, pk, pv = _projections(wq, wk, wv, bq, bk, bv, q_norm, k_norm, ctx.eps, d)
        dout = _OutputGrad(grad, out, wo, d)
        # dK/dV sum over a block's stages along the full sequence: fp32 for low-precision inputs
        # ("bf16 with fp32 reductions"); they are only U/C heads wide. dx and the weight rows are
        # accumulated in the input dtype, as autograd would, to keep dx a single (L, dim) tensor.
        acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        x2 = x.reshape(-1, x.shape[-1])
        dx2 = torch.zeros_like(x2)
        for p in (pq, pk, pv):
            p.dw = torch.zeros_like(p.w)
        lse_it = iter(lses)
        for block in plan.blocks:
            kv_idx = torch.tensor(block.kv_heads, device=x.device)
            wk_rows, wv_rows = pk.rows(kv_idx), pv.rows(kv_idx)
            k = seq_to_head(pk(x, kv_idx, cos, sin, wk_rows), group)
            v = seq_to_head(pv(x, kv_idx, cos, sin, wv_rows), group)
            dk = torch.zeros(k.shape, dtype=acc, device=k.device)
            dv = torch.zeros(v.shape, dtype=acc, device=v.device)
            for stage in block.stages:
                q_idx = torch.tensor(stage, device=x.device)
                wq_rows = pq.rows(q_idx)
                q = seq_to_head(pq(x, q_idx, cos, sin, wq_rows), group)
                o = seq_to_head(out.index_select(2, q_idx), group)
                do = seq_to_head(dout.stage(q_idx), group)
                dq, dk_s, dv_s = ctx.core.backward(do, q, k, v, o, next(lse_it))
                del q, o, do
                dk.add_(dk_s)
                dv.add_(dv_s)
                del dk_s, dv_s
                dq = pq.unrotate(head_to_seq(dq, group), cos, sin)
                pq.backward(dq, x, x2, q_idx, wq_rows, dx2)
                del dq
            del k, v
            dk = pk.unrotate(head_to_seq(dk.to(x.dtype), group), cos, sin)
            pk.backward(dk, x, x2, kv_idx, wk_rows, dx2)
            del dk
            dv = head_to_seq(dv.to(x.dtype), group)
            pv.backward(dv, x, x2, kv_idx, wv_rows, dx2)
            del dv
        (dwq, dbq, dqn), (dwk, dbk, dkn), (dwv, dbv, _) = pq.grads(), pk.grads(), pv.grads()
        return (dx2.view(x.shape), dwq, dwk, dwv, dout.dwo, dbq, dbk, dbv, dqn, dkn,
                *([None] * 6))


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
    bq: torch.Tensor | None = None,
    bk: torch.Tensor | None = None,
    bv: torch.Tensor | None = None,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    cu_seqlens=None,
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
        bq, bk, bv: optional projection biases (n*D,) (Qwen2).
        q_norm, k_norm: optional (D,) weights of per-head RMSNorms applied before RoPE, with
            epsilon ``norm_eps`` (Qwen3; ``upipe.norm.rms_norm``).
        cu_seqlens: packed documents' global cumulative lengths ``[0, l0, ..., S]`` (the same
            on every rank; ``upipe.documents``): attention stays inside each document. RoPE is
            the caller's: pass ``cos``/``sin`` at each token's position *within its document*
            (``Documents.positions`` of this rank's layout segments).

    Returns:
        (B, L, dim_out) when ``wo`` is given, else the (B, L, n_heads, D) attention output before
        the output projection, heads in model order.
    """
    cp = group_size(group)
    check_ulysses_heads(n_heads, n_kv_heads, cp)
    u = cp if heads_per_stage is None else heads_per_stage  # 0 is refused, not the default
    plan = make_stage_plan(n_heads, n_kv_heads, cp, u)
    ring = 1 if ring_group is None else group_size(ring_group)
    docs = documents(cu_seqlens, x.shape[1] * cp * ring)
    ring_docs = None if docs is None else RingDocuments(
        docs, SeqLayout("zigzag") if ring_group is not None else SeqLayout(), ring)
    return _UPipeFunction.apply(
        x, wq, wk, wv, wo, bq, bk, bv, q_norm, k_norm, cos, sin, plan, group,
        SequenceAttention(causal=causal, scale=scale, kernel=kernel, ring_group=ring_group,
                          docs=ring_docs),
        norm_eps,
    )


@register_method("upipe")
class UPipeAttention(ContextParallelAttention):
    """UPipe attention module, a drop-in for the reference Llama attention under CP.

    Extra option: ``heads_per_stage`` (U), default the CP degree; it must be a multiple of the CP
    degree and divide ``n_heads``. forward(x_local (B, L, dim), cu_seqlens=None) -> (B, L, dim);
    with packed documents every stage's attention stays inside them.

    With ``mesh`` (2-D, axes ``ring`` x ``ulysses``; the paper's multi-node 8 x 2) the stages'
    all-to-alls run over the ulysses axis, U is a multiple of its size, and each stage's attention
    is zigzag ring attention over the ring axis (sequence layout: zigzag over the ring ranks,
    contiguous within a ring rank's ulysses group).
    """

    supports_mesh = True

    def __init__(self, *args, heads_per_stage: int | None = None, **kwargs):
        self.heads_per_stage = heads_per_stage
        super().__init__(*args, **kwargs)
        # None is the default (U = C); 0 is not, and is refused by make_stage_plan
        self.heads_per_stage = self.ulysses_degree if heads_per_stage is None else heads_per_stage
        self.plan: StagePlan = make_stage_plan(
            self.n_heads, self.n_kv_heads, self.ulysses_degree, self.heads_per_stage
        )

    def options(self) -> dict:
        return {"heads_per_stage": self.heads_per_stage}

    @classmethod
    def check_heads(cls, n_heads, n_kv_heads, ulysses_degree, *, heads_per_stage=None, **_):
        super().check_heads(n_heads, n_kv_heads, ulysses_degree)
        check_heads_per_stage(n_heads, ulysses_degree,
                              ulysses_degree if heads_per_stage is None else heads_per_stage)

    def forward(self, x: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
        self.check_input(x)
        docs = self.documents(cu_seqlens, x)
        cos, sin = self.rope(x.shape[1], x, docs)
        d = self.head_dim
        norms = [None if n is None else norm_params(n, d, name)
                 for name, n in (("q_norm", self.q_norm), ("k_norm", self.k_norm))]
        eps = next((n[1] for n in norms if n is not None), 1e-6)
        y = _UPipeFunction.apply(
            x, self.wq.weight, self.wk.weight, self.wv.weight, self.wo.weight,
            self.wq.bias, self.wk.bias, self.wv.bias, *(None if n is None else n[0] for n in norms),
            cos, sin, self.plan, self.group,
            SequenceAttention(causal=self.causal, kernel=self.kernel, ring_group=self.ring_group,
                              docs=self.ring_documents(docs)),
            eps,
        )
        return y if self.wo.bias is None else y + self.wo.bias

    def extra_repr(self) -> str:
        return super().extra_repr() + f", heads_per_stage={self.heads_per_stage}"
