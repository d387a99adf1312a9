"""The benchmark cell: everything one measured or emulated run is, frozen and self-validating.

Everything a cell runs is one frozen, self-validating ``Cell``
(docs/conventions.md#one-frozen-cell): method, model preset (+ overrides), sequence length, ranks,
stack, the method's own options, dtype, kernel, budget. Validation names the offending field and
the rule and happens before any process starts, so a sweep's dry run checks every cell and no rank
ever hangs on bad input.

A cell's dict form (``to_dict``: cell.json, a row's identity, a sweep's declaration) is flat: the
fields and the method's options side by side, as a user writes them
(``{"method": "upipe", "heads_per_stage": 8}``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from experiments.config.model import ModelConfig, resolve_model
from experiments.config.options import (
    COMMITTED_COLUMNS,
    HASHED_UNSET,
    declared,
    every_option,
    mark,
)
from experiments.config.options import check as check_options
from experiments.config.sizes import format_size
from experiments.config.stack import DTYPES, STACKS
from upipe.kernels import check_kernel
from upipe.registry import available_methods, get_method


class Options(dict):
    """A cell's options: a dict that cannot be changed once made (a frozen cell's), and that
    pickles (``types.MappingProxyType`` does not, and cells travel to rank processes)."""

    def _read_only(self, *args, **kwargs):
        raise TypeError("a cell's options are read-only: make a new cell "
                        "(dataclasses.replace(cell, options=...))")

    __setitem__ = __delitem__ = __ior__ = _read_only
    clear = pop = popitem = setdefault = update = _read_only

    def __reduce__(self):
        return type(self), (dict(self),)


@dataclass(frozen=True)
class Cell:
    """One benchmark configuration. The job's ranks are ``dp`` groups of ``nproc`` CP ranks;
    the world size (``world``, dp x nproc) is derived, never stored."""

    method: str
    """registry name (``upipe-bench list``)"""
    model: str = "tiny"
    """model preset"""
    seq_len: int = 4096
    """tokens of one sequence (batch 1; each dp replica trains its own); each rank holds
    seq_len / nproc"""
    nproc: int = 4
    """ranks per CP group = the CP degree; world = dp x nproc (FSDP2 shards over the world)"""
    stack: str = "alst"
    """memory-stack level (``STACKS``: the ladder none, ac, offload, alst; the paper's own
    native, torchtitan, megatron-ds; beyond it long, alst-attn, alst-attn-host,
    long-attn-host, alst-block)"""
    options: Mapping[str, object] = field(default_factory=dict, hash=False)
    """the method's own constructor options this cell sets (its ``declared_options``, e.g.
    UPipe's ``heads_per_stage``, FPDT's ``chunk_size``); an unset one (or None) takes the
    method's default. Read-only once made"""
    ring_degree: int = 1
    """hybrids (usp, upipe): ranks on the ring axis of a (ring, ulysses) mesh; Ulysses degree =
    nproc / ring_degree"""
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
    workload: str = "step"
    """what runs (``WORKLOADS``): ``step``, one training step of the model (the paper's
    measurement), or ``attention``, one attention layer's forward and backward on random
    input (the model preset gives its heads and width; stack and budget do not apply)"""
    dp: int = 1
    """data-parallel degree: CP groups, each training its own sequence (FSDP2 over all ranks)"""
    doc_len: int | None = None
    """tokens per packed document: the sequence is cut into seq_len // doc_len documents, the
    last one holding the remainder; attention stays inside each document, RoPE positions
    restart and no label crosses a boundary. None: one unpacked sequence"""
    keep_blocks: int | None = None
    """with a stack that keeps the attention (``alst-attn``, ``alst-attn-host``,
    ``long-attn-host``) or whole blocks (``alst-block``): how many blocks keep it, the last ones
    (``harness.model.kept_blocks``); the others recompute it. None: every block"""
    global_rope_table: bool = False
    """hold the paper's TorchTitan RoPE table on every rank for the run
    (``harness.model.global_rope_table``): complex64 (seq_len, head_dim / 2), every position of
    the global sequence, 512 bytes a token at head_dim 128, as TorchTitan keeps it (the paper's
    runs of every method but DeepSpeed's FPDT). Memory only: the methods compute their RoPE from
    their own positions either way"""
    extra: dict = field(default_factory=dict, compare=False, hash=False)
    """free-form labels carried into the row (e.g. the sweep's ``rep``); not part of the id"""

    def __post_init__(self):
        if not isinstance(self.options, Mapping):
            raise ValueError(f"options must be a mapping of option names to values, got "
                             f"{self.options!r}")
        # None is "unset", as a flag not given: dropped, so the two are one cell
        kept = {k: v for k, v in self.options.items() if v is not None}
        object.__setattr__(self, "options", Options(kept))

    def option(self, name: str):
        """The value this cell sets for the method's option ``name``, else None (the method's
        default)."""
        return self.options.get(name)

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
        check_independent_of_method(seq_len=self.seq_len, nproc=self.nproc, dtype=self.dtype,
                                    kernel=self.kernel)
        if self.dp < 1:
            raise ValueError(f"dp must be >= 1, got {self.dp}")
        if self.warmup < 0 or self.iters < 0:
            raise ValueError(f"warmup and iters must be >= 0, got {self.warmup}, {self.iters}")
        # NaN fails every comparison, so it is refused too (it ran every step, then failed
        # turning the budget into bytes); no budget is None, not inf
        if self.budget_mib is not None and not (0 < self.budget_mib < math.inf):
            raise ValueError(f"budget_mib must be a positive, finite number of MiB, got "
                             f"{self.budget_mib}")
        if self.ring_degree < 1:
            raise ValueError(f"ring_degree must be >= 1, got {self.ring_degree}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {list(WORKLOADS)}, got {self.workload!r}")
        if self.dp != 1 and self.workload != "step":
            # one attention layer has no gradient to average: its replicas would not interact
            raise ValueError(f"dp must be 1 for the {self.workload!r} workload (data parallelism "
                             f"applies to the training step), got {self.dp}")
        if self.keep_blocks is not None:
            self._check_keep_blocks(model.n_layers)
        if not isinstance(self.global_rope_table, bool):
            raise ValueError(f"global_rope_table must be true or false, got "
                             f"{self.global_rope_table!r}")
        if self.global_rope_table and self.workload != "step":
            raise ValueError(f"global_rope_table needs the 'step' workload (the table belongs "
                             f"to the model, not to one attention layer), got {self.workload!r}")
        cls = get_method(self.method)
        self._check_documents(cls)
        check_options(self.method, dict(self.options))
        cls.check_config(model.n_heads, model.n_kv_heads, cp=self.nproc,
                         ring_degree=self.ring_degree, seq_len=self.seq_len, **self.options)
        return model

    def _check_keep_blocks(self, n_layers: int) -> None:
        """keep_blocks: an int from 1 to the model's layers, on a stack that keeps the
        attention or whole blocks (elsewhere no block keeps anything)."""
        if not (STACKS[self.stack].keep_attention or STACKS[self.stack].keep_block):
            keeping = [name for name, s in STACKS.items() if s.keep_attention or s.keep_block]
            raise ValueError(f"keep_blocks needs a stack that keeps the attention or whole "
                             f"blocks ({keeping}), got stack {self.stack!r}")
        if (isinstance(self.keep_blocks, bool) or not isinstance(self.keep_blocks, int)
                or not 1 <= self.keep_blocks <= n_layers):
            raise ValueError(f"keep_blocks must be an int from 1 to the model's {n_layers} "
                             f"layers, got {self.keep_blocks!r}")

    def _check_documents(self, cls: type) -> None:
        """doc_len: 2 <= doc_len <= seq_len (doc_len == seq_len is one document, which runs
        the unpacked path), and a method that masks documents."""
        if self.doc_len is None:
            return
        if not 2 <= self.doc_len <= self.seq_len:
            # the loss is a mean over the target tokens, seq_len less one per document: at
            # doc_len 1 there are none, and the run would fail only after launching
            raise ValueError(f"doc_len must be between 2 and seq_len ({self.seq_len}) tokens, "
                             f"got {self.doc_len}: a document's last token has no target, so "
                             "it needs 2 tokens to train on one")
        refused = getattr(cls, "documents_unsupported", None)
        if refused:
            raise ValueError(f"doc_len (packed documents) is not supported by {self.method!r}: "
                             f"{refused}")

    @property
    def world(self) -> int:
        """Ranks of the job: dp x nproc (what is launched, emulated and FSDP-sharded over)."""
        return self.dp * self.nproc

    def to_dict(self) -> dict:
        """The flat dict form: every field but ``options``, and the options beside them. The
        options that were fields once (``COMMITTED_COLUMNS``) are always there, null when
        unset, at the places committed cell.json files have them; later ones follow when
        set."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name != "options"}
        d["overrides"] = [list(kv) for kv in self.overrides]
        d["extra"] = dict(self.extra)
        d |= {name: self.option(name) for name in COMMITTED_COLUMNS}
        ordered = {k: d.pop(k) for k in _DICT_ORDER}
        extra = ordered.pop("extra")
        later = {k: v for k, v in self.options.items() if k not in ordered}
        return ordered | d | later | {"extra": extra}

    @classmethod
    def from_dict(cls, d: dict) -> Cell:
        """A cell from its dict form: the keys that are fields are fields, the others the
        method's options (``validate`` names one the method does not take)."""
        names = {f.name for f in dataclasses.fields(cls)}
        fields_ = {k: v for k, v in d.items() if k in names and k != "options"}
        options = dict(d.get("options") or {}) | {k: v for k, v in d.items() if k not in names}
        fields_["overrides"] = tuple(tuple(kv) for kv in d.get("overrides", ()))
        return cls(**fields_, options=options)

    def option_marks(self) -> list[str]:
        """The short marks of the options this cell sets (``U8``, ``c64K``, ``ov``), in the
        order its method declares them; one it does not take (an invalid cell's) after, marked
        as a method that does take it marks it."""
        own = declared(self.method) if self.method in available_methods() else {}
        others = every_option()
        order = [k for k in own if k in self.options] + [k for k in self.options if k not in own]
        out = []
        for k in order:
            opt = own.get(k) or next(iter(others.get(k, {}).values()), None)
            out.append(mark(opt, self.options[k]) if opt else f"{k}{self.options[k]}")
        return out

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
        for name in COMMITTED_COLUMNS:  # unset: in the hash as null only where it always was
            if d[name] is None and name not in HASHED_UNSET:
                d.pop(name)
        digest = hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:8]
        r = "" if self.ring_degree == 1 else f"-R{self.ring_degree}"
        opts = "".join(f"-{m}" for m in self.option_marks())
        rep = f"-r{self.extra['rep']}" if "rep" in self.extra else ""
        scope = "" if self.workload == "step" else f"-{self.workload}"
        dp = "" if self.dp == 1 else f"-D{self.dp}"
        docs = "" if self.doc_len is None else f"-d{format_size(self.doc_len)}"
        keep = "" if self.keep_blocks is None else f"-k{self.keep_blocks}"
        rope = "-rope" if self.global_rope_table else ""
        return (f"{self.method}{r}{opts}-{self.model}-{format_size(self.seq_len)}{docs}"
                f"-p{self.nproc}{dp}-{self.stack}{keep}{rope}-{self.dtype}{scope}{rep}-{digest}")


