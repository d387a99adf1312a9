"""What fits on a cluster, and how fast (docs/design.md#the-time-model): ``upipe-bench plan``.

Every configuration a cluster of ``gpus`` GPUs can run a model with at one sequence length:
each registered method, on each stack level, with each valid mesh (hybrids: ring degree x
Ulysses degree) and, for UPipe, each valid number of heads per stage U, and its overlapped
stages (``overlap=True``: faster where the all-to-alls show, one more stage's all-to-all
buffers) on the plain Ulysses mesh at the default U (the Ulysses degree): the trade-off shows
there, and a variant per mesh and U would add as many UPipe fits again to every plan; and,
beyond the paper, UPipe on the ``long`` level with its chunked backward (``LONG``) at the same
mesh and U; each emulated on the
hardware (memory and time, ``emulation.emulate_cell``) and ranked: the configurations that fit
first, fastest first (tokens/s per GPU), then those that do not fit (and why: device or host),
then those that cannot be emulated here.

The stack levels form a ladder in device memory (``config.stack``): alst keeps the least on
the device, then offload and native, then ac, then none (each adds back what a lighter level
moves off the device or never materialises). A configuration is emulated on alst first; a
heavier level is not emulated when a lighter level below it on the ladder is over the device
budget: its row says which one (status ``skipped``). A heavier level is first checked against
the device by a lower bound on its peak where that is cheap (``emulation.device_lower_bound``:
a few layers emulated exactly at the full length; a row over the device by it says "at least"),
then emulated for its memory; only what fits is emulated again with its work counted, for its
time (so those that do not fit have no time). Every fit first bounds the device peak from its
4-layer samples (``emulate_cell(bound_first=True)``): a configuration over the device by that
bound is not fitted further and has no time either. Emulations run in ``workers`` processes.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import json
import multiprocessing
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from experiments.config import STACKS, Cell, Hardware, Status, resolve_model
from experiments.config.cell import check_independent_of_method
from experiments.config.hardware import RESERVE_SOURCE
from experiments.config.options import declared
from experiments.emulation.emulate import device_lower_bound, emulate_cell, kernel_column
from experiments.emulation.fit import sequence_chunk
from experiments.harness.launch import unrun
from experiments.harness.model import block_offloads, kept_blocks
from experiments.timing.profile import profile_for
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


def _over_device(row: dict) -> bool:
    """Whether a row is over the device budget: emulated so (not: over the host budget only,
    or not emulated for another reason), or left out because a lighter level was."""
    return ("plan_inferred_from" in row
            or row["status"] == Status.OOM and "device peak" in row.get("error", ""))


def _over_device_emulated(row: dict) -> bool:
    """Whether a row was emulated (with its time) and is over the device budget."""
    return (row["status"] == Status.OOM and "device peak" in (row.get("error") or "")
            and "plan_inferred_from" not in row)


def _over_host_only(row: dict) -> bool:
    """Whether an emulated row is over the host budget and not over the device's."""
    error = row.get("error") or ""
    return row["status"] == Status.OOM and "host peak" in error and "device peak" not in error


def host_keep_blocks(light: dict, full: dict, cell: Cell, hw: Hardware) -> int | None:
    """The most blocks that can keep their attention within the host budget, below the model's
    depth, on ``cell``'s level (one of ``KEEP_ON_HOST``); None when not even one can.

    ``light`` is the configuration's row on the level that recomputes every attention, ``full``
    its row keeping it in every block. The kept blocks are the last ones
    (``harness.model.kept_blocks``): the last keeps its tensors on the device (it does not
    offload) and every further one sends the same bytes to the host as each offloading block of
    ``full`` does, so the host peak is ``light``'s plus that share per kept offloading block:
    exactly affine (tests/test_selective_recompute.py checks it against exact emulations)."""
    n = cell.validate().n_layers
    stack = STACKS[cell.stack]
    offloading = [i for i in range(n) if block_offloads(stack, i, n)]
    if not stack.keep_on_host or not offloading:
        return None
    per_block = (full["peak_host_bytes"] - light["peak_host_bytes"]) / len(offloading)
    room = hw.host_budget(cell.world) - light["peak_host_bytes"]
    if room < 0 or per_block <= 0:
        return None
    best = None
    for k in range(1, n):
        if sum(block_offloads(stack, i, n) for i in kept_blocks(n, True, k)) * per_block > room:
            break
        best = k
    return best


