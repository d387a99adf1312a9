"""``upipe-bench plan`` (docs/design.md#the-time-model): configurations a cluster can run, the stack
ladder, the ranking, a Hugging Face config.json as the model, and bad input."""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from experiments import cli
from experiments.config import Cell, Hardware, Status
from experiments.emulation.emulate import device_lower_bound, emulate_cell
from experiments.emulation.fit import N_SAMPLE, depth_lower_bound
from experiments.runner import plan as plan_mod
from experiments.runner import plan_keep, plan_ladder
from experiments.runner.plan import default_workers, plan
from experiments.runner.plan_rank import rank
from experiments.runner.plan_spec import LADDER, LONG_CHUNK, PlanSpec, configurations
from experiments.store import row_problem

CPU_PROFILE = str(Path(__file__).parent / "data" / "profile_unit_cpu.json")


def test_configurations_cover_every_mesh_and_heads_per_stage():
    cells, invalid = configurations(PlanSpec("tiny", 4, 4096, methods=("upipe", "usp", "ring")))
    got = {(c.method, c.ring_degree, c.option("heads_per_stage")) for c in cells}
    # tiny: 16 query heads, 4 KV heads; UPipe's U is a multiple of the Ulysses degree (4 / R)
    upipe = {(r, u) for m, r, u in got if m == "upipe"}
    # (U must also divide the 16 heads: no 12 at R = 1, no 6, 10, 12, 14 at R = 2)
    assert upipe == ({(1, u) for u in (4, 8, 16)} | {(2, u) for u in (2, 4, 8, 16)}
                     | {(4, u) for u in (1, 2, 4, 8, 16)})
    assert {(r, u) for m, r, u in got if m == "usp"} == {(1, None), (2, None), (4, None)}
    assert {(r, u) for m, r, u in got if m == "ring"} == {(1, None)}
    # UPipe's overlapped stages: once, on the plain Ulysses mesh at the default U
    overlapped = [(c.method, c.ring_degree, c.option("heads_per_stage")) for c in cells
                  if c.option("overlap")]
    assert overlapped == [("upipe", 1, 4)]
    # beyond the paper: UPipe on the long level with its chunked backward, likewise once
    long = [(c.method, c.ring_degree, c.option("heads_per_stage"), c.option("chunk_size"))
            for c in cells
            if c.stack == "long"]
    assert long == [("upipe", 1, 4, LONG_CHUNK)]
    assert invalid == []


def test_ring_degrees_narrow_the_hybrids_meshes_only():
    """``--ring-degrees``: the hybrids (UPipe, USP) on the named meshes only; a method without
    a mesh is planned as ever; a degree that does not divide the CP degree is refused."""
    spec = PlanSpec("tiny", 4, 4096, methods=("upipe", "usp", "ring"), ring_degrees=(1, 4))
    cells, _ = configurations(spec)
    assert {(c.method, c.ring_degree) for c in cells} == {
        ("upipe", 1), ("upipe", 4), ("usp", 1), ("usp", 4), ("ring", 1)}
    everything, _ = configurations(PlanSpec("tiny", 4, 4096, methods=("upipe", "usp", "ring")))
    assert {c for c in everything if c.ring_degree != 2} == set(cells)
    for rings in ((3,), (0,), ()):
        with pytest.raises(ValueError, match=r"ring_degrees must be divisors of the CP degree "
                                             r"\(4\)"):
            configurations(PlanSpec("tiny", 4, 4096, ring_degrees=rings))


