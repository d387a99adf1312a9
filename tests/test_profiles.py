"""Hardware profiles of the time model (docs/design.md#the-time-model;
experiments/timing/profile.py).

The shipped profiles load and validate; the loader refuses a number without a source, a bare
number, an unknown name and a missing field, naming what is wrong; rate lookups fall back from a
causal pass to the non-causal table and interpolate in log2 between table points, held flat
beyond the ends. CPU-only, no torch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from experiments.timing.profile import (
    COLLECTIVE_OPS,
    DEFAULT_PROFILE,
    HOST_COPIES,
    PASSES,
    ProfileError,
    attention_flops,
    load_profile,
    shipped_profiles,
)

RESULTS = Path(__file__).resolve().parent.parent / "results"


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
    kernels = ("fa3", "flash-attn", "sdpa", "cudnn") if name != "a100-80gb" else (
        "flash-attn", "sdpa", "cudnn")
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


@pytest.mark.parametrize("name", shipped_profiles())
def test_shipped_profile_has_cudnn_bf16_rates_for_every_pass(name):
    """Its own table for each pass: a causal pass missing would fall back to the non-causal
    rate silently (attention_rate), so the tables themselves are checked."""
    tables = load_profile(name).values["attention"]["cudnn"]["bf16"]
    assert set(tables) == set(PASSES)
    assert all("128" in tables[pass_] for pass_ in PASSES)


@pytest.mark.parametrize("name,cc", [("h100-sxm", (9, 0)), ("h200", (9, 0)),
                                     ("a100-80gb", (8, 0))])
def test_shipped_compute_capability(name, cc):
    assert load_profile(name).compute_capability == cc


def test_compute_capability_is_optional(tmp_path):
    assert load_profile(_write(tmp_path, _minimal())).compute_capability is None
    prof = _minimal()
    prof["compute_capability"] = _c("10.3")
    assert load_profile(_write(tmp_path, prof, "cc.json")).compute_capability == (10, 3)


@pytest.mark.parametrize("value", ["9", "9.0.1", "9.x", "sm90", " 9.0", "9.0 ", "", "-9.0",
                                   "\u0669.0", 9.0, ["9", "0"], None])
def test_malformed_compute_capability_is_refused(tmp_path, value):
    prof = _minimal()
    prof["compute_capability"] = _c(value)
    with pytest.raises(ProfileError, match=r"compute_capability: must be a string "
                                           '"<major>.<minor>"'):
        load_profile(_write(tmp_path, prof))


def test_compute_capability_without_source_is_refused(tmp_path):
    prof = _minimal()
    prof["compute_capability"] = "9.0"  # a bare string: the other strings' loophole
    with pytest.raises(ProfileError, match="compute_capability: write it as a constant"):
        load_profile(_write(tmp_path, prof))
    prof["compute_capability"] = {"value": "9.0"}
    with pytest.raises(ProfileError, match="compute_capability: a constant needs"):
        load_profile(_write(tmp_path, prof, "nosource.json"))


def test_shipped_h200_cudnn_beats_flash_where_measured():
    """The H200 run's data: at 32 heads and 32K, cuDNN's causal kernels ran faster than the
    flash backend's (attention.csv: 15.0 vs 25.6 ms forward, 40.9 vs 69.6 ms backward)."""
    p = load_profile("h200")
    for pass_ in ("fwd_causal", "bwd_causal"):
        cudnn = p.attention_rate("cudnn", "bf16", pass_, 128, 32768, 32)
        sdpa = p.attention_rate("sdpa", "bf16", pass_, 128, 32768, 32)
        assert cudnn > 1.5 * sdpa


def test_a100_cudnn_is_082_of_its_sdpa():
    """No A100 cuDNN measurement: every point is 0.82 x the profile's own sdpa rate at the same
    length (huggingface/transformers PR #48163), in every pass."""
    p = load_profile("a100-80gb")
    tables = p.values["attention"]
    for pass_ in PASSES:
        cudnn, sdpa = tables["cudnn"]["bf16"][pass_], tables["sdpa"]["bf16"][pass_]
        assert set(cudnn) == set(sdpa)
        for dim, sdpa_points in sdpa.items():
            assert [x for x, _ in cudnn[dim]] == [x for x, _ in sdpa_points]
            for (_, got), (_, flash) in zip(cudnn[dim], sdpa_points, strict=True):
                assert got == pytest.approx(0.82 * flash, rel=1e-4)  # 5 significant digits
        for seq in (512, 3000, 16384, 1 << 17):
            assert p.attention_rate("cudnn", "bf16", pass_, 128, seq) == pytest.approx(
                0.82 * p.attention_rate("sdpa", "bf16", pass_, 128, seq), rel=1e-4)
    assert "transformers PR #48163" in json.loads(
        Path(p.path).read_text())["attention"]["cudnn"]["bf16"]["fwd"]["source"]


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
    prof = _minimal()  # a flag is a constant: side_streams flips the overlap model
    prof["side_streams"] = False
    with pytest.raises(ProfileError, match="side_streams: False is a flag without a source"):
        load_profile(_write(tmp_path, prof, "flag.json"))