# What a cell runs: a training step of the whole model, or one attention layer (forward and
# backward), the benchmark of one method's attention alone.
WORKLOADS = ("step", "attention")

# Cell fields added after the first committed results, with their defaults: they enter a cell's
# id only when they differ from these (see cell_id), so ids stay stable as fields are added.
_LATER_FIELDS = {"ring_degree": 1, "workload": "step", "dp": 1, "doc_len": None,
                 "keep_blocks": None, "global_rope_table": False}
# The key order of a cell's dict form, as committed cell.json files have it (the options that
# were fields at their places; the dict is also a row's first columns).
_DICT_ORDER = ("method", "model", "seq_len", "nproc", "stack", "heads_per_stage", "ring_degree",
               "chunk_size", "dtype", "kernel", "overrides", "budget_mib", "warmup", "iters",
               "lr", "seed", "workload", "dp", "doc_len", "overlap", "keep_blocks",
               "global_rope_table", "extra")


def check_independent_of_method(*, seq_len: int, nproc: int, dtype: str, kernel: str,
                                nproc_is: str = "nproc") -> None:
    """Raise ValueError naming the field and the rule for what a cell must be whatever its
    method: ``Cell.validate`` checks it, and ``plan`` once up front for all the methods it
    tries (``nproc_is``: what the message calls the CP degree)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if nproc < 1:
        raise ValueError(f"{nproc_is} must be >= 1, got {nproc}")
    if seq_len < 2 or seq_len % nproc:
        raise ValueError(f"seq_len ({seq_len}) must be >= 2 and divisible by {nproc_is} "
                         f"({nproc})")
    check_kernel(kernel)
