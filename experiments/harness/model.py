"""A Llama-style decoder whose attention is any registered CP method, with the memory stack.

Blocks are pre-norm: ``h = x + attention(norm(x)); out = h + mlp(norm(h))`` with RMSNorm (fp32
statistics, as Llama), RoPE inside the attention (global positions), GQA, SwiGLU MLP, and an
untied or tied output head. Names follow Meta's Llama (``tok_embeddings``, ``layers.i.attention.
wq``, ``feed_forward.w1``/``w2``/``w3``, ``norm``, ``output``). Random init; nothing downloaded.

The memory stack (``experiments.config.StackConfig``) is part of the model's forward because
each level changes how the forward runs:

- ``checkpoint``: ``torch.utils.checkpoint`` per block, inside the block's forward so that
  FSDP2's all-gather hooks stay outside the recomputed region; non-reentrant, or reentrant
  (forward under no_grad, recomputed with grad in backward) where the stack says so
  (``reentrant``) or the attention method needs it (``checkpoint_reentrant``: activations kept
  on autograd ``ctx`` attributes, which only a forward without autograd leaves unrecorded);
- ``offload``: the checkpointed block input goes to host memory (``upipe.stack.offload``),
  all blocks but the first and last (ALST), all but the first (``offload_last``: the paper's
  TorchTitan wrapper), or all (``offload_all``: --checkpoint-in-cpu);
- ``tiled``: MLP and RMSNorm in ceil(L / dim) sequence shards, DeepSpeed's ``TiledMLP``
  algorithm (ALST, ``upipe.stack.tiled``); it recomputes each shard in backward and
  accumulates the input gradient in place;
- ``chunked_loss``: ``upipe.stack.loss.chunked_linear_cross_entropy``;
- beyond ALST (the ``long`` level): ``offload_first`` offloads the first block's input too;
  ``residual_ffn`` runs ``h + mlp(norm(h))`` as one tiled op (``upipe.stack.tiled_residual``);
  ``fuse_norm`` hands the attention's pre-norm to an attention that fuses it
  (``fuses_input_norm``: UPipe), so the normalised input is never a saved (L, dim) tensor;
- ``keep_attention`` / ``keep_block`` (selective recomputation, beyond the paper): in the kept
  blocks (``kept_blocks``) the attention half, or the whole block, runs outside the checkpoint;
- ``megatron_fpdt`` (the ``megatron-ds`` stack): the MLP as Megatron-DeepSpeed's FPDT_FFN
  and the norms with a fused kernel's memory (``baselines.megatron_stack``), in chunks of the
  first attention's FPDT chunk (its ``chunk_size``, else Megatron's default) over the CP
  degree, halved.

Shapes: tokens and labels (B, L) int64 (this rank's shard); hidden states (B, L, dim).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

from baselines.ds_fpdt import DEFAULT_CHUNK_SIZE as DEFAULT_FPDT_CHUNK
from baselines.megatron_stack import fpdt_ffn, fpdt_ffn_chunk, fused_norm
from experiments.config import ModelConfig, StackConfig
from upipe.registry import build_method
from upipe.rope import default_inv_freq
from upipe.stack import (
    IGNORE_INDEX,
    chunked_linear_cross_entropy,
    loss_chunk_tokens,
    offload_saved_inputs,
    tiled,
    tiled_residual,
)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, statistics in fp32 (Llama). x (..., dim) -> (..., dim)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x). x (..., dim) -> (..., dim)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def megatron_chunk(attention: nn.Module) -> int:
    """Local tokens per chunk of the ``megatron_fpdt`` MLP and norms: the FPDT chunk (the
    chunked layout's of an FPDT method; Megatron's default for any other method, whose own
    ``chunk_size``, such as UPipe's backward chunks, is not one) over the CP degree, halved."""
    layout = attention.seq_layout
    fpdt_chunk = layout.chunk_size if layout.kind == "chunked" else DEFAULT_FPDT_CHUNK
    return fpdt_ffn_chunk(fpdt_chunk, attention.cp)


class Block(nn.Module):
    """One decoder layer; ``forward(x (B, L, dim), cu_seqlens=None) -> (B, L, dim)``
    (``cu_seqlens``: the packed documents' global bounds, passed to the attention)."""

    def __init__(self, cfg: ModelConfig, attention: nn.Module, stack: StackConfig,
                 offload: bool = False, keep_attention: bool | None = None,
                 checkpointed: bool = True):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = attention
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)
        self.stack = stack
        # selective recomputation in this block (the stack's choice unless the model keeps the
        # attention in some blocks only: Transformer's keep_blocks)
        self.keep_attention = stack.keep_attention if keep_attention is None else keep_attention
        # whole-block keeping (the stack's keep_block, in Transformer's kept blocks): no
        # checkpoint, so no checkpointed input to offload either
        self.checkpointed = stack.checkpoint and checkpointed
        self.offload = offload and self.checkpointed  # its checkpointed input to host memory
        # Set by the harness (Transformer.set_offload): its tracker's host() so offloaded bytes
        # count as host bytes, and whether host memory is pinned.
        self.host_context: Callable[[], contextlib.AbstractContextManager] = (
            contextlib.nullcontext
        )
        self.pin_memory = True

    def _per_token(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.stack.megatron_fpdt:
            chunk = megatron_chunk(self.attention)
            if module is self.feed_forward:
                return fpdt_ffn(module, x, chunk)
            return fused_norm(module, x, chunk)
        return tiled(module, x) if self.stack.tiled else module(x)

    def _attend(self, x: torch.Tensor, cu_seqlens: list[int] | None) -> torch.Tensor:
        """x + attention(norm(x)): the block's first half."""
        if self.stack.fuse_norm and getattr(self.attention, "fuses_input_norm", False):
            return x + self.attention(x, cu_seqlens=cu_seqlens, input_norm=self.attention_norm)
        # (no local for the attention's output: it would live through the MLP)
        return x + self.attention(self._per_token(self.attention_norm, x), cu_seqlens=cu_seqlens)

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        """h + mlp(norm(h)): the block's second half."""
        if self.stack.residual_ffn:
            return tiled_residual((self.ffn_norm, self.feed_forward), h)
        return h + self._per_token(self.feed_forward, self._per_token(self.ffn_norm, h))

    def _forward(self, x: torch.Tensor, cu_seqlens: list[int] | None) -> torch.Tensor:
        return self._mlp(self._attend(x, cu_seqlens))

    @property
    def reentrant(self) -> bool:
        """Checkpoint this block reentrantly: the stack's choice or the attention's need."""
        return self.stack.reentrant or getattr(self.attention, "checkpoint_reentrant", False)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int] | None = None) -> torch.Tensor:
        if not self.checkpointed:
            return self._forward(x, cu_seqlens)
        # Either checkpoint saves only the block input (non-reentrant: its placeholder; reentrant:
        # the Function's save_for_backward), through the saved-tensor hooks active *outside* it:
        # that is where the offload hooks go. ``cu_seqlens`` (host ints) is a non-tensor
        # argument: both checkpoints keep it as is and pass it again to the recomputation.
        ctx = (offload_saved_inputs(self.host_context, self.pin_memory) if self.offload
               else contextlib.nullcontext())
        if self.keep_attention:
            # Selective recomputation: the first half runs once, its saved tensors (the norm's
            # input, the attention's input and whatever the method saves for its backward)
            # kept, on the host where the stack says so; the second half is checkpointed from
            # h, which is what this block's checkpoint saves (and offloads) instead of x.
            kept = ctx if self.stack.keep_on_host else contextlib.nullcontext()
            with kept:
                h = self._attend(x, cu_seqlens)
            with ctx:
                return checkpoint(self._mlp, h, use_reentrant=self.reentrant)
        with ctx:
            return checkpoint(self._forward, x, cu_seqlens, use_reentrant=self.reentrant)


