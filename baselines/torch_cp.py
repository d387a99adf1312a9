"""``torch-cp``: PyTorch's native context parallelism -- the paper's "native PyTorch" baseline.

An adapter over ``torch.distributed.tensor.experimental`` (torch 2.13: ``_context_parallel/
_attention.py``). With its CP dispatcher on, an SDPA call on sequence-sharded DTensors reaches
``_sdpa_handler``, which unwraps the local shards and calls torch's ring: ``_templated_ring_
attention`` with the fused SDPA op (forward: K/V rotated by one all-gather or an all-to-all per
step, an fp32 LSE merge) and ``_templated_ring_attention_backward`` (dK/dV always by
all-to-all). This module calls that same ring with the same arguments on the local shards,
without the DTensor round trip, for three reasons:

* Checkpointing frees what it should. The fused op's autograd node would save q, k, v, out and
  the LSE; :class:`_TorchRingSDPA` saves exactly those through ``save_for_backward``, so
  non-reentrant activation checkpointing drops them after the forward and recomputes them. (An
  earlier version kept the inner DTensor graph on a ``ctx`` attribute to switch the dispatcher
  on again in backward; checkpointing cannot see ``ctx`` attributes, so every layer's q,
  expanded K/V and output outlived the forward.)
* It runs on CPU. DTensor has no CP rule for the CPU fused op
  (``aten._scaled_dot_product_flash_attention_for_cpu``: "does not have a sharding strategy
  registered"); torch's ring takes the op as an argument, so on CPU it runs the CPU op.
* Everything the ring allocates is tracked. A dispatch mode (the memory tracker) is not active
  inside a tensor subclass's ``__torch_dispatch__``, so it would see only the outputs of a
  DTensor SDPA call, not the rotated K/V buffers, per-step outputs and merge temporaries inside.

The fused op is the one SDPA dispatches on the device (``upipe.kernels.kernel_device_type``, so
the emulator's fake CPU tensors take the CUDA path): CUDA fp16/bf16 FlashAttention-2
(``_scaled_dot_product_flash_attention``; flash is SDPA's first choice when it qualifies,
``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``), CUDA fp32 the memory-efficient
kernel, CPU the CPU flash kernel. The options the ring reads from the process-global
``_cp_options`` (load balancing, rotation) are set around each call and restored
(:func:`torch_cp_options`), so one module's settings never leak into another's.

Layout: always zigzag, which is torch's ``_HeadTailLoadBalancer`` order (rank r holds chunks r and
2W-1-r of 2W, in that order; ``_load_balancer.py``). Causal: load balancing on, so the ring's
per-step masking matches that layout. Non-causal: load balancing must be off (the ring raises
"Load balancing requires `is_causal=True`"); every step is then a full block and the key order
does not matter, so the same zigzag shard is exact.

Rotation: the paper's runs name the PyTorch baseline ``attn_impl = "torch_ring_alltoall"``
(togethercomputer/Untied-Ulysses, torchtitan/exps/llama3_8b/run_all_8B.sh and the Qwen3-32B
script), but nothing in their TorchTitan fork reads the "alltoall" of that name: the rotation
is set from ``parallelism.context_parallel_rotate_method`` (torchtitan/distributed/utils.py,
``set_rotate_method``), which their config (llama3_8b_test_2d.toml) and TorchTitan's default
set to ``"allgather"``, and no script overrides. So ``allgather`` is the default here (until
issue 32 it was ``alltoall``, read from the name); ``rotate_method="alltoall"`` runs the other.
The all-gather keeps every rank's K/V for the whole forward and backward ring loop (W x one
rank's K/V), where the all-to-all keeps two blocks.

GQA: torch's ring rotates K/V as given and relies on the SDPA kernel for the head mapping; the
efficient kernel (fp32) takes no ``enable_gqa``, so K/V are expanded to the query heads first
(``repeat_interleave``, as TorchTitan's ``repeat_kv`` did), which costs H/Hkv x the K/V traffic
and memory of a GQA-aware ring -- part of what this baseline measures.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from baselines.zigzag_ring import ZigzagRingAttention
from upipe.amp import cast_for_autocast
from upipe.kernels import fused_op_scope, kernel_device_type
from upipe.registry import register_method

ROTATE_METHODS = ("allgather", "alltoall")
DEFAULT_ROTATE_METHOD = "allgather"  # what the paper's runs applied (module doc)
_ROTATE_ENUM = {"allgather": "ALL_GATHER", "alltoall": "ALL_TO_ALL"}  # torch's _RotateMethod
_SEQ_DIM = 2  # SDPA's (B, H, S, D): the dim torch's ring shards and merges over
_aten = torch.ops.aten
_SAVED = object()  # marks an output of the fused op kept through save_for_backward


def _attention_module():
    """torch's experimental CP attention module (imported lazily: it pulls in DTensor and flex
    attention)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    return _attention


