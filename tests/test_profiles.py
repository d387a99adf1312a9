"""Hardware profiles of the time model (DESIGN.md §9; experiments/emulation/profile.py).

The shipped profiles load and validate; the loader refuses a number without a source, a bare
number, an unknown name and a missing field, naming what is wrong; rate lookups fall back from a
causal pass to the non-causal table and interpolate in log2 between table points, held flat
beyond the ends. CPU-only, no torch.
"""

from __future__ import annotations

import json

import pytest

from experiments.emulation.profile import (
    COLLECTIVE_OPS,
    DEFAULT_PROFILE,
    HOST_COPIES,
    PASSES,
    ProfileError,
    load_profile,
    shipped_profiles,
)


def _c(value):
    return {"value": value, "source": "test fixture"}


def _minimal() -> dict:
    """A valid profile with one constant per field; tables chosen for hand-computed lookups."""
    return {
        "name": "tiny",
        "description": "test profile",
        "device": "cuda",
        "gpu_mem_gib": _c(80.0),
        "side_streams": _c(True),
        "peak_flops": {"bf16": _c(1e15)},
        "matmul": {"bf16": _c([[1024, 1e14], [8192, 4e14]])},
        "attention": {"sdpa": {"bf16": {
            "fwd": _c({"128": [[1024, 2e14], [4096, 4e14]]}),
            "bwd": _c({"128": [[1024, 1e14], [4096, 3e14]]}),
            "fwd_causal": _c({"128": [[1024, 1e14], [4096, 2e14]]}),
        }}},
        "memory_bandwidth": _c(3e12),
        "launch_overhead_s": _c(2e-6),
        "collectives": {scope: {op: {"bus_bandwidth": _c(1e11), "latency_s": _c(1e-5)}
                                for op in COLLECTIVE_OPS}
                        for scope in ("intra", "inter")},
        "host_copy": {name: _c(5e10) for name in HOST_COPIES},
    }


