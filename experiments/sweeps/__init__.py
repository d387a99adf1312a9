"""Sweep declarations, one module per paper artefact (STYLE.md §5).

Each module defines ``SWEEPS``: the paper-scale sweep and its CPU-scale counterpart (named with
a ``-cpu`` suffix). Every paper-scale sweep also gets an emulated twin here (``-emulated``): the
same cells through the emulator on the paper's hardware (8x H100 80 GB per node, DESIGN.md §8),
its memory plots, and its max-context searches at a 64K-token granularity from 1M tokens.
Baselines added to the registry join the method lists here.
"""

from __future__ import annotations

import dataclasses

from experiments.config import (
    EMULATED_GRANULARITY,
    EMULATED_LIMIT,
    EMULATED_START,
    THROUGHPUT_PLOTS,
    Hardware,
    SearchSpec,
    Sweep,
)
from experiments.sweeps import (
    ablation_heads_per_stage,
    bench_attention,
    memory_ladder,
    table3_llama3_8b_h100x8,
    table4_qwen3_32b_h100x16,
)

_MODULES = (table3_llama3_8b_h100x8, table4_qwen3_32b_h100x16, memory_ladder,
            ablation_heads_per_stage, bench_attention)


def emulated_twin(paper: Sweep) -> Sweep:
    """``paper``'s cells emulated on ``Hardware()`` (the paper's H100s): its base and axes,
    its plots but the throughput ones (emulation measures no time), and its search, if any,
    from 1M tokens at a 64K-token granularity (block = 64K / nproc)."""
    search = None
    if paper.search is not None:
        search = SearchSpec(start=EMULATED_START,
                            block=EMULATED_GRANULARITY // paper.base["nproc"],
                            limit=EMULATED_LIMIT)
    return dataclasses.replace(
        paper, name=f"{paper.name}-emulated", scale="emulated", hardware=Hardware(),
        description=f"Emulated: {paper.description} (memory only: no times)", search=search,
        plots=tuple(p for p in paper.plots if p not in THROUGHPUT_PLOTS))


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
