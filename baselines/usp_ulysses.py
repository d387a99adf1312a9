"""``usp-ulysses``: Ulysses as the paper's runs ran it, yunchang's USP (Fang & Zhao, arXiv
2405.07719; PyPI ``yunchang``) at ring degree 1 (the paper's scripts name it ``usp-ulysses``;
it is the "Ulysses" row of its Table 3 and its 3M memory-wall figure).

Its math is ``ulysses``': one sequence->head all-to-all, attention over the full sequence, the
all-to-all back. Its memory differs in one place. yunchang's ``LongContextAttention`` calls its
zigzag ring attention whatever the ring degree, so at ring degree 1 every layer's attention is a
ring of one rank, and that ring's backward (``yunchang/ring/zigzag_ring_flash_attn.py``) keeps,
after its kernel has returned and until it returns itself:

* the kernel's bf16 dq/dk/dv buffers (q+k+v bytes);
* fp32 copies of them, the ring's gradient sums (2 x (q+k+v));
* fp32 dK/dV receive buffers: after its one step the ring passes dK/dV on, here to itself
  (2 x (k+v));
* the bf16 results, cast from the received sums while all of the above are alive (q+k+v).

That tail, 4 q + 12 k bf16-sized bytes beside what the kernel saved (q, k, v, out, lse) and the
output gradient, is the attention backward's peak; ``ulysses`` holds the kernel's outputs and
its workspace (FlashAttention-3's fp32 dq and GQA dk/dv accumulators) instead. On Llama3-8B at
3M tokens on 8 GPUs that is about 7 GiB more per rank, the difference between fitting 4M tokens
(``ulysses``) and not (the paper). The forward is the ring's first step: the kernel's output
copied into an fp32 running output, then cast back, the block's output alive until the cast.
Packed documents are refused (yunchang's are a different, varlen ring).

Written by hand rather than as an adapter (as ``rfa-zigzag`` is): yunchang's ring calls the
flash-attn / FlashAttention-3 kernels on CUDA only, and the suite must run this method on CPU
and under fake tensors, where the emulator predicts its paper-scale memory. upipe's kernels
stand in for FlashAttention-3; what is reproduced is yunchang's order of allocations and frees.
yunchang's ring over more than one rank (its USP 8 x 2) is ``usp``'s memory plus its own
buffers, which this module does not model: upipe's kernels return new tensors where yunchang's
later ring steps write into the first step's buffers.
"""

from __future__ import annotations

import torch

from baselines.ulysses import UlyssesAttention, ulysses_attention
from upipe.amp import cast_for_autocast
from upipe.kernels import attention_backward, attention_forward, check_kernel
from upipe.registry import register_method


class _RingOfOne(torch.autograd.Function):
    """yunchang's zigzag ring attention on a ring of one rank (module docstring): saves q, k, v,
    out and lse, as the ring does."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, kernel):
        block_out, lse = attention_forward(q, k, v, causal=causal, scale=scale, kernel=kernel)
        out = block_out.float()  # the ring's running output starts as the first block, fp32
        out = out.to(q.dtype)  # the block's output is alive until here, as in yunchang's loop
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kw = dict(causal=causal, scale=scale, kernel=kernel)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        # the LSE's second half, copied for the later ring steps, of which a ring of one has none
        lse_half = lse[:, :, lse.shape[2] // 2:].contiguous()  # noqa: F841 (held, as yunchang)
        buffers = attention_backward(dout, q, k, v, out, lse, **ctx.kw)  # bf16 dq/dk/dv
        dq, dk, dv = (b.float() for b in buffers)  # the ring's fp32 sums, from the first step
        received = [torch.empty_like(t).copy_(t) for t in (dk, dv)]  # dK/dV sent to itself
        return dq.to(q.dtype), received[0].to(k.dtype), received[1].to(v.dtype), None, None, None


def ring_of_one_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
    scale: float | None = None, kernel: str = "auto",
) -> torch.Tensor:
    """yunchang's ring attention over one rank: (B, S, H, D) x (B, S, Hkv, D) -> (B, S, H, D),
    differentiable; the values of upipe's kernel, yunchang's allocations (module docstring)."""
    # under autocast: on q, k, v of its dtype (upipe.amp), as torch's SDPA is
    return cast_for_autocast(_RingOfOne.apply, q.device.type, q, k, v, causal, scale,
                             check_kernel(kernel))


@register_method("usp-ulysses")
class USPUlyssesAttention(UlyssesAttention):
    """The paper's Ulysses; forward(x_local (B, L, dim), cu_seqlens=None) -> (B, L, dim)."""

    documents_unsupported = (
        "yunchang's packed-document attention is a different (varlen) ring, not modelled "
        "here; use 'ulysses'"
    )

    def forward(self, x: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
        self.check_input(x)
        self.documents(cu_seqlens, x)  # refused with packed documents (documents_unsupported)
        q, k, v = self.project_qkv(x, None)
        o = ulysses_attention(q, k, v, group=self.group, causal=self.causal, kernel=self.kernel,
                              core=ring_of_one_attention)
        return self.wo(o.flatten(2))
