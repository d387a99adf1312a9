"""Ring attention over a process group: K/V blocks passed rank to rank with P2P send/recv.

Each of the W ranks holds a block of the queries and of the keys/values. In W steps every rank
attends its queries to every K/V block: at step s it holds the block of rank (r - s) mod W, starts
sending it to rank r+1 (and receiving the next one from r-1) and, while that is in flight, runs
the attention kernel on the block it has, folding the result into a running fp32 (out, lse) with
the log-sum-exp merge (``upipe.merge``). Liu et al., "Ring Attention with Blockwise Transformers",
arXiv 2310.01889; the skeleton (forward loop, backward loop, autograd Function, public wrapper)
follows zhuzilin/ring-flash-attention.

Backward passes K/V around the ring again, plus fp32 dK/dV accumulators that travel with them:
each rank adds its queries' contribution to the block it holds and passes the sum on, so after W
steps (W accumulator hops) every block's gradient is back at its owner. The block gradients use
the final, merged out and lse (FlashAttention-2's backward only needs those), so partial blocks
need no rescaling.

Causal masking depends on the sequence layout (``upipe.layout``):

* contiguous (``zigzag=False``): the own block is causal, blocks of earlier ranks are full,
  blocks of later ranks are skipped -- rank W-1 does W blocks of work, rank 0 one.
* zigzag (``zigzag=True``; rank r holds chunks r and 2W-1-r of 2W): the own block is causal; a
  block from an earlier rank is seen by all queries but only through its first chunk; a block from
  a later rank is seen whole but only by the second query chunk. Every step is half a block of
  work on every rank: balanced.

Packed documents (``docs``, ``upipe.documents.RingDocuments``): each (query part, K/V block part)
pair is restricted to the documents both contain, one dense kernel block per document, merged
with the same LSE merge; a pair sharing no document is skipped (its K/V still travel on, so the
P2P pattern and count are unchanged). Step 0 (a rank's own tokens over themselves) covers every
query, so the running (out, lse) still starts from it.

Pure PyTorch and torch.distributed (no flash-attn), so it runs on CPU/gloo and under
FakeTensorMode with the fake process group; the kernel is ``upipe.kernels``' dispatch.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from upipe.amp import cast_for_autocast
from upipe.chunked import accumulator_dtype, check_chunk, chunked_attention_backward
from upipe.comm import group_rank, group_size
from upipe.documents import DocBlocks, RingDocuments
from upipe.kernels import (
    attention_backward,
    attention_blocks_backward,
    attention_blocks_forward,
    attention_forward,
    check_kernel,
)
from upipe.merge import merge_attention
from upipe.pure import metadata_pure

ALL, FIRST, SECOND = slice(None), "first", "second"


class RingComm:
    """Send to the next rank and receive from the previous one, over an explicit group."""

    def __init__(self, group: ProcessGroup | None):
        self.group = group
        self.world, self.rank = group_size(group), group_rank(group)
        self._reqs: list = []
        self._inflight: list[torch.Tensor] = []  # sent/received tensors kept alive until wait
        if self.world > 1:
            g = group if group is not None else dist.group.WORLD
            self.next = dist.get_global_rank(g, (self.rank + 1) % self.world)
            self.prev = dist.get_global_rank(g, (self.rank - 1) % self.world)

    def start(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Send ``tensors`` to the next rank; returns buffers that receive the previous rank's.

        The buffers are valid after :meth:`wait`.
        """
        send = [t.contiguous() for t in tensors]
        recv = [torch.empty_like(t) for t in send]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in recv]
        self._reqs = dist.batch_isend_irecv(ops)
        self._inflight = send + recv
        return recv

    def wait(self) -> None:
        for req in self._reqs:
            req.wait()
        self._reqs, self._inflight = [], []


@contextlib.contextmanager
def _settled(*comms: RingComm):
    """On an error inside, complete the P2P operations already posted, then raise it. An
    error of the inputs or the kernel (an unavailable kernel, a dtype mix) raises on every rank
    at the same step, where each rank's pending sends match its neighbours' receives; left
    pending, they broke the group for every later collective (gloo timed out on the next
    all_reduce)."""
    try:
        yield
    except BaseException:
        for comm in comms:
            with contextlib.suppress(Exception):
                comm.wait()
        raise


