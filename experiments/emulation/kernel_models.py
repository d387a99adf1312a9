"""What each attention kernel allocates on a CUDA device, for the emulator (DESIGN.md §8).

The emulator runs fake tensors on the CPU. Inside ``cuda_kernels()`` the attention dispatch
(``upipe.kernels``) takes its CUDA path, and every kernel allocates what it allocates on a GPU:

* ``sdpa`` runs ``upipe.kernels``' own CUDA code (K/V expanded to the query heads, then
  PyTorch's fused op); the op's meta function gives its outputs (out, fp32 log-sum-exp; for
  fp32 the efficient kernel's log-sum-exp padded to 32 rows). What the fused backward allocates
  *inside* and frees before returning is added here as a workspace, alive during the call:

  - bf16/fp16, PyTorch's FlashAttention-2 (``aten/src/ATen/native/transformers/cuda/flash_attn/
    flash_api.cpp``, ``mha_bwd``, the same code as flash-attn's ``csrc/flash_attn/
    flash_api.cpp``): ``softmax_d`` (B, H, S_q rounded up to 128) fp32 and the non-deterministic
    ``dq_accum`` (B, S_q rounded to 128, H, D rounded to 32) fp32. Forward: no workspace at long
    sequences (split-KV, with its fp32 accumulators, is chosen only when batch x heads x 128-row
    blocks fill less than 80% of the SMs; ``num_splits_heuristic``).
  - fp32, the memory-efficient (CUTLASS) kernel (``aten/src/ATen/native/transformers/cuda/
    attention_backward.cu``, ``_efficient_attention_backward``): ``delta`` (B, H, S_q) fp32. Its
    gradient accumulators are only needed when the output type is narrower than fp32.

* ``flash-attn`` (Dao-AILab flash-attn 2, absent on CPU machines) is replaced by a model of
  ``upipe.kernels``' wrapper plus flash-attn's ``mha_fwd``/``mha_bwd``: forward ``out`` like q,
  ``softmax_lse`` (B, H, S_q) fp32 and the 2-element int64 RNG state; backward: the wrapper's
  dq/dk/dv (``empty_like``), ``softmax_d`` and ``dq_accum`` as above, and for GQA
  ``dk_expanded``/``dv_expanded`` (B, S_k, H, D) in the input dtype, summed into dk/dv at the
  end. flash-attn's Python wrapper makes inputs contiguous when their last stride is not 1
  (``maybe_contiguous``); so does the model.

* ``math`` is plain PyTorch: it runs as is.

FLOPs of the modelled kernels are counted with torch's own SDPA formulas
(``torch.utils.flop_counter.sdpa_flop_count``), as for PyTorch's fused ops: dense, causal
masking not discounted. cuDNN attention is not one of upipe's kernels and is not modelled.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import (
    register_flop_formula,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

from upipe.kernels import kernel_dispatch, kernel_functions


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _flash_workspace(q: torch.Tensor) -> list[torch.Tensor]:
    """FlashAttention-2 backward scratch for q (B, S, H, D): softmax_d and dq_accum."""
    b, s, h, d = q.shape
    s_r = _round_up(s, 128)
    d_r = _round_up(d, 32) if d <= 192 else 256
    return [torch.empty(b, h, s_r, dtype=torch.float32, device=q.device),
            torch.empty(b, s_r, h, d_r, dtype=torch.float32, device=q.device)]


# ---------------------------------------------------------------------------------------------
# sdpa: upipe's CUDA path; the fused backward ops get their internal scratch while they run

_SDPA_FWD, _SDPA_BWD = kernel_functions("sdpa", "cuda")


def _efficient_workspace(q: torch.Tensor) -> list[torch.Tensor]:
    """Memory-efficient attention backward scratch for q (B, H, S, D): delta (B, H, S) fp32."""
    b, h, s, _ = q.shape
    return [torch.empty(b, h, s, dtype=torch.float32, device=q.device)]


# aten op -> scratch for its query argument (BHSD, the op's layout)
_OP_WORKSPACE = {
    torch.ops.aten._scaled_dot_product_flash_attention_backward.default:
        lambda q: _flash_workspace(q.transpose(1, 2)),
    torch.ops.aten._scaled_dot_product_efficient_attention_backward.default:
        _efficient_workspace,
}


class _OpWorkspace(TorchDispatchMode):
    """Allocates a fused op's internal scratch just before the op and frees it just after, so
    the tracker (the mode below this one) sees it alive exactly while the op runs."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        make = _OP_WORKSPACE.get(func)
        scratch = make(args[1]) if make is not None else None  # args: (grad_out, query, ...)
        out = func(*args, **(kwargs or {}))
        del scratch
        return out


