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

Backward walks the same schedule in reverse: recompute K/V and Q from the saved input, form the
stage's output-gradient heads from dy and the stage's columns of wo (so the full (B, L, H, D)
output gradient never exists), all-to-all them and the stage's output heads, run the kernel
backward with the saved LSE, accumulate dK/dV over the block's stages, all-to-all dQ (and, at the
end of a block, dK/dV) back, undo RoPE, and accumulate dx in place (the first contribution
written, not added to zeros) and the weight-row gradients. Peak
attention memory covers U heads plus three (B, L, ~dim) tensors: x, the buffer, dx.

The kept last stage (``keep_last_stage``, beyond the paper; on by default with overlap): the
forward saves its last stage's Q and that stage's KV block's K/V (head layout) and the reverse
walk starts with them, so the backward projects, rotates and all-to-alls one KV block and one
stage's Q less per layer. Under activation checkpointing (the harness's ALST stack) they live
from the block's recompute through its MLP's backward into the attention's first stage, which
would have recomputed them: the attention backward's peak is unchanged and the MLP's grows by
one stage's inputs. Without checkpointing, autograd frees saved tensors when the layer's
backward returns, so the kept Q (and, with several KV blocks, the kept K/V) stay through it.

Overlapped stages (``overlap=True``, beyond the paper, whose stated limit is its synchronous
all-to-alls): the next stage's inputs are all-to-all'd, and the previous stage's outputs sent
back, beside the current stage's attention kernel, with ``async_op=True`` work handles (gloo's
worker thread on CPU, NCCL's own stream on CUDA) that the loop waits on before it reads the
buffers; each in-flight ``upipe.comm.Transfer`` holds its buffers until then, so the caching
allocator never recycles one early and no ``record_stream`` is needed. Exact: the same kernels
on the same values, only issued earlier; it holds one more stage's all-to-all buffers.

