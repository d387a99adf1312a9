"""Sweep declarations, one module per paper artefact (docs/conventions.md#sweeps-are-data).

Each module defines ``SWEEPS``: the paper-scale sweep and its CPU-scale counterpart (named with
a ``-cpu`` suffix). Every paper-scale sweep also gets an emulated twin here (``-emulated``): the
same cells through the emulator on the paper's hardware (8x H100 80 GB per node,
docs/design.md#emulation) with the paper's attention kernel, its plots (time emulated on the
h100-sxm profile, §9), and its max-context searches at a 64K-token granularity from 1M tokens.
Baselines added to the registry join the method lists here.
"""

from __future__ import annotations

import dataclasses

from experiments.config import (
    EMULATED_GRANULARITY,
    EMULATED_LIMIT,
    EMULATED_START,
    Hardware,
    SearchSpec,
    Sweep,
)
from experiments.sweeps import (
    ablation_heads_per_stage,
    bench_attention,
    long_context,
    memory_ladder,
    selective_recompute,
    table3_llama3_8b_h100x8,
    table4_qwen3_32b_h100x16,
    time_validation_cpu,
    two_node_llama3_8b_h100x16,
    upipe_overlap,
)

# the paper's attention kernel: FlashAttention-3 (the official repository's README: "required to
# reproduce exact tokens/second numbers from the paper", github.com/togethercomputer/Untied-Ulysses)
PAPER_KERNEL = "fa3"

_MODULES = (table3_llama3_8b_h100x8, table4_qwen3_32b_h100x16, memory_ladder,
            ablation_heads_per_stage, bench_attention, time_validation_cpu, upipe_overlap,
            long_context, two_node_llama3_8b_h100x16, selective_recompute)


def emulated_twin(paper: Sweep) -> Sweep:
    """``paper``'s cells emulated on ``Hardware()`` (the paper's H100s, time on the h100-sxm
    profile) with the kernel the paper ran (FlashAttention-3, ``fa3``): its base, axes and
    plots, and its search, if any, from 1M tokens at a 64K-token granularity (block = 64K /
    nproc)."""
    search = None
    if paper.search is not None:
        search = SearchSpec(start=EMULATED_START,
                            block=EMULATED_GRANULARITY // paper.base["nproc"],
                            limit=EMULATED_LIMIT)
    return dataclasses.replace(
        paper, name=f"{paper.name}-emulated", scale="emulated", hardware=Hardware(),
        base=paper.base | {"kernel": PAPER_KERNEL},
        description=f"Emulated: {paper.description} (time emulated on the h100-sxm profile)",
        search=search)


_DECLARED = [s for m in _MODULES for s in m.SWEEPS]
SWEEPS: dict[str, Sweep] = {s.name: s for s in _DECLARED} | {
    t.name: t for t in (emulated_twin(s) for s in _DECLARED if s.scale == "paper")}


def get_sweep(name: str) -> Sweep:
    """The sweep called ``name``; ValueError listing the valid names otherwise."""
    if name not in SWEEPS:
        raise ValueError(f"sweep must be one of {sorted(SWEEPS)}, got {name!r}")
    return SWEEPS[name]


def cpu_sweeps() -> list[Sweep]:
    return [s for s in SWEEPS.values() if s.scale == "cpu"]


def paper_sweeps() -> list[Sweep]:
    return [s for s in SWEEPS.values() if s.scale == "paper"]


def emulated_sweeps() -> list[Sweep]:
    return [s for s in SWEEPS.values() if s.scale == "emulated"]
