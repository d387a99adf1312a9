"""What each attention kernel allocates on a CUDA device, for the emulator
(docs/design.md#emulation).

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

* ``cudnn`` runs ``upipe.kernels``' own CUDA code too: PyTorch's cuDNN attention ops, whose meta
  functions give the outputs (``out`` in q's memory layout, the (B, H, S_q, 1) fp32 log-sum-exp;
  the backward's dq/dk/dv like q/k/v). What the backward takes from the caching allocator for
  cuDNN's workspace while it runs is added as a workspace, from cudnn-frontend's SDPA backward
  (``include/cudnn_frontend/node/scaled_dot_product_flash_attention.h`` at commit 3929da2,
  the composite backward node that PyTorch's ``aten/src/ATen/native/cudnn/MHA.cpp`` builds):
  ``dQ_accum`` (B, H, S_q, D) fp32 (the dP-workspace path that would replace it runs only on
  cuDNN 8.9.5-9.0, older than the 9.x this kernel needs) and ``softmax_sum`` (B, H, S_q) fp32.
  The backend's own plan workspace is not counted: its size is cuDNN's choice per plan and
  not published (the GPU check, ``gpu_check``, compares the total with the allocator's). The
  forward's frontend workspace is empty (it holds ALiBi slopes only). GQA K/V are taken as they
  are (no expanded copies).

* ``flash-attn`` (Dao-AILab flash-attn 2, absent on CPU machines) is replaced by a model of
  ``upipe.kernels``' wrapper plus flash-attn's ``mha_fwd``/``mha_bwd``: forward ``out`` like q,
  ``softmax_lse`` (B, H, S_q) fp32 and the 2-element int64 RNG state; backward: the wrapper's
  dq/dk/dv (``empty_like``), ``softmax_d`` and ``dq_accum`` as above, and for GQA
  ``dk_expanded``/``dv_expanded`` (B, S_k, H, D) in the input dtype, summed into dk/dv at the
  end. flash-attn's Python wrapper makes inputs contiguous when their last stride is not 1
  (``maybe_contiguous``); so does the model.

* ``fa3`` (FlashAttention-3, flash-attention's ``hopper/``, absent on CPU machines) is replaced
  by a model of ``upipe.kernels``' wrapper plus FA3's ``mha_fwd``/``mha_bwd`` on an H100
  (sm90; ``hopper/flash_api.cpp`` at commit 0e79d711, the ``TORCH_LIBRARY(flash_attn_3)``
  version; defaults as the wrapper passes them: no window, no softcap, ``num_splits=1``,
  ``deterministic=False``, not varlen). Forward (``mha_fwd``): ``out`` like q, ``softmax_lse``
  (B, H, S_q) fp32, and while it runs, for causal attention only, the persistent scheduler's
  ``tile_count_semaphore`` (1,) int32 (no split-KV accumulators at ``num_splits=1``). Backward
  (``mha_bwd``): the wrapper's dq/dk/dv (``empty_like``); ``softmax_d`` and
  ``softmax_lse_log2`` (B, H, S_q rounded up to kBlockM) fp32; ``dq_accum`` (B, H, S_q rounded
  to kBlockM times D rounded) fp32; for GQA ``dk_accum``/``dv_accum`` (B, H_kv, S_k rounded
  to kBlockN times D rounded) fp32; ``dq_semaphore`` (ceil(S_q / kBlockM), B, H) int32. D rounded is
  ``round_up_headdim`` (64, 96, 128, 192 or 256); on sm90 kBlockM is 128 for D rounded <= 64, 64
  for <= 96, for <= 128 64 if causal else 80, else 64, and kBlockN is 128 for D rounded <= 128,
  96 for <= 192, else 80. ``mha_bwd`` returns all of them to the Python wrapper, which drops
  them when it returns, so they live exactly while the call runs. The Python wrapper
  (``hopper/flash_attn_interface.py``, ``maybe_contiguous``) makes q, k (and v, unless its
  head dim or sequence stride is 1) contiguous in the forward and dout, q, k, v, out in the
  backward when their last stride is not 1; so does the model.

* ``math`` is plain PyTorch: it runs as is.

The custom ops standing for flash-attn and fa3 (``upipe_emul::flash_fwd``/``flash_bwd``,
``upipe_emul::fa3_fwd``/``fa3_bwd``) take the call's ``causal`` flag as an argument, so an observer
at the dispatch level (a ``TorchDispatchMode``) reads from an op's arguments whether the call is
causal. FLOPs of the modelled kernels are counted with torch's own SDPA formulas
(``torch.utils.flop_counter.sdpa_flop_count``), as for PyTorch's fused ops: dense, causal
masking not discounted.

``auto`` resolves as on the emulated GPU, not as on this machine (``auto_on``): PyTorch's kernels
only (a user planning a cluster is told the speed PyTorch gives out of the box; fa3 and
flash-attn are named to be priced), chosen by ``upipe.kernels.auto_kernel`` from the profile's
compute capability: ``cudnn`` on Hopper in fp16/bf16, else ``sdpa``.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import (
    register_flop_formula,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

from upipe.kernels import auto_kernel, kernel_dispatch


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
# sdpa: upipe's CUDA path (and torch-cp's ring); the fused backward ops get their internal
# scratch while they run, inside ``upipe.kernels.fused_op_scope``


def _efficient_workspace(q: torch.Tensor) -> list[torch.Tensor]:
    """Memory-efficient attention backward scratch for q (B, H, S, D): delta (B, H, S) fp32."""
    b, h, s, _ = q.shape
    return [torch.empty(b, h, s, dtype=torch.float32, device=q.device)]


def _cudnn_workspace(q: torch.Tensor) -> list[torch.Tensor]:
    """cuDNN SDPA backward scratch for q (B, H, S, D): dQ_accum (B, H, S, D) and softmax_sum
    (B, H, S), fp32 (module docstring)."""
    b, h, s, d = q.shape
    return [torch.empty(b, h, s, d, dtype=torch.float32, device=q.device),
            torch.empty(b, h, s, dtype=torch.float32, device=q.device)]


# aten op -> scratch for its query argument (BHSD, the op's layout)
_OP_WORKSPACE = {
    torch.ops.aten._scaled_dot_product_flash_attention_backward.default:
        lambda q: _flash_workspace(q.transpose(1, 2)),
    torch.ops.aten._scaled_dot_product_efficient_attention_backward.default:
        _efficient_workspace,
    torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default: _cudnn_workspace,
}


class _OpWorkspace(TorchDispatchMode):
    """Allocates a fused op's internal scratch just before the op and frees it just after, so
    the tracker (the mode below this one) sees it alive exactly while the op runs. Entered by
    the code that calls the fused ops (``upipe.kernels.fused_op_scope``), inside the tracker."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        make = _OP_WORKSPACE.get(func)
        scratch = make(args[1]) if make is not None else None  # args: (grad_out, query, ...)
        out = func(*args, **(kwargs or {}))
        del scratch
        return out


