"""Linear + cross-entropy over token chunks, so full logits never exist (the ALST loss).

Hand-written rather than DeepSpeed's ``TiledFusedLogitsLoss`` because that one (a) branches on a
tensor value in backward (``if grads[0] != 1.0``), which fails under ``FakeTensorMode``, and
(b) runs the backward inside the forward, accumulating the head's weight gradient before
FSDP2's backward hooks expect it. This version saves only its inputs and recomputes each chunk's
logits in backward; the gradient of a chunk is ``softmax(logits) - onehot(label)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from upipe.amp import autocast_state, recompute_autocast
from upipe.chunked import spans
from upipe.pure import Span, metadata_pure

IGNORE_INDEX = -100


def loss_chunk_tokens(dim: int, vocab_size: int) -> int:
    """Tokens per chunk: at most ``dim`` (the tiling rule of the MLP) and at most a 512 MiB fp32
    logits chunk (2**27 values), so large vocabularies stay bounded on GPU."""
    return max(1, min(dim, 2**27 // vocab_size))


# Each chunk is one function call, for two reasons: a chunk's temporaries (its logits, its
# gradient) are freed when it returns, before the next chunk makes its own, and the emulator
# replays the calls of one shape instead of running each chunk's kernels again
# (upipe/pure.py); a 1M-token sequence has hundreds of chunks.
@metadata_pure
def _chunk_loss_into(total: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                     labels: torch.Tensor, chunk: Span) -> None:
    """Add one chunk's summed cross-entropy into ``total`` (fp32 scalar) in place.
    h: (N, dim) hidden states; weight: (V, dim); labels: (N,); chunk: rows of N (n of them)."""
    logits = F.linear(chunk.of(h), weight).float()  # (n, V) fp32
    total += F.cross_entropy(logits, chunk.of(labels), ignore_index=IGNORE_INDEX,
                             reduction="sum")


@metadata_pure
def _chunk_backward_into(dh: torch.Tensor, dw: torch.Tensor, h: torch.Tensor,
                         weight: torch.Tensor, labels: torch.Tensor, grad_total: torch.Tensor,
                         chunk: Span) -> None:
    """One chunk's gradients, written in place: ``dh`` (N, dim), the chunk's rows of the hidden
    states' gradient; ``dw`` (V, dim) fp32, the head's gradient, added into. h: (N, dim);
    labels: (N,); chunk: rows of N (n of them). The gradient of a chunk's logits is
    ``softmax(logits) - onehot(label)`` scaled by ``grad_total`` (scalar), zero where the label
    is IGNORE_INDEX."""
    hc, lc = chunk.of(h), chunk.of(labels)
    valid = (lc != IGNORE_INDEX).unsqueeze(1)  # (n, 1); no data-dependent shapes
    g = torch.softmax(F.linear(hc, weight).float(), dim=-1)
    g.scatter_add_(1, lc.clamp(min=0).unsqueeze(1), -valid.float())
    g.mul_(valid * grad_total)
    g = g.to(hc.dtype)
    chunk.of(dh).copy_(g @ weight)
    dw.addmm_(g.t().float(), hc.float())  # no copies when h is fp32


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, chunk):
        ctx.save_for_backward(h, weight, labels)
        ctx.chunk = chunk
        ctx.amp = autocast_state(h.device.type)  # the backward's logits are the forward's
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        # each chunk a span of the whole tensors: no view is made outside the chunk's call,
        # which the emulator replays (hundreds of chunks per call)
        for c in spans(h.shape[0], chunk):
            _chunk_loss_into(total, h, weight, labels, c)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        h, weight, labels = ctx.saved_tensors
        chunk = ctx.chunk
        dh = torch.empty_like(h)
        # fp32 accumulation of the head's gradient across chunks (one weight-sized buffer)
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        with recompute_autocast(ctx.amp):
            for c in spans(h.shape[0], chunk):
                _chunk_backward_into(dh, dw, h, weight, labels, grad_total, c)
        return dh, dw.to(weight.dtype), None, None


def chunked_linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                 chunk: int) -> torch.Tensor:
    """Summed cross-entropy of ``h @ weight.T`` against ``labels``, ``chunk`` tokens at a time.

    Args:
        h: (N, dim) hidden states; weight: (V, dim) output head; labels: (N,) int64 with
            IGNORE_INDEX for positions without a target; chunk: tokens per chunk.
    Returns:
        fp32 scalar, the sum over non-ignored tokens (divide by the global token count).
    """
    if h.dim() != 2 or labels.shape != (h.shape[0],):
        raise ValueError(f"labels must be (N,) for h of (N, dim): got labels {tuple(labels.shape)} "
                         f"and h {tuple(h.shape)}")
    spans(h.shape[0], chunk)  # refuses a chunk that is not a positive integer, before any work
    return _ChunkedLinearCrossEntropy.apply(h, weight, labels, chunk)