def _part(x: torch.Tensor, part, dim: int = 1) -> torch.Tensor:
    """A view of the first or second half (zigzag chunk) of ``x`` along ``dim``, or all of it."""
    if part is ALL:
        return x
    half = x.shape[dim] // 2
    return x.narrow(dim, 0, half) if part == FIRST else x.narrow(dim, half, x.shape[dim] - half)


def block_plan(step: int, rank: int, world: int, *, zigzag: bool, causal: bool):
    """(query part, kv part, causal) of step ``step``'s block on ``rank``, or None if masked."""
    if step == 0:
        return ALL, ALL, causal
    if not causal:
        return ALL, ALL, False
    src_earlier = (rank - step) % world < rank
    if zigzag:
        return (ALL, FIRST, False) if src_earlier else (SECOND, ALL, False)
    return (ALL, ALL, False) if src_earlier else None


def _part_span(part, n: int) -> tuple[int, int] | None:
    """(local start, length) of a zigzag half of n local tokens, None for all of them."""
    if part is ALL:
        return None
    half = n // 2
    return (0, half) if part == FIRST else (half, n - half)


def step_blocks(step: int, rank: int, world: int, n_local: int, *, zigzag: bool, causal: bool,
                docs: RingDocuments | None):
    """:func:`block_plan` with packed documents: (query part, kv part, causal, blocks), blocks
    None without documents; None when the step is masked or its parts share no document."""
    plan = block_plan(step, rank, world, zigzag=zigzag, causal=causal)
    if plan is None or docs is None:
        return None if plan is None else (*plan, None)
    qp, kvp, blk_causal = plan
    src = (rank - step) % world
    blocks: DocBlocks = docs.docs.blocks(docs.tokens(rank, _part_span(qp, n_local)),
                                         docs.tokens(src, _part_span(kvp, n_local)))
    return (qp, kvp, blk_causal, blocks) if blocks else None


def _check_ring_input(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, zigzag: bool) -> None:
    if not q.shape[1] == k.shape[1] == v.shape[1]:  # a rank's q, k and v are its own tokens'
        raise ValueError(f"ring attention needs q, k and v of this rank's tokens, one local "
                         f"length: got {q.shape[1]}, {k.shape[1]} and {v.shape[1]}")
    if zigzag and q.shape[1] % 2:
        raise ValueError(
            f"zigzag ring attention needs an even local length (two chunks), got {q.shape[1]}"
        )