# ---------------------------------------------------------------------------------------------
# flash-attn: custom ops whose fake implementations allocate the outputs (and whose FLOPs the
# FLOP counter sees); scratch is allocated around them, where the tracker sees it.


@torch.library.custom_op("upipe_emul::flash_fwd", mutates_args=())
def _flash_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    raise RuntimeError("upipe_emul::flash_fwd is a memory model: it runs under FakeTensorMode")


@_flash_fwd_op.register_fake
def _(q, k, v, causal):
    b, s, h, _ = q.shape
    return (torch.empty_like(q), q.new_empty((b, h, s), dtype=torch.float32),
            q.new_empty((2,), dtype=torch.int64))


@torch.library.custom_op("upipe_emul::flash_bwd", mutates_args=())
def _flash_bwd_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  causal: bool) -> torch.Tensor:
    raise RuntimeError("upipe_emul::flash_bwd is a memory model: it runs under FakeTensorMode")


@_flash_bwd_op.register_fake
def _(dout, q, k, v, causal):
    b, s, h, _ = q.shape
    return q.new_empty((b, h, _round_up(s, 128)), dtype=torch.float32)  # softmax_d (returned)


# FlashAttention-3 (hopper/flash_api.cpp mha_fwd / mha_bwd, sm90; see the module docstring)