@pytest.mark.parametrize("where,value,match", [
    (("collectives", "intra", "all_to_all", "latency_s"), math.nan,
     r"collectives\.intra\.all_to_all\.latency_s: must be a finite number >= 0"),
    (("collectives", "intra", "all_to_all", "latency_s"), True,
     r"collectives\.intra\.all_to_all\.latency_s: .* got True"),
    (("collectives", "intra", "p2p", "bus_bandwidth"), math.inf,
     r"collectives\.intra\.p2p\.bus_bandwidth: must be a positive, finite number"),
    (("memory_bandwidth",), math.inf, "memory_bandwidth: must be a positive, finite number"),
    (("matmul", "bf16"), [[1024, math.nan]], r"matmul\.bf16: .*positive, finite"),
])
def test_non_finite_values_are_refused(tmp_path, where, value, match):
    """NaN compares false with everything, so a check written as "refuse x <= 0" let it
    through: an emulation on such a profile printed status ok and a NaN step time."""
    prof = _minimal()
    node = prof
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = {"value": value, "source": "a test"}
    with pytest.raises(ProfileError, match=match):
        load_profile(_write(tmp_path, prof))


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
    """Spot checks against the cited figures (FA3 paper Fig. 5/6 at 16K, datasheet peak) and
    the cited measurement (results/gpu_costs_h200/kernels/attention.csv: the project's sdpa,
    causal, 16 heads at 16K; the same GH100 compute)."""
    p = load_profile("h100-sxm")
    assert p.peak_flops("bf16") == 989.5e12
    assert p.attention_rate("fa3", "bf16", "fwd", 128, 16384) == 648e12
    assert p.attention_rate("fa3", "bf16", "bwd", 128, 16384) == 561e12
    assert p.attention_rate("flash-attn", "bf16", "fwd", 128, 16384) == 370e12
    att = pd.read_csv(RESULTS / "gpu_costs_h200" / "kernels" / "attention.csv")
    row = att[(att["heads"] == 16) & (att["seq"] == 16384)].iloc[0]
    measured = attention_flops(1, 16, 16384, 16384, 128, "fwd_causal") / row["flash_fwd_s"]
    for name in ("h100-sxm", "h200"):
        rate = load_profile(name).attention_rate("sdpa", "bf16", "fwd_causal", 128, 16384, 16)
        assert rate == pytest.approx(measured, rel=1e-3)  # written with 4 significant digits
    assert p.collective("all_to_all", "inter")[0] == 48e9


@pytest.mark.parametrize("name", ["h100-sxm", "h200"])
def test_shipped_pageable_rates_are_the_offloads_measured_copies(name):
    """The offload's pack copies into a host tensor allocated for it (fresh pages every step
    when pageable: results/gpu_costs_h200/kernels/host_copy.csv's first-touch d2h), its unpack
    from pages already touched (warm h2d); 1 GiB rows, 4 significant digits. They had been
    half the pinned rates (2.6-2.8e10), 14x fast for the pack."""
    csv = pd.read_csv(RESULTS / "gpu_costs_h200" / "kernels" / "host_copy.csv")
    row = csv[(csv["bytes"] == 2**30) & ~csv["pinned"]].iloc[0]
    p = load_profile(name)
    assert p.host_copy("d2h", False) == pytest.approx(2**30 / row["d2h_first_s"], rel=1e-3)
    assert p.host_copy("h2d", False) == pytest.approx(2**30 / row["h2d_s"], rel=1e-3)


# ---------------------------------------------------------------------------------------------
# attention tables by heads per call, narrow matmuls, host issue time