@metadata_pure
def ring_attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: ProcessGroup | None, *,
    zigzag: bool, causal: bool, scale: float | None = None, kernel: str = "auto",
    docs: RingDocuments | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention forward on this rank's blocks (no autograd).

    Args:
        q: (B, L, H, D); k, v: (B, L, Hkv, D) -- this rank's tokens in the group's layout
            (contiguous, or zigzag when ``zigzag``); GQA via Hkv < H, K/V travel unexpanded.
        docs: packed documents and the global tokens of each ring rank, or None.
    Returns:
        out (B, L, H, D) in q's dtype; lse (B, H, L) fp32 (fp64 for fp64 inputs).
    """
    _check_ring_input(q, k, v, zigzag)
    comm = RingComm(group)
    kw = dict(scale=scale, kernel=kernel)
    out = lse = None
    with _settled(comm):
        for step in range(comm.world):
            if step + 1 < comm.world:
                nxt = comm.start([k, v])
            plan = step_blocks(step, comm.rank, comm.world, q.shape[1], zigzag=zigzag,
                               causal=causal, docs=docs)
            if plan is not None:
                qp, kvp, blk_causal, blocks = plan
                qs, ks, vs = _part(q, qp), _part(k, kvp), _part(v, kvp)
                if out is None:  # step 0 covers every query: start from it (no -inf arithmetic)
                    o_b, lse = attention_forward(qs, ks, vs, causal=blk_causal, blocks=blocks, **kw)
                    out = o_b.to(accumulator_dtype(q.dtype))  # fp32, fp64 for fp64
                    del o_b
                elif blocks is None:
                    o_b, lse_b = attention_forward(qs, ks, vs, causal=blk_causal, **kw)
                    merge_attention(_part(out, qp), _part(lse, qp, dim=2), o_b, lse_b)
                    del o_b, lse_b
                else:  # each document's rows merged in place: no block-sized temporary
                    out_p, lse_p = _part(out, qp), _part(lse, qp, dim=2)
                    for (qa, qb), o_b, lse_b in attention_blocks_forward(
                            qs, ks, vs, causal=blk_causal, blocks=blocks, **kw):
                        merge_attention(out_p[:, qa:qb], lse_p[:, :, qa:qb], o_b, lse_b)
                        del o_b, lse_b
            if step + 1 < comm.world:
                comm.wait()
                k, v = nxt
    return out.to(q.dtype), lse


@metadata_pure
def ring_attention_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, group: ProcessGroup | None, *,
    zigzag: bool, causal: bool, scale: float | None = None, kernel: str = "auto",
    docs: RingDocuments | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`ring_attention_forward` from its merged ``out`` and ``lse``.

    Shapes as in the forward; returns (dq, dk, dv) shaped like (q, k, v), for this rank's blocks.
    """
    _check_ring_input(q, k, v, zigzag)
    kv_comm, d_comm = RingComm(group), RingComm(group)
    kw = dict(scale=scale, kernel=kernel)
    acc = accumulator_dtype(q.dtype)  # fp32 sums, fp64 for fp64 inputs
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv = recv_d = None  # fp32 (dk, dv) accumulators of the K/V block this rank holds
    with _settled(kv_comm, d_comm):
        for step in range(kv_comm.world):
            if step + 1 < kv_comm.world:
                nxt = kv_comm.start([k, v])
            plan = step_blocks(step, kv_comm.rank, kv_comm.world, q.shape[1], zigzag=zigzag,
                               causal=causal, docs=docs)
            if dkv is None:  # step 0: this rank's own block starts its accumulators
                dkv = [torch.zeros(t.shape, dtype=acc, device=t.device) for t in (k, v)]
            else:  # the accumulators of the block just received, from the previous rank
                d_comm.wait()
                dkv = recv_d
            if plan is not None:
                qp, kvp, blk_causal, blocks = plan
                parts = (_part(dout, qp), _part(q, qp), _part(k, kvp), _part(v, kvp),
                         _part(out, qp), _part(lse, qp, dim=2))
                targets = (_part(dq, qp), _part(dkv[0], kvp), _part(dkv[1], kvp))
                if blocks is None:
                    dq_b, dk_b, dv_b = attention_backward(*parts, causal=blk_causal, **kw)
                    targets[0].add_(dq_b)
                    targets[1].add_(dk_b)
                    targets[2].add_(dv_b)
                    del dq_b, dk_b, dv_b
                else:  # each document's gradients added in place: no block-sized temporary
                    for (qa, qb, ka, kb), dq_b, dk_b, dv_b in attention_blocks_backward(
                            *parts, causal=blk_causal, blocks=blocks, **kw):
                        targets[0][:, qa:qb].add_(dq_b)
                        targets[1][:, ka:kb].add_(dk_b)
                        targets[2][:, ka:kb].add_(dv_b)
                        del dq_b, dk_b, dv_b
            if kv_comm.world > 1:  # pass them on; after the last step they reach their owner
                recv_d = _pass_on_gradients(d_comm, dkv)
            if step + 1 < kv_comm.world:
                kv_comm.wait()
                k, v = nxt
        if kv_comm.world > 1:
            d_comm.wait()
            dkv = recv_d
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


