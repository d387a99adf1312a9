"""The per-token parts of the paper's DeepSpeed-FPDT runs: Megatron-DeepSpeed's MLP and norms.

The paper's FPDT baseline runs on the authors' fork of Megatron-DeepSpeed
(togethercomputer/Untied-Ulysses, ``FPDT/Megatron-DeepSpeed``, launched by
``examples_deepspeed/sequence_parallel/run_single_8B.sh``). Two of its per-token modules keep
far less than a plain PyTorch layer at long sequences, and this module reproduces what they
keep (facts from those files; the code here is our own):

* **The MLP, FPDT_FFN.** With ``--ds-sequence-parallel-fpdt`` Megatron's ``ParallelMLP``
  (``megatron/model/transformer.py``) calls ``FPDT_FFN`` from the authors' patch
  (``megatron/patch/fpdt_layer.py``), which adds a SwiGLU branch to DeepSpeed's GELU-only one,
  in chunks of ``fpdt_chunk_size // sp // 2`` local tokens (``fpdt_FFN_chunk_size``).
  Forward: chunk by chunk without autograd, each chunk's output written into one
  preallocated (L, dim) output; only the input is saved (with the weights). Backward: per
  chunk, the gate and up projections recomputed, SwiGLU's derivative applied, the weight
  gradients added into fp32 accumulators of the weights' shapes (alive through the whole
  backward), and the chunk's input gradient written *into the saved input in place*, which is
  returned as the input's gradient: no second (L, dim) buffer.
* **The norms, fused.** The script passes no ``--normalization``, so every norm is Megatron's
  default LayerNorm, apex's fused ``MixedFusedLayerNorm`` on CUDA (``megatron/model/
  __init__.py``), with ``--disable-mem-efficient-ln`` (it saves its input, not its output): a
  fused kernel keeps the input and per-token fp32 statistics and writes one output and, in
  backward, one input gradient, with no (L, dim) fp32 intermediates. Our model keeps Llama's
  RMSNorm math (``upipe.norm.rms_norm``) with that memory: forward and backward run over token
  tiles written into one output and one input gradient; only the input is saved.

Hand-written because DeepSpeed ships only the GELU FPDT_FFN
(``deepspeed.sequence.fpdt_layer.FPDT_FFN``: ``bias_gelu``) and apex has no CPU or fake-tensor
path; both run on CPU and under fake tensors (no value-dependent control flow).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from upipe.chunked import chunk_spans
from upipe.norm import rms_norm, rms_norm_backward
from upipe.pure import metadata_pure


def fpdt_ffn_chunk(fpdt_chunk_size: int, sp: int) -> int:
    """Local tokens per MLP chunk: the FPDT chunk over the sequence-parallel degree, halved
    (``ParallelMLP.fpdt_FFN_chunk_size``); at least one."""
    return max(1, fpdt_chunk_size // sp // 2)


class _ChunkedSwiGLU(torch.autograd.Function):
    """w2(silu(x w1^T) * (x w3^T)) over sequence chunks; x (B, L, dim) -> (B, L, dim)."""

    @staticmethod
    def forward(ctx, x, w1, w3, w2, chunk):
        out = torch.empty_like(x)
        spans = chunk_spans(x.shape[-2], chunk)
        with torch.no_grad():
            for a, b in spans:
                _swiglu_into(out.narrow(-2, a, b - a), x.narrow(-2, a, b - a), w1, w3, w2)
        ctx.spans = spans
        ctx.save_for_backward(x, w1, w3, w2)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, w1, w3, w2 = ctx.saved_tensors
        # fp32 accumulators of the weights' shapes, as FPDT_FFN's grad_w1/grad_w2 (its w1 is
        # [gate; up] fused: our w1 and w3 together)
        g1, g3, g2 = (torch.zeros(w.shape, dtype=torch.float32, device=w.device)
                      for w in (w1, w3, w2))
        for a, b in ctx.spans:
            _swiglu_backward_into(x.narrow(-2, a, b - a), dout.narrow(-2, a, b - a), w1, w3, w2,
                                  (g1, g3, g2))
        return x, g1.to(w1.dtype), g3.to(w3.dtype), g2.to(w2.dtype), None


# The chunk bodies are metadata-pure (``upipe.pure``): every chunk of every layer makes the same
# call, which the emulator records once and replays.
@metadata_pure
def _swiglu_into(out: torch.Tensor, xc: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                 w2: torch.Tensor) -> None:
    """out (B, c, dim) = w2(silu(xc w1^T) * (xc w3^T)) for one chunk xc (B, c, dim)."""
    act = F.silu(xc @ w1.t()) * (xc @ w3.t())
    out.copy_(act @ w2.t())  # FPDT_FFN's result[st:ed] = ...
    del act


@metadata_pure
def _swiglu_backward_into(xc: torch.Tensor, dc: torch.Tensor, w1: torch.Tensor,
                          w3: torch.Tensor, w2: torch.Tensor,
                          grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """One chunk's backward: the weights' gradients added into the fp32 accumulators ``grads``
    (of w1, w3, w2's shapes), and the chunk's input gradient written over its input xc
    (B, c, dim); dc (B, c, dim) is the output gradient."""
    g1, g3, g2 = grads
    gate, up = xc @ w1.t(), xc @ w3.t()
    sig = torch.sigmoid(gate)
    silu = gate * sig
    act = silu * up
    g2.add_(dc.flatten(0, -2).t() @ act.flatten(0, -2))
    del act
    dact = dc @ w2  # (B, c, ffn)
    dgate = dact * up * (sig * (1 + gate * (1 - sig)))  # silu'(g) = s (1 + g (1 - s))
    dup = dact * silu
    del sig, silu, gate, up, dact
    xf = xc.flatten(0, -2)
    g1.add_(dgate.flatten(0, -2).t() @ xf)
    g3.add_(dup.flatten(0, -2).t() @ xf)
    dx = dgate @ w1
    dx.add_(dup @ w3)
    del dgate, dup
    xc.copy_(dx)  # the input gradient overwrites the chunk's input (FPDT_FFN's x.copy_)
    del dx


def fpdt_ffn(ffn: torch.nn.Module, x: torch.Tensor, chunk: int) -> torch.Tensor:
    """``ffn`` (a SwiGLU with bias-free ``w1`` gate, ``w3`` up and ``w2`` down projections,
    ``experiments.harness.model.FeedForward``) over chunks of ``chunk`` local tokens, as
    Megatron-DeepSpeed's FPDT_FFN runs it. x (B, L, dim) -> (B, L, dim); a last chunk shorter
    than ``chunk`` where L is not a multiple (FPDT_FFN asserts one; its FPDT layout gives one).
    """
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk}")
    return _ChunkedSwiGLU.apply(x, ffn.w1.weight, ffn.w3.weight, ffn.w2.weight, chunk)


class _FusedRMSNorm(torch.autograd.Function):
    """rms_norm(x, weight, eps) with a fused kernel's memory; x (B, L, dim) -> (B, L, dim)."""

    @staticmethod
    def forward(ctx, x, weight, eps, tile):
        out = torch.empty_like(x)
        spans = chunk_spans(x.shape[-2], tile)
        with torch.no_grad():
            for a, b in spans:
                out.narrow(-2, a, b - a).copy_(rms_norm(x.narrow(-2, a, b - a), weight, eps))
        ctx.spans, ctx.eps = spans, eps
        ctx.save_for_backward(x, weight)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, weight = ctx.saved_tensors
        dx = torch.empty_like(x)
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for a, b in ctx.spans:
            dxt, dwt = rms_norm_backward(x.narrow(-2, a, b - a), weight, ctx.eps,
                                         dout.narrow(-2, a, b - a))
            dx.narrow(-2, a, b - a).copy_(dxt)
            dw.add_(dwt)
            del dxt, dwt
        return dx, dw.to(weight.dtype), None, None


def fused_norm(norm: torch.nn.Module, x: torch.Tensor, tile: int) -> torch.Tensor:
    """``norm`` (an RMSNorm with ``weight`` and ``eps``, ``experiments.harness.model.RMSNorm``)
    applied to x (B, L, dim) with a fused kernel's memory, computed over tiles of ``tile``
    tokens (the tiles bound the recomputation's scratch; a fused kernel has none)."""
    if tile < 1:
        raise ValueError(f"tile must be a positive number of tokens, got {tile}")
    return _FusedRMSNorm.apply(x, norm.weight, norm.eps, tile)
