"""Memory-stack levels (docs/design.md#the-memory-stack) and the compute dtypes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StackConfig:
    """What a memory-stack level switches on (docs/design.md#the-memory-stack)."""

    checkpoint: bool
    """activation checkpointing of every block (torch.utils.checkpoint, non-reentrant)"""
    offload: bool
    """checkpointed block inputs to host memory, all blocks but the first and last"""
    tiled: bool
    """tiled MLP and RMSNorm (local sequence in ceil(L / dim) shards)"""
    chunked_loss: bool
    """linear + cross-entropy over token chunks, so full logits never exist"""
    offload_all: bool = False
    """with ``offload``: every block's checkpointed input, the first and last too"""
    reentrant: bool = False
    """checkpoint reentrantly (forward under no_grad, recomputed in backward) instead of
    non-reentrantly; methods that need it ask for it themselves (``checkpoint_reentrant``)"""
    offload_first: bool = False
    """with ``offload``: the first block's checkpointed input (the embedding output) too, which
    ALST keeps on the device for the whole backward; the last block's stays (its backward
    starts as its forward ends)"""
    offload_last: bool = False
    """with ``offload``: the last block's checkpointed input too (every block but the first,
    as the paper's TorchTitan checkpoint wrapper offloads them)"""
    residual_ffn: bool = False
    """with ``tiled``: a block's ``h + mlp(norm(h))`` as one tiled op (``upipe.stack.
    tiled_residual``) that saves only h and writes its output and h's gradient in place, instead
    of a tiled norm, a tiled MLP (each concatenating its shards' outputs) and an add"""
    fuse_norm: bool = False
    """the attention's pre-norm computed inside the attention where the method supports it
    (``fuses_input_norm``: UPipe), tile by tile, so the normalised (L, dim) input is never kept;
    other methods keep the tiled norm"""
    megatron_fpdt: bool = False
    """the MLP and the norms as the paper's DeepSpeed-FPDT runs ran them on Megatron-DeepSpeed
    (``baselines.megatron_stack``): the MLP as FPDT_FFN, in chunks of the FPDT chunk / CP
    degree / 2 local tokens (64K chunks: 4096 on 8 ranks), only its input saved, the input
    gradient written in place, fp32 weight-gradient accumulators; every norm with a fused
    kernel's memory (apex's fused LayerNorm: the input saved, one output, one input gradient).
    Without ``tiled``."""
    keep_attention: bool = False
    """with ``checkpoint``, selective recomputation: each block's attention (and the norm
    before it) runs outside the checkpoint, so what the attention saves for its backward is
    kept and the recomputed block forward skips it (its kernels and its collectives); the MLP
    is checkpointed from the attention's residual sum. What is kept stays on the device, or
    with ``keep_on_host`` goes to host memory as the offloaded block inputs do"""
    keep_on_host: bool = False
    """with ``keep_attention`` and ``offload``: the kept tensors in host memory (pinned and
    copied back in the backward, as ``offload``'s block inputs), in blocks that offload"""
    keep_block: bool = False
    """with ``checkpoint``, whole-block keeping: a kept block (the cell's ``keep_blocks``, the
    last ones; every block when unset) runs without its checkpoint and without offload, so
    everything it saves for its backward stays on the device and its backward recomputes
    nothing but what its tiled ops recompute by design (the tiled MLP's and norms' shards);
    the other blocks run as the level without it"""

    def __post_init__(self):
        """Every field a bool and every "with X" of the docstrings held, so a level registered
        by code (``dataclasses.replace`` of a rung, a new level) runs as its fields say: the
        blocks silently dropped an offload without checkpointing while ``block_offloads``
        still said they offloaded."""
        for name, value in vars(self).items():
            if not isinstance(value, bool):
                raise ValueError(f"StackConfig.{name} must be True or False, got {value!r}")
        needs = {  # field -> (the fields it needs, why)
            "offload": (("checkpoint",), "it offloads the checkpointed block inputs"),
            "offload_all": (("offload",), "it widens which blocks offload"),
            "offload_first": (("offload",), "it widens which blocks offload"),
            "offload_last": (("offload",), "it widens which blocks offload"),
            "reentrant": (("checkpoint",), "it says how blocks are checkpointed"),
            "residual_ffn": (("tiled",), "it is the tiled MLP's residual form"),
            "keep_attention": (("checkpoint",), "it keeps what the recompute would run again"),
            "keep_on_host": (("keep_attention", "offload"),
                             "it sends the kept tensors where the offloaded inputs go"),
            "keep_block": (("checkpoint",), "it exempts blocks from checkpointing"),
        }
        for name, (required, why) in needs.items():
            missing = [r for r in required if not getattr(self, r)]
            if getattr(self, name) and missing:
                raise ValueError(f"StackConfig.{name} needs {' and '.join(missing)}=True: {why}")
        if self.megatron_fpdt and self.tiled:
            raise ValueError("StackConfig.megatron_fpdt runs without tiled: it replaces the "
                             "tiled MLP and norms by Megatron-DeepSpeed's")


STACKS: dict[str, StackConfig] = {
    # the ladder: each level adds to the one before
    "none": StackConfig(False, False, False, False),
    "ac": StackConfig(True, False, False, False),
    "offload": StackConfig(True, True, False, False),
    "alst": StackConfig(True, True, True, True),
    # PyTorch-native: checkpointing and the chunked loss, without tiled MLP or offload
    "native": StackConfig(True, False, False, True),
    # The paper's PyTorch-native CP baseline as its TorchTitan fork ran it: checkpointing,
    # offload and the chunked loss, no tiled MLP. Its "full" checkpointing wraps every block in
    # the authors' patched CheckpointWrapper (togethercomputer/Untied-Ulysses,
    # torchtitan/patch_torch_files/checkpoint_wrapper.py: the checkpoint runs inside
    # torch.autograd.graph.save_on_cpu(pin_memory=True) for every layer whose id is not a
    # multiple of AC_LAYER_STRIDE, default 1000, and is_last_layer, which parallelize_llama.py
    # never passes): every block's input but layer 0's goes to pinned host memory. (Until
    # issue 32 torch-cp ran on "native", which kept them all on the device and made it fail at
    # 0.9M tokens where the paper trains 1M.)
    "torchtitan": StackConfig(True, True, False, True, offload_last=True),
    # The paper's FPDT runs on Megatron-DeepSpeed (the authors' script: togethercomputer/
    # Untied-Ulysses, FPDT/Megatron-DeepSpeed/examples_deepspeed/sequence_parallel/
    # run_single_8B.sh). What of it changes memory, and how it maps here:
    # * --checkpoint-activations --deepspeed-activation-checkpointing: every block through
    #   deepspeed.checkpointing.checkpoint, which is reentrant (its CheckpointFunction runs the
    #   forward under no_grad and recomputes in backward): reentrant=True.
    # * --checkpoint-in-cpu: that checkpoint moves *every* checkpointed input to the CPU
    #   (deepspeed/runtime/activation_checkpointing/checkpointing.py, CPU_CHECKPOINT): offload
    #   with offload_all=True (ALST keeps the first and last block's on the device). Pinned
    #   host memory up to 4M tokens, pageable above: the harness's rule for every stack
    #   (upipe/stack/offload.py PIN_MAX_TOKENS), as the paper ran it.
    # * --ds-sequence-parallel-fpdt: Megatron's ParallelMLP runs FPDT_FFN from the authors'
    #   patch (FPDT/Megatron-DeepSpeed/megatron/model/transformer.py, ParallelMLP.forward;
    #   megatron/patch/fpdt_layer.py, FPDT_FFN with its swiglu branch), in chunks of
    #   chunk_size // sp // 2 tokens. (DeepSpeed's own FPDT_FFN is GELU-only; until issue 32
    #   this stack ran the SwiGLU MLP whole, which the paper's runs did not.)
    # * no --normalization: Megatron's default LayerNorm, apex's fused MixedFusedLayerNorm on
    #   CUDA (megatron/model/__init__.py), with --disable-mem-efficient-ln: our RMSNorm with a
    #   fused kernel's memory. Both: megatron_fpdt=True, tiled=False.
    # * FPDT_LogitsLoss: logits and cross-entropy per sequence chunk: chunked_loss=True.
    # * --zero-stage 3 --fp16: model states are 16 bytes per parameter / N either way (ZeRO,
    #   Rajbhandari et al. 2020, sec. 3: fp16 params and grads 2+2, fp32 master params,
    #   momentum, variance 4+4+4 = K=12, all partitioned at stage 3), which FSDP2 with bf16
    #   compute over fp32 sharded params and Adam states also holds (4 params + 8 Adam states +
    #   4 for the fp32 gradient shard, and the bf16 all-gathered unit while in use, as ZeRO-3's
    #   gathered fp16 parameters): the same bytes, so FSDP2 stays.
    "megatron-ds": StackConfig(True, True, False, True, offload_all=True, reentrant=True,
                               megatron_fpdt=True),
    # Beyond the paper (issue 17): ALST plus the mechanisms that remove what binds UPipe on the
    # way to 8M tokens on one node (the ladder in
    # docs/results.md#one-node-to-8m-tokens-beyond-the-paper): the first block's input
    # offloaded, the residual FFN tiled in place, the attention's pre-norm fused.
    "long": StackConfig(True, True, True, True, offload_first=True, residual_ffn=True,
                        fuse_norm=True),
    # Beyond the paper (issue 34): ALST with selective recomputation, the attention's saved
    # tensors kept on the device (alst-attn) or in host memory (alst-attn-host), so that the
    # recomputed forward skips the attention, the largest part of a long-context step.
    "alst-attn": StackConfig(True, True, True, True, keep_attention=True),
    "alst-attn-host": StackConfig(True, True, True, True, keep_attention=True,
                                  keep_on_host=True),
    # The long level keeping the attention in host memory: UPipe's fused pre-norm saves the
    # block's input once where alst-attn-host keeps it twice (the norm's input and the
    # attention's), a third less per block (Llama3-8B, 8 GPUs, 3M tokens: 6.8 GB of host
    # memory per rank and block against 10.0; results/selective_recompute_*), so more blocks
    # keep theirs within the host budget (keep_blocks).
    "long-attn-host": StackConfig(True, True, True, True, offload_first=True,
                                  residual_ffn=True, fuse_norm=True, keep_attention=True,
                                  keep_on_host=True),
    # ALST with whole blocks un-checkpointed (issue 34's layer-wise policy, what TorchTitan
    # calls selective activation checkpointing by layer): the kept blocks skip their whole
    # recompute (norms, projections, attention) for every tensor they save on the device.
    # Under ALST the tiled MLP and norms recompute their shards in their own backward anyway,
    # so a kept block differs from alst-attn's (every block keeping the attention) by the MLP
    # half's saved tensors: the tiled norm's input and output and the MLP's input (each
    # (L, dim)), where alst-attn checkpoints that half from its input alone.
    "alst-block": StackConfig(True, True, True, True, keep_block=True),
}

DTYPES = ("fp32", "bf16")


# methods the paper runs on a stack of their own; every other one runs on the ALST stack
_PAPER_STACKS = {"torch-cp": "torchtitan", "ds-fpdt": "megatron-ds"}


def paper_stack(method: str) -> str:
    """The memory stack the paper runs ``method`` on (docs/design.md#the-comparison): PyTorch's
    native CP (``torch-cp``) on its TorchTitan fork's (``torchtitan``: checkpointing, offload of
    every block input but the first, the chunked loss, no tiling), DeepSpeed's FPDT (``ds-fpdt``) on
    Megatron-DeepSpeed's (``megatron-ds``), every other method on the ALST stack."""
    return _PAPER_STACKS.get(method, "alst")
