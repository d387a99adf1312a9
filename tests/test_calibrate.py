"""``upipe-bench calibrate``'s measurement (experiments/timing/calibrate.py) on CPU ranks."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest

from experiments import cli
from experiments.config import Cell, Hardware
from experiments.emulation.emulate import emulate_cell
from experiments.timing import calibrate as cal
from experiments.timing.calibrate import calibrate, write_profile
from experiments.timing.calibrate_comm import bus_factor, fit_latency_bandwidth
from experiments.timing.profile import (
    COLLECTIVE_OPS,
    PASSES,
    ProfileError,
    load_profile,
)


@pytest.fixture(scope="module")
def cpu_profile() -> dict:
    """A quick calibration on two gloo ranks (about 4-6 s on 2 cores: its tests are ``slow``)."""
    return calibrate(nproc=2, device="cpu", quick=True)


def _constants(tree, path=""):
    """(field path, constant) for every constant of a profile's JSON."""
    if isinstance(tree, dict) and "value" in tree:
        yield path, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _constants(v, f"{path}.{k}" if path else k)


@pytest.mark.slow  # about 4 s on 2 cores (docs/testing.md)
def test_quick_cpu_profile_round_trips(cpu_profile, tmp_path):
    path = tmp_path / "cpu.json"
    write_profile(cpu_profile, path)
    profile = load_profile(str(path))
    assert profile.device == "cpu" and not profile.side_streams
    for dtype in ("fp32", "bf16"):
        table = cpu_profile["matmul"][dtype]["value"]
        assert table and all(rate > 0 for _, rate in table)
        assert profile.matmul_rate(dtype, 64, 64, 64) > 0
        assert profile.peak_flops(dtype) == max(rate for _, rate in table)
        for kernel in ("sdpa", "math"):
            assert set(cpu_profile["attention"][kernel][dtype]) == set(PASSES)
            assert profile.attention_rate(kernel, dtype, "bwd_causal", 32, 256) > 0
    for scope in ("intra", "inter"):
        for op in COLLECTIVE_OPS:
            bandwidth, latency = profile.collective(op, scope)
            assert bandwidth > 0 and latency >= 0
    assert profile.memory_bandwidth > 0 and profile.launch_overhead_s > 0
    assert profile.host_copy("h2d", pinned=True) > 0


@pytest.mark.slow  # a real calibration (the cpu_profile fixture)
def test_emulation_reads_a_calibrated_profile(cpu_profile, tmp_path):
    """The round trip of the time model: calibrate on CPU -> file -> --hardware PATH -> an
    emulated CPU cell priced on it."""
    path = tmp_path / "cpu.json"
    write_profile(cpu_profile, path)
    cell = Cell("ulysses", "tiny", seq_len=2048, nproc=2, stack="ac")
    row = emulate_cell(cell, Hardware(device="cpu", profile=str(path)), exact=True)
    assert row["status"] == "ok", row["error"]
    assert row["hardware_profile"] == cpu_profile["name"]
    assert row["step_time_s"] > 0 and row["time_compute_s"] > 0


@pytest.mark.slow  # a real calibration (the cpu_profile fixture)
def test_every_source_names_calibrate(cpu_profile):
    constants = dict(_constants({k: v for k, v in cpu_profile.items() if k != "provenance"}))
    assert len(constants) > 30  # device fields, tables, rates, 2 x 5 collectives
    bad = [f for f, c in constants.items() if "upipe-bench calibrate on" not in c["source"]]
    assert not bad, bad
    # one node: the inter-node rates are the intra-node fit, and say so
    inter = cpu_profile["collectives"]["inter"]["all_to_all"]
    assert inter["value"] == cpu_profile["collectives"]["intra"]["all_to_all"]["value"]
    assert inter["source"].startswith("not measured")
    # provenance holds strings only: the loader refuses numbers outside constants
    assert all(v is None or isinstance(v, str) for v in cpu_profile["provenance"].values())


@pytest.mark.slow  # a real calibration (the cpu_profile fixture)
def test_a_profile_that_would_not_load_is_not_written(cpu_profile, tmp_path):
    broken = json.loads(json.dumps(cpu_profile)) | {"memory_bandwidth": 1.0e10}
    with pytest.raises(ProfileError, match="memory_bandwidth: 10000000000.0 is a number"):
        write_profile(broken, tmp_path / "broken.json")
    assert not (tmp_path / "broken.json").exists()


