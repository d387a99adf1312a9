"""The per-token parts of the paper's FPDT stack (``baselines.megatron_stack``): Megatron-
DeepSpeed's FPDT_FFN with SwiGLU and the norms with a fused kernel's memory. The same numbers as
the plain modules, and the memory they keep (exact on CPU, tracked)."""

from __future__ import annotations

import pytest
import torch

from baselines.megatron_stack import fpdt_ffn, fpdt_ffn_chunk, fused_norm
from experiments.config import STACKS
from experiments.harness.model import FeedForward, RMSNorm, megatron_chunk
from experiments.instruments.memory import MemoryTracker
from upipe import build_method

B, DIM, FFN, CHUNK = 2, 16, 40, 8
F32 = 4


def _ffn() -> FeedForward:
    torch.manual_seed(0)
    return FeedForward(DIM, FFN)


def _norm() -> RMSNorm:
    torch.manual_seed(0)
    norm = RMSNorm(DIM, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    return norm


def test_chunk_is_megatrons_rule():
    """ParallelMLP.fpdt_FFN_chunk_size = chunk // sp // 2: 64K chunks give 4096 local tokens
    on 8 ranks (Llama3-8B, Table 3) and 2048 on 16 (Qwen3-32B, Table 4)."""
    assert fpdt_ffn_chunk(65536, 8) == 4096
    assert fpdt_ffn_chunk(65536, 16) == 2048
    assert fpdt_ffn_chunk(4, 8) == 1
    assert STACKS["megatron-ds"].megatron_fpdt and not STACKS["megatron-ds"].tiled
    assert not any(s.megatron_fpdt for name, s in STACKS.items() if name != "megatron-ds")
    # the FPDT chunk is an FPDT method's (its chunked layout's); any other method's chunk_size
    # (UPipe's backward chunks) is not one: Megatron's default then (one rank here)
    assert megatron_chunk(build_method("fpdt", 64, 4, 2, 16, chunk_size=1024)) == 512
    assert megatron_chunk(build_method("upipe", 64, 4, 2, 16, chunk_size=512)) == 32768


@pytest.mark.parametrize("which", ["ffn", "norm"])
def test_equals_the_plain_module_in_output_and_gradients(which):
    """fp32 on CPU: output, input gradient and the weight gradients as the plain module's
    autograd gives them (a last chunk shorter than the others included)."""
    module, chunked = (_ffn(), fpdt_ffn) if which == "ffn" else (_norm(), fused_norm)
    x0 = torch.randn(B, 5 * CHUNK + 3, DIM)
    dout = torch.randn_like(x0)
    grads = []
    for run in (lambda m, x: m(x), lambda m, x: chunked(m, x, CHUNK)):
        module.zero_grad(set_to_none=True)
        leaf = x0.clone().requires_grad_(True)
        y = run(module, leaf * 1.0)  # a non-leaf input, as the block's normalised h
        y.backward(dout)
        grads.append((y.detach(), leaf.grad, *(p.grad for p in module.parameters())))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def _extra_bytes(seq: int, norm: bool = False) -> tuple[int, int]:
    """(bytes alive after forward beyond the input, backward's peak above what is alive when it
    starts) of fpdt_ffn (``norm``: fused_norm) over ``seq`` local tokens; the weights are made
    before tracking."""
    module = _norm() if norm else _ffn()
    x = torch.randn(B, seq, DIM, requires_grad=True)
    with MemoryTracker() as mt:
        # fpdt_ffn writes into its input: a non-leaf, as in the block; the norm takes the leaf,
        # whose gradient is then stored, not copied
        h = x if norm else x * 1.0
        base = mt.current_bytes
        y = (fused_norm if norm else fpdt_ffn)(module, h, CHUNK)
        after_forward = mt.current_bytes - base
        dout = torch.ones_like(y)
        start = mt.current_bytes
        mt.reset_peak()
        y.backward(dout)
        return after_forward, mt.peak_device_bytes - start


def test_keeps_the_output_only_and_a_backward_that_does_not_grow_with_the_sequence():
    """Forward keeps its output and nothing else (the input is saved, not copied; the (L, ffn)
    intermediates are freed chunk by chunk). Backward's working set is one chunk's intermediates
    and the fp32 weight-gradient accumulators: no (L, dim) input-gradient buffer (it is written
    into the saved input), so it is the same at 4 and 12 chunks, to the byte."""
    short, long_ = _extra_bytes(4 * CHUNK), _extra_bytes(12 * CHUNK)
    assert short[0] == B * 4 * CHUNK * DIM * F32
    assert long_[0] == B * 12 * CHUNK * DIM * F32
    assert short[1] == long_[1]
    # at least the three fp32 accumulators (w1, w3: FFN x DIM; w2: DIM x FFN)
    assert short[1] >= 3 * FFN * DIM * F32


def test_norm_keeps_what_a_fused_kernel_keeps():
    """Forward keeps its output only (the input is saved, not copied; no fp32 (L, dim) copy of
    it, as the plain RMSNorm's autograd keeps). Backward allocates the one input gradient and
    a tile's scratch: from 4 to 12 tiles it grows by the gradient's 8 extra tiles, exactly."""
    short, long_ = _extra_bytes(4 * CHUNK, norm=True), _extra_bytes(12 * CHUNK, norm=True)
    assert short[0] == B * 4 * CHUNK * DIM * F32
    assert long_[0] == B * 12 * CHUNK * DIM * F32
    assert long_[1] - short[1] == B * 8 * CHUNK * DIM * F32