def _pass_on_gradients(comm: RingComm, dkv: list[torch.Tensor]) -> list[torch.Tensor]:
    """Send the dK/dV accumulators ``dkv`` to the next rank; returns the buffers receiving the
    previous rank's. The next step waits for them before its kernel: the sent accumulators are
    freed before the kernel allocates (two fp32 K/V blocks fewer at its peak than waiting after
    it, as ring-flash-attention does), at the price of the exchange running beside no kernel
    (``experiments/timing/op_costs.py`` prices it as blocking)."""
    return comm.start(dkv)


class _RingAttention(torch.autograd.Function):
    """Autograd over the ring: saves q, k, v, out and lse, as a fused kernel would."""

    @staticmethod
    def forward(ctx, q, k, v, group, zigzag, causal, scale, kernel, docs):
        kw = dict(zigzag=zigzag, causal=causal, scale=scale, kernel=kernel, docs=docs)
        out, lse = ring_attention_forward(q, k, v, group, **kw)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.kw = group, kw
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_attention_backward(dout, q, k, v, out, lse, ctx.group, **ctx.kw)
        return dq, dk, dv, None, None, None, None, None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: ProcessGroup | None = None,
    zigzag: bool = False, causal: bool = True, scale: float | None = None, kernel: str = "auto",
    docs: RingDocuments | None = None,
) -> torch.Tensor:
    """Differentiable ring attention, (B, L, H, D) x (B, L, Hkv, D) -> (B, L, H, D).

    Inputs are this rank's tokens in the layout ``zigzag`` names (see the module docstring);
    ``docs``: packed documents (attention stays inside each), or None.
    """
    # under autocast: on q, k, v of its dtype (upipe.amp), as torch's SDPA is
    return cast_for_autocast(_RingAttention.apply, q.device.type, q, k, v, group, zigzag,
                             causal, scale, check_kernel(kernel), docs)


class SequenceAttention:
    """The attention step of an all-to-all method on full-sequence (head-sharded) tensors.

    Without ``ring_group`` it is the local kernel; with one (USP and UPipe on a 2-D mesh), the
    "full" sequence is only the ring rank's zigzag pair and the step is zigzag ring attention
    over the ring group. ``forward`` -> (out, lse); ``backward`` from the saved out and lse.
    ``docs``: packed documents (``RingDocuments``: with a ring, the ring axis's tokens; without,
    only its ``docs`` is read: the full sequence holds every document). ``chunk``: run the
    backward over sequence chunks of that many tokens (``backward_into``, ``upipe.chunked``;
    local kernel only), None: one kernel call.
    """

    def __init__(self, *, causal: bool, scale: float | None = None, kernel: str = "auto",
                 ring_group: ProcessGroup | None = None, docs: RingDocuments | None = None,
                 chunk: int | None = None):
        check_chunk(chunk, ring=ring_group is not None)
        self.kw = dict(causal=causal, scale=scale, kernel=check_kernel(kernel))
        self.ring_group, self.docs, self.chunk = ring_group, docs, chunk
        self.blocks = None if docs is None else docs.docs.full_blocks()

    def forward(self, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ring_group is None:
            return attention_forward(q, k, v, blocks=self.blocks, **self.kw)
        return ring_attention_forward(q, k, v, self.ring_group, zigzag=True, docs=self.docs,
                                      **self.kw)

    def backward(self, dout, q, k, v, out, lse) -> tuple[torch.Tensor, ...]:
        if self.ring_group is None:
            return attention_backward(dout, q, k, v, out, lse, blocks=self.blocks, **self.kw)
        return ring_attention_backward(
            dout, q, k, v, out, lse, self.ring_group, zigzag=True, docs=self.docs, **self.kw
        )

    def backward_into(self, dout, q, k, v, out, lse, dk_acc, dv_acc) -> torch.Tensor:
        """The chunked backward (``chunk`` set): dq, with dk/dv added into the fp32
        ``dk_acc``/``dv_acc`` (k's and v's shapes)."""
        return chunked_attention_backward(
            dout, q, k, v, out, lse, dk_acc, dv_acc, chunk=self.chunk,
            docs=None if self.docs is None else self.docs.docs, **self.kw)
