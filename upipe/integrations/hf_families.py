"""The Hugging Face model families the drop-in computes exactly, and where each keeps its window.

A CP method replaces a decoder layer's attention with its own: q/k/v/o linears (biases
allowed), per-head q/k RMSNorm, rotate-half RoPE from the model's one rotary module at each
token's global position, softmax scale ``head_dim**-0.5``, causal. A family whose attention
differs in any other way (interleaved RoPE: Cohere, ERNIE-4.5; partial rotary: StableLM,
Nemotron; differential or chunked attention: DiffLlama, Llama 4; learned position embeddings:
GPT-2) would convert and give other numbers without a word, so :func:`check_family` admits
only the families listed here, each run against its unconverted copy in
``tests/test_hf_families.py`` (and every other family of the installed ``transformers`` is
checked to be refused there).

Sliding windows are the one attention feature of these families the methods do not compute;
a window covering every span attention sees (the sequence, or each packed document) changes
nothing and is accepted. Where a family declares its window (read in transformers 5.24's
modelling code):
- in the config, applied to every layer: Mistral, Mixtral, Starcoder2 (``sliding_window``
  passed at each attention call), Qwen3-MoE (``sliding_window`` chooses its mask);
- per layer: Qwen2, Qwen2-MoE, Qwen3 (``layer_types[i] == "sliding_attention"``, from
  ``use_sliding_window`` and ``max_window_layers``, then ``config.sliding_window``; the attention
  module keeps it as ``sliding_window``).
:func:`layer_window` reads all of these for any admitted family, so a window declared in a
place its family does not read is refused too (conservative; never a silent difference).
Pure Python over the config and the attention module: no ``transformers`` import.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """What a verified family needs beyond the shared checks of ``hf._check_layer``."""

    window_in_config: bool = False
    """the family applies ``config.sliding_window`` to every layer when it is set"""
    off_fields: tuple[tuple[str, str], ...] = ()
    """(config field or call argument, why): what the CP model would compute differently unless
    it is off (0, False or None)"""


# The MoE models' load-balancing loss is a product of two means over the batch's tokens: each
# rank would take it over its own shard, and the ranks' sum would not be the sequence's loss.
_ROUTER_LOSS = (("output_router_logits", "the router's load-balancing loss would be taken over "
                 "each rank's tokens alone, and its sum over ranks is not the sequence's"),)
#: model_type -> Family: verified equal to their unconverted copies (tests/test_hf_families.py)
FAMILIES: dict[str, Family] = {
    "gemma": Family(),
    "llama": Family(),
    "mistral": Family(window_in_config=True),
    "mixtral": Family(window_in_config=True, off_fields=_ROUTER_LOSS),
    "qwen2": Family(),
    "qwen2_moe": Family(off_fields=_ROUTER_LOSS),
    "qwen3": Family(),
    "qwen3_moe": Family(window_in_config=True, off_fields=_ROUTER_LOSS),
    "starcoder2": Family(window_in_config=True, off_fields=(
        ("residual_dropout", "Starcoder2's attention drops out its output in training; the CP "
         "methods do not"),)),
}
_LAYER_TYPES = ("full_attention", "sliding_attention")


def check_family(config) -> Family:
    """The :class:`Family` of a model's (top-level) config; ValueError naming the model type
    and the supported families when the drop-in has not been verified on it."""
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(
            f"model_type {model_type!r} is not supported by upipe.integrations.hf: its attention "
            f"has not been verified to equal the CP methods' (rotate-half RoPE at global "
            f"positions, q/k/v/o linears, full causal softmax); supported families: "
            f"{sorted(FAMILIES)}")
    check_off(family, model_type, lambda name: getattr(config, name, None))
    return family


def check_off(family: Family, model_type: str, value) -> None:
    """ValueError naming the first of ``family.off_fields`` that is on; ``value(name)`` reads it
    (from the config, or from a call's arguments)."""
    for name, why in family.off_fields:
        if value(name):
            raise ValueError(f"{name} ({value(name)}) must be off for model_type "
                             f"{model_type!r}: {why}")


def layer_window(config, family: Family, attn, layer_idx: int | None) -> int | None:
    """The sliding window (tokens a query sees, itself included) of one decoder layer, or None.

    config: the text config; attn: the layer's Hugging Face attention module. The smallest of
    every window declared for the layer; ValueError for a layer type other than full or
    sliding attention (a chunked or linear layer is not softmax attention over the sequence).
    """
    windows = []
    if getattr(attn, "sliding_window", None) is not None:
        windows.append(attn.sliding_window)
    if family.window_in_config and getattr(config, "sliding_window", None) is not None:
        windows.append(config.sliding_window)
    layer_types = getattr(config, "layer_types", None)
    if layer_types and layer_idx is not None:
        kind = layer_types[layer_idx]
        if kind not in _LAYER_TYPES:
            raise ValueError(f"layer_types[{layer_idx}] is {kind!r}: only {list(_LAYER_TYPES)} "
                             "are supported")
        if kind == "sliding_attention":
            if getattr(config, "sliding_window", None) is None:  # transformers raises too
                raise ValueError(f"layer_types[{layer_idx}] is 'sliding_attention' but "
                                 "sliding_window is not set")
            windows.append(config.sliding_window)
    return min(windows) if windows else None


__all__ = ["FAMILIES", "Family", "check_family", "check_off", "layer_window"]