def test_the_long_variant_is_planned_on_its_level_only_and_when_asked(monkeypatch):
    monkeypatch.setattr(plan_ladder, "emulate_cell",
                        _fake_emulation({"long": "ok", "long-attn-host": "host"}))
    spec = PlanSpec("tiny", 4, 4096, methods=("upipe",))
    (cell,) = [c for c in configurations(spec)[0] if c.stack == "long"]
    # by default beside its level keeping the attention in host memory (selective levels)
    rows = plan_ladder.plan_configuration(cell, Hardware(), spec.stacks)
    assert [(r["stack"], r["status"]) for r in rows] == [("long", Status.OK),
                                                          ("long-attn-host", Status.OOM)]
    rows = plan_ladder.plan_configuration(cell, Hardware(), ("alst", "long"))
    assert [(r["stack"], r["status"]) for r in rows] == [("long", Status.OK)]
    without = PlanSpec("tiny", 4, 4096, methods=("upipe",), stacks=("alst",))
    assert all(c.stack == "alst" for c in configurations(without)[0])
    # the long levels alone: UPipe's variant only, and a row saying so for every other method
    # (it had none: the plan printed UPipe's row and said nothing of Ulysses)
    only = PlanSpec("tiny", 4, 4096, methods=("upipe", "ulysses"), stacks=("long",))
    cells, rows = configurations(only)
    assert [(c.method, c.stack) for c in cells] == [("upipe", "long")]
    (row,) = rows
    assert (row["method"], row["stack"], row["status"]) == ("ulysses", "long", Status.SKIPPED)
    assert row["error"].startswith("long: planned for UPipe only")


def test_the_default_plan_weighs_selective_recomputation_and_not_the_paper_only_stacks():
    """Memory into speed is the default question: every selective level is planned unless
    ``--stacks`` leaves it out; the stacks that reproduce the paper's FPDT and PyTorch-CP runs
    are planned when named."""
    stacks = PlanSpec("tiny", 4, 4096).stacks
    assert {"alst-attn", "alst-attn-host", "alst-block", "long-attn-host"} <= set(stacks)
    assert {"alst", "offload", "native", "ac", "none", "long"} <= set(stacks)
    assert not {"megatron-ds", "torchtitan"} & set(stacks)


def test_a_cluster_a_method_cannot_use_is_an_invalid_row_naming_the_rule():
    # 3 ranks: neither 16 query heads nor 4 KV heads split over 3 Ulysses ranks
    cells, invalid = configurations(PlanSpec("tiny", 3, 3 * 1024, methods=("ulysses",)))
    assert cells == []
    assert [r["status"] for r in invalid] == [Status.INVALID]
    assert "n_heads" in invalid[0]["error"] or "heads" in invalid[0]["error"]


def _fake_emulation(outcome: dict):
    """An emulate_cell stand-in: each stack's status from ``outcome`` (``device``: over the
    device budget; ``host``: over the host budget only; ``ok``)."""
    def emulate(cell, hw, exact=False, count=True, bound_first=False):
        kind = outcome[cell.stack]
        row = {"method": cell.method, "stack": cell.stack, "nproc": cell.nproc,
               "ring_degree": cell.ring_degree, "heads_per_stage": cell.option("heads_per_stage")}
        if kind == "ok":
            return row | {"status": Status.OK, "error": "", "tokens_per_s_per_gpu": 1.0}
        return row | {"status": Status.OOM, "error": f"{kind} peak 9 GiB > budget 8 GiB"}
    return emulate


@pytest.mark.parametrize("outcome,emulated", [
    # alst over the device: nothing heavier is emulated (megatron-ds and torchtitan have no
    # lighter level)
    ({"alst": "device", "megatron-ds": "ok", "torchtitan": "ok"},
     {"alst", "megatron-ds", "torchtitan"}),
    # alst fits, offload does not: ac (needs offload and native) and none (needs ac) are not;
    # the selective levels (alst's own, keeping more) are
    ({"alst": "ok", "offload": "device", "native": "ok", "megatron-ds": "device",
      "torchtitan": "device", "alst-attn": "device", "alst-attn-host": "ok",
      "alst-block": "device"},
     {"alst", "offload", "native", "megatron-ds", "torchtitan", "alst-attn", "alst-attn-host",
      "alst-block"}),
    # over the host budget only says nothing of the device: the ladder goes on
    ({s: "host" for s in LADDER}, set(LADDER)),
])
def test_the_stack_ladder_emulates_a_heavier_level_only_if_the_lighter_ones_fit(
        monkeypatch, outcome, emulated):
    monkeypatch.setattr(plan_ladder, "emulate_cell", _fake_emulation(outcome))
    cell = configurations(PlanSpec("tiny", 2, 4096, methods=("ulysses",)))[0][0]
    rows = plan_ladder.plan_configuration(cell, Hardware(), tuple(LADDER))
    assert [r["stack"] for r in rows] == list(LADDER)
    assert {r["stack"] for r in rows if "plan_inferred_from" not in r} == emulated
    for r in rows:
        if "plan_inferred_from" in r:
            assert r["status"] == Status.SKIPPED
            assert r["plan_inferred_from"] in LADDER[r["stack"]]