@contextlib.contextmanager
def torch_cp_options(causal: bool, rotate_method: str):
    """torch's process-global ring options for this call (load balancing: on for the causal
    head-tail layout, off otherwise, as the ring requires; the rotation), then put back."""
    att = _attention_module()
    opts = att._cp_options
    saved = (opts.enable_load_balance, opts.rotate_method)
    opts.enable_load_balance = causal
    # what set_rotate_method does, without its log line on every call
    opts.rotate_method = getattr(att._RotateMethod, _ROTATE_ENUM[rotate_method])
    try:
        yield
    finally:
        opts.enable_load_balance, opts.rotate_method = saved


def _ring_forward(q, k, v, group, causal: bool, device_type: str) -> tuple:
    """torch's ring over the fused op SDPA would run on ``device_type``; (B, H, L, D) x 3 ->
    (out (B, H, L, D), lse (B, H, L) fp32, *the op's other outputs, as its backward takes them)."""
    ring = _attention_module()._templated_ring_attention
    if device_type != "cuda":
        return ring(group, _SEQ_DIM, _aten._scaled_dot_product_flash_attention_for_cpu, q, k, v,
                    is_causal=causal, dropout_p=0.0)
    if q.dtype in (torch.float16, torch.bfloat16):  # as _scaled_dot_product_ring_flash_attention
        return ring(group, _SEQ_DIM, _aten._scaled_dot_product_flash_attention, q, k, v,
                    is_causal=causal, dropout_p=0.0, scale=None)
    # as _scaled_dot_product_ring_efficient_attention (compute_log_sumexp: the merge needs it)
    return ring(group, _SEQ_DIM, _aten._scaled_dot_product_efficient_attention, q, k, v,
                is_causal=causal, attn_bias=None, dropout_p=0.0, scale=None,
                compute_log_sumexp=True)


def _ring_backward(dout, q, k, v, out, lse, rest, group, causal: bool, device_type: str):
    """torch's ring backward for the op :func:`_ring_forward` ran; returns (dq, dk, dv)."""
    ring = _attention_module()._templated_ring_attention_backward
    common = dict(grad_out=dout, query=q, key=k, value=v, out=out, logsumexp=lse,
                  is_causal=causal, dropout_p=0.0)
    if device_type != "cuda":
        return ring(group, _SEQ_DIM, _aten._scaled_dot_product_flash_attention_for_cpu_backward
                    .default, grad_out_name="grad_out", **common)[:3]
    if q.dtype in (torch.float16, torch.bfloat16):
        # the forward's (cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug_mask)
        cum_q, cum_k, max_q, max_k, seed, offset = rest[:6]
        return ring(group, _SEQ_DIM, _aten._scaled_dot_product_flash_attention_backward.default,
                    grad_out_name="grad_out", cum_seq_q=cum_q, cum_seq_k=cum_k, max_q=max_q,
                    max_k=max_k, philox_seed=seed, philox_offset=offset, scale=None,
                    **common)[:3]
    seed, offset = rest[:2]
    return ring(group, _SEQ_DIM, _aten._scaled_dot_product_efficient_attention_backward.default,
                grad_out_name="grad_out_", attn_bias=None, philox_seed=seed,
                philox_offset=offset, grad_input_mask=(True, True, True, False), scale=None,
                **common)[:3]


class _TorchRingSDPA(torch.autograd.Function):
    """torch's ring attention on local shards q, k, v (B, H, L, D) -> out (B, H, L, D).

    Saves what the fused op's own autograd node saves (q, k, v, out, lse and the op's RNG
    outputs), through ``save_for_backward``, so activation checkpointing can drop them.
    """

    @staticmethod
    def forward(ctx, q, k, v, group, causal, rotate_method):
        device_type = kernel_device_type(q)
        with torch_cp_options(causal, rotate_method):
            out, lse, *rest = _ring_forward(q, k, v, group, causal, device_type)
        tensors = [t for t in rest if isinstance(t, torch.Tensor)]
        ctx.save_for_backward(q, k, v, out, lse, *tensors)
        # the other outputs (max_q/max_k; None for the flash op's undefined cum_seq_q/k) keep
        # their places among the saved tensors
        ctx.rest = [_SAVED if isinstance(t, torch.Tensor) else t for t in rest]
        ctx.group, ctx.causal, ctx.rotate_method = group, causal, rotate_method
        ctx.device_type = device_type
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, *tensors = ctx.saved_tensors
        it = iter(tensors)
        rest = [next(it) if r is _SAVED else r for r in ctx.rest]
        with torch_cp_options(ctx.causal, ctx.rotate_method), fused_op_scope():
            dq, dk, dv = _ring_backward(dout.contiguous(), q, k, v, out, lse, rest, ctx.group,
                                        ctx.causal, ctx.device_type)
        return dq, dk, dv, None, None, None