def _sdpa_backward(dout, q, k, v, out, lse, causal, scale):
    with _OpWorkspace():
        return _SDPA_BWD(dout, q, k, v, out, lse, causal, scale)


# ---------------------------------------------------------------------------------------------
# flash-attn: custom ops whose fake implementations allocate the outputs (and whose FLOPs the
# FLOP counter sees); scratch is allocated around them, where the tracker sees it.


@torch.library.custom_op("upipe_emul::flash_fwd", mutates_args=())
def _flash_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    raise RuntimeError("upipe_emul::flash_fwd is a memory model: it runs under FakeTensorMode")


@_flash_fwd_op.register_fake
def _(q, k, v):
    b, s, h, _ = q.shape
    return (torch.empty_like(q), q.new_empty((b, h, s), dtype=torch.float32),
            q.new_empty((2,), dtype=torch.int64))


@torch.library.custom_op("upipe_emul::flash_bwd", mutates_args=())
def _flash_bwd_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                  ) -> torch.Tensor:
    raise RuntimeError("upipe_emul::flash_bwd is a memory model: it runs under FakeTensorMode")


@_flash_bwd_op.register_fake
def _(dout, q, k, v):
    b, s, h, _ = q.shape
    return q.new_empty((b, h, _round_up(s, 128)), dtype=torch.float32)  # softmax_d (returned)


def _bhsd(shape) -> tuple[int, ...]:
    b, s, h, d = shape
    return (b, h, s, d)


@register_flop_formula(torch.ops.upipe_emul.flash_fwd)
def _flash_fwd_flops(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(_bhsd(q_shape), _bhsd(k_shape), _bhsd(v_shape))


@register_flop_formula(torch.ops.upipe_emul.flash_bwd)
def _flash_bwd_flops(dout_shape, q_shape, k_shape, v_shape, *args, out_shape=None,
                     **kwargs) -> int:
    return sdpa_backward_flop_count(_bhsd(dout_shape), _bhsd(q_shape), _bhsd(k_shape),
                                    _bhsd(v_shape))


def _maybe_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _flash_attn_forward(q, k, v, causal, scale):
    q, k, v = (_maybe_contiguous(t) for t in (q, k, v))
    out, lse, _rng_state = _flash_fwd_op(q, k, v)
    return out, lse


def _flash_attn_backward(dout, q, k, v, out, lse, causal, scale):
    dout, q, k, v = (_maybe_contiguous(t) for t in (dout, q, k, v))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # the wrapper's
    scratch = _flash_workspace(q)[1:]  # dq_accum; softmax_d is the op's output
    if k.shape[2] != q.shape[2]:  # GQA: per-query-head dK/dV, summed into dk/dv at the end
        b, s_k, h, d = *k.shape[:2], q.shape[2], k.shape[3]
        scratch += [k.new_empty((b, s_k, h, d)), v.new_empty((b, s_k, h, d))]
    _softmax_d = _flash_bwd_op(dout, q, k, v)
    del scratch, _softmax_d
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def cuda_kernels():
    """Attention inside runs the CUDA kernels' code path and allocations (see the module)."""
    overrides = {"sdpa": (_SDPA_FWD, _sdpa_backward),
                 "flash-attn": (_flash_attn_forward, _flash_attn_backward)}
    with kernel_dispatch("cuda", overrides):
        yield