def _by_heads() -> dict:
    """``_minimal`` with the fwd head-dim-128 entry split by heads per call (2, 8, 32); bwd keeps
    one list for every head count."""
    prof = _minimal()
    prof["attention"]["sdpa"]["bf16"]["fwd"] = _c({"128": {
        "2": [[1024, 1e14], [4096, 2e14]],
        "8": [[1024, 3e14], [4096, 4e14]],
        "32": [[1024, 5e14]],
    }})
    return prof


def test_attention_rate_interpolates_in_log2_of_the_heads(tmp_path):
    p = load_profile(_write(tmp_path, _by_heads()))

    def rate(heads, seq=1024):
        return p.attention_rate("sdpa", "bf16", "fwd", 128, seq, heads)

    # a measured count: its own table, itself interpolated in log2(seq_k) and held flat
    assert rate(8) == 3e14
    assert rate(8, 2048) == pytest.approx(3.5e14)
    assert rate(8, 1 << 16) == 4e14
    assert rate(2, 4096) == 2e14
    # 4 heads sit half way between 2 and 8 in log2 (linear in heads, 5 would be half way)
    assert rate(4) == pytest.approx(2e14)
    assert rate(4, 4096) == pytest.approx(3e14)
    assert rate(4, 2048) == pytest.approx((1.5e14 + 3.5e14) / 2)
    # 16 heads half way between 8 and 32; the 32-head table is flat at 5e14
    assert rate(16, 4096) == pytest.approx(4.5e14)
    # clamped to the tables' range: below the fewest, above the most
    assert rate(1) == 1e14 and rate(1, 4096) == 2e14
    assert rate(64) == 5e14 and rate(1 << 20, 4096) == 5e14
    # None: the largest head count's table
    assert rate(None) == 5e14 and rate(None, 4096) == 5e14
    assert p.attention_rate("sdpa", "bf16", "fwd", 128, 4096) == 5e14
    # the nearest head dim (log distance) still applies to a table by heads
    assert p.attention_rate("sdpa", "bf16", "fwd", 64, 1024, 4) == pytest.approx(2e14)


def test_a_list_entry_is_one_table_for_every_head_count(tmp_path):
    p = load_profile(_write(tmp_path, _by_heads()))
    # bwd [[1024, 1e14], [4096, 3e14]]: 2e14 at 2048 whatever the heads
    for heads in (None, 1, 2, 5, 8, 1 << 20):
        assert p.attention_rate("sdpa", "bf16", "bwd", 128, 2048, heads) == pytest.approx(2e14)
    # a causal pass without its own table falls back to the list too
    assert p.attention_rate("sdpa", "bf16", "bwd_causal", 128, 2048, 4) == pytest.approx(2e14)


@pytest.mark.parametrize("entry,match", [
    ({}, r"attention\.sdpa\.bf16\.fwd\.128: must map head counts"),
    ({"1.5": [[1024, 1e14]]}, r"attention\.sdpa\.bf16\.fwd: head dims and head counts must be "
                              "integers"),
    ({"four": [[1024, 1e14]]}, r"attention\.sdpa\.bf16\.fwd: .*must be integers"),
    ({"0": [[1024, 1e14]], "4": [[1024, 2e14]]},
     r"attention\.sdpa\.bf16\.fwd\.128: head counts must be positive"),
    ({"-4": [[1024, 1e14]]}, r"attention\.sdpa\.bf16\.fwd\.128: head counts must be positive"),
    ({"4": []}, r"attention\.sdpa\.bf16\.fwd\.128\.4: must be a non-empty list"),
])
def test_a_bad_table_by_heads_is_refused(tmp_path, entry, match):
    prof = _minimal()
    prof["attention"]["sdpa"]["bf16"]["fwd"] = _c({"128": entry})
    with pytest.raises(ProfileError, match=match):
        load_profile(_write(tmp_path, prof))


def _gqa(by_group: dict) -> dict:
    """``_by_heads`` with ``attention_gqa.sdpa.bf16.fwd`` = ``by_group`` at head dim 128."""
    prof = _by_heads()
    prof["attention_gqa"] = {"sdpa": {"bf16": {"fwd": _c({"128": by_group})}}}
    return prof