def torch_ring_sdpa(q, k, v, group, *, causal: bool,
                    rotate_method: str = DEFAULT_ROTATE_METHOD) -> torch.Tensor:
    """torch's native CP ring attention on this rank's shards, differentiable.

    q, k, v: (B, H, L, D) with equal head counts (expand GQA K/V first), the local tokens of a
    head-tail (zigzag) layout when causal; ``group``: the CP process group. Returns
    (B, H, L, D) in q's dtype.
    """
    # under autocast: on q, k, v of its dtype (upipe.amp), as torch's SDPA is
    out, _lse = cast_for_autocast(_TorchRingSDPA.apply, q.device.type, q, k, v, group, causal,
                                  rotate_method)
    return out


@register_method("torch-cp")
class TorchCPAttention(ZigzagRingAttention):
    """PyTorch-native ring CP attention; forward(x_local (B, L, dim)) -> (B, L, dim).

    Option ``rotate_method``: how torch's ring moves K/V, ``"allgather"`` (one all-gather of
    K/V, then a slice per step; torch's own default and what the paper's runs applied: the
    default, ``DEFAULT_ROTATE_METHOD``) or ``"alltoall"`` (a permute per step). Head rules
    are the ring's (any GQA ratio on any number of ranks); the layout is zigzag (see the module
    docstring). Runs wherever SDPA's fused op does: CUDA, CPU, and the emulator's fake tensors.
    """

    own_kernel = ("sdpa", "torch's ring (_templated_ring_attention) calls the fused op SDPA picks, "
                          "PyTorch's flash kernel for fp16/bf16 on CUDA; its cuDNN ring passes "
                          "the full-sequence max_q/max_k to the backward of half-sequence blocks, "
                          "which the cuDNN op checks against its inputs' shapes")
    p2p_exchange = ("torch's ring rotates K/V with functional collectives (all-to-all or "
                    "all-gather per step, _templated_ring_attention), not run on gloo with CUDA "
                    "tensors here")
    documents_unsupported = (
        "torch's SDPA ring (_templated_ring_attention, the paper's PyTorch CP) takes no mask; "
        "PyTorch keeps documents apart only in its flex_attention CP, with block masks; use "
        "'zigzag-ring' (the same layout) for packed sequences")

    def __init__(self, *args, rotate_method: str = DEFAULT_ROTATE_METHOD, **kwargs):
        if rotate_method not in ROTATE_METHODS:
            raise ValueError(
                f"rotate_method must be one of {ROTATE_METHODS}, got {rotate_method!r}"
            )
        self.rotate_method = rotate_method
        super().__init__(*args, **kwargs)

    def options(self) -> dict:
        return {"rotate_method": self.rotate_method}

    @classmethod
    def memory_ranks(cls, cp: int, ring_degree: int = 1) -> tuple[int, ...]:
        # Rank 0 too: torch's ring runs each step after the first on rank 0 as (second query
        # half, all K/V) and on the last rank (the one played) as (all queries, first K/V half);
        # its backward's temporaries then differ with the kernel. On the CPU flash kernel on 2
        # ranks rank 0 peaks higher (tiny, 1024 tokens: 278,528 B, the second query half's dQ and
        # LSE slice beside the dK/dV all-to-all buffer; tests/test_emulate.py), on CUDA kernels
        # lower (docs/emulation.md#how-exact-it-is).
        return (0,) if cp > 1 else ()

    @classmethod
    def unavailable_reason(cls, device_type: str) -> str | None:
        try:
            _attention_module()
        except ImportError as e:
            return f"method 'torch-cp' needs torch's experimental context_parallel module ({e})"
        return None

    def forward(self, x: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
        self.check_input(x)
        self.documents(cu_seqlens, x)  # refused with packed documents (documents_unsupported)
        q, k, v = self.project_qkv(x)  # (B, L, H, D), (B, L, Hkv, D) x 2; RoPE at zigzag positions
        g = self.n_heads // self.n_kv_heads
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k.repeat_interleave(g, 2),
                                                   v.repeat_interleave(g, 2)))
        if dist.is_available() and dist.is_initialized():
            group = self.group if self.group is not None else dist.group.WORLD
            oh = torch_ring_sdpa(qh, kh, vh, group, causal=self.causal,
                                 rotate_method=self.rotate_method)
        else:  # one process, no group: torch's ring would be one local block anyway
            oh = F.scaled_dot_product_attention(qh, kh, vh, is_causal=self.causal)
        return self.wo(oh.transpose(1, 2).flatten(2))