def _fa3_headdim(d: int) -> int:
    """FA3's ``round_up_headdim`` (every head dim compiled in, the default build)."""
    return next(r for r in (64, 96, 128, 192, 256) if d <= r) if d <= 256 else 256


def _fa3_bwd_blocks(d: int, causal: bool) -> tuple[int, int]:
    """(kBlockM, kBlockN) of FA3's sm90 backward for head dim d (no softcap, no local window)."""
    r = _fa3_headdim(d)
    block_m = 128 if r <= 64 else 64 if r <= 96 else (64 if causal else 80) if r <= 128 else 64
    block_n = 128 if r <= 128 else 96 if r <= 192 else 80
    return block_m, block_n


@torch.library.custom_op("upipe_emul::fa3_fwd", mutates_args=())
def _fa3_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
    raise RuntimeError("upipe_emul::fa3_fwd is a memory model: it runs under FakeTensorMode")


@_fa3_fwd_op.register_fake
def _(q, k, v, causal):
    b, s, h, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, h, s), dtype=torch.float32)  # out, softmax_lse


@torch.library.custom_op("upipe_emul::fa3_bwd", mutates_args=())
def _fa3_bwd_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                causal: bool) -> torch.Tensor:
    raise RuntimeError("upipe_emul::fa3_bwd is a memory model: it runs under FakeTensorMode")


@_fa3_bwd_op.register_fake
def _(dout, q, k, v, causal):
    b, s, h, d = q.shape
    block_m, _ = _fa3_bwd_blocks(d, causal)
    return q.new_empty((b, h, _round_up(s, block_m)), dtype=torch.float32)  # softmax_d