@pytest.mark.slow  # about 4 s on 2 cores (docs/testing.md)
def test_more_heads_per_stage_never_keep_less_on_the_device():
    """What the planner's inference over U rests on (``plan._over_by_u``): exact emulations of
    UPipe on tiny (16 heads), U from 2 to 16, on two stacks and both mesh shapes (alst: the
    peak is the attention's, so it grows; offload: it is elsewhere, so it stays)."""
    for stack, ring in (("alst", 1), ("offload", 2)):
        peaks = []
        for u in (2, 4, 16):
            cell = Cell(method="upipe", model="tiny", nproc=4 if ring > 1 else 2, seq_len=4096,
                        ring_degree=ring, options={"heads_per_stage": u}, stack=stack, dtype="bf16")
            peaks.append(emulate_cell(cell, Hardware(), exact=True, count=False)[
                "peak_device_bytes"])
        assert peaks == sorted(peaks), (stack, ring, peaks)
        assert (peaks[-1] > peaks[0]) == (stack == "alst")


@pytest.mark.slow  # about 1 s on 2 cores (docs/testing.md)
def test_a_heads_per_stage_over_the_device_spares_the_larger_ones(monkeypatch):
    """Serially (one worker) the plan starts U = 4 first (most stages), then 8, then 16: once 8
    is over the device on alst, 16 is not emulated on any stack (each row says why)."""
    emulated = []

    def emulate(cell, hw, exact=False, count=True, bound_first=False):
        emulated.append((cell.option("heads_per_stage"), cell.stack))
        over = cell.option("heads_per_stage") >= 8 and cell.stack == "alst"
        row = {"method": cell.method, "stack": cell.stack, "heads_per_stage":
               cell.option("heads_per_stage"), "ring_degree": cell.ring_degree}
        if over:
            return row | {"status": Status.OOM, "error": "device peak 9 GiB > budget 8 GiB"}
        return row | {"status": Status.OK, "error": "", "tokens_per_s_per_gpu": 1.0}

    for module in (plan_ladder, plan_keep):
        monkeypatch.setattr(module, "emulate_cell", emulate)
    spec = PlanSpec("tiny", 4, 4096, methods=("upipe",), stacks=("alst", "offload"))
    rows = plan(spec, Hardware(), workers=1)
    r1 = {(r["heads_per_stage"], r["stack"]): r for r in rows if r["ring_degree"] == 1}
    assert {(u, s) for u, s in r1} == {(u, s) for u in (4, 8, 16) for s in ("alst", "offload")}
    assert r1[8, "alst"]["status"] == Status.OOM  # emulated
    assert r1[8, "offload"]["plan_inferred_from"] == "alst"  # the ladder
    row = r1[16, "alst"]
    assert row["status"] == Status.SKIPPED and row["plan_inferred_from"] == "heads_per_stage=8"
    assert "8 heads per stage do not fit" in row["error"]
    assert r1[16, "offload"]["plan_inferred_from"] == "alst"  # and the ladder from there
    assert (16, "alst") not in emulated and (4, "offload") in emulated


