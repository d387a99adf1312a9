"""The emulator's kernel memory models against the allocations their sources list, beyond
tests/test_emulate.py's: flash-attn's varlen path, PyTorch's fused backward ops (fp32
memory-efficient delta, FA2 head-dim rounding, the contiguous copies of grad_out/out), and the
refusals of what a kernel or a hardware profile does not take (every sizes rule cites its source
in experiments/emulation/kernel_models.py)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from experiments.config import Cell, Hardware
from experiments.emulation.emulate import emulate_cell, emulation_unavailable, profile_refusal
from experiments.emulation.kernel_models import cuda_kernels, kernel_limit_reason
from experiments.instruments.memory import MemoryTracker
from upipe.kernels import _varlen_ok, attention_backward, attention_forward

BF16, FP32 = torch.bfloat16, torch.float32
# tiny with a narrow MLP and one layer: the device peak is attention's backward
SMALL_FF = (("ffn_dim", "16"), ("dim", "64"), ("n_layers", "1"))


def _peaks(kernel, dtype, b, s, h, h_kv, d, blocks=None, causal=True):
    """(forward peak, backward peak above the forward's outputs) of one call, CUDA path."""
    with FakeTensorMode():
        q = torch.empty(b, s, h, d, dtype=dtype)
        k, v = torch.empty(b, s, h_kv, d, dtype=dtype), torch.empty(b, s, h_kv, d, dtype=dtype)
        with cuda_kernels(), MemoryTracker() as mt:
            out, lse = attention_forward(q, k, v, causal=causal, kernel=kernel, blocks=blocks)
            fwd = mt.peak_bytes
            mt.reset_peak()
            base = mt.current_bytes
            attention_backward(out, q, k, v, out, lse, causal=causal, kernel=kernel,
                               blocks=blocks)
            return fwd, mt.peak_bytes - base


@pytest.mark.parametrize("b", [1, 2])
def test_packed_flash_attn_is_modelled_as_its_one_varlen_call(b):
    """A GPU with flash-attn runs aligned document blocks as one varlen call
    (upipe.kernels._varlen_ok); its backward's scratch spans the whole packed sequence
    (mha_varlen_bwd): softmax_d (H, total + 128 n), dq_accum (total + 128 n, H, D rounded) fp32,
    dk/dv expanded (total, H, D) for GQA. The emulator modelled the per-document path."""
    s, h, h_kv, d, n = 8192, 8, 2, 128, 8
    docs = s // n
    blocks = tuple((i * docs, (i + 1) * docs, i * docs, (i + 1) * docs) for i in range(n))
    with FakeTensorMode():
        q, k = torch.empty(b, s, h, d, dtype=BF16), torch.empty(b, s, h_kv, d, dtype=BF16)
        with cuda_kernels():
            assert _varlen_ok("flash-attn", blocks, q, k)
    fwd, bwd = _peaks("flash-attn", BF16, b, s, h, h_kv, d, blocks)
    total, seqs = b * s, b * n
    cu_seqlens = (seqs + 1) * 4  # upipe.kernels._varlen_meta, int32
    assert fwd == total * h * d * 2 + h * total * 4 + 16 + cu_seqlens  # out, lse, rng_state
    grads = (total * h * d + 2 * total * h_kv * d) * 2  # dq, dk, dv over packed tokens
    # B > 1: the forward's LSE is a (B, H, S) view of (H, B, S); attention_backward makes it
    # contiguous (_kernel_lse) and the varlen wrapper reshapes that to (H, B*S): two copies
    lse_copy = 2 * h * total * 4 if b > 1 else 0
    scratch = (h * (total + 128 * seqs) * 4 + (total + 128 * seqs) * h * d * 4
               + 2 * total * h * d * 2)  # softmax_d, dq_accum, dk/dv expanded
    assert bwd == cu_seqlens + lse_copy + grads + scratch


def test_packed_flash_attn_cell_peaks_at_the_varlen_backward():
    """The reviewer's cell (ulysses, tiny, 8K tokens in 1K documents on 4 ranks): 8,695,296 B
    modelled per document; the varlen call's 14,446,080 B plus its 512-byte cu_seqlens."""
    cell = Cell(method="ulysses", model="tiny", seq_len=8192, nproc=4, dtype="bf16",
                kernel="flash-attn", doc_len=1024, overrides=SMALL_FF, warmup=0, iters=0)
    row = emulate_cell(cell, Hardware(), exact=True, count=False)
    assert row["status"] == "ok", row["error"]
    assert row["peak_device_bytes"] == 14_446_592
    assert row["peak_phase"].endswith("attention:bwd")


def _op_peak(op: str, dtype, b, s, h, d, bhsd: bool = False) -> int:
    """Peak bytes a fused backward op allocates (its gradients and modelled scratch), its
    BHSD arguments transposes of BSHD tensors (upipe's layout) or, with ``bhsd``, contiguous
    BHSD tensors (torch's context-parallel ring's)."""
    from upipe.kernels import fused_op_scope

    with FakeTensorMode():
        if bhsd:
            dout, q, k, v, out = (torch.empty(b, h, s, d, dtype=dtype) for _ in range(5))
        else:
            x = [torch.empty(b, s, h, d, dtype=dtype) for _ in range(5)]
            dout, q, k, v, out = (t.transpose(1, 2) for t in x)
        lse, rng = torch.empty(b, h, s, dtype=FP32), torch.empty((), dtype=torch.int64)
        with cuda_kernels(), MemoryTracker() as mt, fused_op_scope():
            if op == "flash":
                torch.ops.aten._scaled_dot_product_flash_attention_backward(
                    dout, q, k, v, out, lse, None, None, s, s, 0.0, True, rng, rng, scale=None)
            else:
                torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                    dout, q, k, v, None, out, lse, rng, rng, 0.0, [True, True, True, False],
                    True, scale=None)
            return mt.peak_bytes