def test_attention_rate_by_gqa_group_interpolates_from_group_one(tmp_path):
    """Group 1 is the plain table (2, 8, 32 heads: 1e14, 3e14, 5e14 at 1024); groups 4 and 8
    measured at 8 heads (4e14, 6e14) and group 4 also at 32 heads (8e14)."""
    p = load_profile(_write(tmp_path, _gqa({"4": {"8": [[1024, 4e14]], "32": [[1024, 8e14]]},
                                            "8": {"8": [[1024, 6e14]]}})))

    def rate(heads, group, seq=1024):
        return p.attention_rate("sdpa", "bf16", "fwd", 128, seq, heads, group)

    assert rate(8, 1) == 3e14 and rate(8, 4) == 4e14 and rate(8, 8) == 6e14
    # group 2 half way between group 1 (3e14) and group 4 (4e14) in log2(group)
    assert rate(8, 2) == pytest.approx(3.5e14)
    # beyond the largest measured group: held at it
    assert rate(8, 16) == 6e14
    # heads interpolate inside each group's own table: 16 heads, group 4: 6e14 (8 -> 32)
    assert rate(16, 4) == pytest.approx(6e14)
    # a group table holds flat beyond its heads (group 8 has only 8 heads)
    assert rate(32, 8) == 6e14
    # 4 heads at group 4: group 4's table held flat below 8 heads (4e14)
    assert rate(4, 4) == 4e14
    # other passes and kernels without gqa tables: every group at group 1's rate
    assert p.attention_rate("sdpa", "bf16", "bwd", 128, 2048, 8, 4) == pytest.approx(2e14)


def test_a_profile_without_gqa_rates_prices_every_group_at_group_one(tmp_path):
    p = load_profile(_write(tmp_path, _by_heads()))
    for g in (1, 2, 4, 8):
        assert p.attention_rate("sdpa", "bf16", "fwd", 128, 1024, 8, g) == 3e14


@pytest.mark.parametrize("by_group,match", [
    ({"1": {"8": [[1024, 1e14]]}}, r"attention_gqa\.sdpa\.bf16\.fwd: groups must be at least 2"),
    ([[1024, 1e14]], r"attention_gqa\.sdpa\.bf16\.fwd: must map head dims to"),
    ({"four": {"8": [[1024, 1e14]]}}, r"attention_gqa\.sdpa\.bf16\.fwd: .*must be integers"),
    ({"4": {"8": []}}, r"attention_gqa\.sdpa\.bf16\.fwd\.128\.4\.8: must be a non-empty"),
])
def test_a_bad_gqa_table_is_refused(tmp_path, by_group, match):
    with pytest.raises(ProfileError, match=match):
        load_profile(_write(tmp_path, _gqa(by_group)))


def _narrow(sides: dict) -> dict:
    prof = _minimal()
    prof["matmul_narrow"] = {"bf16": _c(sides)}
    return prof


# out: 5e13 at 64, 1e14 at 256 (log2 midpoint 128: 7.5e13); inner: 2e13 at 128, 8e13 at 512
# (midpoint 256: 5e13). The square table [[1024, 1e14], [8192, 4e14]]: 4e14 from side 8192 on.
NARROW = {"out": [[64, 5e13], [256, 1e14]], "inner": [[128, 2e13], [512, 8e13]]}


def test_narrow_sides_cap_the_square_rate(tmp_path):
    p = load_profile(_write(tmp_path, _narrow(NARROW)))
    plain = load_profile(_write(tmp_path, _minimal(), "plain.json"))
    # (2^20 * 128 * 8192)^(1/3) = 2^(40/3) > 8192: the square rate is 4e14; n = 128 is narrow
    assert plain.matmul_rate("bf16", 1 << 20, 128, 8192) == 4e14
    assert p.matmul_rate("bf16", 1 << 20, 128, 8192) == pytest.approx(7.5e13)
    # the output's narrow side is min(m, n): m = 128 caps the same
    assert p.matmul_rate("bf16", 128, 1 << 20, 8192) == pytest.approx(7.5e13)
    # the inner dimension: k = 256 with a wide output, (2^16 * 2^16 * 2^8)^(1/3) = 2^(40/3)
    assert plain.matmul_rate("bf16", 1 << 16, 1 << 16, 256) == 4e14
    assert p.matmul_rate("bf16", 1 << 16, 1 << 16, 256) == pytest.approx(5e13)
    # both narrow: the lower cap; (2^20 * 64 * 128)^(1/3) = 2^11: square rate 2e14
    assert plain.matmul_rate("bf16", 1 << 20, 64, 128) == pytest.approx(2e14)
    assert p.matmul_rate("bf16", 1 << 20, 64, 128) == pytest.approx(2e13)
    # at the last width it still caps; wider is not narrow (no flat hold beyond the table)
    assert p.matmul_rate("bf16", 1 << 20, 256, 8192) == 1e14
    assert p.matmul_rate("bf16", 1 << 20, 257, 8192) == 4e14
    assert p.matmul_rate("bf16", 1 << 20, 4096, 512) == pytest.approx(8e13)
    assert p.matmul_rate("bf16", 1 << 20, 4096, 513) == 4e14
    assert p.matmul_rate("bf16", 1 << 20, 512, 1024) == plain.matmul_rate(
        "bf16", 1 << 20, 512, 1024) == 4e14
    # one side only: the other is not capped
    out_only = load_profile(_write(tmp_path, _narrow({"out": NARROW["out"]}), "out.json"))
    assert out_only.matmul_rate("bf16", 1 << 16, 1 << 16, 256) == 4e14
    assert out_only.matmul_rate("bf16", 1 << 20, 128, 8192) == pytest.approx(7.5e13)