@pytest.mark.slow  # about 1-2 s on 2 cores (docs/testing.md)
def test_the_plan_is_the_same_for_any_number_of_workers(monkeypatch):
    """Two workers, U = 8 slow to emulate and over the device on alst: each larger U of its
    mesh waits for it rather than start on the free worker, so U = 16 is inferred, not
    emulated, and the ranked table equals one worker's, row for row (rows equal in rank in
    the order of their configuration, not of their finishing)."""
    emulated = []

    def emulate(cell, hw, exact=False, count=True, bound_first=False):
        u = cell.option("heads_per_stage")
        emulated.append((u, cell.ring_degree, cell.stack))
        if u == 8:
            time.sleep(0.2)  # the other worker is free meanwhile
        row = {"method": cell.method, "stack": cell.stack, "heads_per_stage": u,
               "ring_degree": cell.ring_degree, "overlap": cell.option("overlap")}
        if u and u >= 8 and cell.stack == "alst":
            return row | {"status": Status.OOM, "error": "device peak 9 GiB > budget 8 GiB",
                          "peak_device_bytes": 9 * 2**30}
        return row | {"status": Status.OK, "error": "", "tokens_per_s_per_gpu": 1.0}

    for module in (plan_ladder, plan_keep):
        monkeypatch.setattr(module, "emulate_cell", emulate)
    # threads in place of worker processes, so the stub above is what they call
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor",
                        lambda n, mp_context=None: ThreadPoolExecutor(n))
    spec = PlanSpec("tiny", 4, 4096, methods=("upipe",), stacks=("alst",))
    tables = {}
    for workers in (2, 1):
        emulated.clear()
        tables[workers] = plan(spec, Hardware(), workers=workers)
        assert not [e for e in emulated if e[0] == 16], (workers, emulated)
    assert tables[2] == tables[1]
    inferred = [r for r in tables[2] if r.get("plan_inferred_from") == "heads_per_stage=8"]
    assert inferred and all(r["heads_per_stage"] == 16 for r in inferred)


def test_a_schedule_where_every_configuration_waits_is_an_error_not_a_hang(monkeypatch):
    monkeypatch.setattr(plan_mod, "_spares", lambda family, u, cell: True)
    spec = PlanSpec("tiny", 4, 4096, methods=("upipe",), stacks=("alst",))
    with pytest.raises(RuntimeError, match="waits on another"):
        plan(spec, Hardware(), workers=2)


@pytest.mark.slow  # about 3 s on 2 cores (docs/testing.md)
def test_the_device_lower_bound_is_below_the_peak_and_decides_only_when_over():
    """``device_lower_bound``: 1, then 4, of 8 layers at the full length, exactly; never above
    the 8-layer model's emulated peak; a row (oom, "at least") only when over the budget, from
    the shallowest depth that proves it."""
    def cell(layers, **kw):
        return Cell(method="ulysses", model="tiny", overrides=(("n_layers", str(layers)),),
                    nproc=2, seq_len=4096, stack="offload", dtype="bf16", **kw)

    full, four, one = (emulate_cell(cell(n), Hardware(), exact=True, count=False)
                       ["peak_device_bytes"] for n in (8, 4, 1))
    assert 0 < one < four < full
    # a budget between the 4-layer bound and the model: the bounds prove nothing, the full
    # emulation says over
    between = cell(8, budget_mib=(four + full) / 2 / 2**20)
    assert device_lower_bound(between, Hardware()) is None
    assert emulate_cell(between, Hardware(), exact=True, count=False)["status"] == Status.OOM
    # between one layer and four: the 4-layer step proves it
    row = device_lower_bound(cell(8, budget_mib=(one + four) / 2 / 2**20), Hardware())
    assert row["status"] == Status.OOM and row["peak_device_is_lower_bound"]
    assert row["peak_device_bytes"] == four and "(4 of the model's 8 layers" in row["error"]
    assert row_problem(row) is None  # a row a sweep's store takes
    # below one layer: one layer proves it
    below = cell(8, budget_mib=one / 2 / 2**20)
    row = device_lower_bound(below, Hardware())
    assert row["status"] == Status.OOM and row["peak_device_is_lower_bound"]
    assert row["peak_device_bytes"] == one and "device peak at least" in row["error"]
    assert "(1 of the model's 8 layers" in row["error"]
    # the tiled stack's op count grows with the length: no bound, nothing emulated
    assert device_lower_bound(Cell.from_dict(below.to_dict() | {"stack": "alst"}),
                              Hardware()) is None