def _fa3_bwd_workspace(q: torch.Tensor, k: torch.Tensor, causal: bool) -> list[torch.Tensor]:
    """What mha_bwd allocates besides softmax_d (the op's output), for q (B, S_q, H, D) and
    k (B, S_k, H_kv, D): softmax_lse_log2, dq_accum, dk_accum/dv_accum (GQA), dq_semaphore."""
    b, s_q, h, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    block_m, block_n = _fa3_bwd_blocks(d, causal)
    s_q_r, d_r = _round_up(s_q, block_m), _fa3_headdim(d)
    f32 = dict(dtype=torch.float32)
    out = [q.new_empty((b, h, s_q_r), **f32),  # softmax_lse_log2
           q.new_empty((b, h, s_q_r * d_r), **f32)]  # dq_accum
    if h_kv != h:  # MQA / GQA: fp32 dK/dV accumulators over the KV heads
        s_k_r = _round_up(s_k, block_n)
        out += [q.new_empty((b, h_kv, s_k_r * d_r), **f32) for _ in range(2)]
    out.append(q.new_empty(((s_q + block_m - 1) // block_m, b, h), dtype=torch.int32))
    return out


def _bhsd(shape) -> tuple[int, ...]:
    b, s, h, d = shape
    return (b, h, s, d)


# causal is one of *args: the count is dense, as torch counts its own SDPA ops
@register_flop_formula([torch.ops.upipe_emul.flash_fwd, torch.ops.upipe_emul.fa3_fwd])
def _flash_fwd_flops(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(_bhsd(q_shape), _bhsd(k_shape), _bhsd(v_shape))


@register_flop_formula([torch.ops.upipe_emul.flash_bwd, torch.ops.upipe_emul.fa3_bwd])
def _flash_bwd_flops(dout_shape, q_shape, k_shape, v_shape, *args, out_shape=None,
                     **kwargs) -> int:
    return sdpa_backward_flop_count(_bhsd(dout_shape), _bhsd(q_shape), _bhsd(k_shape),
                                    _bhsd(v_shape))


def _maybe_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _flash_attn_forward(q, k, v, causal, scale):
    q, k, v = (_maybe_contiguous(t) for t in (q, k, v))
    out, lse, _rng_state = _flash_fwd_op(q, k, v, causal)
    return out, lse


def _flash_attn_backward(dout, q, k, v, out, lse, causal, scale):
    dout, q, k, v = (_maybe_contiguous(t) for t in (dout, q, k, v))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # the wrapper's
    scratch = _flash_workspace(q)[1:]  # dq_accum; softmax_d is the op's output
    if k.shape[2] != q.shape[2]:  # GQA: per-query-head dK/dV, summed into dk/dv at the end
        b, s_k, h, d = *k.shape[:2], q.shape[2], k.shape[3]
        scratch += [k.new_empty((b, s_k, h, d)), v.new_empty((b, s_k, h, d))]
    _softmax_d = _flash_bwd_op(dout, q, k, v, causal)
    del scratch, _softmax_d
    return dq, dk, dv


def _fa3_forward(q, k, v, causal, scale):
    q, k = _maybe_contiguous(q), _maybe_contiguous(k)
    v = v.contiguous() if v.stride(-1) != 1 and v.stride(-3) != 1 else v  # FA3's rule for v
    # the persistent scheduler's tile counter, causal (num_splits=1) on sm90: freed on return
    scratch = [q.new_empty((1,), dtype=torch.int32)] if causal else []
    out, lse = _fa3_fwd_op(q, k, v, causal)
    del scratch
    return out, lse


def _fa3_backward(dout, q, k, v, out, lse, causal, scale):
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # the wrapper's
    dout, q, k, v, out = (_maybe_contiguous(t) for t in (dout, q, k, v, out))
    scratch = _fa3_bwd_workspace(q, k, causal)  # softmax_d is the op's output
    _softmax_d = _fa3_bwd_op(dout, q, k, v, causal)
    del scratch, _softmax_d
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------

# kernels that need a CUDA library absent here, run as their models on an emulated CUDA device
MODELLED_KERNELS = ("flash-attn", "fa3")


# what PyTorch itself runs beside sdpa on a CUDA GPU, with no other package installed
PYTORCH_KERNELS = frozenset({"cudnn"})


@functools.cache
def auto_on(capability: tuple[int, int] | None,
            installed: frozenset[str] = PYTORCH_KERNELS):
    """What ``"auto"`` runs on an emulated GPU of compute ``capability`` (None: unknown, so
    ``sdpa``) with ``installed`` kernels beside sdpa (PyTorch's own only: module docstring;
    none where the profile prices no cudnn), for a call's query q (B, S, H, D). One function
    per GPU: the replay cache keys on it (``kernel_dispatch_state``)."""
    return lambda q: auto_kernel("cuda", q.dtype, capability, installed, q.shape[-1])


@contextlib.contextmanager
def cuda_kernels(capability: tuple[int, int] | None = None,
                 installed: frozenset[str] = PYTORCH_KERNELS):
    """Attention inside runs the CUDA kernels' code path and allocations (see the module), with
    ``"auto"`` resolved for a GPU of compute ``capability`` and ``installed`` kernels
    (``auto_on``)."""
    overrides = {"flash-attn": (_flash_attn_forward, _flash_attn_backward),
                 "fa3": (_fa3_forward, _fa3_backward)}
    with kernel_dispatch("cuda", overrides, op_scope=_OpWorkspace,
                         auto=auto_on(capability, installed)):
        yield
