"""Cells run on the test session's gloo ranks instead of fresh launches.

``SessionRanks(dist_pool)`` has the executor interface of ``experiments.runner.executor``
(``unavailable(cell)``, ``run(cell) -> row``). Its cells run through ``run_cell`` on the
ranks of the session's ``dist_pool`` (tests/conftest.py), where torch.distributed is already
initialised: the harness's in-process path, the one torchrun uses, with the same validation,
measurement and row. What it saves is each launch's start-up (python, torch and DeepSpeed
imports: about 5-8 s on 2 cores); the tracked peaks on CPU do not depend on the process
(tests/test_emulate.py holds such runs to the emulator's bytes). The launch itself (spawn,
timeouts, killed ranks, progress) is tested where it matters: tests/test_faults.py and
tests/test_runner.py.
"""

from __future__ import annotations

from experiments.config import Cell
from experiments.harness.launch import run_cell, unavailable_reason


def _run_on_rank(cell_dict: dict) -> dict:
    return run_cell(Cell.from_dict(cell_dict))


class SessionRanks:
    """An executor whose cells run on the session's ranks (``dist_pool(cell.world)``)."""

    def __init__(self, dist_pool):
        self.dist_pool = dist_pool

    def unavailable(self, cell: Cell) -> str | None:
        return unavailable_reason(cell)

    def run(self, cell: Cell) -> dict:
        try:
            cell.validate()
        except ValueError:  # an invalid row, as a launcher gives it: nothing runs
            return run_cell(cell)
        return self.dist_pool(cell.world).run(_run_on_rank, cell.to_dict())[0]