def block_offloads(stack: StackConfig, i: int, n_layers: int) -> bool:
    """Whether block ``i`` of ``n_layers`` sends its checkpointed input (and, keeping the
    attention on the host, its kept tensors) to host memory: with ``offload``, every block but
    the first and last, unless the stack offloads those too."""
    return stack.offload and (stack.offload_all or (
        (0 < i or stack.offload_first) and (i < n_layers - 1 or stack.offload_last)))


def kept_blocks(n_layers: int, keep_attention: bool, keep_blocks: int | None) -> range:
    """The blocks that keep their attention's saved tensors (or, on a ``keep_block`` stack,
    everything they save: they are not checkpointed): none without ``keep_attention``, every
    one with ``keep_blocks`` None, else the last ``keep_blocks``.

    The last ones because the backward reaches them first: a block's kept tensors are freed as
    soon as its backward has run, so the blocks nearest the loss hold theirs the shortest time
    (the same total at the forward's end, where the host peak is). With ALST's offload the
    last block keeps them on the device (it does not offload) and every further one in host
    memory (``keep_on_host``), so each block past the last adds the same host bytes: the host
    peak is affine in ``keep_blocks``."""
    if not keep_attention:
        return range(0)
    k = n_layers if keep_blocks is None else keep_blocks
    return range(n_layers - k, n_layers)


