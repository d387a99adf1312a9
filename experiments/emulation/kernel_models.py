"""What each attention kernel allocates on a CUDA device, for the emulator
(docs/design.md#emulation).

The emulator runs fake tensors on the CPU. Inside ``cuda_kernels()`` the attention dispatch
(``upipe.kernels``) takes its CUDA path, and every kernel allocates what it allocates on a GPU:

* ``sdpa`` runs ``upipe.kernels``' own CUDA code (K/V expanded to the query heads, then
  PyTorch's fused op); the op's meta function gives its outputs (out, fp32 log-sum-exp; for
  fp32 the efficient kernel's log-sum-exp padded to 32 rows). What the fused backward allocates
  *inside* and frees before returning is added here as a workspace, alive during the call:

  - bf16/fp16, PyTorch's FlashAttention-2 (``aten/src/ATen/native/transformers/cuda/flash_attn/
    flash_api.cpp``, ``mha_bwd``; a copy of flash-attn's ``csrc/flash_attn/flash_api.cpp``,
    whose sizes are those of flash-attn 2.8; ``_fa2_headdim``): ``softmax_d`` (B, H, S_q rounded
    up to 128) fp32 and the non-deterministic ``dq_accum`` (B, S_q rounded to 128, H, D
    rounded) fp32, D rounded up to a multiple of 32 up to 128, of 64 above. Forward: no
    workspace when batch x heads x ceil(S_q / 64) fills at least 80% of twice the SMs
    (``num_splits_heuristic``, called with ``num_splits`` 0 by ``mha_fwd``): 212 or more on an
    H100 SXM (132 SMs), e.g. B = 1 and 8 heads from S_q = 1,665 on. Below that it takes
    split-KV with fp32 accumulators (``out_accum`` (splits, B, H, S_q, D rounded),
    ``softmax_lse_accum`` (splits, B, H, S_q)), which is not modelled: short per-call lengths
    (small documents, a ring's small chunks, few heads) read low by those.
  - fp32, the memory-efficient (CUTLASS) kernel (``aten/src/ATen/native/transformers/cuda/
    attention_backward.cu``, ``_efficient_attention_backward``): fp32 kernels do not compute
    delta themselves (``kKernelComputesDelta`` is for half types), so PyTorch computes it from
    an fp32 (B, S_q, H, D) product of grad_out and out and its (B, S_q, H) sum, alive with the
    gradients until ``delta`` (B, H, S_q) fp32 exists (``_efficient_workspace``). Not modelled:
    the kernel's ``workspace`` for dQ (``kNeedsAccumGradQ`` is true with split keys,
    ``mem_eff_attention/kernel_backward.h``, ``workspace_elements_gq``: about B x H x S_q x D
    fp32 plus 16 bytes per tile), whose tiles depend on the kernel ``cutlassB`` picks per GPU
    and PyTorch version. The forward's RNG seed and offset are CPU tensors on a GPU (dropout
    0) but the op's meta function makes them device tensors: 2 x 512 bytes counted, freed
    when the forward returns.
  - both: the backward ops transpose grad_out (and the flash op out) to (B, S, H, D) and make
    them contiguous (``_flash_attention_backward``'s ``grad_out.contiguous()`` and
    ``out.contiguous()``, ``_efficient_attention_backward``'s ``grad_out_.contiguous()``,
    ``attention_backward.cu`` at 00afd8f2): a copy of each argument that is not a transpose
    of a BSHD tensor, alive while the op runs (``_bshd_copies``). upipe's path passes
    transposes (no copy); torch's context-parallel ring (``torch-cp``) passes BHSD-contiguous
    ones and their sequence halves, so each of its backward calls holds them.

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
  ``upipe.kernels``' wrapper plus flash-attn's ``mha_fwd``/``mha_bwd`` (flash-attn 2.8; 2.7.4
  and older rounded head dims 129-160 to 160 in ``dq_accum``, not 192): forward ``out`` like
  q, ``softmax_lse`` (B, H, S_q) fp32 and the 2-element int64 RNG state; backward: the
  wrapper's dq/dk/dv (``empty_like``), ``softmax_d`` and ``dq_accum`` as above, and for GQA
  ``dk_expanded``/``dv_expanded`` (B, S_k, H, D) in the input dtype, summed into dk/dv at the
  end. flash-attn's Python wrapper makes inputs contiguous when their last stride is not 1
  (``maybe_contiguous``); so does the model. Packed documents in aligned blocks take the
  varlen path in one call, as on a GPU (``upipe.kernels._varlen_ok``; ``FLASH_VARLEN``):
  ``mha_varlen_bwd``'s ``softmax_d`` (H, B*S + 128 n) and ``dq_accum`` (B*S + 128 n, H, D
  rounded) span every document with 128 rows of padding each (n documents over the batch),
  and GQA's expanded dK/dV the packed sequence (``_flash_varlen_forward``/``_backward``).

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

What a kernel's GPU code refuses (flash-attn, FA3 and PyTorch's flash op: head dims not a
multiple of 8 or over 256; flash-attn and FA3: fp32) is refused before emulating
(``kernel_limit_reason``, as cuDNN's limits are: ``upipe.kernels.cudnn_shape_reason``).

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

from upipe.kernels import FLASH_VARLEN, _varlen_meta, auto_kernel, kernel_dispatch


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _fa2_headdim(d: int) -> int:
    """FlashAttention-2's ``head_size_rounded``: ``round_multiple(head_size, head_size <= 128 ?
    32 : 64)`` in PyTorch's copy (``aten/src/ATen/native/transformers/cuda/flash_attn/
    flash_api.cpp``, ``mha_fwd``/``mha_bwd``/``mha_varlen_bwd``, pytorch/pytorch at 03b7c19d)
    and in flash-attn since 2.8.0 (``csrc/flash_attn/flash_api.cpp`` lines 435, 834 and 1051
    at v2.8.3, 060c9188; the rule of commit ce212720, "Don't specialize for hdim 160
    anymore"). flash-attn 2.7.4 and older rounded ``head_size <= 192 ? round_multiple(
    head_size, 32) : 256``: the same but for head dims 129-160 (160 there, 192 here) and
    193-256 (256 in both)."""
    return _round_up(d, 32 if d <= 128 else 64)


def _flash_workspace(q: torch.Tensor) -> list[torch.Tensor]:
    """FlashAttention-2 backward scratch for q (B, S, H, D): softmax_d (B, H, S rounded to
    128) and dq_accum (B, S rounded to 128, H, D rounded) fp32 (``mha_bwd``, flash_api.cpp
    lines 883 and 888 at flash-attn v2.8.3; the same in PyTorch's copy)."""
    b, s, h, d = q.shape
    s_r = _round_up(s, 128)
    return [torch.empty(b, h, s_r, dtype=torch.float32, device=q.device),
            torch.empty(b, s_r, h, _fa2_headdim(d), dtype=torch.float32, device=q.device)]


# ---------------------------------------------------------------------------------------------
# sdpa: upipe's CUDA path (and torch-cp's ring); the fused backward ops get their internal
# scratch while they run, inside ``upipe.kernels.fused_op_scope``


def _efficient_workspace(q: torch.Tensor) -> list[torch.Tensor]:
    """Memory-efficient (CUTLASS) attention backward scratch for fp32 q (B, H, S, D), the only
    dtype upipe runs it in. fp32 kernels have ``kKernelComputesDelta`` false (it is ``kIsHalf
    && ...``, ``mem_eff_attention/kernel_backward.h``), so ``_efficient_attention_backward``
    (``attention_backward.cu`` at 00afd8f2, in ``launchKernel``) computes ``delta = (grad_out.
    to(kFloat) * out.to(kFloat)).sum(-1).transpose(-2, -1).contiguous()``: the (B, S, H, D)
    product and its (B, S, H) sum are temporaries of that statement, alive beside the
    gradients (allocated before it) until ``delta`` (B, H, S) exists; all fp32 (``.to(kFloat)``
    of fp32 is no copy). All three are held while the op runs: the product and sum only
    until the kernel launches, when nothing else of the call is allocated, so the call's peak
    is the same."""
    b, h, s, d = q.shape
    f32 = dict(dtype=torch.float32, device=q.device)
    return [torch.empty(b, s, h, d, **f32), torch.empty(b, s, h, **f32),  # product, sum
            torch.empty(b, h, s, **f32)]  # delta


def _cudnn_workspace(q: torch.Tensor) -> list[torch.Tensor]:
    """cuDNN SDPA backward scratch for q (B, H, S, D): dQ_accum (B, H, S, D) and softmax_sum
    (B, H, S), fp32 (module docstring)."""
    b, h, s, d = q.shape
    return [torch.empty(b, h, s, d, dtype=torch.float32, device=q.device),
            torch.empty(b, h, s, dtype=torch.float32, device=q.device)]


def _bshd_copies(*ts: torch.Tensor) -> list[torch.Tensor]:
    """The copies the CUDA backward ops make of their (B, H, S, D) arguments ``ts``: each is
    transposed to (B, S, H, D) and made contiguous (module docstring), which copies it unless
    it is already a transpose of a contiguous BSHD tensor (upipe's layout)."""
    return [t.transpose(1, 2).contiguous() for t in ts if not t.transpose(1, 2).is_contiguous()]


# aten op -> scratch for its arguments (BHSD, the op's layout): (grad_out, query, key, value,
# out, ...) for flash and cudnn, (grad_out, query, key, value, attn_bias, out, ...) for efficient
_OP_WORKSPACE = {
    torch.ops.aten._scaled_dot_product_flash_attention_backward.default:
        lambda a: _bshd_copies(a[0], a[4]) + _flash_workspace(a[1].transpose(1, 2)),
    torch.ops.aten._scaled_dot_product_efficient_attention_backward.default:
        lambda a: _bshd_copies(a[0]) + _efficient_workspace(a[1]),
    # cuDNN takes dO and O with their strides (MHA.cpp); upipe's _cudnn_backward aligns them
    torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default:
        lambda a: _cudnn_workspace(a[1]),
}


class _OpWorkspace(TorchDispatchMode):
    """Allocates a fused op's internal scratch just before the op and frees it just after, so
    the tracker (the mode below this one) sees it alive exactly while the op runs. Entered by
    the code that calls the fused ops (``upipe.kernels.fused_op_scope``), inside the tracker."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        make = _OP_WORKSPACE.get(func)
        scratch = make(args) if make is not None else None
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
    # flash_attn_interface.py line 259 at v2.8.3: dout, q, k, v, out
    dout, q, k, v, out = (_maybe_contiguous(t) for t in (dout, q, k, v, out))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # the wrapper's
    scratch = _flash_workspace(q)[1:]  # dq_accum; softmax_d is the op's output
    if k.shape[2] != q.shape[2]:  # GQA: per-query-head dK/dV, summed into dk/dv at the end
        b, s_k, h, d = *k.shape[:2], q.shape[2], k.shape[3]
        scratch += [k.new_empty((b, s_k, h, d)), v.new_empty((b, s_k, h, d))]
    _softmax_d = _flash_bwd_op(dout, q, k, v, causal)
    del scratch, _softmax_d
    return dq, dk, dv


# flash-attn's varlen path (packed documents in one call: ``upipe.kernels``'
# ``_flash_attn_varlen_forward``/``_backward``, which a GPU with flash-attn takes whenever
# ``_varlen_ok``), replaced as a pair with the same signatures. Each allocates what upipe's
# wrapper and flash-attn's ``_flash_attn_varlen_forward``/``_backward`` (flash_attn_interface.py
# lines 143 and 330 at v2.8.3, 060c9188) with ``mha_varlen_fwd``/``mha_varlen_bwd``
# (csrc/flash_attn/flash_api.cpp) allocate. The work is each document's dense modelled op on
# its slices (FLOPs and time as the block-by-block path's), run first: its outputs are
# dropped before the call allocates its own, which are at least as large, so they never
# raise the call's peak.


def _flash_varlen_forward(q, k, v, blocks, causal, scale):
    """q (B, S, H, D), k/v (B, S, H_kv, D) -> out (B, S, H, D), lse (B, H, S) (a view of the
    kernel's (H, B*S)). Allocates cu_seqlens (B*n+1,) int32 (``upipe.kernels._varlen_meta``),
    out (B*S, H, D) like q, softmax_lse (H, B*S) fp32 (unpadded) and rng_state (2,) int64
    (``mha_varlen_fwd``, flash_api.cpp lines 643, 652 and 723 at v2.8.3; split-KV only for a
    paged KV cache, line 703)."""
    for qa, qb, ka, kb in blocks:  # the work (see above)
        _ = _flash_fwd_op(q[:, qa:qb], k[:, ka:kb], v[:, ka:kb], causal)
        del _
    b, s, h, d = q.shape
    _cu = _varlen_meta(blocks, b, s, q.device)[0]
    # the wrapper's reshape to packed tokens, made contiguous as the interface does (line 164)
    q, k, v = (_maybe_contiguous(t.reshape(b * s, t.shape[2], d)) for t in (q, k, v))
    out = torch.empty_like(q)
    lse = q.new_empty((h, b * s), dtype=torch.float32)
    _rng_state = q.new_empty((2,), dtype=torch.int64)
    return out.view(b, s, h, d), lse.view(h, b, s).transpose(0, 1)


def _flash_varlen_backward(dout, q, k, v, out, lse, blocks, causal, scale):
    """(dq, dk, dv) like (q, k, v). Allocates upipe's cu_seqlens, its (H, B*S) LSE (a copy
    when B > 1) and dq/dk/dv over packed tokens; flash-attn's interface makes dout, q, k, v,
    out contiguous (line 356); ``mha_varlen_bwd`` (flash_api.cpp lines 1100, 1113 and 1122 at
    v2.8.3) allocates softmax_d (H, B*S + 128 x n) and dq_accum (B*S + 128 x n, H, D rounded)
    fp32 for n = B x len(blocks) sequences, and for GQA dk/dv expanded to the query heads
    (B*S, H, D) in the input dtype, summed into dk/dv at the end."""
    for qa, qb, ka, kb in blocks:  # the work (see above)
        _ = _flash_bwd_op(dout[:, qa:qb], q[:, qa:qb], k[:, ka:kb], v[:, ka:kb], causal)
        del _
    b, s, h, d = q.shape
    _cu = _varlen_meta(blocks, b, s, q.device)[0]
    flat = lambda x: x.reshape(b * s, x.shape[2], -1)  # noqa: E731
    _lse = lse.transpose(0, 1).reshape(h, b * s)
    dq, dk, dv = torch.empty_like(flat(q)), torch.empty_like(flat(k)), torch.empty_like(flat(v))
    _inputs = [_maybe_contiguous(flat(t)) for t in (dout, q, k, v, out)]
    padded = b * s + 128 * b * len(blocks)
    scratch = [q.new_empty((h, padded), dtype=torch.float32),  # softmax_d
               q.new_empty((padded, h, _fa2_headdim(d)), dtype=torch.float32)]  # dq_accum
    if k.shape[2] != h:  # MQA / GQA
        scratch += [k.new_empty((b * s, h, d)), v.new_empty((b * s, h, d))]
    del scratch, _inputs
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)


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
# what the modelled kernels refuse (cuDNN's limits: upipe.kernels.cudnn_dtype_reason and
# cudnn_shape_reason). upipe calls the libraries' private functions and PyTorch's private ops,
# so nothing pads a head dim or casts a dtype first: a GPU raises, and the emulator must not
# print numbers for the cell instead.

# the largest head dim and the multiple it must be of, fp16/bf16 (both also refuse fp32):
# flash-attn 2 ``mha_fwd``/``mha_bwd`` (csrc/flash_attn/flash_api.cpp lines 373, 393-394 and
# 804, 829-830 at v2.8.3), PyTorch's copy of it behind ``_scaled_dot_product_flash_attention``
# (``aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp``, ``mha_fwd``: "head_size
# must be a multiple of 8, this is ensured by padding!", which only the public SDPA does),
# FA3 ``mha_fwd`` (hopper/flash_api.cpp lines 670, 730-731 and 805-806 at 0e79d711: fp8 too,
# no fp32; max_headdim 256 in the default build)
FLASH_MAX_HEAD_DIM, FLASH_HEAD_DIM_MULTIPLE = 256, 8


def kernel_limit_reason(kernel: str, dtype: str, head_dim: int) -> str | None:
    """Why the CUDA ``kernel`` (a resolved name) refuses a ``dtype`` (a cell's name: ``bf16``,
    ``fp32``, ...) or ``head_dim`` call, or None. ``sdpa`` runs PyTorch's flash op in
    fp16/bf16 (its limits) and the memory-efficient one in fp32 (any head dim: it has kernels
    up to head dim 65536, ``mem_eff_attention/kernels/cutlassB.h``); ``cudnn`` is checked by
    ``upipe.kernels``' own rules; ``math`` takes anything."""
    half = dtype in ("bf16", "fp16")
    if kernel in ("flash-attn", "fa3") and not half:
        return (f"kernel {kernel!r} takes fp16/bf16 only (its mha_fwd has no {dtype} kernel); "
                "use 'sdpa' (PyTorch's memory-efficient kernel in fp32) or 'auto'")
    if kernel in ("flash-attn", "fa3") or (kernel == "sdpa" and half):
        if head_dim % FLASH_HEAD_DIM_MULTIPLE or head_dim > FLASH_MAX_HEAD_DIM:
            what = "PyTorch's flash kernel (sdpa in fp16/bf16)" if kernel == "sdpa" else (
                f"kernel {kernel!r}")
            return (f"{what} takes head dims that are multiples of {FLASH_HEAD_DIM_MULTIPLE} up "
                    f"to {FLASH_MAX_HEAD_DIM}, got {head_dim} (upipe calls it unpadded)")
    return None


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
                 FLASH_VARLEN: (_flash_varlen_forward, _flash_varlen_backward),
                 "fa3": (_fa3_forward, _fa3_backward)}
    with kernel_dispatch("cuda", overrides, op_scope=_OpWorkspace,
                         auto=auto_on(capability, installed)):
        yield