def test_a_narrow_cap_never_raises_the_rate(tmp_path):
    fast = {"out": [[256, 9e14]], "inner": [[256, 9e14]]}
    p = load_profile(_write(tmp_path, _narrow(fast)))
    # 256^3: square side 256, below the table: 1e14; both caps (9e14) apply but are higher
    assert p.matmul_rate("bf16", 256, 256, 256) == 1e14
    assert p.matmul_rate("bf16", 1 << 20, 64, 128) == pytest.approx(2e14)


@pytest.mark.parametrize("sides,match", [
    ({"out": [[64, 1e14]], "middle": [[64, 1e14]]}, r"matmul_narrow\.bf16: must map"),
    ({}, r"matmul_narrow\.bf16: must map"),
    ([[64, 1e14]], r"matmul_narrow\.bf16: must map"),
    ({"out": []}, r"matmul_narrow\.bf16\.out: must be a non-empty list"),
    ({"inner": [[64, -1.0]]}, r"matmul_narrow\.bf16\.inner: must be a non-empty list of "
                              "positive"),
])
def test_a_bad_narrow_table_is_refused(tmp_path, sides, match):
    with pytest.raises(ProfileError, match=match):
        load_profile(_write(tmp_path, _narrow(sides)))


def test_host_op_s_defaults_to_zero_and_must_be_positive(tmp_path):
    assert load_profile(_write(tmp_path, _minimal())).host_op_s == 0.0
    prof = _minimal()
    prof["host_op_s"] = _c(7.5e-6)
    assert load_profile(_write(tmp_path, prof, "host.json")).host_op_s == 7.5e-6
    for i, bad in enumerate((0, -1e-6, "fast", True)):
        prof["host_op_s"] = _c(bad)
        with pytest.raises(ProfileError, match="host_op_s: must be a positive, finite number"):
            load_profile(_write(tmp_path, prof, f"bad{i}.json"))
    prof["host_op_s"] = 7.5e-6
    with pytest.raises(ProfileError, match="host_op_s: .* without a source"):
        load_profile(_write(tmp_path, prof, "bare.json"))


def test_mfu_needs_a_peak_no_priced_rate_exceeds(tmp_path):
    """MFU's denominator is the dtype's peak only while every rate the profile prices in that
    dtype (matmul, any kernel's attention) stays under it: else an MFU could exceed 1."""
    p = load_profile(_write(tmp_path, _minimal()))
    assert p.mfu_peak("bf16") == p.peak_flops("bf16") == 1e15
    assert p.mfu_peak("fp32") is None  # no peak at all
    fast = _minimal()
    fast["attention"]["sdpa"]["bf16"]["bwd"] = _c({"128": {"16": [[1024, 1e14], [4096, 2e15]]}})
    p = load_profile(_write(tmp_path, fast, "fast.json"))
    assert p.peak_flops("bf16") == 1e15 and p.mfu_peak("bf16") is None
    # the shipped GPUs: fp32 attention runs 3xTF32 tensor-core MMAs past the CUDA cores' fp32
    # peak (the suite leaves TF32 off for matmuls), so an fp32 step has no MFU there
    for name in shipped_profiles():
        shipped = load_profile(name)
        assert shipped.mfu_peak("bf16") == shipped.peak_flops("bf16")
        assert shipped.attention_rate("sdpa", "fp32", "fwd", 128, 16384) > shipped.peak_flops(
            "fp32")
        assert shipped.mfu_peak("fp32") is None