Longer contexts (also beyond the paper): ``chunk_size`` runs each stage's attention backward over
sequence chunks (``upipe.chunked``), its blocks' dK/dV added straight into the KV block's fp32
sums, so the kernel's full-sequence dq/dk/dv and fp32 dq accumulator are never allocated; a fused
input norm (``input_norm``: the block's pre-attention RMSNorm) makes x the block's un-normalised
input, normalised tile by tile inside each projection (``upipe.projections``), so the saved
input is the block's own and no normalised (L, dim) copy is kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from upipe.amp import cast_for_autocast
from upipe.chunked import accumulator_dtype, check_chunk
from upipe.comm import (
    Transfer,
    check_mesh_axes,
    group_size,
    head_to_seq_start,
    seq_to_head,
    seq_to_head_start,
)
from upipe.documents import RingDocuments, documents
from upipe.layout import SeqLayout
from upipe.module import ContextParallelAttention, check_ulysses_heads
from upipe.norm import norm_params
from upipe.options import MethodOption
from upipe.projections import OutputGrad, Projection, input_norm_backward, projections
from upipe.registry import register_method
from upipe.ring import SequenceAttention
from upipe.staging import (
    StagePlan,
    check_heads_per_stage,
    make_stage_plan,
    plan_indices,
    stage_heads,
)


@dataclass(frozen=True)
class _Walk:
    """What a stage walk runs besides its tensors, the same forward and backward: the head
    schedule, the Ulysses group, the attention core (kernel, ring axis, documents, chunks),
    the options, and the epsilons of the per-head RMSNorms (``eps``: Q's and K's, each its own
    module's) and of the input RMSNorm (``in_eps``)."""

    plan: StagePlan
    group: ProcessGroup | None
    core: SequenceAttention
    overlap: bool
    keep: bool
    eps: tuple[float, float]
    in_eps: float


@dataclass(frozen=True)
class _Layer:
    """One pass's view of the layer: its input ``x`` (B, L, dim), the Q, K, V projections made
    from the weights (``upipe.projections``) and the RoPE tables ``cos``, ``sin`` (L, D)."""

    x: torch.Tensor
    pq: Projection
    pk: Projection
    pv: Projection
    cos: torch.Tensor
    sin: torch.Tensor


def _layer(walk: _Walk, x, wq, wk, wv, bq, bk, bv, q_norm, k_norm, in_w, cos, sin) -> _Layer:
    d = wq.shape[0] // walk.plan.n_heads
    pq, pk, pv = projections(wq, wk, wv, bq, bk, bv, q_norm, k_norm, *walk.eps, d, in_w,
                             walk.in_eps)
    return _Layer(x, pq, pk, pv, cos, sin)


def _order(plan: StagePlan) -> list[tuple[int, int]]:
    """(block, stage) of every stage, in execution order."""
    return [(b, s) for b, block in enumerate(plan.blocks) for s in range(len(block.stages))]


def _forward_stages(layer: _Layer, walk: _Walk, out: torch.Tensor) -> tuple[list, tuple | None]:
    """Run every stage, writing its heads into ``out`` (B, L, H, D); returns the per-stage LSEs
    and, with ``walk.keep``, the last stage's Q and its KV block's K, V (head layout), which the
    backward starts with instead of recomputing them (else None).

    With ``overlap`` the next stage's Q all-to-all is issued before this stage's attention, and
    this stage's output all-to-all is waited on after the next stage's attention: both run beside
    the kernel (the first stage's Q and the last one's output, with no kernel beside them,
    block). A KV block's K/V are all-to-all'd when it opens, blocking: prefetching them too would
    hold a second block's K/V beside the first. Without ``overlap``, each all-to-all runs where
    its tensor is made and is waited on at once (the paper's schedule).
    """
    x, pq, pk, pv, cos, sin = layer.x, layer.pq, layer.pk, layer.pv, layer.cos, layer.sin
    plan, group, core, overlap, keep = walk.plan, walk.group, walk.core, walk.overlap, walk.keep
    c, idx = group_size(group), plan_indices(plan, x.device)

    def q_in(b, s, ov):
        q_idx = idx.q[b][s]
        return seq_to_head_start(pq(x, q_idx, cos, sin, split=c), group, ov)

    order, lses = _order(plan), []
    next_q = out_in_flight = k = v = None
    for i, (b, s) in enumerate(order):
        if s == 0:
            kv_idx = idx.kv[b]
            k = seq_to_head(pk(x, kv_idx, cos, sin, split=c), group)
            v = seq_to_head(pv(x, kv_idx, cos, sin), group)
        q = (next_q or q_in(b, s, False)).wait()
        last = i + 1 == len(order)
        next_q = q_in(*order[i + 1], True) if overlap and not last else None
        o, lse = core.forward(q, k, v)
        if last and keep:
            kept = q, k, v
        del q  # free before the all-to-all back allocates
        if out_in_flight is not None:
            out_in_flight.wait()
        out_in_flight = head_to_seq_start(o, group, overlap and not last,
                                          into=stage_heads(out, plan, b, s))
        lses.append(lse)
        del o
        if s == len(plan.blocks[b].stages) - 1:
            k = v = None
    out_in_flight.wait()
    return lses, (kept if keep else None)


class _BlockGrads:
    """A KV block's recomputed K/V (head layout) and their gradients summed over its stages."""

    def __init__(self, kv_idx, wk_rows, wv_rows, k, v):
        self.kv_idx, self.wk_rows, self.wv_rows, self.k, self.v = kv_idx, wk_rows, wv_rows, k, v
        self.dk = self.dv = None

    def add(self, dk_s, dv_s, acc) -> None:
        """Sum a stage's dK, dV in ``acc`` (its first stage's converted, not added to zeros)."""
        self.dk = dk_s.to(acc) if self.dk is None else self.dk.add_(dk_s)
        self.dv = dv_s.to(acc) if self.dv is None else self.dv.add_(dv_s)


def _backward_stages(layer: _Layer, walk: _Walk, x2, dx2, out, dout, lses, kept) -> None:
    """Walk the stages in reverse, accumulating dx (``dx2``, (B*L, dim); ``x2`` is the input's
    (B*L, dim) view) and the projections' weight gradients; ``out`` is the forward's (B, L, H,
    D) output, ``dout`` its gradient by stage (``OutputGrad``), ``lses`` the forward's per-stage
    LSEs. The first is the forward's last stage: with ``kept`` (its Q and its KV
    block's K, V, saved by the forward) they are not projected and all-to-all'd again. With
    ``overlap`` the next stage's Q, O, dO all-to-alls run beside this stage's attention backward,
    and this stage's dQ all-to-all back runs beside the next one's; it is then finished (RoPE
    undone, rows and dx accumulated). A block's K/V (in) and dK/dV (out) are blocking, as in
    the forward: in flight they would hold a second block's."""
    x, pq, pk, pv, cos, sin = layer.x, layer.pq, layer.pk, layer.pv, layer.cos, layer.sin
    plan, group, core, overlap = walk.plan, walk.group, walk.core, walk.overlap
    # dK/dV are summed over a block's stages in accumulator_dtype (only U/C heads wide); dx and
    # the weight rows in the input dtype, to keep dx one (L, dim) tensor: dx takes 3 H / U
    # roundings where autograd's takes 3, so in bf16 its error grows as U shrinks (measured on
    # CPU with 40-64 heads: about 5x autograd's at U = 1, 2.5-3x at U = 2, 1x at U = H)
    dev, acc, c = x.device, accumulator_dtype(x.dtype), group_size(group)
    idx = plan_indices(plan, dev)

    def stage_in(b, s, ov, q=None):
        # dO, O, then Q: each all-to-all's source is freed before the next one is made, and Q,
        # rotated straight into its send buffer (split), is made last, so blocking, the three
        # inputs peak at four stage-sized tensors (dO, O, Q's send and receive), no more than
        # the kernel's backward then holds (Q, O, dO, dQ)
        q_idx = idx.q[b][s]
        wq_rows = pq.rows(q_idx)
        do = seq_to_head_start(dout.stage(q_idx), group, ov)
        o = seq_to_head_start(stage_heads(out, plan, b, s), group, ov)
        q = (seq_to_head_start(pq(x, q_idx, cos, sin, wq_rows, split=c), group, ov)
             if q is None else Transfer(None, q, None, lambda y: y))
        return q_idx, wq_rows, q, o, do

    def block_in(b, kv=None):
        kv_idx = idx.kv[b]
        wk_rows, wv_rows = pk.rows(kv_idx), pv.rows(kv_idx)
        if kv is None:
            kv = (seq_to_head(pk(x, kv_idx, cos, sin, wk_rows, split=c), group),
                  seq_to_head(pv(x, kv_idx, cos, sin, wv_rows), group))
        return kv_idx, wk_rows, wv_rows, *kv

    dx_written = False  # dx2 is uninitialised until the first gradient is finished into it

    def finish(p, transfer, idx, rows):
        nonlocal dx_written
        p.backward(p.unrotate(transfer.wait(), cos, sin), x, x2, idx, rows, dx2,
                   overwrite=not dx_written)
        dx_written = True

    in_flight = []  # (projection, transfer, head index, weight rows) of gradients going back

    def send_back(p, transfer, idx, rows, ov):
        # the caller drops its gradient first: only the transfer holds it (or its result)
        in_flight.append((p, transfer, idx, rows))
        if not ov:  # in the order sent: a block's last dQ, still in flight, before its dK, dV,
            while in_flight:  # so dx sums in the blocking schedule's order, bit for bit
                finish(*in_flight.pop(0))

    forward_order = _order(plan)
    lse_of = {bs: lse for bs, lse in zip(forward_order, lses, strict=True)}
    order = forward_order[::-1]
    q_kept, kv_kept = (None, None) if kept is None else (kept[0], tuple(kept[1:]))
    if kept is not None:
        kept.clear()  # the caller's list: these locals are the only references left
    next_stage = blk = None
    for i, (b, s) in enumerate(order):
        if i == 0 or order[i - 1][0] != b:  # the block opens
            blk = _BlockGrads(*block_in(b, kv_kept if i == 0 else None))
            kv_kept = None
        q_idx, wq_rows, *transfers = next_stage or stage_in(b, s, False, q_kept)
        q_kept = None
        q, o, do = (t.wait() for t in transfers)
        ov = overlap and i + 1 < len(order)  # the last stage's dQ has no kernel beside it
        next_stage = stage_in(*order[i + 1], True) if ov else None
        if core.chunk is None:
            dq, dk_s, dv_s = core.backward(do, q, blk.k, blk.v, o, lse_of[b, s])
            del q, o, do
            blk.add(dk_s, dv_s, acc)
            del dk_s, dv_s
        else:  # sequence chunks: each block's dK/dV go straight into the block's sums
            if blk.dk is None:
                blk.dk, blk.dv = (torch.zeros(t.shape, dtype=acc, device=dev)
                                  for t in (blk.k, blk.v))
            dq = core.backward_into(do, q, blk.k, blk.v, o, lse_of[b, s], blk.dk, blk.dv)
            del q, o, do
        while in_flight:  # the previous stage's gradients, sent back beside this kernel
            finish(*in_flight.pop(0))
        transfer = head_to_seq_start(dq, group, ov)
        del dq
        send_back(pq, transfer, q_idx, wq_rows, ov)
        if i + 1 == len(order) or order[i + 1][0] != b:  # the block's last stage
            blk.k = blk.v = None
            transfer = head_to_seq_start(blk.dk.to(x.dtype), group, False)
            blk.dk = None
            send_back(pk, transfer, blk.kv_idx, blk.wk_rows, False)
            transfer = head_to_seq_start(blk.dv.to(x.dtype), group, False)
            blk.dv = None
            send_back(pv, transfer, blk.kv_idx, blk.wv_rows, False)
        del transfer
    while in_flight:
        finish(*in_flight.pop(0))


class _UPipeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, walk, x, wq, wk, wv, wo, bq, bk, bv, q_norm, k_norm, in_w, cos, sin):
        b, l, _ = x.shape
        layer = _layer(walk, x, wq, wk, wv, bq, bk, bv, q_norm, k_norm, in_w, cos, sin)
        out = x.new_empty(b, l, walk.plan.n_heads, wq.shape[0] // walk.plan.n_heads)
        lses, kept = _forward_stages(layer, walk, out)
        del layer
        ctx.save_for_backward(x, wq, wk, wv, wo, bq, bk, bv, q_norm, k_norm, in_w, cos, sin, out,
                              *(kept or ()), *lses)
        ctx.walk = walk
        if wo is None:
            return out
        return out.flatten(2) @ wo.t()

    @staticmethod
    def backward(ctx, grad):
        (x, wq, wk, wv, wo, bq, bk, bv, q_norm, k_norm, in_w, cos, sin, out,
         *rest) = ctx.saved_tensors
        walk = ctx.walk
        # the kept Q, K, V go in a list the walk empties: no reference here outlives their use
        kept, lses = (list(rest[:3]), rest[3:]) if walk.keep else (None, rest)
        del rest
        layer = _layer(walk, x, wq, wk, wv, bq, bk, bv, q_norm, k_norm, in_w, cos, sin)
        pq, pk, pv = layer.pq, layer.pk, layer.pv
        dout = OutputGrad(grad, out, wo, wq.shape[0] // walk.plan.n_heads)
        x2 = x.reshape(-1, x.shape[-1])
        dx2 = torch.empty_like(x2)  # the first stage's finish writes it (beta 0)
        for p in (pq, pk, pv):
            p.dw = torch.zeros_like(p.w)
        _backward_stages(layer, walk, x2, dx2, out, dout, lses, kept)
        (dwq, dbq, dqn), (dwk, dbk, dkn), (dwv, dbv, _) = pq.grads(), pk.grads(), pv.grads()
        d_in = None if in_w is None else input_norm_backward(x2, in_w, walk.in_eps, dx2)
        return (None, dx2.view(x.shape), dwq, dwk, dwv, dout.dwo, dbq, dbk, dbv, dqn, dkn,
                d_in, None, None)


def _apply(walk: _Walk, x, *tensors) -> torch.Tensor:
    """``_UPipeFunction`` of x and ``tensors`` (its forward's arguments after x). Under autocast
    it runs on every floating input cast to autocast's dtype, the weights too (``upipe.amp``):
    the Function projects with them itself, where autocast would cast them per matmul."""
    return cast_for_autocast(_UPipeFunction.apply, x.device.type, walk, x, *tensors)


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
    overlap: bool = False,
    chunk_size: int | None = None,
    input_norm: torch.Tensor | None = None,
    input_norm_eps: float = 1e-5,
    keep_last_stage: bool | None = None,
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
        overlap: run each stage's all-to-alls beside the neighbouring stage's attention
            (asynchronous, ``async_op=True``), holding one more stage's all-to-all buffers;
            False (default): the paper's blocking schedule.
        chunk_size: run each stage's attention backward over sequence chunks of this many
            tokens (``upipe.chunked``; plain Ulysses mesh only); None (default): one kernel call.
        input_norm: optional (dim,) weight of the block's pre-attention RMSNorm (epsilon
            ``input_norm_eps``): x is then the block's un-normalised input, normalised tile by
            tile inside every projection (``upipe.projections``), so the normalised input is
            never stored; the gradient is x's and the weight's.
        keep_last_stage: save the forward's last stage's Q and its KV block's K, V (head
            layout) for the backward, which walks the stages in reverse and starts with them
            instead of projecting and all-to-all'ing them again (``UPipeAttention``'s docstring
            says what it holds when); None (default): as ``overlap``.

    Returns:
        (B, L, dim_out) when ``wo`` is given, else the (B, L, n_heads, D) attention output before
        the output projection, heads in model order.
    """
    cp = group_size(group)
    check_ulysses_heads(n_heads, n_kv_heads, cp)
    _check_function_inputs(x, n_heads, n_kv_heads, overlap, wq=wq, wk=wk, wv=wv, wo=wo, bq=bq,
                           bk=bk, bv=bv, q_norm=q_norm, k_norm=k_norm, cos=cos, sin=sin)
    u = cp if heads_per_stage is None else heads_per_stage  # 0 is refused, not the default
    plan = make_stage_plan(n_heads, n_kv_heads, cp, u)
    if ring_group is not None:
        check_mesh_axes(group, ring_group)
    ring = 1 if ring_group is None else group_size(ring_group)
    docs = documents(cu_seqlens, x.shape[1] * cp * ring)
    ring_docs = None if docs is None else RingDocuments(
        docs, SeqLayout("zigzag") if ring_group is not None else SeqLayout(), ring)
    check_input_norm(input_norm, x.shape[-1])
    keep = check_keep(keep_last_stage, overlap)
    core = SequenceAttention(causal=causal, scale=scale, kernel=kernel, ring_group=ring_group,
                             docs=ring_docs, chunk=chunk_size)
    walk = _Walk(plan, group, core, overlap, keep, (norm_eps, norm_eps), input_norm_eps)
    return _apply(walk, x, wq, wk, wv, wo, bq, bk, bv, q_norm, k_norm, input_norm, cos, sin)


def _check_function_inputs(x: torch.Tensor, n_heads: int, n_kv_heads: int, overlap,
                           **tensors: torch.Tensor | None) -> None:
    """The function form's tensors against its head counts, each refused by name before any
    collective (the same on every rank). The module form's come from its own nn.Linear
    layers; here a k/v weight of more heads than ``n_kv_heads`` ran on its first heads only,
    a longer bias was read in part, and an empty shard crashed the kernel."""
    if not isinstance(overlap, bool):
        raise ValueError(f"overlap must be True or False, got {overlap!r}")
    if x.dim() != 3 or 0 in x.shape:
        raise ValueError(f"x must be (B, L, dim) with no empty dimension, got shape "
                         f"{tuple(x.shape)}")
    _, local, dim = x.shape
    wq = tensors["wq"]
    if wq.dim() != 2 or wq.shape[1] != dim or wq.shape[0] % n_heads or not wq.shape[0]:
        raise ValueError(f"wq must be (n_heads * head_dim, dim) = ({n_heads} * D, {dim}), got "
                         f"shape {tuple(wq.shape)}")
    d = wq.shape[0] // n_heads
    want = {"wk": (n_kv_heads * d, dim), "wv": (n_kv_heads * d, dim), "bq": (n_heads * d,),
            "bk": (n_kv_heads * d,), "bv": (n_kv_heads * d,), "q_norm": (d,), "k_norm": (d,),
            "cos": (local, d), "sin": (local, d)}
    for name, shape in want.items():
        t = tensors[name]
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} (n_heads {n_heads}, n_kv_heads "
                             f"{n_kv_heads}, head_dim {d} from wq, {local} local tokens), got "
                             f"{tuple(t.shape)}")
    wo = tensors["wo"]
    if wo is not None and (wo.dim() != 2 or wo.shape[1] != n_heads * d):
        raise ValueError(f"wo must be (dim_out, n_heads * head_dim) = (dim_out, {n_heads * d}), "
                         f"got shape {tuple(wo.shape)}")


def check_keep(keep_last_stage: bool | None, overlap: bool) -> bool:
    """``keep_last_stage`` resolved (None: as ``overlap``), else a ValueError naming it."""
    if keep_last_stage is not None and not isinstance(keep_last_stage, bool):
        raise ValueError(f"keep_last_stage must be True, False or None, got {keep_last_stage!r}")
    return overlap if keep_last_stage is None else keep_last_stage


def check_input_norm(weight: torch.Tensor | None, dim: int) -> None:
    """A fused input norm's weight must be (dim,), else a ValueError naming it."""
    if weight is not None and tuple(weight.shape) != (dim,):
        raise ValueError(f"input_norm must be an RMSNorm over dim ({dim}) with a weight of shape "
                         f"({dim},), got a weight of shape {tuple(weight.shape)}")


