"""Model FLOPs and MFU (experiments/harness/flops.py)."""

from __future__ import annotations

import pytest

from experiments.harness.flops import mfu, peak_flops


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.5e12),  # SXM: the name carries no form factor
    ("NVIDIA H100 PCIe", 756.5e12),
    ("NVIDIA H100 NVL", 835.5e12),
    ("NVIDIA H200", 989.5e12),
    ("NVIDIA H200 NVL", 835.5e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA A100 80GB PCIe", 312e12),
])
def test_each_part_gets_its_own_peak(name, peak):
    """A PCIe or NVL part is not an SXM one (its MFU came out a fifth low)."""
    assert peak_flops(name, "bf16") == peak
    assert mfu(peak, 1.0, 1, name, "bf16") == 1.0


def test_no_peak_no_mfu():
    assert peak_flops("NVIDIA L4", "bf16") is None and peak_flops("NVIDIA H100", "fp32") is None
    assert mfu(1e12, 1.0, 1, "NVIDIA L4", "bf16") is None