def test_fp32_efficient_backward_holds_the_delta_product():
    """fp32 has kKernelComputesDelta false: PyTorch computes delta from an fp32 (B, S, H, D)
    product and its (B, S, H) sum, alive with the gradients (attention_backward.cu). The model
    allocated delta only."""
    b, s, h, d = 1, 1024, 8, 128
    grads = 3 * b * s * h * d * 4  # dq, dk, dv
    product, row_sum, delta = b * s * h * d * 4, b * s * h * 4, b * h * s * 4
    assert _op_peak("efficient", FP32, b, s, h, d) == grads + product + row_sum + delta


@pytest.mark.parametrize("op,dtype,copied", [("flash", BF16, 2), ("efficient", FP32, 1)])
def test_bhsd_arguments_are_copied_to_bshd_while_the_backward_runs(op, dtype, copied):
    """The backward ops transpose grad_out (flash: and out) to (B, S, H, D) and make them
    contiguous (attention_backward.cu): torch's ring passes contiguous BHSD tensors, so each
    call holds a copy of each, beside its scratch; upipe's transposes of BSHD are not copied.
    The model held none before."""
    b, s, h, d = 1, 1024, 8, 128
    size = b * s * h * d * dtype.itemsize
    upipe_layout = _op_peak(op, dtype, b, s, h, d)
    assert _op_peak(op, dtype, b, s, h, d, bhsd=True) == upipe_layout + copied * size
    # one head: the transpose of a (B, 1, S, D) tensor is contiguous, so nothing is copied
    assert _op_peak(op, dtype, b, s, 1, d, bhsd=True) == _op_peak(op, dtype, b, s, 1, d)


@pytest.mark.parametrize("d,d_rounded", [(64, 64), (80, 96), (128, 128), (136, 192),
                                         (160, 192), (176, 192), (200, 256)])
def test_fa2_dq_accum_rounds_the_head_dim_as_pytorch_and_flash_attn_2_8(d, d_rounded):
    """round_multiple(head_size, head_size <= 128 ? 32 : 64) (PyTorch's flash_api.cpp,
    flash-attn >= 2.8.0): 136 and 160 round to 192, not to 160 as flash-attn 2.7 did."""
    b, s, h = 1, 1024, 8
    grads = 3 * b * s * h * d * 2
    softmax_d, dq_accum = b * h * s * 4, b * s * h * d_rounded * 4
    assert _op_peak("flash", BF16, b, s, h, d) == grads + softmax_d + dq_accum


@pytest.mark.parametrize("kernel,dtype,head_dim,rule", [
    ("flash-attn", "fp32", 128, "fp16/bf16 only"), ("fa3", "fp32", 128, "fp16/bf16 only"),
    ("flash-attn", "bf16", 20, "multiples of 8 up to 256"),
    ("fa3", "bf16", 512, "multiples of 8 up to 256"),
    ("sdpa", "bf16", 20, "multiples of 8 up to 256")])
def test_kernels_refuse_what_their_gpu_code_refuses(kernel, dtype, head_dim, rule):
    assert rule in kernel_limit_reason(kernel, dtype, head_dim)
    overrides = SMALL_FF + (("head_dim", str(head_dim)),)
    cell = Cell(method="ulysses", model="tiny", seq_len=1024, nproc=4, dtype=dtype,
                kernel=kernel, overrides=overrides, warmup=0, iters=0)
    reason = emulation_unavailable(cell, Hardware())
    assert reason.startswith("cannot be emulated") and rule in reason


@pytest.mark.parametrize("kernel,dtype,head_dim", [
    ("sdpa", "fp32", 20), ("sdpa", "bf16", 128), ("fa3", "bf16", 256), ("math", "fp32", 20)])
def test_kernels_take_what_their_gpu_code_takes(kernel, dtype, head_dim):
    assert kernel_limit_reason(kernel, dtype, head_dim) is None


def test_a_kernel_the_profile_has_no_rates_for_is_refused_before_emulating():
    """fa3 on a100-80gb: the time model would raise ProfileError after the emulation."""
    cell = Cell(method="ulysses", model="tiny", seq_len=1024, nproc=4, dtype="bf16",
                kernel="fa3", overrides=SMALL_FF, warmup=0, iters=0)
    a100 = Hardware(profile="a100-80gb")
    assert "no attention rates for kernel 'fa3'" in profile_refusal(cell, a100)
    row = emulate_cell(cell, a100, exact=True)
    assert row["status"] == "skipped" and "no attention rates for kernel 'fa3'" in row["error"]
    assert profile_refusal(cell, Hardware()) is None