@pytest.mark.slow  # about 9 s on 2 cores (docs/testing.md)
def test_the_fits_shallow_bound_is_below_the_peak_and_decides_only_when_over():
    """``emulate_cell(bound_first=True)``: the fit's 4-layer samples predicted at the full
    length, plus the further layers' parameter and optimizer shards, never above the deeper
    model's exact peak; a row (oom, "at least", no time) only when over the budget, else the
    fit's own row, unchanged."""
    def cell(layers, **kw):
        return Cell(method="ulysses", model="tiny", overrides=(("n_layers", str(layers)),),
                    nproc=2, seq_len=4096, stack="alst", dtype="bf16", **kw)

    # counted (FLOPs and bytes, as the last case below asks): its window samples then serve
    # the memory-only calls too (fit._cached), and the memory-only fit below takes them beside
    # 5-layer samples of its own (it failed so, reading their bytes sent, until Fit.counted
    # asked every window sample)
    bound = depth_lower_bound(cell(6), Hardware())
    full, four = (emulate_cell(cell(n), Hardware(), exact=True, count=False)
                  ["peak_device_bytes"] for n in (6, N_SAMPLE[0]))
    assert four < bound.peak_device_bytes <= full
    # the 4-layer line is exact: what the bound adds is (6 - 4) blocks' states, each at least
    # the fp32 parameter shard and Adam's two fp32 states of a tiny block over 2 ranks (12 bytes
    # a parameter), at most that plus the allocator's 512-byte rounding of their 4 tensors each
    per_block, rem = divmod(bound.peak_device_bytes - four, 6 - N_SAMPLE[0])
    cfg = cell(6).validate()
    params = (2 * cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim * cfg.dim \
        + 3 * cfg.dim * cfg.ffn_dim + 2 * cfg.dim
    assert rem == 0 and 12 * params // 2 <= per_block <= 12 * params // 2 + 9 * 4 * 512
    between = cell(6, budget_mib=(bound.peak_device_bytes + full) / 2 / 2**20)
    row = emulate_cell(between, Hardware(), count=False, bound_first=True)
    plain = emulate_cell(between, Hardware(), count=False)
    assert row["status"] == Status.OOM and row["emulation"] == "fit"
    assert {k: v for k, v in row.items() if k not in ("emulation_s", "date_utc")} == {
        k: v for k, v in plain.items() if k not in ("emulation_s", "date_utc")}
    below = cell(6, budget_mib=(four + bound.peak_device_bytes) / 2 / 2**20)
    row = emulate_cell(below, Hardware(), bound_first=True)
    assert row["status"] == Status.OOM and row["peak_device_is_lower_bound"]
    assert row["peak_device_bytes"] == bound.peak_device_bytes
    assert "device peak at least" in row["error"] and "4-layer samples" in row["error"]
    assert row.get("step_time_s") is None and row["emulation"] == "lower bound"
    assert row_problem(row) is None  # a search's probe: a row its sweep stores


def test_ranking_puts_what_fits_first_fastest_first():
    rows = [
        {"status": Status.SKIPPED, "error": "x"},
        {"status": Status.OOM, "peak_device_bytes": 9},
        {"status": Status.OK, "tokens_per_s_per_gpu": 10.0},
        {"status": Status.INVALID, "error": "y"},
        {"status": Status.OOM, "peak_device_bytes": 5},
        {"status": Status.OK, "tokens_per_s_per_gpu": 30.0},
    ]
    ranked = rank(rows)
    assert [r["status"] for r in ranked] == [Status.OK, Status.OK, Status.OOM, Status.OOM,
                                              Status.SKIPPED, Status.INVALID]
    assert [r.get("tokens_per_s_per_gpu") for r in ranked[:2]] == [30.0, 10.0]
    assert [r.get("peak_device_bytes") for r in ranked[2:4]] == [5, 9]


@pytest.mark.slow  # about 1 s on 2 cores (docs/testing.md)
def test_a_small_real_plan_emulates_and_ranks(tmp_path):
    """tiny on 2 CPU "GPUs", Ulysses on two stacks, emulated with the CPU unit profile: every
    row has a time and the ranking follows the emulated tokens/s."""
    # two layers: fewer than the fit's samples, so each stack is one exact emulation
    spec = PlanSpec("tiny", 2, 2048, overrides=(("n_layers", "2"),), methods=("ulysses",),
                    stacks=("alst", "ac"))
    hw = Hardware(device="cpu", profile=CPU_PROFILE)
    rows = plan(spec, hw, workers=1)
    assert {r["stack"] for r in rows} == {"alst", "ac"}
    ok = [r for r in rows if r["status"] == Status.OK]
    assert ok and all(r["step_time_s"] > 0 for r in ok)
    tps = [r["tokens_per_s_per_gpu"] for r in ok]
    assert tps == sorted(tps, reverse=True)


def test_plan_reads_a_hugging_face_config_and_prints_json(tmp_path, capsys):
    config = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 256,
              "num_attention_heads": 16, "num_key_value_heads": 4, "intermediate_size": 768,
              "vocab_size": 1024, "rope_theta": 500000.0, "rms_norm_eps": 1e-5}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code = cli.main(["plan", "--model", str(path), "--gpus", "2", "--seq-len", "2K",
                     "--methods", "ulysses", "--stacks", "alst", "--emulate-device", "cpu",
                     "--hardware", CPU_PROFILE, "--workers", "1", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["model"] == str(path) and out["gpus"] == 2
    q = out["question"]  # what was asked, flags included
    assert (q["methods"], q["stacks"], q["ring_degrees"], q["dp"], q["dtype"]) == (
        ["ulysses"], ["alst"], None, 1, "bf16")
    assert ["n_layers", "2"] in q["overrides"] and q["label"] == str(path)
    assert out["rows"][0]["model_n_layers"] == 2 and out["rows"][0]["model_dim"] == 256
    assert out["plan"][0]["fits"] == "yes" and out["plan"][0]["tokens_per_s_per_gpu"] > 0


@pytest.mark.parametrize("argv,match", [
    (["--hardware", "no-such-gpu"], "--hardware"),
    (["--methods", "ulysses,warp-drive"], "--methods must be among"),
    (["--stacks", "alst,turbo"], "--stacks must be among"),
    (["--model", "no-such-model"], "--model must be a preset"),
    # a cell's rules whatever the method: refused up front, not an invalid row per method
    (["--seq-len", "0"], "--seq-len (0) must be >= 2 and divisible by the CP degree (2)"),
    (["--seq-len", "2049"], "--seq-len (2049)"),
    (["--gpus", "4", "--dp", "3"], "--dp must be >= 1 and divide --gpus (4)"),
    # inf and nan were let through, to fail later as a traceback (OverflowError)
    (["--gpu-mem", "inf"], "--gpu-mem must be a finite positive number, got inf"),
    (["--host-mem", "nan"], "--host-mem must be a finite positive number, got nan"),
    # planned twice, the same cells twice
    (["--methods", "upipe,ulysses,upipe"], "--methods must name each once"),
    # the default reserve over the device blames --gpu-mem, not the --reserve nobody gave
    (["--gpu-mem", "5"], "--gpu-mem must be above the reserve kept off the device budget "
                         "unless --reserve (not given) sets a smaller one, got 5.0 GiB against "
                         "6.3 GiB (the default reserve)"),
])
def test_bad_plan_input_is_a_clear_error(capsys, argv, match):
    base = {"--model": "tiny", "--gpus": "2", "--seq-len": "2K"}
    for flag, value in zip(argv[::2], argv[1::2], strict=True):
        base[flag] = value
    code = cli.main(["plan", *[x for kv in base.items() for x in kv]])
    assert code == 2
    assert match in capsys.readouterr().err


def test_a_methods_measured_reserve_over_the_device_is_its_invalid_row_before_emulating(
        monkeypatch):
    """fpdt's measured 10 GiB reserve on an 8 GiB device (the default 6.3 fits): fpdt is one
    invalid row naming --gpu-mem and the method, never emulated (its first emulation raised
    and ended the whole plan), and the other methods are planned as ever."""
    emulated = []
    fake = _fake_emulation({"alst": "ok"})
    for module in (plan_ladder, plan_keep):
        monkeypatch.setattr(module, "emulate_cell",
                            lambda cell, hw, **kw: emulated.append(cell.method) or fake(cell, hw))
    spec = PlanSpec("tiny", 2, 2048, methods=("fpdt", "ulysses"), stacks=("alst",))
    rows = plan(spec, Hardware(gpu_mem_gib=8.0), workers=1)
    assert set(emulated) == {"ulysses"}
    (fpdt,) = [r for r in rows if r["method"] == "fpdt"]
    assert fpdt["status"] == Status.INVALID
    assert fpdt["error"].startswith("fpdt's measured reserve, 10 GiB")
    assert "is not below --gpu-mem (8 GiB)" in fpdt["error"] and "--reserve" in fpdt["error"]
    # a reserve given applies to every method: fpdt is planned with it
    emulated.clear()
    plan(spec, Hardware(gpu_mem_gib=8.0, reserve_gib=2.0), workers=1)
    assert set(emulated) == {"fpdt", "ulysses"}


def test_upipe_off_the_long_levels_mesh_is_told_which_ring_degrees_leave_it_out():
    """--stacks long --ring-degrees 2: UPipe's long variant is on ring degree 1 only; its row
    said "planned for UPipe only" to UPipe."""
    spec = PlanSpec("tiny", 4, 4096, methods=("upipe",), stacks=("long",), ring_degrees=(2,))
    cells, (row,) = configurations(spec)
    assert cells == [] and row["status"] == Status.SKIPPED
    assert row["error"].startswith("long: planned on the plain Ulysses mesh (ring degree 1) "
                                   "only, which --ring-degrees 2 leaves out")


def test_more_ulysses_ranks_than_heads_is_a_row_not_a_crash():
    """32 ranks, 16 heads: no U on the plain Ulysses mesh (it raised IndexError)."""
    cells, invalid = configurations(PlanSpec("tiny", 32, 32 * 1024, methods=("upipe",),
                                             ring_degrees=(1,)))
    assert cells == [] and [r["status"] for r in invalid] == [Status.INVALID]


def _one_node_profile(tmp_path) -> str:
    """The CPU unit profile as ``upipe-bench calibrate`` writes it on one node without
    --base: each inter-node collective a copy of the intra-node one, its source saying so."""
    raw = json.loads(Path(CPU_PROFILE).read_text())
    raw["collectives"]["inter"] = {
        op: {"value": c["value"], "source": "not measured by upipe-bench calibrate (one node: "
             f"no inter-node link): a copy of collectives.intra.{op}, {c['source']}"}
        for op, c in raw["collectives"]["intra"].items()}
    path = tmp_path / "one_node.json"
    path.write_text(json.dumps(raw))
    return str(path)


def test_a_one_node_calibration_across_nodes_warns_its_inter_node_times_are_copies(
        tmp_path, capsys, monkeypatch):
    """4 GPUs, 2 per node, on a profile calibrated on one node: the table's header and the
    JSON say the inter-node collectives are priced at intra-node speed; one node, or a
    profile that measured them, says nothing (the plan itself stubbed)."""
    row = {"status": Status.OK, "method": "ulysses", "nproc": 4, "ring_degree": 1,
           "stack": "alst", "peak_device_bytes": 2**25, "peak_host_bytes": 0}
    monkeypatch.setattr(cli, "plan", lambda spec, hw, **_: [row])
    argv = ["plan", "--model", "tiny", "--gpus", "4", "--seq-len", "4K", "--no-progress",
            "--hardware", _one_node_profile(tmp_path)]
    assert cli.main([*argv, "--gpus-per-node", "2"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("warning: inter-node times not measured: the 4 GPUs span 2 nodes")
    assert "are copies of its intra-node ones" in first
    assert cli.main([*argv, "--gpus-per-node", "2", "--json"]) == 0
    (warning,) = json.loads(capsys.readouterr().out)["warnings"]
    assert warning == first.removeprefix("warning: ")
    assert cli.main([*argv, "--json"]) == 0  # one node of 8
    assert json.loads(capsys.readouterr().out)["warnings"] == []
    measured = ["plan", "--model", "tiny", "--gpus", "4", "--seq-len", "4K", "--no-progress",
                "--hardware", CPU_PROFILE, "--gpus-per-node", "2", "--json"]
    assert cli.main(measured) == 0
    assert json.loads(capsys.readouterr().out)["warnings"] == []


def test_the_default_workers_are_the_cpus_this_process_may_use(monkeypatch):
    """``plan``'s default (and the CLI's ``--workers``): one emulation per CPU of the process's
    affinity, not of the machine, and ``os.cpu_count`` where affinity is unknown; never more
    than physical memory holds at ``WORKER_BYTES`` each."""
    pages = {"SC_PHYS_PAGES": 2**20, "SC_PAGE_SIZE": 2**12}  # 4 GiB
    monkeypatch.setattr(os, "sysconf", lambda name: pages[name])
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert default_workers() == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert default_workers() == 4 * 2**30 // plan_mod.WORKER_BYTES == 4
    assert cli.parser().parse_args(["plan", "--model", "tiny", "--gpus", "4",
                                      "--seq-len", "4096"]).workers is None
    monkeypatch.delattr(os, "sched_getaffinity")
    pages["SC_PHYS_PAGES"] = 2**30  # 4 TiB: the CPUs decide
    assert default_workers() == 64
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert default_workers() == 1


def test_a_plan_line_writes_the_mesh_as_ulysses_by_ring_and_no_bound_as_a_host_figure():
    """Rings are 1 x P, as the paper and the README write them (they were P x 1); a row found
    over the device by a lower bound (a shallower step's figures) has no host figure; a peak
    under 1 GiB keeps two significant digits (it was 0)."""
    base = {"status": Status.OK, "nproc": 8, "stack": "alst", "chunk_size": None,
            "peak_device_bytes": 54_736_456, "peak_host_bytes": 3 << 30}
    line = cli._plan_line(base | {"method": "zigzag-ring", "ring_degree": 1})
    assert line["mesh"] == "1x8" and line["peak_device_gib"] == 0.051
    assert line["peak_host_gib"] == 3.0
    assert cli._plan_line(base | {"method": "usp", "ring_degree": 2})["mesh"] == "4x2"
    bound = cli._plan_line(base | {"method": "upipe", "status": Status.OOM,
                                   "peak_device_is_lower_bound": True,
                                   "error": "device peak at least ..."})
    assert bound["mesh"] == "8x1" and bound["peak_host_gib"] is None


def test_over_budget_figures_differ_as_printed():
    from experiments.emulation.emulate import exceeds

    assert exceeds(80 << 30, 78 << 30) == "80.00 GiB > budget 78.00 GiB"
    assert exceeds(54_736_456, 53_687_091) == "0.051 GiB > budget 0.050 GiB"


def test_plan_on_an_emulated_cpu_device_names_no_gpu_profile(capsys, monkeypatch):
    """No profile on a cpu device: the header says there is no time model instead of naming
    the GPU profile it did not use (the plan itself stubbed: its emulations are tested above)."""
    row = {"status": Status.OK, "method": "ulysses", "nproc": 2, "ring_degree": 1,
           "stack": "alst", "peak_device_bytes": 2**25, "peak_host_bytes": 0,
           "hardware_profile": None}
    monkeypatch.setattr(cli, "plan", lambda spec, hw, **_: [row])
    argv = ["plan", "--model", "tiny", "--gpus", "2", "--seq-len", "1K", "--no-progress"]
    assert cli.main([*argv, "--emulate-device", "cpu", "--gpu-mem", "1"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header == "tiny on 2 GPUs at 1024 tokens, an emulated cpu device, no time model:"
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.splitlines()[0] == "tiny on 2 GPUs at 1024 tokens, h100-sxm:"


def test_plan_numbers_have_no_exponent():
    """Step seconds and tokens/s in the thousands print in full (they printed as 7.21e+03)."""
    assert [cli._plan_number(v) for v in (7213.4, 1330.2, 90.93, 0.3834, 0.00049)] == [
        "7,213", "1,330", "90.9", "0.383", "0.00049"]
