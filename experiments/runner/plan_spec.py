"""The planning question and the configurations it weighs (``upipe-bench plan``, run by
``runner.plan``): the stack levels the plan walks (``LADDER``; UPipe's ``long`` level; the
levels keeping the attention in host memory or whole blocks on the device), the question
itself (``PlanSpec``), and every valid method x mesh x U it expands to
(``configurations``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from experiments.config import Cell, Status, resolve_model
from experiments.config.cell import check_independent_of_method
from experiments.config.options import declared
from experiments.harness.launch import unrun
from upipe.registry import available_methods, get_method

# stack -> the lighter levels (less on the device) that must fit before it is worth emulating
LADDER: dict[str, tuple[str, ...]] = {
    "alst": (), "offload": ("alst",), "native": ("alst",), "ac": ("offload", "native"),
    "none": ("ac",),
    # more offloaded than alst but their MLP untiled: neither bounds the other, emulated alone
    "megatron-ds": (), "torchtitan": (),
    # selective recomputation (issue 34): alst keeping the attention's saved tensors, on the
    # device or in host memory. Either holds on the device what alst holds and more (the
    # attention's backward needs its saved tensors back on the device, and the MLP's recompute
    # is alst's), so alst over the device rules both out.
    "alst-attn": ("alst",), "alst-attn-host": ("alst",),
    # whole blocks un-checkpointed: every tensor alst's recompute would make again stays on the
    # device, so alst over the device rules it out too
    "alst-block": ("alst",),
}

# Beyond the paper: the ``long`` level (config.stack) with UPipe's chunked attention backward,
# what takes UPipe to 8M tokens on one 8-GPU node
# (docs/results.md#one-node-to-8m-tokens-beyond-the-paper). Planned as one more UPipe
# configuration (plain Ulysses mesh, default U), on that level only: its fused
# input norm is UPipe's, and the other methods gain little from the level's other mechanisms.
LONG = "long"
LONG_CHUNK = 2**16  # tokens per chunk of the backward: FPDT's chunk in the paper's FPDT runs

# Selective levels that keep the attention in host memory -> the level they are otherwise (the
# same blocks recomputing their attention). Where keeping it in every block is over the host
# budget only, the plan adds the configuration keeping it in as many blocks as the host holds
# (``host_keep_blocks``), the fastest by estimate emulated exactly (the fit cannot mix blocks,
# ``fit.fit_refusal``; ``plan``).
KEEP_ON_HOST = {"alst-attn-host": "alst", "long-attn-host": LONG}
# Levels that keep whole blocks on the device -> the level they are otherwise. Where keeping
# every block is over the device budget while the level without keeping fits, the plan adds
# the configuration keeping as many of the last blocks as the device holds by estimate
# (``device_keep_blocks``), emulated exactly as the host's are.
KEEP_ON_DEVICE = {"alst-block": "alst"}

# by default the stacks a user chooses between; megatron-ds and torchtitan reproduce the
# paper's FPDT (DeepSpeed's on Megatron-DeepSpeed) and PyTorch-CP runs and are planned when
# asked for by name
PAPER_ONLY_STACKS = ("megatron-ds", "torchtitan")
# Selective recomputation's levels are planned by default
# (docs/results.md#memory-into-speed-selective-recomputation-beyond-the-paper): the fastest
# configuration that trains is often one of them (Llama3-8B on 8 GPUs at 4M: UPipe keeping the
# attention in host memory in 11 blocks, 7% above the fastest on alst). Measured on 2 cores
# with two workers (docs/emulation.md#the-planner), that plan took 11:17 and 1,302 CPU-s, of
# which the rows of these levels (alst-attn, alst-attn-host, alst-block, long-attn-host) 727
# CPU-s; ``--stacks`` without them plans the rest.
DEFAULT_STACKS = tuple(s for s in LADDER if s not in PAPER_ONLY_STACKS) + (
    LONG, "long-attn-host")


@dataclass(frozen=True)
class PlanSpec:
    """One planning question: a model, a cluster size and a sequence length."""

    model: str
    """preset name (the model's shape; a config.json arrives as ``overrides`` of a preset)"""
    gpus: int
    """GPUs in the job: dp x the CP degree (FSDP2 shards over all of them)"""
    seq_len: int
    """tokens of one sequence (each dp replica trains its own)"""
    overrides: tuple[tuple[str, str], ...] = ()
    dtype: str = "bf16"
    kernel: str = "auto"
    methods: tuple[str, ...] | None = None
    """None: every registered method"""
    stacks: tuple[str, ...] = DEFAULT_STACKS
    """the memory stacks to plan on"""
    ring_degrees: tuple[int, ...] | None = None
    """the hybrids' ring degrees to plan (each divides the CP degree); None: every divisor.
    Methods without a mesh (``supports_mesh`` false) have one layout and are planned as
    ever"""
    label: str = ""
    """what the model is called in the rows (a config.json's path; default the preset)"""
    extra: dict = field(default_factory=dict, compare=False)
    dp: int = 1
    """data-parallel replicas, each training its own sequence of ``seq_len``; CP degree =
    gpus / dp"""

    @property
    def cp(self) -> int:
        """The CP degree of every configuration: the GPUs over the dp replicas."""
        return self.gpus // self.dp

    def validate(self) -> None:
        """Raise ValueError naming the field and the rule: the question's own, and the rules a
        cell obeys whatever its method (which would otherwise make every method's row
        ``invalid`` for the same reason)."""
        resolve_model(self.model, self.overrides)
        if self.gpus < 1:
            raise ValueError(f"gpus must be >= 1, got {self.gpus}")
        if self.dp < 1 or self.gpus % self.dp:
            raise ValueError(f"dp must be >= 1 and divide gpus ({self.gpus}), got {self.dp}")
        check_independent_of_method(seq_len=self.seq_len, nproc=self.cp, dtype=self.dtype,
                                    kernel=self.kernel, nproc_is="the CP degree")
        for name in ("methods", "stacks", "ring_degrees"):
            # a repeated method would be planned twice (the same configurations, twice the
            # work); repeated levels or ring degrees change nothing, and are refused alike
            values = list(getattr(self, name) or ())
            repeated = [v for i, v in enumerate(values) if v in values[:i]]
            if repeated:
                raise ValueError(f"{name} must name each once, got {values} "
                                 f"({', '.join(map(str, repeated))} repeated)")
        unknown = [m for m in self.methods or () if m not in available_methods()]
        if unknown:
            raise ValueError(f"methods must be among {available_methods()}, got {unknown}")
        known = [*LADDER, LONG, "long-attn-host"]
        bad = [s for s in self.stacks if s not in known]
        if bad:
            raise ValueError(f"stacks must be among {known}, got {bad}")
        if self.ring_degrees is not None:
            bad_rings = [r for r in self.ring_degrees if r < 1 or self.cp % r]
            if bad_rings or not self.ring_degrees:
                raise ValueError(f"ring_degrees must be divisors of the CP degree ({self.cp}), "
                                 f"got {list(self.ring_degrees)}")


def _meshes(method: str, cp: int, rings: tuple[int, ...] | None = None) -> list[int]:
    """Ring degrees a method can use on a CP group of ``cp`` ranks (1 for the non-hybrids),
    among ``rings`` when given (``PlanSpec.ring_degrees``)."""
    if not get_method(method).supports_mesh:
        return [1]
    return [r for r in range(1, cp + 1) if cp % r == 0 and (rings is None or r in rings)]


def _variants(spec: PlanSpec, method: str) -> list[Cell]:
    """The method's valid (mesh, U) configurations on the alst stack (invalid ones dropped:
    their rule is the method's, not the cluster's)."""
    cfg = resolve_model(spec.model, spec.overrides)
    cells = []
    for ring in _meshes(method, spec.cp, spec.ring_degrees):
        own = declared(method)
        us = [None]
        if "heads_per_stage" in own:
            uly = spec.cp // ring
            us = list(range(uly, cfg.n_heads + 1, uly))
            if not us:  # more Ulysses ranks than heads: no U on this mesh (us[0] below)
                continue
        options = [{"heads_per_stage": u} for u in us]
        if "overlap" in own and ring == 1 and spec.cp > 1:
            options.append({"heads_per_stage": us[0], "overlap": True})
        if getattr(get_method(method), "fuses_input_norm", False) and ring == 1 and (
                LONG in spec.stacks or "long-attn-host" in spec.stacks):
            options.append({"heads_per_stage": us[0], "chunk_size": LONG_CHUNK, "stack": LONG})
        for opts in options:
            stack = opts.pop("stack", "alst")
            cell = Cell(method=method, model=spec.model, overrides=spec.overrides,
                        seq_len=spec.seq_len, nproc=spec.cp, dp=spec.dp, ring_degree=ring,
                        dtype=spec.dtype, kernel=spec.kernel, stack=stack, options=opts,
                        extra={"plan_model": spec.label or spec.model})
            try:
                cell.validate()
            except ValueError:
                continue
            cells.append(cell)
    return cells


def configurations(spec: PlanSpec) -> tuple[list[Cell], list[dict]]:
    """(the alst cell of every valid method x mesh x U, rows of the methods that have no valid
    configuration on this cluster with the first rule each breaks, or none on the levels asked:
    only the long levels, which are UPipe's)."""
    spec.validate()
    cells, invalid = [], []
    ladder = any(s in LADDER for s in spec.stacks)  # else only the long levels: UPipe's variant
    for method in spec.methods or available_methods():
        variants = _variants(spec, method)
        planned = [c for c in variants if ladder or c.stack == LONG]
        if planned:
            cells += planned
            continue
        if variants:  # valid, but on no level asked: a row that says so, not silence
            cell = Cell.from_dict(variants[0].to_dict() | {"stack": spec.stacks[0]})
            invalid.append(unrun(cell, None, Status.SKIPPED, _not_on_long(spec, method),
                                 "emulated"))
            continue
        cell = Cell(method=method, model=spec.model, overrides=spec.overrides, dp=spec.dp,
                    seq_len=spec.seq_len, nproc=spec.cp, dtype=spec.dtype, kernel=spec.kernel,
                    stack="alst", extra={"plan_model": spec.label or spec.model})
        try:
            cell.validate()
            reason = "no valid mesh or heads per stage"
        except ValueError as e:
            reason = str(e)
        invalid.append(unrun(cell, None, Status.INVALID, reason, "emulated"))
    return cells, invalid


def _not_on_long(spec: PlanSpec, method: str) -> str:
    """Why ``method``, valid on the cluster, has no configuration on the levels asked (only the
    long ones): another method is not planned there; UPipe is, on the plain Ulysses mesh only,
    so for it the reason is ``--ring-degrees`` leaving that mesh out."""
    levels = " and ".join(spec.stacks)
    if getattr(get_method(method), "fuses_input_norm", False) and spec.ring_degrees is not None \
            and 1 not in spec.ring_degrees:
        rings = ",".join(map(str, spec.ring_degrees))
        return (f"{levels}: planned on the plain Ulysses mesh (ring degree 1) only, which "
                f"--ring-degrees {rings} leaves out; add 1 to --ring-degrees, or another "
                "--stacks level")
    return (f"{levels}: planned for UPipe only (its fused input norm, on a plain Ulysses "
            "mesh); add another --stacks level for this method, or emulate it there with "
            "'upipe-bench emulate --stack'")
