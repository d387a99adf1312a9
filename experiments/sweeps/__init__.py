"""Sweep declarations, one module per paper artefact (STYLE.md §5).

Each module defines ``SWEEPS``: the paper-scale sweep and its CPU-scale counterpart (named with
a ``-cpu`` suffix). Baselines added to the registry join the method lists here.
"""

from __future__ import annotations

from experiments.sweep import Sweep
from experiments.sweeps import (
    ablation_heads_per_stage,
    memory_ladder,
    table3_llama3_8b_h100x8,
    table4_qwen3_32b_h100x16,
)

_MODULES = (table3_llama3_8b_h100x8, table4_qwen3_32b_h100x16, memory_ladder,
            ablation_heads_per_stage)

SWEEPS: dict[str, Sweep] = {s.name: s for m in _MODULES for s in m.SWEEPS}


def get_sweep(name: str) -> Sweep:
    """The sweep called ``name``; ValueError listing the valid names otherwise."""
    if name not in SWEEPS:
        raise ValueError(f"sweep must be one of {sorted(SWEEPS)}, got {name!r}")
    return SWEEPS[name]


def cpu_sweeps() -> list[Sweep]:
    return [s for s in SWEEPS.values() if s.scale == "cpu"]


def paper_sweeps() -> list[Sweep]:
    return [s for s in SWEEPS.values() if s.scale == "paper"]
