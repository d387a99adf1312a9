"""FPDT, the Fully Pipelined Distributed Transformer's attention (Yao et al., arXiv 2408.16978).

Ulysses attention run sequence chunk by sequence chunk, with every chunk's activations parked in
host memory. A portable re-implementation on upipe's pieces: facts (schedule, what is offloaded)
from DeepSpeed's ``deepspeed/sequence/fpdt_layer.py`` (``_FPDTGPUOffloadingAttentionImpl_``),
no code from it; it needs flash-attn and CUDA, this runs on CPU/gloo and under fake tensors.

Layout ("chunked", upipe/layout.py): the global sequence is cut into chunks of ``chunk_size``
tokens (the last may be shorter), each split over the C ranks, so the sequence->head all-to-all
of local chunk i yields global chunk i (one contiguous span) for H/C heads.

Forward, per chunk i (K/V of chunk i are projected when first needed: at step i when causal,
all before step 0 otherwise): project q, k, v of the local chunk from the layer input, RoPE,
all-to-all to head layout (KV heads replicated to C when fewer), put all three in host memory.
Then attention of q_i over the visible K/V chunks j (causal: j <= i, causal only when j == i;
else all j), each fetched from host (chunk i's own still on the device, the next one prefetched),
merged by log-sum-exp in fp32 (upipe/merge.py); the merged output goes back by all-to-all and
through ``wo`` into the chunk of y, so no (L, H*D) output ever exists. Saved for backward: x and
the weights on the device; q, k, v, the output (head and sequence layout) and LSE per chunk, in
host memory (through ``save_for_backward``, so activation checkpointing drops and recomputes them
like any saved tensor).

Backward, query chunk outer (DeepSpeed's loop is KV-outer with dQ accumulators in host memory;
with GQA the K/V accumulators are the smaller ones): dO_i = dy_i @ wo, all-to-all; per visible j,
the kernel backward with chunk i's *merged* out and LSE (exact per block, as in FlashAttention-2:
P = exp(S - lse_final)); dQ_i accumulates on the device, dK_j/dV_j in fp32 host accumulators.
After chunk i, dQ_i goes back, RoPE is undone and dx_i, dWq accumulate; at the end each dK_j,
dV_j goes back (KV replicas' gradients summed) into dx_j, dWk, dWv.

Device working set: O(chunk) plus the layer's interface tensors x, y, dy, dx and the weights'
gradients. Host bytes per rank (B batch, L local tokens, H' = max(Hkv, C), b the input's
itemsize, a the accumulators' (4 for fp32/bf16)): B*L*[(3H + 2H')*D*b + 4H] saved (q, k, v, the
output in both layouts, fp32 LSE) + B*L*2H'*D*a for the dK/dV accumulators in backward
(tests/test_fpdt.py checks it to the byte). Llama3-8B attention, 1M tokens on 8 ranks, bf16,
64K chunks: 4.5 GiB of host memory per rank and layer.
All-to-alls: 4 per chunk forward (q, k, v, out) and 4 per chunk backward (dO, dQ, dK, dV).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from upipe.amp import cast_for_autocast
from upipe.comm import group_size, head_to_seq, seq_to_head
from upipe.documents import DocBlocks, Documents
from upipe.host import HostStore
from upipe.kernels import attention_backward, attention_forward
from upipe.layout import SeqLayout
from upipe.merge import merge_attention
from upipe.module import ContextParallelAttention, replicate_kv_heads
from upipe.options import MethodOption
from upipe.pure import metadata_pure
from upipe.registry import register_method
from upipe.rope import apply_rope, apply_rope_inverse, rope_tables

DEFAULT_CHUNK = 65536  # global tokens per chunk: the paper's (and Megatron-DeepSpeed's) 64K


@dataclass(frozen=True)
class ChunkPlan:
    """One rank's chunks and the static facts the autograd function needs.

    segments: per chunk, (global position of this rank's first token, local token count).
    chunks: per chunk, its global (start, length): what a rank holds after the all-to-all.
    docs: packed documents, or None: a (query chunk, K/V chunk) pair then attends in one block
        per document both hold, and a pair sharing none is skipped (never fetched from host).
    """

    segments: tuple[tuple[int, int], ...]
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float
    causal: bool
    kernel: str
    chunks: tuple[tuple[int, int], ...] = ()
    docs: Documents | None = None

    @property
    def n_chunks(self) -> int:
        return len(self.segments)

    def local_span(self, i: int) -> tuple[int, int]:
        """(offset, length) of chunk i within this rank's local tokens."""
        return sum(n for _, n in self.segments[:i]), self.segments[i][1]

    def visible(self, i: int) -> list[int]:
        """K/V chunks query chunk i attends to; the diagonal first (its LSE is finite: every
        query sees itself, in its own document too)."""
        others = range(i) if self.causal else (j for j in range(self.n_chunks) if j != i)
        return [i, *(j for j in others if self.blocks(i, j) != ())]

    def blocks(self, i: int, j: int) -> DocBlocks | None:
        """The document blocks of query chunk i over K/V chunk j (``()``: no shared document),
        or None without packed documents."""
        if self.docs is None:
            return None
        return self.docs.blocks([self.chunks[i]], [self.chunks[j]])

    def rope(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (n_i, D) of local chunk i: per chunk, so no (L, D) table is alive."""
        start, n = self.segments[i]
        if self.docs is None:
            pos = torch.arange(start, start + n, device=x.device)
        else:
            pos = self.docs.positions([(start, n)], device=x.device)
        return rope_tables(pos, self.head_dim, self.rope_theta, x.dtype)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32 for low-precision inputs ("bf16 with fp32 reductions")."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _project_chunk(x, wq, wk, wv, plan: ChunkPlan, i: int, group):
    """q (B, c_i, H/C, D), k, v (B, c_i, H'/C, D) of global chunk i in head layout, rotated."""
    off, n = plan.local_span(i)
    return _project(x[:, off:off + n], *plan.rope(i, x), wq, wk, wv, plan.head_dim, group)


@metadata_pure  # one recording serves every chunk of a length, in every layer (emulation)
def _project(xi, cos, sin, wq, wk, wv, d: int, group):
    """``_project_chunk`` of the chunk's tokens xi (B, n, dim) and rotary tables (n, D)."""
    cp = group_size(group)
    heads = lambda w: (xi @ w.t()).unflatten(-1, (-1, d))  # noqa: E731  (B, n, h, D)
    q = seq_to_head(apply_rope(heads(wq), cos, sin), group)
    k = seq_to_head(replicate_kv_heads(apply_rope(heads(wk), cos, sin), cp), group)
    v = seq_to_head(replicate_kv_heads(heads(wv), cp), group)
    return q, k, v


def _kv_chunks(plan: ChunkPlan, store: HostStore, ks, vs, i: int, diag=None):
    """Yield (j, k_j, v_j) on the device for each K/V chunk query chunk i sees.

    ks/vs: per chunk, host handles. ``diag``: chunk i's (k, v) when still on the device (the
    chunk just projected), used instead of a host round trip. The next pair is prefetched so
    its copy overlaps this block's compute (CUDA).
    """
    order = plan.visible(i)
    for n, j in enumerate(order):
        if n + 1 < len(order):
            store.prefetch(ks[order[n + 1]])
            store.prefetch(vs[order[n + 1]])
        if j == i and diag is not None:
            yield j, *diag
        else:
            yield j, store.get(ks[j]), store.get(vs[j])


@metadata_pure  # one recording per query chunk serves every layer (emulation)
def _attend(q, ks, vs, plan: ChunkPlan, i: int, store: HostStore, diag=None):
    """Attention of query chunk i over its visible K/V chunks, merged by LSE.

    q (B, c_i, H/C, D). Returns out (B, c_i, H/C, D) in the accumulation dtype and lse
    (B, H/C, c_i) fp32. Every chunk it prefetches it also uses, so the store holds nothing
    after it (``HostStore.metadata_key``).
    """
    out = lse = None
    for j, k, v in _kv_chunks(plan, store, ks, vs, i, diag):
        o, o_lse = attention_forward(q, k, v, causal=plan.causal and j == i, kernel=plan.kernel,
                                     blocks=plan.blocks(i, j))
        del k, v
        if out is None:  # the diagonal: every query sees at least itself, so lse is finite
            out, lse = o.to(_acc_dtype(o.dtype)), o_lse
        else:
            merge_attention(out, lse, o, o_lse)
    return out, lse


class _FPDTFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, wq, wk, wv, wo, plan: ChunkPlan, group, store: HostStore, save: bool):
        y = x.new_empty(*x.shape[:2], wo.shape[0])
        qs, ks, vs, outs, seqs, lses = [], [], [], [], [], []
        for i in range(plan.n_chunks):
            fresh = None  # chunk i's q, k, v when projected in this step: still on the device
            while len(ks) <= (i if plan.causal else plan.n_chunks - 1):
                j = len(ks)
                q, k, v = _project_chunk(x, wq, wk, wv, plan, j, group)
                qs.append(store.put(q))
                ks.append(store.put(k))
                vs.append(store.put(v))
                fresh = (q, k, v) if j == i else fresh
                del q, k, v
            q, diag = (fresh[0], fresh[1:]) if fresh else (store.get(qs[i]), None)
            del fresh
            out, lse = _attend(q, ks, vs, plan, i, store, diag)
            del q, diag
            out = out.to(x.dtype)
            o_seq = head_to_seq(out, group)  # (B, n_i, H, D)
            off, n = plan.local_span(i)
            y[:, off:off + n] = o_seq.flatten(2) @ wo.t()
            if save:
                outs.append(store.put(out))
                seqs.append(store.put(o_seq))
                lses.append(store.put(lse))
            else:
                qs[i] = None  # only K/V chunks are needed again
            del out, lse, o_seq
        store.sync()
        if save:
            ctx.save_for_backward(x, wq, wk, wv, wo, *qs, *ks, *vs, *outs, *seqs, *lses)
        ctx.plan, ctx.group, ctx.store = plan, group, store
        return y

    @staticmethod
    def backward(ctx, dy):
        x, wq, wk, wv, wo, *saved = ctx.saved_tensors
        nc = ctx.plan.n_chunks
        chunks = [saved[t * nc:(t + 1) * nc] for t in range(6)]  # qs, ks, vs, outs, seqs, lses
        bwd = _Backward.start(x, (wq, wk, wv, wo), ctx.plan, ctx.group, ctx.store, *chunks)
        for i in range(nc):
            _query_chunk(bwd, i, dy)
        for j in range(nc):
            _kv_chunk(bwd, j)
        ctx.store.sync()
        return bwd.dx, *(g.to(x.dtype) for g in bwd.dw), None, None, None, None


def _accumulate_input_grad(g, xi, dxi, w, dw) -> None:
    """For y = x @ w^T over one chunk: dx_i += g @ w, dw += g^T x_i (dw in its own dtype).

    g (B, n, out) in the input dtype; xi, dxi (B, n, dim) views of x, dx; w (out, dim).
    """
    dxi.add_(g @ w)
    g2, x2 = g.reshape(-1, g.shape[-1]), xi.reshape(-1, xi.shape[-1])
    dw.addmm_(g2.t().to(dw.dtype), x2.to(dw.dtype))


@dataclass
class _Backward:
    """State of one backward pass: inputs, saved chunk handles and gradient accumulators.

    dx (B, L, dim) in the input dtype (accumulated in place, like autograd would hold it);
    dw: dWq, dWk, dWv, dWo in the accumulation dtype (they sum over chunks); dks/dvs: per K/V
    chunk, a (B, c_j, H'/C, D) accumulation-dtype host accumulator (it sums over the query
    chunks that see chunk j, so it is complete only at the end). A dataclass, so an emulated
    step's chunk steps (``_query_chunk``, ``_kv_chunk``) replay from one layer to the next by
    the state's metadata (``upipe.pure``).
    """

    x: torch.Tensor
    weights: tuple[torch.Tensor, ...]
    plan: ChunkPlan
    group: object
    store: HostStore
    qs: tuple
    ks: tuple
    vs: tuple
    outs: tuple
    seqs: tuple
    lses: tuple
    dx: torch.Tensor
    dw: list[torch.Tensor]
    dks: list[torch.Tensor]
    dvs: list[torch.Tensor]

    @classmethod
    def start(cls, x, weights, plan: ChunkPlan, group, store: HostStore,
              qs, ks, vs, outs, seqs, lses) -> _Backward:
        """The state with zeroed accumulators."""
        acc = _acc_dtype(x.dtype)
        return cls(x, weights, plan, group, store, tuple(qs), tuple(ks), tuple(vs), tuple(outs),
                   tuple(seqs), tuple(lses), torch.zeros_like(x),
                   [torch.zeros(w.shape, dtype=acc, device=w.device) for w in weights],
                   [store.zeros(k.shape, acc) for k in ks],
                   [store.zeros(v.shape, acc) for v in vs])


def _add_to_host(b: _Backward, h: torch.Tensor, t: torch.Tensor) -> None:
    """h += t for a host accumulator h (fetch, add on the device, write back)."""
    a = b.store.get(h)
    a.add_(t)
    b.store.write(h, a)


def _output_grad(b: _Backward, i: int, dy: torch.Tensor) -> torch.Tensor:
    """dWo += dy_i^T out_i; returns dO_i = dy_i @ wo in head layout (B, c_i, H/C, D)."""
    off, n = b.plan.local_span(i)
    dy_i, wo, dwo = dy[:, off:off + n], b.weights[3], b.dw[3]
    o_seq = b.store.get(b.seqs[i])  # (B, n_i, H, D): the input of wo
    dwo.addmm_(dy_i.reshape(-1, dy_i.shape[-1]).t().to(dwo.dtype),
               o_seq.reshape(-1, wo.shape[1]).to(dwo.dtype))
    del o_seq
    return seq_to_head((dy_i @ wo).unflatten(-1, (-1, b.plan.head_dim)), b.group)


@metadata_pure  # one recording per query chunk serves every layer (emulation)
def _query_chunk(b: _Backward, i: int, dy: torch.Tensor) -> None:
    """Through query chunk i: dWo, dQ_i (into dx_i, dWq), its dK_j/dV_j contributions."""
    plan, store = b.plan, b.store
    do = _output_grad(b, i, dy)
    q, out, lse = store.get(b.qs[i]), store.get(b.outs[i]), store.get(b.lses[i])
    dq = torch.zeros(q.shape, dtype=_acc_dtype(q.dtype), device=q.device)
    for j, k, v in _kv_chunks(plan, store, b.ks, b.vs, i):
        # the merged (final) out/lse make each block's gradients exact on their own
        dq_j, dk_j, dv_j = attention_backward(
            do, q, k, v, out, lse, causal=plan.causal and j == i, kernel=plan.kernel,
            blocks=plan.blocks(i, j),
        )
        del k, v
        dq.add_(dq_j)
        _add_to_host(b, b.dks[j], dk_j)
        _add_to_host(b, b.dvs[j], dv_j)
        del dq_j, dk_j, dv_j
    del q, out, lse, do
    off, n = plan.local_span(i)
    cos, sin = plan.rope(i, b.x)
    dq = apply_rope_inverse(head_to_seq(dq.to(b.x.dtype), b.group), cos, sin)
    _accumulate_input_grad(dq.flatten(2), b.x[:, off:off + n], b.dx[:, off:off + n],
                           b.weights[0], b.dw[0])


def _from_heads(b: _Backward, h: torch.Tensor) -> torch.Tensor:
    """A dK/dV host accumulator -> (B, n_j, Hkv, D): all-to-all back, replicas summed.

    Replicas are consecutive (``replicate_kv_heads`` repeats each KV head C/Hkv times);
    they are summed in the accumulation dtype, then cast to the input dtype.
    """
    g = head_to_seq(b.store.get(h), b.group)
    bsz, n, hh, d = g.shape
    kv = b.plan.n_kv_heads
    return g.view(bsz, n, kv, hh // kv, d).sum(3).to(b.x.dtype)


@metadata_pure  # one recording per K/V chunk serves every layer (emulation)
def _kv_chunk(b: _Backward, j: int) -> None:
    """dK_j, dV_j (complete once every query chunk is done) into dx_j, dWk, dWv."""
    off, n = b.plan.local_span(j)
    cos, sin = b.plan.rope(j, b.x)
    xj, dxj = b.x[:, off:off + n], b.dx[:, off:off + n]
    dk = apply_rope_inverse(_from_heads(b, b.dks[j]), cos, sin)
    _accumulate_input_grad(dk.flatten(2), xj, dxj, b.weights[1], b.dw[1])
    del dk
    dv = _from_heads(b, b.dvs[j])
    _accumulate_input_grad(dv.flatten(2), xj, dxj, b.weights[2], b.dw[2])


@register_method("fpdt")
class FPDTAttention(ContextParallelAttention):
    """FPDT attention module; forward(x_local (B, L, dim), cu_seqlens=None) -> (B, L, dim),
    chunked layout; packed documents are kept apart per chunk pair (``ChunkPlan.blocks``).

    Extra options:
        chunk_size: global tokens per chunk (a multiple of the CP degree; need not divide the
            sequence, the last chunk is shorter; >= the sequence is one chunk, i.e. Ulysses).
        offload: keep chunk activations in host memory (False: on the device, for comparison).

    Attributes the harness may set: ``host_context`` (zero-argument callable returning a
    context manager entered around host allocations, e.g. a tracker's ``host``) and
    ``pin_memory`` (pin host buffers; CUDA only).
    """

    declared_options = (
        MethodOption("chunk_size", int, "global tokens per sequence chunk, a multiple of the "
                     "CP degree", tag="c", tokens=True),
    )

    def __init__(self, *args, chunk_size: int = DEFAULT_CHUNK, offload: bool = True, **kwargs):
        self.chunk_size, self.offload = chunk_size, offload  # options() runs in super().__init__
        super().__init__(*args, **kwargs)
        self.host_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        self.pin_memory = True

    # The chunk loop projects with the bare weights and theta's RoPE (ChunkPlan.rope).
    projection_features = frozenset()

    def options(self) -> dict:
        return {"chunk_size": self.chunk_size, "offload": self.offload}

    @classmethod
    def check_heads(cls, n_heads, n_kv_heads, ulysses_degree, *, chunk_size=DEFAULT_CHUNK, **_):
        super().check_heads(n_heads, n_kv_heads, ulysses_degree)
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
        if chunk_size % ulysses_degree:
            raise ValueError(
                f"chunk_size ({chunk_size}) must be divisible by the CP degree ({ulysses_degree})"
            )

    @classmethod
    def layout_for(cls, *, hybrid, ulysses_degree, chunk_size=DEFAULT_CHUNK, **_) -> SeqLayout:
        return SeqLayout("chunked", chunk_size=chunk_size)

    def chunk_plan(self, seq_local: int, docs: Documents | None = None) -> ChunkPlan:
        """This rank's chunks for a local length (validated by ``check_input``)."""
        s = seq_local * self.cp
        segs = self.seq_layout.segments(s, self.rank, self.cp)
        chunks = tuple((start, n * self.cp) for start, n in self.seq_layout.segments(s, 0, self.cp))
        return ChunkPlan(tuple(segs), self.n_heads, self.n_kv_heads, self.head_dim,
                         self.rope_theta, self.causal, self.kernel, chunks, docs)

    def forward(self, x: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
        self.check_input(x)
        docs = self.documents(cu_seqlens, x)
        weights = (self.wq.weight, self.wk.weight, self.wv.weight, self.wo.weight)
        # Q and the outputs are kept only for a backward (K/V are needed by later chunks anyway)
        save = torch.is_grad_enabled() and any(t.requires_grad for t in (x, *weights))
        store = HostStore(x.device, self.offload, self.host_context, self.pin_memory)
        # under autocast: on x and the weights cast to its dtype (upipe.amp), since the
        # Function projects with them itself
        return cast_for_autocast(_FPDTFunction.apply, x.device.type, x, *weights,
                                 self.chunk_plan(x.shape[1], docs), self.group, store, save)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", chunk_size={self.chunk_size}, offload={self.offload}"
