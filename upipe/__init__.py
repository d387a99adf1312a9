"""upipe: UPipe (Untied Ulysses) context-parallel attention and the shared CP building blocks."""

import importlib.metadata as _metadata

from upipe.comm import head_to_seq, head_to_seq_autograd, seq_to_head, seq_to_head_autograd
from upipe.documents import Documents, cu_seqlens_from_position_ids
from upipe.kernels import KERNELS, attention, attention_backward, attention_forward
from upipe.layout import LAYOUTS, SeqLayout
from upipe.merge import merge_attention
from upipe.module import ContextParallelAttention
from upipe.reference import LlamaAttention
from upipe.registry import available_methods, build_method, get_method, register_method
from upipe.ring import (
    SequenceAttention,
    ring_attention,
    ring_attention_backward,
    ring_attention_forward,
)
from upipe.rope import apply_rope, apply_rope_inverse, rope_tables
from upipe.staging import StagePlan, make_stage_plan
from upipe.untied import UPipeAttention, upipe_attention

try:  # pyproject.toml's version, as installed; None when imported from a bare source tree
    __version__ = _metadata.version("upipe")
except _metadata.PackageNotFoundError:
    __version__ = None

__all__ = [
    "KERNELS",
    "LAYOUTS",
    "ContextParallelAttention",
    "Documents",
    "LlamaAttention",
    "SeqLayout",
    "SequenceAttention",
    "StagePlan",
    "UPipeAttention",
    "apply_rope",
    "apply_rope_inverse",
    "attention",
    "attention_backward",
    "attention_forward",
    "available_methods",
    "build_method",
    "cu_seqlens_from_position_ids",
    "get_method",
    "head_to_seq",
    "head_to_seq_autograd",
    "make_stage_plan",
    "merge_attention",
    "register_method",
    "ring_attention",
    "ring_attention_backward",
    "ring_attention_forward",
    "rope_tables",
    "seq_to_head",
    "seq_to_head_autograd",
    "upipe_attention",
]