@pytest.mark.slow  # about 4 s on 2 cores (docs/testing.md)
def test_inter_node_rates_from_a_base_profile():
    got = calibrate(nproc=2, device="cpu", quick=True, base="h100-sxm", dtypes=("fp32",))
    shipped = json.loads(Path(load_profile("h100-sxm").path).read_text())
    inter = got["collectives"]["inter"]["all_to_all"]["bus_bandwidth"]
    assert inter["value"] == shipped["collectives"]["inter"]["all_to_all"]["bus_bandwidth"]["value"]
    assert "from profile h100-sxm" in inter["source"]
    assert set(got["matmul"]) == {"fp32"}


@pytest.mark.parametrize("kwargs, match", [
    ({"nproc": 1}, "needs nproc >= 2"),
    ({"nproc": 2, "dtypes": ("fp8",)}, "dtypes must be"),
    ({"nproc": 2, "device": "tpu"}, "device must be"),
])
def test_refused_before_anything_runs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        calibrate(**({"device": "cpu"} | kwargs))


def test_fit_recovers_latency_and_bandwidth():
    latency, bandwidth = 20e-6, 5e9
    points = [(b, latency + b / bandwidth) for b in (1e3, 1e5, 1e7, 1e9)]
    *got, resolved = fit_latency_bandwidth(points)
    assert got == pytest.approx((latency, bandwidth), rel=1e-9) and resolved
    # times that shrink with size (noise) cannot give a negative latency
    lat, bw, _ = fit_latency_bandwidth([(1e3, 1e-3), (1e6, 1e-3), (4e6, 1.5e-3)])
    assert lat >= 0 and bw > 0


def test_times_flat_in_size_keep_their_latency():
    """gloo on a loaded CPU: every size latency-bound (a quick calibration's all-to-all, 4 KB
    0.906 ms, 64 KB 1.01 ms, 1 MB 0.855 ms). The fit had set the latency to 0 and priced a
    4 KB call at 3.5 us; now the latency is the latency-only least squares (sum u / sum u^2,
    u = 1 / t) and the bandwidth the least the points allow (the largest bytes / time)."""
    points = [(4096, 0.906e-3), (65536, 1.01e-3), (2**20, 0.855e-3)]
    lat, bw, resolved = fit_latency_bandwidth(points)
    u = [1 / t for _, t in points]
    assert not resolved
    assert lat == pytest.approx(sum(u) / sum(x * x for x in u), rel=1e-12)
    assert 0.85e-3 < lat < 1.01e-3
    assert bw == pytest.approx(2**20 / 0.855e-3, rel=1e-12)
    # the latency-bound 4 KB call is priced within 10% (it had been 257x low), and no point's
    # transfer is priced longer than the whole measured call
    assert lat + 4096 / bw == pytest.approx(0.906e-3, rel=0.1)
    assert all(b / bw <= t for b, t in points)


def test_host_op_count_is_that_of_every_timed_call():
    """host_op_s is a timed call's time over the ops counted once: every call must dispatch
    what was counted. Gradients left set made later calls sum them (9 more add_ ops: 51 timed
    against 42 counted, host_op_s 21% high)."""
    import torch

    step, n_ops = cal._eager_step(torch.device("cpu"))
    for _ in range(3):
        with cal._OpCount() as count:
            step()
        assert count.n == n_ops


def test_bus_factors_follow_nccl_tests():
    assert bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert bus_factor("all_gather", 8) == bus_factor("all_to_all", 8) == pytest.approx(7 / 8)
    assert bus_factor("p2p", 8) == 1.0


# -- upipe-bench calibrate --out -----------------------------------------------------------------


def _no_measuring(**_):
    pytest.fail("calibrate measured before --out was checked")


