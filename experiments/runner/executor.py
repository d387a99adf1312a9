"""One executor interface for running a cell: measured (``Launcher``) or emulated (``Emulator``).

The sweep runner, the ``upipe-bench`` commands and the CI max-context guard all run cells, and
searches of cells, through one of these two, so the choice between a launch and an emulation,
and what a cell that cannot run here becomes, is made in one place:

    executor.unavailable(cell) -> str | None   why the cell cannot run here (nothing launched)
    executor.run(cell) -> dict                 the cell's row, whatever happens
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from experiments.config import DEFAULT_TIMEOUT_S, Cell, Hardware
from experiments.emulation.emulate import emulate_cell, emulation_unavailable
from experiments.harness.launch import launch_refusal, run_cell


@dataclass(frozen=True)
class Launcher:
    """Runs a cell for real: its ranks in a fresh process group (or, under torchrun, in the
    launched group), rows with ``mode`` ``measured``."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    """wall-clock limit of one launch (seconds)"""
    progress: bool = False
    """rank 0 prints a line per step on stderr"""
    shared_gpu: bool = False
    """every rank on one GPU with gloo (``launch.shared_gpu_refusal``; rows say
    ``shared_gpu``: their times are no speed result)"""

    def __post_init__(self):
        if not self.timeout_s > 0:
            raise ValueError(f"timeout must be positive (seconds per launch), got "
                             f"{self.timeout_s}")

    def unavailable(self, cell: Cell) -> str | None:
        return launch_refusal(cell, self.shared_gpu)

    def run(self, cell: Cell) -> dict:
        return run_cell(cell, timeout_s=self.timeout_s, progress=self.progress,
                        shared_gpu=self.shared_gpu)


@dataclass(frozen=True)
class Emulator:
    """Emulates a cell at its own scale in this process (docs/design.md#emulation), rows with
    ``mode`` ``emulated``: on ``hardware``, by the fit (``exact``: the target size itself), with
    FLOPs and bytes sent (``count``) or memory only, its peaks certified (``certify``) or the
    fit window's lines (``emulation.certify``)."""

    hardware: Hardware = field(default_factory=Hardware)
    exact: bool = False
    count: bool = True
    certify: bool = True

    def __post_init__(self):
        self.hardware.validate()
        # The emulator runs CPU code on fake tensors: DeepSpeed (tiled MLP, ds-ulysses) is told
        # its accelerator is the CPU; left to probe, it warns when it finds no GPU.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")

    def unavailable(self, cell: Cell) -> str | None:
        return emulation_unavailable(cell, self.hardware)

    def run(self, cell: Cell) -> dict:
        # a search's probe (no timed steps, ``runner.search``) asks only whether the cell fits:
        # a lower bound over the budget answers that without the samples that would certify
        # its peak at millions of tokens (``emulate_cell``'s ``bound_first``)
        probe = cell.iters == 0 and self.certify
        return emulate_cell(cell, self.hardware, exact=self.exact, count=self.count,
                            bound_first=probe, certify=self.certify)
