"""A sweep is data: a base cell, axes to expand, and optional max-context searches.

Sweep declarations live in ``experiments/sweeps/``, one file per paper artefact, each with a
paper-scale sweep and a CPU-scale counterpart that runs on 2 cores
(docs/conventions.md#sweeps-are-data); every paper-scale sweep also has an emulated twin (scale
``emulated``: the same cells through the emulator on declared ``hardware``,
docs/design.md#emulation). ``cells`` turns a sweep into cells;
``validate`` checks every one of them before anything runs (a dry run).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

from experiments.config.cell import Cell
from experiments.config.hardware import Hardware
from experiments.config.limits import DEFAULT_TIMEOUT_S
from experiments.config.options import token_options
from experiments.config.search import SearchSpec
from experiments.config.sizes import parse_size

# Cell fields given in tokens: a declaration may write them as "128K" or "1M"
SIZE_FIELDS = frozenset({"seq_len", "doc_len"})
PLOTS = ("max_context", "memory_vs_seq", "throughput_vs_seq", "throughput_vs_ulysses",
         "memory_ladder", "heads_per_stage", "memory_wall")
THROUGHPUT_PLOTS = ("throughput_vs_seq", "throughput_vs_ulysses")  # need step times
SCALES = ("paper", "cpu", "emulated")


@dataclass(frozen=True)
class Sweep:
    """One paper artefact's measurements."""

    name: str
    """file-system-safe name, after the artefact (``table3_llama3_8b_h100x8``)"""
    description: str
    """what the artefact shows, in one line"""
    scale: str
    """``paper`` (GPUs, NCCL), ``cpu`` (2 cores, gloo) or ``emulated`` (paper-scale cells through
    the emulator on ``hardware``; memory, FLOPs, communication and the time model's step time)"""
    base: dict
    """Cell fields shared by every cell"""
    axes: dict = field(default_factory=dict)
    """Cell field -> values, expanded as a product; a dict value sets several fields at once
    (e.g. ``{"method": "upipe", "heads_per_stage": 16}``)"""
    extra_cells: tuple[dict, ...] = ()
    """cells outside the product, each Cell fields over ``base`` (e.g. one packed-documents
    row beside the grid); run after the grid's cells, never searched"""
    search: SearchSpec | None = None
    """also search the maximum context of every expanded cell but its seq_len"""
    search_axes: tuple[str, ...] = ("variant",)
    """axes a search runs over (the rest are fixed by ``base``)"""
    search_methods: tuple[str, ...] | None = None
    """methods whose max context is searched (None: every method of the axes)"""
    search_base: dict = field(default_factory=dict)
    """Cell fields for the searches only (the CPU budget: the grid's cells run unbudgeted so
    that every length gets a time)"""
    repeats: int = 1
    """launches per cell (rows carry ``rep``)"""
    plots: tuple[str, ...] = ()
    """plots drawn from the tables (see ``PLOTS``)"""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """per-cell (and per-probe) wall-clock limit (measured sweeps)"""
    hardware: Hardware | None = None
    """the emulated hardware; emulated sweeps only"""
    exact: bool = False
    """emulated sweeps: emulate every cell at its own size instead of the fit of small exact
    emulations (``experiments.emulation.emulate_cell``)"""

    def __post_init__(self):
        if self.scale not in SCALES:
            raise ValueError(f"sweep.scale must be one of {list(SCALES)}, got {self.scale!r}")
        bad = [p for p in self.plots if p not in PLOTS]
        if bad:
            raise ValueError(f"sweep.plots must be among {PLOTS}, got {bad}")
        if (self.scale == "emulated") != (self.hardware is not None):
            raise ValueError("sweep.hardware must be given for an emulated sweep and only for "
                             f"one (scale {self.scale!r}, hardware {self.hardware})")
        if self.hardware is not None:
            self.hardware.validate()
        if self.exact and self.scale != "emulated":
            raise ValueError(f"sweep.exact applies to emulated sweeps only, not {self.scale!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"sweep.timeout_s must be positive, got {self.timeout_s}")

    def _products(self, axes: dict) -> list[dict]:
        names = list(axes)
        out = []
        for values in itertools.product(*(axes[n] for n in names)):
            fields_ = dict(self.base)
            for name, val in zip(names, values, strict=True):
                if isinstance(val, dict):
                    fields_.update(val)
                else:
                    fields_[name] = val
            out.append(_sizes(fields_))
        return out

    def cells(self) -> list[Cell]:
        """Every run cell (x repeats): the grid's, short sequences first so results arrive
        early, then ``extra_cells``."""
        rep = [{"rep": r} if self.repeats > 1 else {} for r in range(self.repeats)]
        grid = [Cell.from_dict(f | {"extra": e}) for f in self._products(self.axes) for e in rep]
        extra = [Cell.from_dict(_sizes(self.base | f) | {"extra": e}) for f in self.extra_cells
                 for e in rep]
        return sorted(grid, key=lambda c: c.seq_len) + extra

    def search_cells(self) -> list[Cell]:
        """One base cell per max-context search (its seq_len is replaced while searching)."""
        if self.search is None:
            return []
        axes = {k: v for k, v in self.axes.items() if k in self.search_axes}
        seen, out = set(), []
        for f in self._products(axes):
            cell = Cell.from_dict(f | self.search_base | {"seq_len": self.search.start})
            if self.search_methods is not None and cell.method not in self.search_methods:
                continue
            if cell not in seen:
                seen.add(cell)
                out.append(cell)
        return out

    def validate(self) -> list[tuple[Cell, str]]:
        """(cell, error) for every invalid cell; an empty list means the sweep can run."""
        bad = []
        for cell in self.cells() + self.search_cells():
            try:
                cell.validate()
            except ValueError as e:
                bad.append((cell, str(e)))
        if self.search is not None:
            for cell in self.search_cells():
                try:
                    self.search.validate(cell.nproc)
                except ValueError as e:
                    bad.append((cell, str(e)))
        return bad

    def with_overrides(self, **base) -> Sweep:
        """The sweep with base fields replaced (``nproc`` from the launcher, for instance)."""
        return dataclasses.replace(self, base=dict(self.base) | base)


def _sizes(fields_: dict) -> dict:
    """Cell fields and options with their token counts parsed ("128K" -> 131072): the fields
    of ``SIZE_FIELDS`` and the options a method counts in tokens."""
    sizes = SIZE_FIELDS | token_options()
    return {k: parse_size(v) if k in sizes and isinstance(v, str) else v
            for k, v in fields_.items()}
