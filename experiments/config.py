"""Typed configuration: model presets, memory-stack levels and the benchmark cell.

Everything a cell runs is one frozen, self-validating ``Cell`` (STYLE.md §4): method, model
preset (+ overrides), sequence length, ranks, stack, heads per stage, dtype, kernel, budget.
Validation names the offending field and the rule and happens before any process starts, so a
sweep's dry run checks every cell and no rank ever hangs on bad input.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import re
from dataclasses import dataclass, field, fields
from typing import Any

from upipe.kernels import check_kernel
from upipe.registry import available_methods, get_method

MiB = 2**20


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


# DESIGN.md §6 (paper shapes; Qwen3-32B with Llama-style blocks) and CPU-sized counterparts.
PRESETS: dict[str, ModelConfig] = {
    "llama3-8b": ModelConfig(32, 4096, 32, 8, 128, 14336, 128256, 500000.0),
    "qwen3-32b": ModelConfig(64, 5120, 64, 8, 128, 25600, 151936, 1000000.0),
    "llama3-70b": ModelConfig(80, 8192, 64, 8, 128, 28672, 128256, 500000.0),
    # CPU counterparts. Llama3-8B's structure scaled down: H/Hkv = 4, H*d_h = dim, and on 4 ranks
    # with U = C four stages, as the 32 heads on 8 GPUs of the paper ...
    "tiny": ModelConfig(4, 256, 16, 4, 16, 768, 1024, 500000.0),
    # ... and Qwen3-32B's: H/Hkv = 8, H*d_h > dim.
    "tiny-wide": ModelConfig(4, 256, 16, 2, 32, 768, 1024, 1000000.0),
}


def _coerce(name: str, typ: Any, text: str) -> Any:
    typ = {"int": int, "float": float, "bool": bool}.get(typ, typ)
    if typ is bool:
        if text.lower() in ("1", "true", "yes"):
            return True
        if text.lower() in ("0", "false", "no"):
            return False
        raise ValueError(f"{name} must be true or false, got {text!r}")
    try:
        return typ(parse_size(text) if typ is int else text)
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


def parse_size(text: str | int) -> int:
    """'128K' -> 131072, '1M' -> 1048576, '131072' -> 131072 (binary K/M/G suffixes)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"(\d+)([kKmMgG]?)", str(text).strip())
    if not m:
        raise ValueError(f"size must look like 131072, 128K or 1M, got {text!r}")
    return int(m[1]) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[m[2].lower()]


