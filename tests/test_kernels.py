"""Kernel dispatch: SDPA vs the math reference vs fp64, forward (out, lse) and backward, GQA."""

from __future__ import annotations

import pytest
import torch

from upipe.kernels import (
    KERNELS,
    attention,
    attention_backward,
    attention_forward,
    check_kernel,
    fa3_available,
    flash_attn_available,
    kernel_functions,
    kernel_unavailable_reason,
)
from upipe.ring import ring_attention


def _inputs(s, hq, hkv, d, dtype, device="cpu"):
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, s, h, d, dtype=torch.float64) for h in (hq, hkv, hkv))
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)], (q, k, v)


def _dense_fp64(q, k, v, causal):
    """Autograd fp64 attention with K/V repeated: independent of the kernels under test."""
    g = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) / q.shape[-1] ** 0.5
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    lse = s.logsumexp(-1)
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vv), lse


@pytest.mark.parametrize("kernel", ["sdpa", "math"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (4, 1)])
def test_forward_backward_against_fp64(kernel, causal, hq, hkv):
    (q, k, v), ref_in = _inputs(29, hq, hkv, 8, torch.float32)
    out, lse = attention_forward(q, k, v, causal=causal, kernel=kernel)
    ref_in = [t.requires_grad_(True) for t in ref_in]
    ref_out, ref_lse = _dense_fp64(*ref_in, causal)
    dout = torch.randn_like(ref_out)
    ref_grads = torch.autograd.grad(ref_out, ref_in, dout)
    grads = attention_backward(dout.float(), q, k, v, out, lse, causal=causal, kernel=kernel)
    # fp32 kernels against fp64: a few fp32 ulps of O(1) values
    tol = dict(atol=2e-5, rtol=2e-5)
    assert lse.dtype == torch.float32 and lse.shape == (2, hq, 29)
    torch.testing.assert_close(out.double(), ref_out.detach(), **tol)
    torch.testing.assert_close(lse.double(), ref_lse.detach(), **tol)
    for g, r in zip(grads, ref_grads, strict=True):
        assert g.shape == r.shape
        torch.testing.assert_close(g.double(), r, **tol)


