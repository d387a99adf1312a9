"""The emulated device budget: the GPU's memory as CUDA sees it less the allocator's reserve,
both from measurements (experiments/config/hardware.py), recomputed here from the measured rows."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from experiments.config import DEFAULT_RESERVE_GIB, METHOD_RESERVE_GIB, Cell, GiB, Hardware
from experiments.config.hardware import RESERVE_SOURCE

ROOT = Path(__file__).resolve().parents[1]


def _reserved_minus_allocated() -> pd.DataFrame:
    rows = pd.read_csv(ROOT / RESERVE_SOURCE)
    rows = rows[rows.status == "ok"]
    gib = (rows.allocator_peak_reserved_bytes - rows.allocator_peak_allocated_bytes) / GiB
    return rows.assign(slack_gib=gib)


def test_reserves_are_the_measured_ones():
    rows = _reserved_minus_allocated()
    own = rows.method.isin(list(METHOD_RESERVE_GIB))
    assert round(rows[~own].slack_gib.median(), 1) == DEFAULT_RESERVE_GIB
    for method, reserve in METHOD_RESERVE_GIB.items():
        measured = rows[rows.method == method].slack_gib
        assert len(measured) and round(measured.max(), 1) == reserve, method


def test_budget_uses_the_methods_reserve_unless_one_is_given():
    hw = Hardware()
    assert hw.gpu_mem_gib == 79.65  # an H100 80 GB as CUDA sees it
    ulysses, fpdt = Cell("ulysses"), Cell("fpdt")
    assert hw.device_budget(ulysses) == int((79.65 - DEFAULT_RESERVE_GIB) * GiB)
    assert hw.device_budget(fpdt) == int((79.65 - METHOD_RESERVE_GIB["fpdt"]) * GiB)
    assert hw.columns("fpdt")["hw_reserve_gib"] == METHOD_RESERVE_GIB["fpdt"]
    given = Hardware(reserve_gib=2.0)
    assert given.device_budget(fpdt) == given.device_budget(ulysses) == int(77.65 * GiB)
    small = Hardware(gpu_mem_gib=8.0)
    small.validate()  # the default reserve fits an 8 GiB device ...
    with pytest.raises(ValueError, match=r"reserve_gib .*\(the measured reserve of 'fpdt'\)"):
        small.device_budget(fpdt)  # ... fpdt's measured 10 GiB do not


def test_an_emulated_cpu_device_keeps_no_reserve():
    """The reserve is a CUDA caching allocator's; a gloo run's tracker counts live tensors only,
    so an emulated cpu device's budget is its whole memory unless a reserve is given."""
    cpu = Hardware(device="cpu", gpu_mem_gib=1.0)
    cpu.validate()  # the H100's 6.3 GiB would not fit under 1 GiB
    assert cpu.device_budget(Cell("fpdt")) == cpu.device_budget(Cell("ulysses")) == GiB
    assert cpu.columns("ulysses")["hw_reserve_gib"] == 0.0
    given = Hardware(device="cpu", gpu_mem_gib=1.0, reserve_gib=0.25)
    assert given.device_budget(Cell("ulysses")) == int(0.75 * GiB)
