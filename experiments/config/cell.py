"""The benchmark cell: everything one measured or emulated run is, frozen and self-validating.

Everything a cell runs is one frozen, self-validating ``Cell``
(docs/conventions.md#one-frozen-cell): method, model preset (+ overrides), sequence length, ranks,
stack, heads per stage, dtype, kernel, budget. Validation names the offending field and the rule and
happens before any process starts, so a sweep's dry run checks every cell and no rank ever hangs on
bad input.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
from dataclasses import dataclass, field

from experiments.config.model import ModelConfig, resolve_model
from experiments.config.sizes import format_size
from experiments.config.stack import DTYPES, STACKS
from upipe.kernels import check_kernel
from upipe.registry import available_methods, get_method


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
    overlap: bool | None = None
    """upipe: run the stages' all-to-alls beside the neighbouring stages' attention kernels
    (``upipe.untied``); None: the method's default"""
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
        check_independent_of_method(seq_len=self.seq_len, nproc=self.nproc, dtype=self.dtype,
                                    kernel=self.kernel)
        if self.dp < 1:
            raise ValueError(f"dp must be >= 1, got {self.dp}")
        if self.warmup < 0 or self.iters < 0:
            raise ValueError(f"warmup and iters must be >= 0, got {self.warmup}, {self.iters}")
        if self.budget_mib is not None and self.budget_mib <= 0:
            raise ValueError(f"budget_mib must be positive, got {self.budget_mib}")
        if self.ring_degree < 1:
            raise ValueError(f"ring_degree must be >= 1, got {self.ring_degree}")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {self.chunk_size}")
        if self.heads_per_stage is not None and self.heads_per_stage < 1:
            raise ValueError(f"heads_per_stage must be positive, got {self.heads_per_stage}")
        if self.overlap is not None and not isinstance(self.overlap, bool):
            raise ValueError(f"overlap must be true, false or unset, got {self.overlap!r}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {list(WORKLOADS)}, got {self.workload!r}")
        if self.dp != 1 and self.workload != "step":
            # one attention layer has no gradient to average: its replicas would not interact
            raise ValueError(f"dp must be 1 for the {self.workload!r} workload (data parallelism "
                             f"applies to the training step), got {self.dp}")
        cls = get_method(self.method)
        self._check_documents(cls)
        options = self.method_options()
        for name in options:
            if not takes_option(cls, name):
                takers = [m for m in available_methods() if takes_option(get_method(m), name)]
                raise ValueError(f"{name} applies to {', '.join(takers) or 'no registered method'}"
                                 f" only, not {self.method!r}")
        cls.check_config(model.n_heads, model.n_kv_heads, cp=self.nproc,
                         ring_degree=self.ring_degree, seq_len=self.seq_len, **options)
        return model

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
        scope = "" if self.workload == "step" else f"-{self.workload}"
        dp = "" if self.dp == 1 else f"-D{self.dp}"
        docs = "" if self.doc_len is None else f"-d{format_size(self.doc_len)}"
        ov = {None: "", True: "-ov", False: "-noov"}[self.overlap]
        return (f"{self.method}{u}{r}{c}{ov}-{self.model}-{format_size(self.seq_len)}{docs}"
                f"-p{self.nproc}{dp}-{self.stack}-{self.dtype}{scope}{rep}-{digest}")


# Method-specific constructor options a cell can set; each applies to the methods whose
# constructor takes a keyword of that name.
METHOD_OPTIONS = ("heads_per_stage", "chunk_size", "overlap")

# What a cell runs: a training step of the whole model, or one attention layer (forward and
# backward), the benchmark of one method's attention alone.
WORKLOADS = ("step", "attention")

# Cell fields added after the first committed results, with their defaults: they enter a cell's
# id only when they differ from these (see cell_id), so ids stay stable as fields are added.
_LATER_FIELDS = {"ring_degree": 1, "chunk_size": None, "workload": "step", "dp": 1,
                 "doc_len": None, "overlap": None}


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


def takes_option(method_cls: type, name: str) -> bool:
    """Whether the method's constructor accepts the keyword ``name`` (e.g. heads_per_stage)."""
    return name in inspect.signature(method_cls).parameters