def test_autograd_wrapper_matches_explicit_backward():
    (q, k, v), _ = _inputs(16, 4, 2, 8, torch.float32)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out = attention(q, k, v, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    o, lse = attention_forward(q, k, v, causal=True)
    expect = attention_backward(dout, q, k, v, o, lse, causal=True)
    for got, exp in zip((q.grad, k.grad, v.grad), expect, strict=True):
        assert torch.equal(got, exp)


def test_unknown_kernel_is_a_value_error():
    (q, k, v), _ = _inputs(4, 2, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="kernel must be one of"):
        attention_forward(q, k, v, causal=True, kernel="cudnn-v9")


@pytest.mark.skipif(flash_attn_available(), reason="flash-attn is installed")
def test_flash_attn_missing_gives_clear_error():
    (q, k, v), _ = _inputs(4, 2, 2, 8, torch.float32)
    with pytest.raises(RuntimeError, match=r"needs the optional flash-attn package"):
        attention_forward(q, k, v, causal=True, kernel="flash-attn")


def test_fa3_is_a_kernel_name():
    assert "fa3" in KERNELS and check_kernel("fa3") == "fa3"
    assert kernel_functions("fa3", "cuda") != kernel_functions("flash-attn", "cuda")


def test_fa3_on_cpu_gives_clear_error():
    """Not installed: the message names the kernel and what to install; installed, on CPU
    tensors: it names the kernel and CUDA."""
    (q, k, v), _ = _inputs(4, 2, 2, 8, torch.float32)
    with pytest.raises(RuntimeError, match=r"kernel='fa3' (needs FlashAttention-3|is CUDA only)"):
        attention_forward(q, k, v, causal=True, kernel="fa3")
    out, lse = attention_forward(q, k, v, causal=True, kernel="sdpa")
    with pytest.raises(RuntimeError, match=r"kernel='fa3'"):
        attention_backward(out, q, k, v, out, lse, causal=True, kernel="fa3")


@pytest.mark.parametrize("kernel", ["flash-attn", "fa3"])
def test_cuda_only_kernels_say_why_they_cannot_run(kernel):
    assert "CUDA only" in kernel_unavailable_reason(kernel, "cpu")
    available = {"flash-attn": flash_attn_available, "fa3": fa3_available}[kernel]()
    reason = kernel_unavailable_reason(kernel, "cuda")
    assert (reason is None) if available else (f"kernel {kernel!r} needs" in reason)
    for other in ("auto", "sdpa", "math"):
        assert kernel_unavailable_reason(other, "cpu") is None


@pytest.mark.gpu
class TestCUDAKernels:
    @pytest.mark.parametrize("kernel", ["sdpa", "math"])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_cuda_matches_fp64(self, kernel, dtype):
        (q, k, v), ref_in = _inputs(64, 8, 2, 64, dtype, "cuda")
        out, lse = attention_forward(q, k, v, causal=True, kernel=kernel)
        ref_in = [t.requires_grad_(True) for t in ref_in]
        ref_out, _ = _dense_fp64(*ref_in, True)
        dout = torch.randn_like(ref_out)
        ref_grads = torch.autograd.grad(ref_out, ref_in, dout)
        grads = attention_backward(dout.to("cuda", dtype), q, k, v, out, lse, causal=True,
                                   kernel=kernel)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4  # bf16: 2^-8 relative on O(1) values
        torch.testing.assert_close(out.double().cpu(), ref_out.detach(), atol=tol, rtol=tol)
        for g, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g.double().cpu(), r, atol=tol * 4, rtol=tol * 4)

    @pytest.mark.skipif(not flash_attn_available(), reason="flash-attn not installed")
    def test_flash_attn_matches_sdpa(self):
        (q, k, v), _ = _inputs(128, 8, 2, 64, torch.bfloat16, "cuda")
        o1, l1 = attention_forward(q, k, v, causal=True, kernel="flash-attn")
        o2, l2 = attention_forward(q, k, v, causal=True, kernel="sdpa")
        torch.testing.assert_close(o1, o2, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(l1, l2, atol=1e-3, rtol=1e-3)

    @pytest.mark.skipif(not fa3_available(), reason="FlashAttention-3 (flash_attn_interface) not "
                        "installed: built from flash-attention's hopper/, Hopper GPUs only")
    @pytest.mark.parametrize("causal", [True, False])
    def test_fa3_matches_sdpa(self, causal):
        (q, k, v), _ = _inputs(128, 8, 2, 64, torch.bfloat16, "cuda")
        o1, l1 = attention_forward(q, k, v, causal=causal, kernel="fa3")
        o2, l2 = attention_forward(q, k, v, causal=causal, kernel="sdpa")
        torch.testing.assert_close(o1, o2, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(l1, l2, atol=1e-3, rtol=1e-3)
        dout = torch.randn_like(o1)
        g1 = attention_backward(dout, q, k, v, o1, l1, causal=causal, kernel="fa3")
        g2 = attention_backward(dout, q, k, v, o2, l2, causal=causal, kernel="sdpa")
        for a, b in zip(g1, g2, strict=True):
            torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("shapes,causal,match", [
    # v shorter than k: the CPU SDPA returned an output as if v had k's length
    (((1, 4, 2, 8), (1, 4, 2, 8), (1, 3, 2, 8)), False, "q \\(B, S_q, Hq, D\\)"),
    (((1, 4, 3, 8), (1, 4, 2, 8), (1, 4, 2, 8)), False, "Hq a multiple of Hkv"),
    (((1, 4, 2, 8), (1, 6, 2, 8), (1, 6, 2, 8)), True, "S_q == S_k"),
])
def test_attention_refuses_shapes_it_would_compute_nonsense_from(shapes, causal, match):
    q, k, v = (torch.randn(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        attention_forward(q, k, v, causal=causal)
    with pytest.raises(ValueError, match=match):
        attention(q, k, v, causal=causal)


def test_ring_attention_refuses_k_and_v_of_another_length_than_q():
    q, kv = torch.randn(1, 4, 2, 8), torch.randn(1, 3, 2, 8)
    with pytest.raises(ValueError, match="one local length: got 4, 3 and 3"):
        ring_attention(q, kv, kv, group=None)