def _write(tmp_path, profile: dict, name: str = "p.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(profile))
    return str(path)


@pytest.mark.parametrize("name", shipped_profiles())
def test_shipped_profile_loads_and_validates(name):
    p = load_profile(name)
    assert p.device == "cuda" and p.side_streams is True
    assert p.gpu_mem_gib > 0 and p.memory_bandwidth > 0 and p.launch_overhead_s > 0
    assert p.peak_flops("bf16") > p.peak_flops("fp32") > 0
    for dtype in ("bf16", "fp32"):
        assert p.matmul_rate(dtype, 4096, 4096, 4096) <= p.peak_flops(dtype)
    kernels = ("fa3", "flash-attn", "sdpa") if name != "a100-80gb" else ("flash-attn", "sdpa")
    for kernel in kernels:
        for pass_ in PASSES:
            for seq in (512, 4096, 16384):
                rate = p.attention_rate(kernel, "bf16", pass_, 128, seq)
                assert 0 < rate < p.peak_flops("bf16")
    assert p.attention_rate("sdpa", "fp32", "fwd", 128, 4096) > 0
    for scope in ("intra", "inter"):
        for op in COLLECTIVE_OPS:
            bw, lat = p.collective(op, scope)
            assert bw > 0 and lat > 0
    for direction in ("h2d", "d2h"):
        assert p.host_copy(direction, pinned=True) > p.host_copy(direction, pinned=False) > 0


def test_shipped_names():
    names = shipped_profiles()
    assert DEFAULT_PROFILE == "h100-sxm" and "h100-sxm" in names
    assert {"h100-sxm", "h200", "a100-80gb"} <= set(names)
    assert "fa3" not in load_profile("a100-80gb").values["attention"]  # Hopper-only kernel


def test_constant_without_source_names_the_field(tmp_path):
    prof = _minimal()
    del prof["collectives"]["intra"]["p2p"]["latency_s"]["source"]
    with pytest.raises(ProfileError, match=r"collectives\.intra\.p2p\.latency_s"):
        load_profile(_write(tmp_path, prof))
    prof = _minimal()
    prof["memory_bandwidth"]["source"] = "  "
    with pytest.raises(ProfileError, match="memory_bandwidth: a constant needs"):
        load_profile(_write(tmp_path, prof, "blank.json"))


def test_bare_number_is_refused(tmp_path):
    prof = _minimal()
    prof["gpu_mem_gib"] = 80.0
    with pytest.raises(ProfileError, match="gpu_mem_gib: 80.0 is a number without a source"):
        load_profile(_write(tmp_path, prof))
    prof = _minimal()
    prof["matmul"]["bf16"] = [[1024, 1e14]]
    with pytest.raises(ProfileError, match=r"matmul\.bf16: .* without a source"):
        load_profile(_write(tmp_path, prof, "table.json"))


def test_unknown_profile_lists_the_shipped_ones():
    with pytest.raises(ProfileError) as err:
        load_profile("b200-imaginary")
    for name in shipped_profiles():
        assert name in str(err.value)
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile("no/such/profile.json")


def test_missing_field_is_named(tmp_path):
    prof = _minimal()
    del prof["host_copy"]
    with pytest.raises(ProfileError, match="lacks host_copy"):
        load_profile(_write(tmp_path, prof))
    prof = _minimal()
    del prof["host_copy"]["d2h_pageable"]
    with pytest.raises(ProfileError, match=r"host_copy\.d2h_pageable"):
        load_profile(_write(tmp_path, prof, "one_copy.json"))


def test_causal_pass_without_table_falls_back(tmp_path):
    p = load_profile(_write(tmp_path, _minimal()))
    # bwd_causal has no table: the non-causal bwd rate, at every length
    for seq in (512, 2048, 4096, 65536):
        assert p.attention_rate("sdpa", "bf16", "bwd_causal", 128, seq) == \
            p.attention_rate("sdpa", "bf16", "bwd", 128, seq)
    # fwd_causal has its own table and uses it
    assert p.attention_rate("sdpa", "bf16", "fwd_causal", 128, 4096) == 2e14
    assert p.attention_rate("sdpa", "bf16", "fwd", 128, 4096) == 4e14


def test_tables_interpolate_in_log2_and_clamp(tmp_path):
    p = load_profile(_write(tmp_path, _minimal()))
    # matmul [[1024, 1e14], [8192, 4e14]], keyed by the square side (m n k)^(1/3): log2 spans
    # 10..13, so 2048 sits 1/3 of the way and 4096 2/3
    assert p.matmul_rate("bf16", 2048, 2048, 2048) == pytest.approx(2e14)
    assert p.matmul_rate("bf16", 4096, 4096, 4096) == pytest.approx(3e14)
    x = 1024 * 2 ** 1.5  # log2 = 11.5: halfway between the ends
    assert p.matmul_rate("bf16", x, x, x) == pytest.approx(2.5e14)
    # a non-square product: (1024 * 4096 * 4096)^(1/3) = 2^(34/3), 4/9 of the way
    assert p.matmul_rate("bf16", 1024, 4096, 4096) == pytest.approx(1e14 + 4 / 9 * 3e14)
    # clamped: held flat below the first and beyond the last point
    assert p.matmul_rate("bf16", 16, 16, 16) == 1e14
    assert p.matmul_rate("bf16", 1 << 20, 1 << 20, 1 << 20) == 4e14
    # attention fwd [[1024, 2e14], [4096, 4e14]]: 2048 is the log2 midpoint
    assert p.attention_rate("sdpa", "bf16", "fwd", 128, 2048) == pytest.approx(3e14)
    assert p.attention_rate("sdpa", "bf16", "fwd", 128, 256) == 2e14
    assert p.attention_rate("sdpa", "bf16", "fwd", 128, 1 << 20) == 4e14
    # the nearest head dim (log distance) is used when the asked one has no table
    assert p.attention_rate("sdpa", "bf16", "fwd", 64, 2048) == pytest.approx(3e14)


def test_shipped_h100_values_match_their_sources():
    """Spot checks against the cited figures (FA3 paper Fig. 5/6 at 16K, datasheet peak)."""
    p = load_profile("h100-sxm")
    assert p.peak_flops("bf16") == 989.5e12
    assert p.attention_rate("fa3", "bf16", "fwd", 128, 16384) == 648e12
    assert p.attention_rate("fa3", "bf16", "bwd", 128, 16384) == 561e12
    assert p.attention_rate("flash-attn", "bf16", "fwd", 128, 16384) == 370e12
    assert p.attention_rate("sdpa", "bf16", "fwd_causal", 128, 16384) == 335e12
    assert p.collective("all_to_all", "inter")[0] == 48e9
