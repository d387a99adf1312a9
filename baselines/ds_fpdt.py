"""``ds-fpdt``: DeepSpeed's Fully Pipelined Distributed Transformer attention (Yao et al., arXiv
2408.16978; ``deepspeed.sequence.fpdt_layer.FPDT_Attention``).

An adapter, not a re-implementation. FPDT takes the layer input and the projection weights and
does everything itself, chunk by chunk: the fused QKV projection of one local chunk, Ulysses
all-to-alls of q/k/v (heads split over ranks, KV heads too), RoPE, flash-attn of that query chunk
against every earlier K/V chunk with an LSE merge (causal only on the diagonal chunk), the output
all-to-all back, and with offloading on every q/k/v/input chunk kept in pinned host memory and
fetched on a side stream (``_FPDTGPUOffloadingAttentionImpl_``); then the output projection.

What this module maps (fpdt_layer.py, DeepSpeed 0.19.8):

* Weights: FPDT computes ``x @ W_qkv.T + b`` with ``W_qkv`` = [q rows; k rows; v rows] and splits
  the result at H*D and H*D + Hkv*D, then ``o @ W_o.T``. The parameters stay ``wq``/``wk``/``wv``/
  ``wo`` (the common interface); each forward hands FPDT ``cat([wq, wk, wv])`` (differentiable, so
  FPDT's weight gradient flows back to the three) and a zero bias (it always adds one).
  KV heads fewer than ranks are replicated by repeating their weight rows (FPDT asserts
  Hkv >= W), so the gradients of the copies sum back to the original rows.
* RoPE: FPDT rotates after the all-to-all with full-sequence tables of shape (S, 1, 1, D)
  (Megatron's layout), sliced per global chunk, in the rotate-half convention -- the same as
  ``upipe.rope`` -- so we pass ``rope_tables(arange(S))``. That table is O(S*D) per call, FPDT's
  own cost.
* Layout: ``FPDT_InputConstruct`` gives rank r the r-th piece of every global chunk of
  ``chunk_size`` tokens, in chunk order: our ``SeqLayout("chunked", chunk_size)``. FPDT needs
  whole chunks: S a positive multiple of chunk_size (``check_whole_chunks``); with one chunk the
  layout is contiguous and nothing is offloaded.
* Input/output: FPDT is sequence-first, (L, B, dim); ours is (B, L, dim).

Off CUDA (a CPU run, and the emulator's fake CPU tensors) FPDT runs with stand-ins for
flash-attn and DeepSpeed's CUDA accelerator (``baselines.ds_fpdt_portable``): real attention
through upipe's kernel dispatch on CPU (fp32 too), the emulator's flash-attn 2 memory model where
the dispatch picks CUDA kernels, and host buffers counted as host bytes on every device.

Activation checkpointing: FPDT keeps its chunks on ``ctx`` attributes, not through
``save_for_backward``, so non-reentrant checkpointing (which drops saved tensors only) keeps
every layer's chunks alive until backward. Megatron-DeepSpeed checkpoints reentrantly
(``deepspeed.checkpointing.checkpoint``: forward under no_grad, where FPDT records nothing), so
the class asks the harness for that (``checkpoint_reentrant``).

Kernel: FPDT calls flash-attn 2 on CUDA. ``kernel="fa3"`` runs FlashAttention-3 in its place
on the same chunk pairs, as the paper's FPDT runs did (the authors' patch of fpdt_layer; see
``ds_fpdt_portable.FA3_KERNEL``); every other kernel name leaves FPDT's own (rows record the
kernel that ran, ``kernel_ran``).

Limits inherited from FPDT: on CUDA flash-attn (fp16/bf16), causal only, no dropout, and it
calls ``deepspeed.comm.barrier()`` on the default group every chunk, so the CP group should be
the world (or every rank must run FPDT).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import SimpleNamespace
from typing import ClassVar

import torch
import torch.distributed as dist

from baselines.ds_fpdt_portable import FA3_KERNEL, FPDTCall, flash_attn_stand_ins, fpdt_call
from baselines.ds_ulysses import _attach_deepspeed_comm
from baselines.rfa_zigzag import check_half_precision, import_problem, requirements_reason
from upipe.kernels import kernel_device_type
from upipe.layout import SeqLayout
from upipe.module import ContextParallelAttention
from upipe.options import MethodOption
from upipe.registry import register_method
from upipe.rope import rope_tables

DEFAULT_CHUNK_SIZE = 65536  # Megatron-DeepSpeed's --ds-sequence-parallel-fpdt-chunk-size default
FPDT_EXTRA = "pip install 'upipe[flash]'"
# DeepSpeed is a base dependency, imported (and checked) by the constructor only: it is heavy
_PACKAGES = {"flash_attn": "flash-attn"}


def check_whole_chunks(seq_len: int, chunk_size: int) -> None:
    """FPDT cuts the sequence into seq_len // chunk_size whole chunks, at least one:
    Megatron-DeepSpeed's ``FPDT_InputConstruct`` asserts ``seq_len % chunk_size == 0``, and
    ``FPDT_Attention`` divides the local length by ``seq_len // chunk_size`` chunks (zero below
    one chunk: a ZeroDivisionError), so a shorter sequence is refused here too rather than run
    as one chunk of its own length under a row that names ``chunk_size``."""
    if seq_len < chunk_size or seq_len % chunk_size:
        raise ValueError(
            f"seq_len ({seq_len}) must be a positive multiple of chunk_size ({chunk_size}) for "
            "'ds-fpdt' (DeepSpeed's FPDT processes whole chunks: give a chunk_size that divides "
            "the sequence, or pad the sequence)"
        )


@register_method("ds-fpdt")
class DSFPDTAttention(ContextParallelAttention):
    """DeepSpeed FPDT behind the common interface; forward(x_local (B, L, dim)) -> (B, L, dim).

    Options: ``chunk_size`` (global tokens per chunk, a multiple of the CP degree; default
    65536), ``offload`` (FPDT's pinned-host offload of q/k/v/input chunks; default on, as in the
    paper's FPDT runs). Head rules are Ulysses' (heads split over the ranks). Causal only; on
    CUDA fp16/bf16 and flash-attn required; torch.distributed must be initialised.

    Attributes the harness may set (as for ``fpdt``): ``host_context`` (zero-argument callable
    returning a context manager entered around FPDT's host allocations: a tracker's ``host``)
    and ``pin_memory`` (FPDT always pins on CUDA; kept for the common interface).
    """

    layout = "chunked"
    # FPDT's chunks live on ctx attributes: only reentrant checkpointing frees them (docstring)
    checkpoint_reentrant: ClassVar[bool] = True
    # Measured (emulated Llama3-8B on 8 ranks, 64K chunks, alst, offload and native stacks):
    # the attention phases' peaks are not collinear over 3-5 or 4-6 chunks, and are from 5 on.
    steady_chunks: ClassVar[int] = 5
    # FPDT takes one fused bias-free qkv weight and theta's RoPE tables (see forward).
    projection_features = frozenset()
    own_kernel = ("flash-attn", "DeepSpeed's FPDT calls flash-attn's kernels itself on CUDA "
                                "(on CPU, stand-ins through upipe's dispatch)")
    # kernel="fa3": FlashAttention-3 in FPDT's place, as the paper's runs (ds_fpdt_portable)
    own_kernel_choices = frozenset({FA3_KERNEL})
    documents_unsupported = (
        "DeepSpeed's FPDT_Attention takes no document boundaries (dense flash-attn per chunk, "
        "RoPE at global positions); use 'fpdt'")

    declared_options = (
        MethodOption("chunk_size", int, "global tokens per sequence chunk", tag="c",
                     tokens=True),
    )

    def __init__(self, *args, chunk_size: int = DEFAULT_CHUNK_SIZE, offload: bool = True,
                 **kwargs):
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.chunk_size, self.offload = chunk_size, offload
        super().__init__(*args, **kwargs)
        if not self.causal:
            raise ValueError("causal must be True for 'ds-fpdt': FPDT masks causally only")
        self.host_context: Callable[[], contextlib.AbstractContextManager] = (
            contextlib.nullcontext)
        self.pin_memory = True
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("'ds-fpdt' needs an initialised torch.distributed process group")
        try:
            from deepspeed.sequence.fpdt_layer import FPDT_Attention
        except ImportError as e:
            raise ImportError("'ds-fpdt' needs DeepSpeed with FPDT: pip install deepspeed") from e
        _attach_deepspeed_comm()
        # KV heads below the CP degree are replicated to it (see _qkv_weight)
        self.fpdt_kv_heads = max(self.n_kv_heads, self.cp)
        config = SimpleNamespace(
            kv_channels=self.head_dim, num_attention_heads=self.n_heads,
            num_key_value_heads=self.fpdt_kv_heads, hidden_size=self.dim, attention_dropout=0.0,
        )
        # Weights are handed over per call (forward), so FPDT holds no parameter of its own and
        # the state_dict keeps the reference names. Batch-first all-to-alls: scatter heads (2),
        # gather sequence (1), as in ds_ulysses.
        group = self.group if self.group is not None else dist.group.WORLD
        # without flash-attn FPDT refuses to build; its stand-ins serve off CUDA (forward)
        stand_ins = (flash_attn_stand_ins(self.kernel, torch.device("cpu"))
                     if import_problem("flash_attn") else contextlib.nullcontext())
        with stand_ins:
            self.fpdt = FPDT_Attention(
                config, None, None, None, None, group, gather_idx=1,
                scatter_idx=2, return_bias=True, chunk_size=chunk_size, enable_offloading=offload,
            )

    def options(self) -> dict:
        return {"chunk_size": self.chunk_size, "offload": self.offload}

    @classmethod
    def layout_for(cls, *, hybrid: bool, ulysses_degree: int, **options) -> SeqLayout:
        return SeqLayout("chunked", chunk_size=options.get("chunk_size", DEFAULT_CHUNK_SIZE))

    @classmethod
    def check_config(cls, n_heads, n_kv_heads, *, cp, ring_degree=1, seq_len=None, **options):
        super().check_config(n_heads, n_kv_heads, cp=cp, ring_degree=ring_degree,
                             seq_len=seq_len, **options)
        if seq_len is not None:
            check_whole_chunks(seq_len, options.get("chunk_size", DEFAULT_CHUNK_SIZE))

    @classmethod
    def unavailable_reason(cls, device_type: str) -> str | None:
        """None on CPU (stand-ins, ``ds_fpdt_portable``); on CUDA, FPDT's flash-attn."""
        if device_type == "cpu":
            return None
        return requirements_reason("ds-fpdt", device_type, _PACKAGES, FPDT_EXTRA)

    def _qkv_weight(self) -> torch.Tensor:
        """FPDT's fused projection weight ((H + 2 Hkv') * D, dim): [wq; wk; wv], KV rows repeated
        cp/Hkv times when Hkv < cp (KV head j becomes copies j*r .. j*r+r-1, which is the head
        each rank's query heads use after the all-to-all)."""
        r = self.fpdt_kv_heads // self.n_kv_heads
        wk, wv = self.wk.weight, self.wv.weight
        if r > 1:
            d = self.head_dim
            wk, wv = (w.view(self.n_kv_heads, d, self.dim).repeat_interleave(r, 0).flatten(0, 1)
                      for w in (wk, wv))
        return torch.cat([self.wq.weight, wk, wv], dim=0)

    def forward(self, x: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
        reason = self.unavailable_reason(x.device.type)
        if reason is not None:  # before any collective, so no peer waits on this rank
            raise RuntimeError(reason)
        if kernel_device_type(x) == "cuda":  # flash-attn's rule (also its emulated model's)
            check_half_precision("ds-fpdt", x)
        self.check_input(x)
        self.documents(cu_seqlens, x)  # refused with packed documents (documents_unsupported)
        s = x.shape[1] * self.cp
        check_whole_chunks(s, self.chunk_size)
        pos = torch.arange(s, device=x.device)
        cos, sin = (t.view(s, 1, 1, self.head_dim)
                    for t in rope_tables(pos, self.head_dim, self.rope_theta, x.dtype))
        w_qkv = self._qkv_weight()
        fpdt = self.fpdt
        fpdt.chunk_size = self.chunk_size
        # Plain tensors (not Parameters): a view of wo keeps the gradient path without
        # registering wo under a second name inside FPDT.
        fpdt.qkv_linear_weight = w_qkv
        fpdt.qkv_dense_weight = self.wo.weight.view_as(self.wo.weight)
        fpdt.qkv_linear_bias = x.new_zeros(w_qkv.shape[0])
        call = FPDTCall(self.kernel, x.device, self.host_context,
                        stand_ins=x.device.type != "cuda")
        try:
            with fpdt_call(call):
                y, _ = fpdt(x.transpose(0, 1).contiguous(), None, None, (cos, sin),
                            cpu_offloading=self.offload)  # (L, B, dim)
        finally:  # FPDT's autograd context keeps what backward needs; drop our references
            fpdt.qkv_linear_weight = fpdt.qkv_dense_weight = fpdt.qkv_linear_bias = None
        return y.transpose(0, 1)
