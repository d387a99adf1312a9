"""Model shapes: a Llama-style decoder's ``ModelConfig``, the presets, and overrides.

Random init everywhere: nothing is downloaded. Validation names the field and the rule.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

from experiments.config.sizes import parse_size


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-style decoder (random init; nothing is downloaded)."""

    n_layers: int
    """transformer blocks"""
    dim: int
    """model width"""
    n_heads: int
    """query heads"""
    n_kv_heads: int
    """key/value heads (GQA when fewer than n_heads)"""
    head_dim: int
    """per-head width"""
    ffn_dim: int
    """SwiGLU hidden width"""
    vocab_size: int
    """vocabulary (embedding and output head rows)"""
    rope_theta: float = 500000.0
    """RoPE base"""
    norm_eps: float = 1e-5
    """RMSNorm epsilon"""
    tie_embeddings: bool = False
    """share the output head with the token embedding (Llama 3.2 small models do; 8B/70B not)"""

    def validate(self) -> None:
        for f in fields(self):
            val = getattr(self, f.name)
            if isinstance(val, (int, float)) and not isinstance(val, bool) and val <= 0:
                raise ValueError(f"model.{f.name} must be positive, got {val}")
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim must be even (RoPE), got {self.head_dim}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads ({self.n_heads}) must be a multiple of model.n_kv_heads "
                f"({self.n_kv_heads})"
            )

    def n_params(self) -> int:
        """Parameter count (embeddings and head included)."""
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        block = attn + 3 * self.dim * self.ffn_dim + 2 * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.n_layers * block + self.vocab_size * self.dim + head + self.dim


# docs/design.md#the-comparison (paper shapes; Qwen3-32B with Llama-style blocks) and CPU-sized
# counterparts.
PRESETS: dict[str, ModelConfig] = {
    "llama3-8b": ModelConfig(32, 4096, 32, 8, 128, 14336, 128256, 500000.0),
    "qwen3-32b": ModelConfig(64, 5120, 64, 8, 128, 25600, 151936, 1000000.0),
    "llama3-70b": ModelConfig(80, 8192, 64, 8, 128, 28672, 128256, 500000.0),
    # CPU counterparts. Llama3-8B's structure scaled down: H/Hkv = 4, H*d_h = dim, and on 4 ranks
    # with U = C four stages, as the 32 heads on 8 GPUs of the paper ...
    "tiny": ModelConfig(4, 256, 16, 4, 16, 768, 1024, 500000.0),
    # ... and Qwen3-32B's: H/Hkv = 8, H*d_h > dim.
    "tiny-wide": ModelConfig(4, 256, 16, 2, 32, 768, 1024, 1000000.0),
    # The attention-layer benchmark's layer (the ``attention`` workload reads only n_heads,
    # n_kv_heads, head_dim, dim and rope_theta): Llama3-8B's 32 query and 8 KV heads at a
    # CPU-sized width, head dim 64 and dim 2048.
    "bench-attn": ModelConfig(1, 2048, 32, 8, 64, 5632, 1024, 500000.0),
}


def _coerce(name: str, typ: Any, text: str) -> Any:
    typ = {"int": int, "float": float, "bool": bool}.get(typ, typ)
    if typ is bool:
        if text.lower() in ("1", "true", "yes"):
            return True
        if text.lower() in ("0", "false", "no"):
            return False
        raise ValueError(f"{name} must be true or false, got {text!r}")
    text = text.strip()
    try:
        if typ is int:  # a signed integer ("-1" reaches validate, which names the rule) or a
            return int(text) if text.lstrip("+-").isdigit() else parse_size(text)  # size, 4K
        return typ(text)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be {typ.__name__}, got {text!r}") from None


def resolve_model(preset: str, overrides: tuple[tuple[str, str], ...] = ()) -> ModelConfig:
    """The preset with ``key=value`` overrides applied; unknown names list the valid ones."""
    if preset not in PRESETS:
        raise ValueError(f"model must be one of {sorted(PRESETS)}, got {preset!r}")
    cfg = PRESETS[preset]
    types = {f.name: f.type for f in fields(ModelConfig)}
    changes = {}
    for key, val in overrides:
        if key not in types:
            raise ValueError(f"override key must be one of {sorted(types)}, got {key!r}")
        changes[key] = _coerce(f"model.{key}", types[key], val)
    cfg = dataclasses.replace(cfg, **changes)
    cfg.validate()
    return cfg


def parse_overrides(items: list[str] | tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """['n_layers=2', ...] -> (('n_layers', '2'), ...); the key is checked by resolve_model."""
    out = []
    for item in items:
        key, eq, val = item.partition("=")
        if not eq or not key:
            raise ValueError(f"override must be key=value, got {item!r}")
        out.append((key.strip(), val.strip()))
    return tuple(out)
