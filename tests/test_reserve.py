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
