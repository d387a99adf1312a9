"""What a memory-stack level switches on, for models outside the harness
(docs/design.md#the-memory-stack)."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class MemoryStack:
    """The ALST memory stack's levels, each optional (docs/design.md#the-memory-stack)."""

    checkpoint: bool
    """activation checkpointing of every decoder layer (torch.utils.checkpoint, non-reentrant)"""
    offload: bool
    """checkpointed layer inputs to host memory, all layers but the first and last"""
    tiled: bool
    """each layer's MLP over ceil(L / dim) sequence shards (DeepSpeed's TiledMLP algorithm,
    ``upipe.stack.tiled``)"""
    chunked_loss: bool
    """linear + cross-entropy over token chunks, so full-vocabulary logits never exist"""
    keep_attention: bool = False
    """selective recomputation: each layer's attention half (its norm, the attention, the
    residual add) runs outside the checkpoint, so what it saves for its backward is kept and
    the recompute runs the MLP half only"""
    keep_on_host: bool = False
    """with ``keep_attention`` and ``offload``: in the layers that offload, what the attention
    half keeps goes to host memory, as the checkpointed inputs do"""
    uncheckpointed_layers: int = 0
    """with ``checkpoint``, layer-wise selective recomputation: the last this many decoder
    layers run without their checkpoint (and without offload), so all they save stays on the
    device and their backward recomputes nothing (the harness's ``alst-block`` level with a
    cell's ``keep_blocks``). The last layers because the backward frees theirs first: the last
    one alone adds nothing to a peak reached in an earlier layer's backward"""

    def __post_init__(self):
        for f in fields(self):
            if f.name == "uncheckpointed_layers":
                continue
            if not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"MemoryStack.{f.name} must be a bool, got "
                                 f"{getattr(self, f.name)!r}")
        n = self.uncheckpointed_layers
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"MemoryStack.uncheckpointed_layers must be an int >= 0, got {n!r}")
        if n and not self.checkpoint:
            raise ValueError("MemoryStack.uncheckpointed_layers needs checkpoint=True: without "
                             "it no layer is checkpointed")
        if self.offload and not self.checkpoint:
            raise ValueError("MemoryStack.offload needs checkpoint=True: it offloads the "
                             "checkpointed layer inputs, which exist only under checkpointing")
        if self.keep_attention and not self.checkpoint:
            raise ValueError("MemoryStack.keep_attention needs checkpoint=True: it keeps what "
                             "the recompute would otherwise run again")
        if self.keep_on_host and not (self.keep_attention and self.offload):
            raise ValueError("MemoryStack.keep_on_host needs keep_attention=True and "
                             "offload=True: it sends the kept tensors where the offloaded "
                             "inputs go")


#: the harness's levels of the same names (experiments.config.STACKS) for these fields: the
#: ladder (each adds to the last) and the selective-recomputation levels
LEVELS: dict[str, MemoryStack] = {
    "none": MemoryStack(checkpoint=False, offload=False, tiled=False, chunked_loss=False),
    "ac": MemoryStack(checkpoint=True, offload=False, tiled=False, chunked_loss=False),
    "offload": MemoryStack(checkpoint=True, offload=True, tiled=False, chunked_loss=False),
    "alst": MemoryStack(checkpoint=True, offload=True, tiled=True, chunked_loss=True),
    # selective recomputation (beyond the paper): alst keeping the attention's saved tensors
    "alst-attn": MemoryStack(checkpoint=True, offload=True, tiled=True, chunked_loss=True,
                             keep_attention=True),
    "alst-attn-host": MemoryStack(checkpoint=True, offload=True, tiled=True, chunked_loss=True,
                                  keep_attention=True, keep_on_host=True),
}


def memory_stack(stack: str | MemoryStack) -> MemoryStack:
    """A level name (``LEVELS``) or a ``MemoryStack`` -> the ``MemoryStack``."""
    if isinstance(stack, MemoryStack):
        return stack
    if not isinstance(stack, str) or stack not in LEVELS:
        raise ValueError(f"stack {stack!r} is not a memory-stack level: choose one of "
                         f"{sorted(LEVELS)} or pass a MemoryStack")
    return LEVELS[stack]