@register_method("upipe")
class UPipeAttention(ContextParallelAttention):
    """UPipe attention module, a drop-in for the reference Llama attention under CP.

    Extra options: ``heads_per_stage`` (U), default the CP degree; it must be a multiple of the CP
    degree and divide ``n_heads``. ``chunk_size`` (default None, beyond the paper): each stage's
    attention backward runs over sequence chunks of that many tokens (``upipe.chunked``), so the
    kernel's dq/dk/dv and its fp32 dq accumulator scale with the chunk, not the sequence (plain
    Ulysses mesh only). ``overlap`` (default False): the stages' all-to-alls run beside
    the neighbouring stages' attention kernels (the module docstring) -- faster where the
    all-to-alls are a visible part of the step (short contexts, across nodes), at one more
    stage's all-to-all buffers (8U heads over the local tokens at the backward's peak: 6 GiB
    per rank for Llama3-8B at 3M tokens on 8 GPUs), which costs the longest contexts their fit.
    ``keep_last_stage`` (default: as ``overlap``): the backward starts from the forward's last
    stage, whose Q and K/V the forward saved, instead of recomputing them (the module
    docstring: free at the attention backward's peak under activation checkpointing; without
    it the kept tensors stay saved through the layer's backward).
    forward(x_local (B, L, dim), cu_seqlens=None, input_norm=None) -> (B, L, dim); with packed
    documents every stage's attention stays inside them. ``input_norm``: the block's
    pre-attention RMSNorm module (a ``weight`` of shape (dim,) and ``eps`` or
    ``variance_epsilon``); x is then the block's un-normalised input and the norm runs tile by
    tile inside the projections (``fuses_input_norm``; the harness's ``fuse_norm`` stack option).

    With ``mesh`` (2-D, axes ``ring`` x ``ulysses``; the paper's multi-node 8 x 2) the stages'
    all-to-alls run over the ulysses axis, U is a multiple of its size, and each stage's attention
    is zigzag ring attention over the ring axis (sequence layout: zigzag over the ring ranks,
    contiguous within a ring rank's ulysses group).
    """

    supports_mesh = True
    fuses_input_norm = True
    declared_options = (
        MethodOption("heads_per_stage", int, "UPipe's U: heads per stage, a positive multiple "
                     "of the Ulysses degree dividing the heads", tag="U",
                     unset="the Ulysses degree"),
        MethodOption("chunk_size", int, "global tokens per chunk of UPipe's chunked attention "
                     "backward (plain Ulysses mesh)", tag="c", tokens=True,
                     unset="unchunked"),
        MethodOption("overlap", bool, "run the stages' all-to-alls beside the attention "
                     "kernels; off: the paper's blocking schedule", tag="ov"),
    )

    def __init__(self, *args, heads_per_stage: int | None = None, overlap: bool = False,
                 chunk_size: int | None = None, keep_last_stage: bool | None = None, **kwargs):
        if not isinstance(overlap, bool):
            raise ValueError(f"overlap must be True or False, got {overlap!r}")
        self.heads_per_stage, self.overlap, self.chunk_size = heads_per_stage, overlap, chunk_size
        self.keep_last_stage = check_keep(keep_last_stage, overlap)
        super().__init__(*args, **kwargs)
        check_chunk(chunk_size, ring=self.ring_group is not None)
        # None is the default (U = C); 0 is not, and is refused by make_stage_plan
        self.heads_per_stage = self.ulysses_degree if heads_per_stage is None else heads_per_stage
        self.plan: StagePlan = make_stage_plan(
            self.n_heads, self.n_kv_heads, self.ulysses_degree, self.heads_per_stage
        )

    def options(self) -> dict:
        return {"heads_per_stage": self.heads_per_stage, "overlap": self.overlap,
                "chunk_size": self.chunk_size, "keep_last_stage": self.keep_last_stage}

    @classmethod
    def check_config(cls, n_heads, n_kv_heads, *, cp, ring_degree=1, seq_len=None, **options):
        check_chunk(options.get("chunk_size"), ring=ring_degree > 1)
        super().check_config(n_heads, n_kv_heads, cp=cp, ring_degree=ring_degree,
                             seq_len=seq_len, **options)

    @classmethod
    def check_heads(cls, n_heads, n_kv_heads, ulysses_degree, *, heads_per_stage=None, **_):
        super().check_heads(n_heads, n_kv_heads, ulysses_degree)
        check_heads_per_stage(n_heads, ulysses_degree,
                              ulysses_degree if heads_per_stage is None else heads_per_stage)

    def forward(self, x: torch.Tensor, cu_seqlens=None, input_norm=None) -> torch.Tensor:
        self.check_input(x)
        in_w, in_eps = (None, 0.0) if input_norm is None else norm_params(
            input_norm, x.shape[-1], "input_norm", over="dim")
        docs = self.documents(cu_seqlens, x)
        cos, sin = self.rope(x.shape[1], x, docs)
        d = self.head_dim
        norms = [None if n is None else norm_params(n, d, name)
                 for name, n in (("q_norm", self.q_norm), ("k_norm", self.k_norm))]
        # each norm its own epsilon (a model may give Q's and K's different ones)
        eps = tuple(1e-6 if n is None else n[1] for n in norms)
        core = SequenceAttention(causal=self.causal, kernel=self.kernel,
                                 ring_group=self.ring_group, docs=self.ring_documents(docs),
                                 chunk=self.chunk_size)
        walk = _Walk(self.plan, self.group, core, self.overlap, self.keep_last_stage, eps, in_eps)
        y = _apply(
            walk, x, self.wq.weight, self.wk.weight, self.wv.weight, self.wo.weight,
            self.wq.bias, self.wk.bias, self.wv.bias, *(None if n is None else n[0] for n in norms),
            in_w, cos, sin)
        return y if self.wo.bias is None else y + self.wo.bias

    def extra_repr(self) -> str:
        return (super().extra_repr()
                + f", heads_per_stage={self.heads_per_stage}, overlap={self.overlap}"
                + f", keep_last_stage={self.keep_last_stage}"
                + ("" if self.chunk_size is None else f", chunk_size={self.chunk_size}"))
