"""Memory-stack levels (DESIGN.md §6, "the ALST stack") and the compute dtypes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StackConfig:
    """What a memory-stack level switches on (DESIGN.md §6, "the ALST stack")."""

    checkpoint: bool
    """activation checkpointing of every block (torch.utils.checkpoint, non-reentrant)"""
    offload: bool
    """checkpointed block inputs to host memory, all blocks but the first and last"""
    tiled: bool
    """tiled MLP and RMSNorm (local sequence in ceil(L / dim) shards)"""
    chunked_loss: bool
    """linear + cross-entropy over token chunks, so full logits never exist"""


STACKS: dict[str, StackConfig] = {
    # the ladder: each level adds to the one before
    "none": StackConfig(False, False, False, False),
    "ac": StackConfig(True, False, False, False),
    "offload": StackConfig(True, True, False, False),
    "alst": StackConfig(True, True, True, True),
    # the paper's PyTorch-native baseline (DESIGN.md §6): checkpointing and the chunked loss,
    # without tiled MLP or offload
    "native": StackConfig(True, False, False, True),
}

DTYPES = ("fp32", "bf16")


def paper_stack(method: str) -> str:
    """The memory stack the paper runs ``method`` on (DESIGN.md §6): PyTorch's native CP
    (``torch-cp``) on its own ``native`` stack (checkpointing and the chunked loss, no tiling or
    offload), every other method on the ALST stack."""
    return "native" if method == "torch-cp" else "alst"