class Transformer(nn.Module):
    """The decoder; ``forward(tokens, labels, cu_seqlens=None) -> summed token loss`` (fp32
    scalar); ``cu_seqlens``: packed documents' global bounds (host ints), to every attention.

    Args:
        cfg: model shape.
        method: registry name of the CP attention; ``group`` its process group, or ``mesh``
            (hybrid methods: a 2-D DeviceMesh with dims ``("ring", "ulysses")``) instead.
        stack: memory-stack switches.
        kernel, method_options: passed to every attention module.
        keep_blocks: with a stack that keeps the attention (``keep_attention``) or whole
            blocks (``keep_block``), the number of blocks that keep it, the last ones
            (``kept_blocks``); None: every block.
    """

    def __init__(self, cfg: ModelConfig, method: str, stack: StackConfig, *,
                 group: ProcessGroup | None = None, mesh: DeviceMesh | None = None,
                 kernel: str = "auto", method_options: dict | None = None,
                 keep_blocks: int | None = None):
        super().__init__()
        self.cfg, self.stack = cfg, stack
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        n = cfg.n_layers
        kept = kept_blocks(n, stack.keep_attention or stack.keep_block, keep_blocks)
        # the method's constructor rejects group and mesh together; pass only the one given
        where = {"group": group} if mesh is None else {"mesh": mesh}
        self.layers = nn.ModuleList(
            Block(cfg, build_method(method, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                                    causal=True, rope_theta=cfg.rope_theta, kernel=kernel,
                                    **where, **(method_options or {})),
                  stack, offload=block_offloads(stack, i, n),
                  keep_attention=stack.keep_attention and i in kept,
                  checkpointed=not (stack.keep_block and i in kept))
            for i in range(n)
        )
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        # the paper's TorchTitan RoPE table when the cell holds it (``global_rope_table``): a
        # plain attribute, not a buffer, so that neither FSDP2 nor ``.to(dtype)`` touches it
        self.rope_table: torch.Tensor | None = None
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size,
                                                                bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Llama-like random init: N(0, 0.02) for matrices, output layers scaled by depth."""
        std_out = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, std=std_out if name.endswith(("wo.weight", "w2.weight"))
                                else 0.02)

    @property
    def attention_modules(self) -> list[nn.Module]:
        return [layer.attention for layer in self.layers]

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a (B, S, ...) tensor in the attention method's layout."""
        return self.layers[0].attention.shard(full, dim=1)

    def set_offload(
        self, *, host_context: Callable[[], contextlib.AbstractContextManager] | None = None,
        pin_memory: bool | None = None,
    ) -> None:
        """Where offloaded bytes are accounted (a tracker's ``host``) and whether to pin.

        Applies to the blocks' checkpoint offload and to attention modules that offload to host
        themselves (FPDT's chunks: they have the same two attributes).
        """
        for m in [*self.layers, *self.attention_modules]:
            if host_context is not None and hasattr(m, "host_context"):
                m.host_context = host_context
            if pin_memory is not None and hasattr(m, "pin_memory"):
                m.pin_memory = pin_memory

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor,
                cu_seqlens: list[int] | None = None) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cu_seqlens)
        if self.stack.megatron_fpdt:
            h = fused_norm(self.norm, h, megatron_chunk(self.layers[-1].attention))
        else:
            h = tiled(self.norm, h) if self.stack.tiled else self.norm(h)
        weight = self.tok_embeddings.weight if self.output is None else self.output.weight
        if self.stack.chunked_loss:
            chunk = loss_chunk_tokens(self.cfg.dim, self.cfg.vocab_size)
            return chunked_linear_cross_entropy(h.flatten(0, 1), weight, labels.flatten(), chunk)
        logits = F.linear(h, weight).float()
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")


def global_rope_table(cfg: ModelConfig, seq_len: int, device: torch.device) -> torch.Tensor:
    """The RoPE table the paper's TorchTitan keeps on every GPU: complex64 (seq_len,
    head_dim / 2), e^(i p theta^(-2j/d)) for every position p of the global sequence (512 bytes
    a token at head_dim 128: 1.5 GiB at 3M tokens).

    TorchTitan makes it for its ``max_seq_len``, which the paper's scripts set to the training
    length (togethercomputer/Untied-Ulysses: torchtitan/torchtitan/models/llama3/model.py,
    ``precompute_freqs_cis`` and ``TransformerModelArgs.update_from_config``; the Qwen3-32B
    flavour is the same Llama class, head_dim 128), then hands CP each rank's positions by
    ``buffer.resize_(chunk.shape)`` on the full table (torchtitan/torchtitan/train.py), and
    ``resize_`` never shrinks a storage: every rank keeps the whole table for the run. The
    methods here compute their RoPE from their own positions, so the table is held, not read:
    a cell with ``global_rope_table`` has the paper's memory and the same numbers as one
    without. Made before the tracked steps (TorchTitan makes it at initialisation), so its
    fp32 angles are not in a peak."""
    inv_freq = default_inv_freq(cfg.head_dim, cfg.rope_theta, device)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return torch.polar(torch.ones_like(angles), angles)


def shifted_labels(tokens: torch.Tensor, cu_seqlens: list[int] | None = None) -> torch.Tensor:
    """Next-token labels for a full (B, S) sequence; the last position is ignored, and with
    packed documents (``cu_seqlens``, global bounds) the last position of every document: its
    next token starts another document.

    Shift the *full* sequence, then shard tokens and labels with the same layout: a rank's last
    label is then the next rank's first token, exactly as on one device.
    """
    labels = torch.full_like(tokens, IGNORE_INDEX)
    labels[:, :-1] = tokens[:, 1:]
    for end in cu_seqlens or ():
        if end > 0:  # an empty first document ends at 0: no last token
            labels[:, end - 1] = IGNORE_INDEX
    return labels
