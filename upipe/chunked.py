"""Attention backward over sequence chunks of a full (head-sharded) sequence (UPipe's option).

An all-to-all method's attention kernel sees every token of its heads: its backward allocates
dq, dk and dv over the full sequence and, on GPU, FlashAttention's fp32 dq accumulator (with
the recv buffers and UPipe's fp32 dK/dV sums, most of UPipe's attention working set at long
contexts). Here the backward runs block by block over sequence chunks of ``chunk`` tokens, the
blockwise decomposition of ring attention (``upipe.ring``) without the ring: query chunk i
against key chunk j <= i (all j when not causal), the diagonal block causal, the others full,
each from the final ``out`` and ``lse`` (FlashAttention-2's backward needs only those, so no
block is rescaled). dq of a query chunk is summed over its key chunks in fp32 (the input's
dtype if wider: ``accumulator_dtype``) and written to
the chunk's rows of one dq; each block's dk/dv are added into the caller's fp32 accumulators.
The kernel's scratch then scales with the chunk, not with the sequence; the forward is
unchanged (its working set is the output and the LSE, which the backward needs whole anyway).

Packed documents (``docs``): each (query chunk, key chunk) pair is restricted to the documents
both contain (``Documents.blocks``), as the ring does; pairs sharing none are skipped.

Written by hand: the fused kernels have no chunked backward, and this must run on CPU and
under fake tensors. The per-block step is metadata-pure (``upipe.pure``), so the emulator
replays the many blocks of a long sequence instead of dispatching each one.
"""

from __future__ import annotations

import numbers

import torch

from upipe.documents import Documents
from upipe.kernels import attention_blocks_backward
from upipe.pure import Span, metadata_pure


def chunk_spans(n: int, chunk: int) -> list[tuple[int, int]]:
    """(start, end) of consecutive chunks of ``chunk`` tokens over n tokens (the last shorter).
    A chunk that is not a positive integer is refused: a negative one made no span at all, and
    a chunked function returned what it had not computed."""
    check_chunk(chunk, name="chunk")
    if chunk is None:
        raise ValueError("chunk must be a positive number of tokens, got None")
    chunk = int(chunk)
    return [(a, min(n, a + chunk)) for a in range(0, n, chunk)]


def spans(n: int, chunk: int, dim: int = 0) -> list[Span]:
    """``chunk_spans`` as ``Span``s of ``dim``: the views ``t.split(chunk, dim)`` makes
    (``torch.chunk(t, k, dim)``'s for chunk = ceil(n / k)), as a metadata-pure function's
    arguments."""
    return [Span(a, b - a, dim) for a, b in chunk_spans(n, chunk)]


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where gradients are summed over blocks or stages: fp32 for low-precision inputs ("bf16
    with fp32 reductions"), else the input's own dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def check_chunk(chunk: int | None, ring: bool = False, name: str = "chunk_size") -> None:
    """None (not chunked) or a positive int, and no ring axis (``ring``: the attention is ring
    attention over one, whose blocks are already the chunks), else a ValueError naming
    ``name``."""
    if chunk is None:
        return
    if isinstance(chunk, bool) or not isinstance(chunk, numbers.Integral) or chunk < 1:
        raise ValueError(f"{name} must be a positive number of tokens or None, got {chunk!r}")
    if ring:
        raise ValueError(f"{name} (a chunked attention backward) needs the plain Ulysses mesh "
                         "(ring_degree 1) given as a group, not a (ring, ulysses) mesh or "
                         "ring_group, even of one ring rank: with a ring axis the ring's blocks "
                         "are the chunks")


@metadata_pure
def _block(dout, q, k, v, out, lse, dq_acc, dk_acc, dv_acc, blocks, causal: bool,
           scale, kernel: str, first: bool) -> None:
    """One (query chunk, key chunk) pair: its document blocks' gradients added in place.

    Tensors are the chunks' views: dout, q, out (B, c_q, H, D), lse (B, H, c_q), k, v
    (B, c_k, Hkv, D); dq_acc (B, c_q, H, D) (``first``: the chunk's first pair, which copies
    instead of adding); dk_acc, dv_acc (B, c_k, Hkv, D), all in ``accumulator_dtype``.
    """
    for (qa, qb, ka, kb), dq_b, dk_b, dv_b in attention_blocks_backward(
            dout, q, k, v, out, lse, causal=causal, scale=scale, kernel=kernel, blocks=blocks):
        target = dq_acc[:, qa:qb]
        if first:
            target.copy_(dq_b)
        else:
            target.add_(dq_b)
        dk_acc[:, ka:kb].add_(dk_b)
        dv_acc[:, ka:kb].add_(dv_b)
        del dq_b, dk_b, dv_b


def chunked_attention_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, dk_acc: torch.Tensor, dv_acc: torch.Tensor, *, chunk: int, causal: bool,
    scale: float | None = None, kernel: str = "auto", docs: Documents | None = None,
) -> torch.Tensor:
    """dq of full-sequence attention, and its dk/dv added into ``dk_acc``/``dv_acc``.

    Args:
        dout, q, out: (B, S, H, D); k, v: (B, S, Hkv, D); lse: (B, H, S) fp32 -- the forward's
            (``upipe.kernels.attention_forward`` on the whole sequence).
        dk_acc, dv_acc: (B, S, Hkv, D) accumulators in ``accumulator_dtype`` (zero, or earlier
            stages' sums).
        chunk: tokens per sequence chunk; docs: packed documents over the S tokens, or None.
    Returns:
        dq (B, S, H, D) in q's dtype; rows that see no key (outside every document) are 0.
    """
    spans = chunk_spans(q.shape[1], chunk)
    dq = torch.empty_like(q)
    # each key chunk's views, made once: a causal backward visits chunk j from every query chunk
    # i >= j, and under the emulator's fake tensors every slice is a dispatched op
    kv_chunks = [(k[:, a:b], v[:, a:b], dk_acc[:, a:b], dv_acc[:, a:b]) for a, b in spans]
    for i, (qa, qb) in enumerate(spans):
        dq_acc = None
        dout_i, q_i, out_i, lse_i = dout[:, qa:qb], q[:, qa:qb], out[:, qa:qb], lse[:, :, qa:qb]
        for j, (ka, kb) in enumerate(spans[:i + 1] if causal else spans):
            blocks = ((0, qb - qa, 0, kb - ka),) if docs is None else docs.blocks(
                [(qa, qb - qa)], [(ka, kb - ka)])
            if not blocks:
                continue
            first = dq_acc is None
            if first:
                shape = (q.shape[0], qb - qa, *q.shape[2:])
                dq_acc = (torch.empty if docs is None else torch.zeros)(
                    shape, dtype=accumulator_dtype(q.dtype), device=q.device)
            k_j, v_j, dk_j, dv_j = kv_chunks[j]
            _block(dout_i, q_i, k_j, v_j, out_i, lse_i, dq_acc, dk_j, dv_j, blocks,
                   causal and i == j, scale, kernel, first and docs is None)
        if dq_acc is None:  # no key visible to these queries (packed documents only)
            dq[:, qa:qb] = 0
        else:
            dq[:, qa:qb] = dq_acc
        del dq_acc
    return dq
