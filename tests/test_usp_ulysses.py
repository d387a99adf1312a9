"""The paper's Ulysses (``usp-ulysses``: yunchang's USP at ring degree 1): the same numbers as
``ulysses``, and the memory its ring of one rank keeps (exact on CPU, tracked). Its values
against the reference on 1, 2 and 4 ranks are in test_correctness.py."""

from __future__ import annotations

import pytest
import torch

import baselines.usp_ulysses as usp_ulysses
from experiments.instruments.memory import MemoryTracker
from upipe import build_method
from upipe.kernels import attention_backward, attention_forward

B, L, H, HKV, D, DIM = 1, 24, 8, 2, 16, 128
BF16, F32 = 2, 4
SQ, SKV = B * L * H * D * BF16, B * L * HKV * D * BF16  # q's and k's bytes in bf16
LSE = B * H * L * F32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_ulysses_to_the_bit(dtype):
    """One process: the ring of one's fp32 round trips are exact (bf16 -> fp32 -> bf16), so the
    output and every gradient equal ``ulysses``' bit for bit."""
    results = []
    for method in ("ulysses", "usp-ulysses"):
        torch.manual_seed(0)
        m = build_method(method, DIM, H, HKV).to(dtype)
        x = torch.randn(B, L, DIM, dtype=dtype, requires_grad=True)
        y = m(x)
        y.backward(torch.ones_like(y))
        results.append((y.detach(), x.grad, *(p.grad for p in m.parameters())))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def _outputs_only_forward(q, k, v, **kw):
    """A stand-in kernel that allocates its outputs and nothing else: what is measured is what
    the method keeps around the kernel (FA3's workspace is freed when it returns)."""
    return torch.empty_like(q), torch.empty(q.shape[0], q.shape[2], q.shape[1])


def _outputs_only_backward(dout, q, k, v, out, lse, **kw):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _peaks(monkeypatch) -> tuple[int, int]:
    """(forward, backward) peak bytes of the ring of one above what is alive as each starts."""
    monkeypatch.setattr(usp_ulysses, "attention_forward", _outputs_only_forward)
    monkeypatch.setattr(usp_ulysses, "attention_backward", _outputs_only_backward)
    q, k, v = (torch.randn(B, L, h, D, dtype=torch.bfloat16, requires_grad=True)
               for h in (H, HKV, HKV))
    with MemoryTracker() as mt:
        start = mt.current_bytes
        out = usp_ulysses.ring_of_one_attention(q, k, v, causal=True)
        forward = mt.peak_bytes - start
        dout = torch.empty_like(out)
        start = mt.current_bytes
        mt.reset_peak()
        out.backward(dout)
        return forward, mt.peak_bytes - start


def test_the_stand_ins_replace_the_kernels_it_calls():
    """The kernels monkeypatched below are the ones the method calls (not copies)."""
    assert usp_ulysses.attention_forward is attention_forward
    assert usp_ulysses.attention_backward is attention_backward


def test_ring_of_one_keeps_yunchangs_fp32_tail(monkeypatch):
    """Backward (yunchang's zigzag ring backward on one rank): the LSE's copied second half,
    then at its return the bf16 kernel buffers (q+k+v), fp32 dq/dk/dv, the fp32 dK/dV it sent
    itself and the bf16 casts (q+k+v), alive together: 4 q + 12 k bytes, where Ulysses keeps
    the kernel's outputs only (q + 2 k) once the kernel has returned. Forward: the block's bf16
    output, its fp32 copy and the bf16 result together, beside the LSE."""
    forward, backward = _peaks(monkeypatch)
    assert backward == LSE // 2 + 4 * SQ + 12 * SKV
    assert backward - LSE // 2 - (SQ + 2 * SKV) == 3 * SQ + 10 * SKV
    assert forward == SQ + LSE + 2 * SQ + SQ


def test_refuses_packed_documents_before_any_collective():
    m = build_method("usp-ulysses", DIM, H, HKV)
    with pytest.raises(ValueError, match="usp-ulysses.*packed documents.*varlen"):
        m(torch.randn(B, L, DIM), cu_seqlens=torch.tensor([0, 8, L]))