def format_size(n: int) -> str:
    """131072 -> '128K', 1048576 -> '1M', 1000 -> '1000'."""
    for unit, mult in (("M", 2**20), ("K", 2**10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


def parse_overrides(items: list[str] | tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """['n_layers=2', ...] -> (('n_layers', '2'), ...); the key is checked by resolve_model."""
    out = []
    for item in items:
        key, eq, val = item.partition("=")
        if not eq or not key:
            raise ValueError(f"override must be key=value, got {item!r}")
        out.append((key.strip(), val.strip()))
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# memory stack


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


# ---------------------------------------------------------------------------------------------
# the cell


@dataclass(frozen=True)
class Cell:
    """One benchmark configuration. World size is ``nproc`` (= the CP degree), stored once."""

    method: str
    """registry name (``upipe-bench list``)"""
    model: str = "tiny"
    """model preset"""
    seq_len: int = 4096
    """global tokens per step (batch 1); each rank holds seq_len / nproc"""
    nproc: int = 4
    """ranks = CP degree (FSDP2 shards over the same ranks)"""
    stack: str = "alst"
    """memory-stack level (``STACKS``): none, ac, offload, alst, native"""
    heads_per_stage: int | None = None
    """UPipe's U (a multiple of the Ulysses degree); None: the method's default"""
    ring_degree: int = 1
    """hybrids (usp, upipe): ranks on the ring axis of a (ring, ulysses) mesh; Ulysses degree =
    nproc / ring_degree"""
    chunk_size: int | None = None
    """fpdt, ds-fpdt: global tokens per chunk; None: the method's default"""
    dtype: str = "fp32"
    """parameter/compute dtype; bf16 keeps fp32 reductions"""
    kernel: str = "auto"
    """attention kernel (upipe.kernels.KERNELS)"""
    overrides: tuple[tuple[str, str], ...] = ()
    """model field overrides, (key, value) pairs"""
    budget_mib: float | None = None
    """per-rank device budget in MiB: on CPU a tracked-bytes limit, on GPU the device's own"""
    warmup: int = 1
    """untimed steps before the memory step and the timed ones"""
    iters: int = 2
    """timed steps"""
    lr: float = 1e-4
    """AdamW learning rate"""
    seed: int = 0
    """parameter and data seed"""
    extra: dict = field(default_factory=dict, compare=False, hash=False)
    """free-form labels carried into the row (e.g. the sweep's ``rep``); not part of the id"""

    def validate(self) -> ModelConfig:
        """Raise ValueError naming the field and the rule; returns the resolved model.

        The method's own rules (heads over the Ulysses degree, layout divisibility, its options)
        come from its class-level ``check_config``, the same check its constructor makes.
        """
        if self.method not in available_methods():
            raise ValueError(f"method must be one of {available_methods()}, got {self.method!r}")
        model = resolve_model(self.model, self.overrides)
        if self.stack not in STACKS:
            raise ValueError(f"stack must be one of {list(STACKS)}, got {self.stack!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if self.nproc < 1:
            raise ValueError(f"nproc must be >= 1, got {self.nproc}")
        if self.seq_len < 2 or self.seq_len % self.nproc:
            raise ValueError(
                f"seq_len ({self.seq_len}) must be >= 2 and divisible by nproc ({self.nproc})"
            )
        if self.warmup < 0 or self.iters < 0:
            raise ValueError(f"warmup and iters must be >= 0, got {self.warmup}, {self.iters}")
        if self.budget_mib is not None and self.budget_mib <= 0:
            raise ValueError(f"budget_mib must be positive, got {self.budget_mib}")
        if self.ring_degree < 1:
            raise ValueError(f"ring_degree must be >= 1, got {self.ring_degree}")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {self.chunk_size}")
        cls = get_method(self.method)
        options = self.method_options()
        for name in options:
            if not takes_option(cls, name):
                takers = [m for m in available_methods() if takes_option(get_method(m), name)]
                raise ValueError(f"{name} applies to {', '.join(takers) or 'no registered method'}"
                                 f" only, not {self.method!r}")
        cls.check_config(model.n_heads, model.n_kv_heads, cp=self.nproc,
                         ring_degree=self.ring_degree, seq_len=self.seq_len, **options)
        check_kernel(self.kernel)
        return model

    def method_options(self) -> dict:
        """The method's constructor options this cell sets (unset ones take the method default);
        what the model passes to every attention module and what validation checks."""
        opts = {name: getattr(self, name) for name in METHOD_OPTIONS}
        return {k: v for k, v in opts.items() if v is not None}

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["overrides"] = [list(kv) for kv in self.overrides]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Cell:
        d = dict(d)
        d["overrides"] = tuple(tuple(kv) for kv in d.get("overrides", ()))
        return cls(**d)

    def cell_id(self) -> str:
        """A readable, unique directory name for this cell (the hash covers every field).

        Fields added after results were committed enter the name and the hash only when they
        differ from their default, so the cells that existed before keep their ids (and a sweep
        re-run resumes them).
        """
        d = self.to_dict()
        d.pop("extra")
        for name, default in _LATER_FIELDS.items():
            if d[name] == default:
                d.pop(name)
        digest = hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:8]
        u = "" if self.heads_per_stage is None else f"-U{self.heads_per_stage}"
        r = "" if self.ring_degree == 1 else f"-R{self.ring_degree}"
        c = "" if self.chunk_size is None else f"-c{format_size(self.chunk_size)}"
        rep = f"-r{self.extra['rep']}" if "rep" in self.extra else ""
        return (f"{self.method}{u}{r}{c}-{self.model}-{format_size(self.seq_len)}-p{self.nproc}-"
                f"{self.stack}-{self.dtype}{rep}-{digest}")


# Method-specific constructor options a cell can set; each applies to the methods whose
# constructor takes a keyword of that name.
METHOD_OPTIONS = ("heads_per_stage", "chunk_size")

# Cell fields added after the first committed results, with their defaults (see cell_id).
_LATER_FIELDS = {"ring_degree": 1, "chunk_size": None}


def takes_option(method_cls: type, name: str) -> bool:
    """Whether the method's constructor accepts the keyword ``name`` (e.g. heads_per_stage)."""
    return name in inspect.signature(method_cls).parameters