def device_keep_blocks(light: dict, full: dict, cell: Cell, hw: Hardware) -> int | None:
    """How many of the last blocks may run un-checkpointed within the device budget, below the
    model's depth, on ``cell``'s level (one of ``KEEP_ON_DEVICE``), by estimate; None when the
    level without keeping (``light``) leaves no room or keeping adds nothing.

    ``light`` is the configuration's row recomputing every block, ``full`` its row keeping
    every one. The estimate is the chord between their device peaks: k = room / ((full -
    light) / N), at least 1. The device peak does not grow faster than that chord (exact
    emulations of tiny, tests/test_selective_recompute.py, and of every partial cell of the
    selective sweeps, tests/test_selective_table.py): the last block keeps its tensors only
    until its own backward, the first of the step's, so it adds least, and each further
    middle block adds the same bytes. Unlike the host's rule this is an estimate: the plan
    emulates the configuration it picks exactly (``_partial_rows``), so a k that does not fit
    is a row over the budget, not a wrong one."""
    n = cell.validate().n_layers
    room = hw.device_budget(cell) - light["peak_device_bytes"]
    per_block = (full["peak_device_bytes"] - light["peak_device_bytes"]) / n
    if room < 0 or per_block <= 0:
        return None
    return max(1, min(n - 1, int(room // per_block)))


def _keep_row(cell: Cell, light: dict, hw: Hardware, exact: bool) -> dict:
    """``cell`` (a level of ``KEEP_ON_HOST``) keeping the attention in every block: its row,
    timed even when it is over the host budget only (``partial_candidates`` interpolates its
    time). Not emulated when ``light`` (the level without keeping) is over the device: keeping
    holds more on it."""
    if _over_device(light):
        row = unrun(cell, None, Status.SKIPPED, f"not emulated: the {light['stack']} stack keeps "
                    "less on the device and does not fit it either", "emulated")
        row["plan_inferred_from"] = light["stack"]
        return row | kernel_column(cell, cell.validate(), hw)
    return emulate_cell(cell, hw, exact=exact, bound_first=True)


@dataclass(frozen=True)
class _Candidate:
    """A configuration keeping the attention (whole blocks) in its last blocks only, with what
    its estimate came from (``partial_candidates``)."""

    tokens: float
    """estimated tokens/s per GPU"""
    cell: Cell
    """on its level of ``KEEP_ON_HOST`` or ``KEEP_ON_DEVICE``, with ``keep_blocks``"""
    estimate: str
    """the estimate in words, for a row that is not emulated"""
    light: dict
    """its row on the level without keeping"""
    full: dict
    """its row keeping every block"""


def _candidate(cell: Cell, light: dict, full: dict, k: int, after: str = "") -> _Candidate:
    """``cell`` keeping ``k`` blocks, its step time interpolated between ``light``'s and
    ``full``'s by the share of blocks kept (``partial_candidates``); ``after`` ends the
    estimate's wording."""
    n = cell.validate().n_layers
    step = light["step_time_s"] - k / n * (light["step_time_s"] - full["step_time_s"])
    tokens = cell.dp * cell.seq_len / cell.world / step
    lighter = (KEEP_ON_HOST | KEEP_ON_DEVICE)[cell.stack]
    return _Candidate(tokens, Cell.from_dict(cell.to_dict() | {"keep_blocks": k}),
                      f"{tokens:.4g} tokens/s per GPU by interpolating the step time between "
                      f"{lighter} and {cell.stack}{after}", light, full)


def _candidates(configs: list[tuple[Cell, list[dict]]], hw: Hardware) -> list[_Candidate]:
    """``partial_candidates``, each with the rows its estimate came from."""
    out = []
    for config, rows in configs:
        by_stack = {r["stack"]: r for r in rows}
        for stack, lighter in (KEEP_ON_HOST | KEEP_ON_DEVICE).items():
            full, light = by_stack.get(stack), by_stack.get(lighter)
            on_host = stack in KEEP_ON_HOST
            if (full is None or light is None or light["status"] != Status.OK
                    or not (_over_host_only(full) if on_host else _over_device_emulated(full))
                    or not full.get("step_time_s")):
                continue
            cell = Cell.from_dict(config.to_dict() | {"stack": stack})
            k = (host_keep_blocks if on_host else device_keep_blocks)(light, full, cell, hw)
            if k is not None:
                out.append(_candidate(cell, light, full, k))
    return out


def partial_candidates(configs: list[tuple[Cell, list[dict]]],
                       hw: Hardware) -> list[tuple[float, Cell, str]]:
    """(estimated tokens/s per GPU, cell, the estimate's wording) of every configuration (its
    cell and rows, ``plan_configuration``'s) whose level of ``KEEP_ON_HOST`` is over the host
    budget only while its level without keeping fits: kept in the last ``host_keep_blocks``
    blocks; likewise a level of ``KEEP_ON_DEVICE`` over the device, in the last
    ``device_keep_blocks``. The estimate interpolates the step time between the two levels' by
    the share of blocks kept, as each kept block skips the same recompute (exact emulations of tiny,
    tests/test_selective_recompute.py; Llama3-8B on 8 GPUs, the six cells of
    results/selective_recompute_llama3_8b_h100x8-emulated from 1M to 5M: within 0.12% of their
    exact emulations); it only chooses which to emulate."""
    return [(c.tokens, c.cell, c.estimate) for c in _candidates(configs, hw)]


def _fewer_blocks(cand: _Candidate, row: dict, hw: Hardware) -> _Candidate | None:
    """The configuration of ``cand`` keeping fewer blocks, after its exact emulation (``row``)
    came back over a budget; None below one block. Over the device, k is read again from the
    secant through the exact peak (the chord's k was an estimate: ``device_keep_blocks``),
    at most k - 1; over the host (whose rule is exact: not expected), k - 1."""
    k = cand.cell.keep_blocks
    fewer = k - 1
    on_device = _over_device_emulated(row)
    light_peak = cand.light.get("peak_device_bytes")
    if on_device and row.get("peak_device_bytes") and light_peak is not None:
        per_block = (row["peak_device_bytes"] - light_peak) / k
        if per_block > 0:
            room = hw.device_budget(cand.cell) - light_peak
            fewer = min(fewer, int(room // per_block))
    if fewer < 1:
        return None
    level = "device" if on_device else "host"
    return _candidate(cand.cell, cand.light, cand.full, fewer,
                      f" (k{k} was over the {level} budget when emulated)")


def plan_configuration(alst: Cell, hw: Hardware, stacks: tuple[str, ...],
                       exact: bool = False, over: dict[str, int] | None = None) -> list[dict]:
    """Rows of one configuration on each stack of ``stacks``, walking the ladder (see the
    module): a level is emulated unless a lighter level it depends on is over the device.
    ``over``: stack -> a smaller number of UPipe heads per stage already over the device on that
    stack (``_over_by_u``): this configuration is too, on it. A configuration on the ``long``
    level (UPipe's variant) is emulated on that level and, when asked, on ``long-attn-host``.
    A level keeping the attention in host memory is timed even when it is over the host budget
    only (``_keep_row``): ``plan`` may then keep it in some blocks (``partial_candidates``)."""
    if alst.stack == LONG:
        light = emulate_cell(alst, hw, exact=exact, bound_first=True)
        if "long-attn-host" not in stacks:
            return [light]
        keep = Cell.from_dict(alst.to_dict() | {"stack": "long-attn-host"})
        return [light, _keep_row(keep, light, hw, exact)]  # long's row too: the plan pairs them
    rows: dict[str, dict] = {}
    for stack in LADDER:  # lightest first
        if stack not in stacks:
            continue
        cell = Cell.from_dict(alst.to_dict() | {"stack": stack})
        blocking = [s for s in LADDER[stack] if s in rows and _over_device(rows[s])]
        if stack in (over or {}):
            also = ", as overlapped stages do" if alst.option("overlap") else ""
            rows[stack] = unrun(cell, None, Status.SKIPPED,
                                f"not emulated: {over[stack]} heads per stage do not fit the "
                                "device on this stack and mesh, and more heads per stage keep "
                                f"more on it{also}", "emulated")
            rows[stack]["plan_inferred_from"] = f"heads_per_stage={over[stack]}"
            rows[stack] |= kernel_column(cell, cell.validate(), hw)
        elif blocking:
            rows[stack] = unrun(cell, None, Status.SKIPPED,
                                f"not emulated: the {blocking[0]} stack keeps less on the device "
                                "and does not fit it either", "emulated")
            rows[stack]["plan_inferred_from"] = blocking[0]
            rows[stack] |= kernel_column(cell, cell.validate(), hw)
        elif stack == "alst":  # the level most likely to fit: its memory and time at once
            rows[stack] = emulate_cell(cell, hw, exact=exact, bound_first=True)
        elif stack in KEEP_ON_HOST and KEEP_ON_HOST[stack] in rows:
            rows[stack] = _keep_row(cell, rows[KEEP_ON_HOST[stack]], hw, exact)
        elif stack in KEEP_ON_DEVICE:
            # memory and time even over the device: partial_candidates interpolates its time
            rows[stack] = emulate_cell(cell, hw, exact=exact)
        else:
            # over the device by a lower bound (one short exact step, where that is cheap), or
            # memory first (no work counted: three dispatch layers fewer per op); the time of
            # what fits only
            row = None if exact else device_lower_bound(cell, hw)
            if row is None:
                row = emulate_cell(cell, hw, exact=exact, count=False, bound_first=True)
            if row["status"] == Status.OK:
                row = emulate_cell(cell, hw, exact=exact)
            rows[stack] = row
    return list(rows.values())


def _order(row: dict) -> tuple:
    status = row["status"]
    if status == Status.OK:
        return (0, -(row.get("tokens_per_s_per_gpu") or 0.0))
    if status == Status.OOM:
        return (1, row.get("peak_device_bytes") or 0)
    return (2 if status == Status.SKIPPED else 3, 0)


def _identity(row: dict) -> tuple:
    """A row's configuration as a sortable tuple: ``rank``'s tie-break."""
    return (str(row.get("method") or ""), row.get("ring_degree") or 0,
            row.get("heads_per_stage") or 0, bool(row.get("overlap")), str(row.get("stack") or ""),
            row.get("keep_blocks") or 0, row.get("chunk_size") or 0)


def rank(rows: list[dict]) -> list[dict]:
    """Best first: fitting rows by tokens/s per GPU, then rows over a budget by device peak,
    then skipped and invalid ones; rows equal on that (most skipped rows) in the order of their
    configuration (method, ring degree, heads per stage, ...), not in the order they finished:
    the table is the same for any number of workers."""
    return sorted(rows, key=lambda r: (_order(r), _identity(r)))


def _cost(cell: Cell) -> tuple[bool, int, bool]:
    """A configuration's relative emulation cost, to start the longest first (no long tail on
    the last worker). Methods with sequence chunks first: their fits take the most samples (the
    window moves until the chunk loop's regimes settle) and each sample runs every pair of
    chunks (measured, Llama3-8B on 8 GPUs at 4M: ds-fpdt 69 s and fpdt 26 s of emulation over
    their stacks, no other configuration above 20 s); then UPipe's head stages times the ring
    steps each runs. UPipe's overlapped stages right after their blocking twins (last, they
    would leave one worker alone at the end)."""
    stages, u = 1, cell.option("heads_per_stage")
    if u:
        stages = resolve_model(cell.model, cell.overrides).n_heads // u
    return sequence_chunk(cell) is not None, stages * cell.ring_degree, not cell.option("overlap")


def _family(cell: Cell) -> tuple:
    """What configurations that differ only in UPipe's heads per stage share."""
    return (cell.method, cell.ring_degree, cell.option("overlap"), cell.option("chunk_size"),
            cell.stack)


def _over_by_u(cell: Cell, over_at: dict[tuple, int]) -> dict[str, int]:
    """stack -> the smallest heads per stage of ``cell``'s family found over the device on that
    stack, where it is below ``cell``'s. A UPipe stage's buffers (its heads' Q, K, V, output
    and their gradients) grow with the heads it processes and nothing else does, so the peak
    never falls as U grows (tests/test_plan.py checks it on exact emulations). Overlapped stages
    hold one more stage's buffers than the blocking schedule at the same U: where that does not
    fit (at U or below), neither do they."""
    out: dict[str, int] = {}
    for (f, stack), u in over_at.items():
        if _spares(f, u, cell):
            out[stack] = min(u, out.get(stack, u))
    return out


def _spares(family: tuple, u: int | None, cell: Cell) -> bool:
    """Whether a UPipe configuration of ``family`` with ``u`` heads per stage, over the device
    on a stack, rules ``cell`` out on it (``_over_by_u``'s rule): same family and fewer heads
    per stage, or, for overlapped stages, their blocking twin at as many or fewer."""
    u_cell = cell.option("heads_per_stage")
    if not u or not u_cell:
        return False
    twin = (cell.method, cell.ring_degree, None, None, "alst") if cell.option("overlap") else None
    return (family == _family(cell) and u < u_cell) or (family == twin and u <= u_cell)


def _next_startable(pending: list[Cell], running: list[Cell]) -> int | None:
    """The index of the first of ``pending`` that no other pending or running configuration
    could rule out (``_spares``), or None: each waits until those have their rows, so whether
    it is emulated or inferred does not depend on which worker finished first."""
    for i, cell in enumerate(pending):
        others = [*pending[:i], *pending[i + 1:], *running]
        if not any(_spares(_family(o), o.option("heads_per_stage"), cell) for o in others):
            return i
    return None


def _record_over(cell: Cell, rows: list[dict], over_at: dict[tuple, int]) -> None:
    """Note the stacks on which ``cell`` (a UPipe configuration) was emulated over the
    device."""
    u = cell.option("heads_per_stage")
    if not u:
        return
    for row in rows:
        # a level keeping whole blocks is over the device by design wherever keeping them all
        # is: that row is what its candidates keeping some blocks are read from
        # (``partial_candidates``), so a larger U still needs its own, not an inference
        if row["stack"] in KEEP_ON_DEVICE:
            continue
        if _over_device(row) and "plan_inferred_from" not in row:
            key = (_family(cell), row["stack"])
            over_at[key] = min(over_at.get(key, u), u)


def _done(fn, *args) -> concurrent.futures.Future:
    """``fn(*args)`` run here, as a finished future (the serial plan's executor)."""
    f: concurrent.futures.Future = concurrent.futures.Future()
    f.set_result(fn(*args))
    return f


# Memory one plan worker may take: an exact 32-layer Llama3-8B step at 2M tokens, the plan's
# dearest kind of emulation, peaked at 370 MB resident (``/usr/bin/time -v`` on this
# project's 2-core CI machine; the fake tensors hold no data), rounded up to 1 GiB for the
# pool's own processes and headroom.
WORKER_BYTES = 2**30


def default_workers() -> int:
    """The plan's emulations at once by default: one per CPU this process may run on
    (``os.sched_getaffinity``, ``os.cpu_count`` where that does not exist), but no more than
    the machine's physical memory holds at ``WORKER_BYTES`` each."""
    if hasattr(os, "sched_getaffinity"):
        cpus = len(os.sched_getaffinity(0))
    else:
        cpus = os.cpu_count() or 1
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # not POSIX: the CPUs alone decide
        memory = None
    if memory and memory > 0:
        cpus = min(cpus, memory // WORKER_BYTES)
    return max(1, cpus)


def plan(spec: PlanSpec, hw: Hardware, *, workers: int | None = None, exact: bool = False,
         on_rows: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Every configuration of ``spec`` on ``hw``, ranked (``rank``). ``on_rows`` sees each
    configuration's rows as they arrive (progress).

    Configurations start longest first (``_cost``), at most ``workers`` at once (default
    ``default_workers()``: the table is the same for any number), each when a
    worker is free, except that a UPipe configuration waits until the smaller numbers of heads
    per stage of its mesh (and, overlapped, its blocking twin) have their rows
    (``_next_startable``): it is not emulated on a stack where one of them was over the device
    (``_over_by_u``; not on a level of ``KEEP_ON_DEVICE``, over the device by design), whatever
    the number of workers. A method whose measured reserve leaves no device budget is an
    invalid row, not emulated (``_within_reserve``). Then the configurations keeping the
    attention (whole blocks) in as many blocks as the host (the device) holds, on the levels of
    ``KEEP_ON_HOST`` (``KEEP_ON_DEVICE``), fastest estimate first (``partial_candidates``): one
    is emulated exactly (17 s to 8 minutes each at paper scale: its mix of blocks is beyond
    the fit) when no candidate of its method and level has fitted yet and it is above every
    row that fits so far (``_partial_rows``); the others are rows saying their estimate."""
    hw.validate(world=spec.gpus)
    workers = default_workers() if workers is None else workers
    cells, rows = configurations(spec)
    cells, refused = _within_reserve(cells, hw)  # before any emulation, which would raise
    rows += refused
    stacks = tuple(spec.stacks)
    pending = sorted(cells, key=_cost, reverse=True)
    over_at: dict[tuple, int] = {}
    configs: list[tuple[Cell, list[dict]]] = []  # each configuration's cell and rows
    with contextlib.ExitStack() as exits:
        if workers > 1 and len(cells) > 1:
            # spawn: workers start clean (no fake process group or dispatch mode of this one)
            pool = exits.enter_context(concurrent.futures.ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("spawn")))
            submit = pool.submit
        else:
            submit = _done
        running: dict[concurrent.futures.Future, Cell] = {}
        while pending or running:
            while pending and len(running) < max(1, workers):
                i = _next_startable(pending, list(running.values()))
                if i is None and not running:  # a cycle in ``_spares``: never, but never hang
                    raise RuntimeError("plan: every pending configuration waits on another")
                if i is None:  # every pending one waits on a running one
                    break
                cell = pending.pop(i)
                running[submit(plan_configuration, cell, hw, stacks, exact,
                               _over_by_u(cell, over_at))] = cell
            finished, _ = concurrent.futures.wait(
                running, return_when=concurrent.futures.FIRST_COMPLETED)
            for f in finished:
                got = f.result()
                cell = running.pop(f)
                _record_over(cell, got, over_at)
                configs.append((cell, got))
                rows += got
                if on_rows is not None:
                    on_rows(got)
        rows += _partial_rows(configs, hw, exact, submit, on_rows)
    return rank(rows)


def _within_reserve(cells: list[Cell], hw: Hardware) -> tuple[list[Cell], list[dict]]:
    """(``cells`` whose method's reserve leaves the device a budget, an invalid row for each
    method whose measured reserve does not). ``hw.validate`` checked a given reserve and the
    default; a method's own measured one (fpdt's 10 GiB against ``--gpu-mem 8``) rules out that
    method only, so its row says so instead of the plan stopping at its first emulation."""
    if hw.reserve_gib is not None:
        return cells, []
    kept, refused = [], {}
    for cell in cells:
        reserve = hw.measured_reserve(cell.method)
        if reserve < hw.gpu_mem_gib:
            kept.append(cell)
        elif cell.method not in refused:
            refused[cell.method] = unrun(cell, None, Status.INVALID, (
                f"{cell.method}'s measured reserve, {reserve:g} GiB (the caching allocator's "
                f"cache beyond its tensors, {RESERVE_SOURCE}), is not below --gpu-mem "
                f"({hw.gpu_mem_gib:g} GiB): no device budget is left; give --reserve to set "
                "another"), "emulated")
    return kept, list(refused.values())


# calibrate.py's source of an inter-node figure it could not measure on one node
COPIED_FROM_INTRA = "a copy of collectives.intra"


def inter_node_warning(spec: PlanSpec, hw: Hardware) -> str | None:
    """A warning when the plan's ranks span nodes but its profile's inter-node collectives are
    copies of its intra-node ones (``upipe-bench calibrate`` on one node without ``--base``;
    each such constant's source says so), or None: the plan would price inter-node
    communication at intra-node speed without saying it."""
    if spec.gpus <= hw.gpus_per_node:
        return None
    profile = profile_for(hw)
    if profile is None:
        return None
    # the loaded profile keeps the values only; the sources are in its file
    inter = json.loads(Path(profile.path).read_text()).get("collectives", {}).get("inter", {})
    copied = [op for op, tree in inter.items()
              if any(COPIED_FROM_INTRA in source for source in _sources(tree))]
    if not copied:
        return None
    nodes = -(-spec.gpus // hw.gpus_per_node)
    return (f"inter-node times not measured: the {spec.gpus} GPUs span {nodes} nodes, but "
            f"profile {profile.name!r} was calibrated on one node and its inter-node "
            f"collectives ({', '.join(sorted(copied))}) are copies of its intra-node ones, so "
            "they are priced at intra-node speed; calibrate with --base NAME to take them from "
            "a shipped profile")


def _sources(tree) -> list[str]:
    """Every constant's source in a profile's raw JSON ``tree``."""
    if isinstance(tree, dict) and "value" in tree:
        return [str(tree.get("source", ""))]
    if isinstance(tree, dict):
        return [s for v in tree.values() for s in _sources(v)]
    return []


def _best_fitting(rows: list[dict]) -> dict | None:
    """The fastest row that fits (``status`` ok, with a time), or None."""
    timed = [r for r in rows if r["status"] == Status.OK and r.get("tokens_per_s_per_gpu")]
    return max(timed, key=lambda r: (r["tokens_per_s_per_gpu"], _identity(r)), default=None)


def _configuration_name(row: dict) -> str:
    """How a skipped row names another row: method, level, heads per stage, ring degree."""
    keep = f" k{row['keep_blocks']}" if row.get("keep_blocks") else ""
    u = f", U={row['heads_per_stage']}" if row.get("heads_per_stage") else ""
    return f"{row['method']} on {row['stack']}{keep}{u}, ring degree {row.get('ring_degree', 1)}"


def _partial_rows(configs: list[tuple[Cell, list[dict]]], hw: Hardware, exact: bool, submit,
                  on_rows: Callable[[list[dict]], None] | None) -> list[dict]:
    """The configurations keeping the attention, or whole blocks, in some blocks
    (``partial_candidates``), fastest estimate first, one at a time: a candidate is emulated
    (exactly: 17 s to 8 minutes at paper scale) when its estimate is above every row that fits
    so far (``configs``' and the candidates' emulated before it) and no candidate of its method
    and level has fitted yet (the leader); otherwise it is a row saying its estimate and what it
    is below. One emulated over a budget leads nothing (its k was an estimate): the next
    candidate of its method and level may be emulated, and the same configuration keeping
    fewer blocks (``_fewer_blocks``) joins the candidates at its own estimate.

    The estimate is the step time interpolated by the share of blocks kept, within 0.12% of
    the exact emulations (``partial_candidates``); what it is not sure of is the memory (the
    device's k is read from a chord). So a candidate estimated slower than a configuration that
    fits is no faster than the plan's answer by more than that error, and emulating it would
    tell only whether it fits. One at a time, so which are emulated does not depend on
    ``submit``'s workers (the table is the same for any number); the plan of Llama3-8B on 8
    GPUs at 4M emulates one of its ten (docs/emulation.md#the-planner)."""
    pending = _candidates(configs, hw)
    best = _best_fitting([r for _, rows in configs for r in rows])
    leaders: dict[tuple, Cell] = {}  # (method, level) -> its candidate that fits
    emulate = functools.partial(emulate_cell, exact=exact)  # keyword-only; pickles for a pool
    out = []
    while pending:
        pending.sort(key=lambda c: (-c.tokens, _identity(c.cell.to_dict())))
        cand = pending.pop(0)
        cell, key = cand.cell, (cand.cell.method, cand.cell.stack)
        if key in leaders:
            why = f"below {_configuration_name(leaders[key].to_dict())}, which fits"
        elif best is not None and cand.tokens <= best["tokens_per_s_per_gpu"]:
            why = (f"not above the fastest configuration that fits "
                   f"({_configuration_name(best)}: {best['tokens_per_s_per_gpu']:.4g} tokens/s "
                   "per GPU), so not the plan's answer by its estimate")
        else:
            row = submit(emulate, cell, hw).result()
            out.append(row)
            if on_rows is not None:
                on_rows([row])
            if row["status"] == Status.OK:
                leaders[key] = cell
                best = _best_fitting([r for r in (best, row) if r is not None])
            elif row["status"] == Status.OOM and (fewer := _fewer_blocks(cand, row, hw)):
                pending.append(fewer)
            continue
        row = unrun(cell, None, Status.SKIPPED, f"not emulated: estimated {cand.estimate}, {why}",
                    "emulated")
        out.append(row | kernel_column(cell, cell.validate(), hw))
    return out