@pytest.mark.parametrize("where, rule", [
    ("a directory", "is a directory"),
    ("under a file", "is a file, not a directory"),
    pytest.param("an unwritable directory", "is not writable", marks=pytest.mark.skipif(
        os.geteuid() == 0, reason="root writes anywhere")),
])
def test_a_bad_out_is_refused_before_measuring(tmp_path, monkeypatch, capsys, where, rule):
    """The measurements take minutes: an --out they could not be written to is exit 2 naming
    --out and the rule, before measuring (it was a traceback after)."""
    (tmp_path / "file").write_text("")
    (tmp_path / "locked").mkdir(mode=0o500)
    out = {"a directory": tmp_path, "under a file": tmp_path / "file" / "node.json",
           "an unwritable directory": tmp_path / "locked" / "node.json"}[where]
    monkeypatch.setattr(cli, "calibrate", _no_measuring)
    assert cli.main(["calibrate", "--device", "cpu", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and rule in err, err


def test_out_creates_missing_folders_as_every_writer_does(tmp_path, monkeypatch, capsys):
    """Missing folders above --out are created (``store.write_text``), not refused."""
    shipped = json.loads((Path(__file__).parent / "data" / "profile_unit_cpu.json").read_text())
    monkeypatch.setattr(cli, "calibrate", lambda **_: shipped)
    out = tmp_path / "new" / "node.json"
    assert cli.main(["calibrate", "--device", "cpu", "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == shipped


@pytest.mark.slow  # about 4 s on 2 cores (docs/testing.md)
def test_a_grid_by_heads_and_narrow_widths_round_trips(monkeypatch, tmp_path):
    """The CUDA grid's shape on CPU ranks: attention timed per heads per call gives tables by
    heads, grouped-query calls (CPU sdpa standing in for a kernel sharing K/V) give
    ``attention_gqa`` by group, narrow products give ``matmul_narrow``, the eager step gives
    ``host_op_s``; the profile loads and the time model reads each (the rates are the CPU's)."""
    quick = cal.GRIDS["cpu", True]
    grid = dataclasses.replace(quick, heads=(1, 2), max_head_tokens=512**2,
                               narrow_widths=(8, 16), narrow_m=128, narrow_k=32,
                               gqa_groups=(2,), gqa_kernels=("sdpa",))
    monkeypatch.setitem(cal.GRIDS, ("cpu", True), grid)
    raw = calibrate(nproc=2, device="cpu", quick=True, dtypes=("fp32",))
    write_profile(raw, tmp_path / "p.json")
    profile = load_profile(str(tmp_path / "p.json"))
    by_heads = raw["attention"]["sdpa"]["fp32"]["fwd_causal"]["value"]["32"]
    assert set(by_heads) == {"1", "2"}
    # heads x S^2 over the cap is not timed: 512 tokens only with one head
    assert [s for s, _ in by_heads["1"]] == [128, 256, 512]
    assert [s for s, _ in by_heads["2"]] == [128, 256]
    assert profile.attention_rate("sdpa", "fp32", "fwd_causal", 32, 256, heads=2) == \
        pytest.approx(dict(by_heads["2"])[256])
    # group 2: two query heads over one K/V head, causal passes only, at the heads it divides
    gqa = raw["attention_gqa"]["sdpa"]["fp32"]
    assert set(gqa) == {"fwd_causal", "bwd_causal"}
    assert set(gqa["fwd_causal"]["value"]["32"]) == {"2"}
    by_group = gqa["bwd_causal"]["value"]["32"]["2"]
    assert set(by_group) == {"2"} and [s for s, _ in by_group["2"]] == [128, 256]
    assert profile.attention_rate("sdpa", "fp32", "bwd_causal", 32, 256, heads=2, group=2) == \
        pytest.approx(dict(by_group["2"])[256])
    narrow = raw["matmul_narrow"]["fp32"]["value"]
    assert [w for w, _ in narrow["out"]] == [8, 16] == [w for w, _ in narrow["inner"]]
    assert profile.matmul_rate("fp32", 128, 8, 32) <= dict(narrow["out"])[8]
    assert raw["host_op_s"]["value"] > 0 and profile.host_op_s == raw["host_op_s"]["value"]
    # on CPU the host's cost per op is the kernel floor too: the two are one measurement
    assert raw["launch_overhead_s"]["value"] == raw["host_op_s"]["value"]


def test_each_point_is_timed_after_an_untimed_call():
    """The first call of a shape pays one-off costs; the timed samples never include it."""
    calls = []

    def fn():
        calls.append(time.perf_counter())
        if len(calls) == 1:
            time.sleep(0.3)  # a cold first call, longer than half the point's budget

    grid = cal.GRIDS["cpu", True]
    t = cal._time(fn, lambda: None, grid)
    assert t < 0.1 and len(calls) >= 3
