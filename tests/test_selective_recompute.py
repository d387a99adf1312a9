"""Selective recomputation (the ``alst-attn`` and ``alst-attn-host`` levels, and ``alst-block``'s
un-checkpointed blocks): every method trains exactly as under full checkpointing, and the
emulator sees what is kept."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist

from experiments.config import STACKS, Cell, GiB, Hardware
from experiments.emulation.emulate import emulate_cell
from experiments.emulation.fit import fit_refusal, fitted
from experiments.harness.train import build
from experiments.runner import plan as planner
from experiments.runner import plan_keep
from experiments.runner.plan import plan
from experiments.runner.plan_keep import (
    device_keep_blocks,
    host_keep_blocks,
    partial_candidates,
)
from experiments.runner.plan_spec import PlanSpec
from upipe.registry import available_methods

SELECTIVE = ("alst-attn", "alst-attn-host")
# 3 layers (the middle one offloads, so alst-attn-host keeps its attention in host memory),
# 8 heads over 2 KV heads, 128 tokens on 4 ranks (2: TWO_RANKS), fp32
OVERRIDES = (("n_layers", "3"), ("dim", "64"), ("n_heads", "8"), ("n_kv_heads", "2"),
             ("head_dim", "8"), ("ffn_dim", "96"), ("vocab_size", "128"))
BASE = dict(model="tiny", seq_len=128, nproc=4, overrides=OVERRIDES, warmup=0, iters=0,
            lr=1e-3)
# every method runnable on a CPU, each with the options that change what its attention saves.
# On 4 ranks: the hybrids (a 2 x 2 mesh), UPipe's and Ulysses' plain cases (KV heads fewer than
# ranks) and UPipe's overlapped stages; the rest on 2 ranks (``TWO_RANKS``): what a method keeps
# for its backward is per rank and the same code at any world size, and a case's cost is its
# ranks' dispatches (each rank makes as many), so these cost half.
METHODS = [("ulysses", {}), ("ds-ulysses", {}), ("ring", {}), ("zigzag-ring", {}),
           ("usp", {"ring_degree": 2}), ("usp-ulysses", {}),
           ("upipe", {}), ("upipe", {"heads_per_stage": 4, "overlap": True}),
           ("upipe", {"ring_degree": 2}), ("fpdt", {"chunk_size": 32}),
           ("ds-fpdt", {"chunk_size": 32}), ("torch-cp", {}),
           ("upipe", {"doc_len": 48}), ("zigzag-ring", {"doc_len": 48})]  # packed documents


def _losses_and_grads(cells: list[Cell]) -> list[tuple[list[float], list[torch.Tensor]]]:
    """Per cell: 2 AdamW steps' losses, then this rank's gradient shards of a third step."""
    out = []
    for cell in cells:
        torch.manual_seed(cell.seed)
        state = build(cell, cell.validate(), distributed=dist.is_initialized())
        losses = [state.step().item() for _ in range(2)]
        (state.loss_sum() / state.n_label_tokens).backward()
        grads = [p.grad.to_local().clone() if hasattr(p.grad, "to_local") else p.grad.clone()
                 for p in state.model.parameters()]
        out.append((losses, grads))
    return out


# Methods whose gradients already differ, at round-off, between a recomputed attention forward
# and one run once. DeepSpeed's FPDT checkpoints reentrantly, so its first forward runs under
# no_grad: on this test's cell its gradients with checkpointing (ac) differ from those without
# (none) by 5.6e-7 of a tensor's largest after one step, and AdamW's normalised updates amplify
# that to 3.6e-4 after two (alst against none: 4.9e-4, tiling's own round-off included); every
# other method's ac and none gradients are bitwise equal. How much AdamW amplifies varies by
# machine: on an AMD EPYC machine of 2026-11-29 alst against none was 3.9e-5, and
# alst-attn-host keeping 2 blocks against alst 1.6e-4, four times that. So for FPDT the
# selective levels must land within the round-off any of them shows, below 1e-3 of a tensor's
# largest value (a wrong gradient is off by its own size).
NOT_BITWISE = {"ds-fpdt"}
ROUND_OFF = 1e-3


def _spread(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest difference of two gradient lists, relative to each tensor's largest value."""
    return max(((x - y).abs().max() / x.abs().max().clamp_min(1e-30)).item()
               for x, y in zip(a, b, strict=True))


# the inner loop (-m 'not slow') keeps UPipe's plain case; each case is 1.5-6 s
INNER = {("upipe", ())}
TWO_RANKS = {("ds-ulysses", ()), ("ring", ()), ("zigzag-ring", ()), ("usp-ulysses", ()),
             ("fpdt", ("chunk_size",)), ("ds-fpdt", ("chunk_size",)), ("torch-cp", ()),
             ("upipe", ("doc_len",)), ("zigzag-ring", ("doc_len",))}


@pytest.mark.parametrize("method,options", [
    pytest.param(m, o, id=m + "".join(f"-{k}{v}" for k, v in o.items()),
                 marks=() if (m, tuple(o)) in INNER else pytest.mark.slow)
    for m, o in METHODS])
def test_selective_levels_train_bitwise_as_full_checkpointing(dist_pool, method, options):
    """Same losses and the same gradients, bit for bit (fp32, deterministic CPU kernels): the
    kept tensors are the ones the recompute would have made again, and the host round trip
    copies them exactly; also with the attention kept in the last two of the three blocks only
    (the middle one in host memory, the last on the device; the first recomputes), and with
    the last two blocks not checkpointed at all (alst-block; the first recomputes)."""
    if method not in available_methods():
        pytest.skip(f"{method} not registered")
    levels = [{"stack": s} for s in SELECTIVE] + [{"stack": "alst-attn-host", "keep_blocks": 2},
                                                  {"stack": "alst-block", "keep_blocks": 2}]
    extra = [{"stack": "none"}] if method in NOT_BITWISE else []
    world = 2 if (method, tuple(options)) in TWO_RANKS else 4
    cells = [Cell.from_dict(BASE | {"method": method, "nproc": world} | level | options)
             for level in [{"stack": "alst"}, *levels, *extra]]
    for rank in dist_pool(world).run(_losses_and_grads, cells):
        (full_losses, full_grads), *selective = rank
        assert full_losses[1] < full_losses[0]  # it trains
        if method in NOT_BITWISE:
            spread = _spread(full_grads, selective.pop()[1])  # against none: once, no recompute
            assert 0 < spread < ROUND_OFF
            for level, (losses, grads) in zip(levels, selective, strict=True):
                torch.testing.assert_close(losses, full_losses, rtol=1e-6, atol=0)
                assert _spread(full_grads, grads) < ROUND_OFF, level
            continue
        for level, (losses, grads) in zip(levels, selective, strict=True):
            assert losses == full_losses, level
            assert all(torch.equal(a, b) for a, b in zip(full_grads, grads, strict=True)), level


def test_the_levels_are_alst_with_the_attention_kept():
    for name in SELECTIVE:
        s = STACKS[name]
        assert s.keep_attention and s.checkpoint and s.offload and s.tiled and s.chunked_loss
    assert STACKS["alst-attn-host"].keep_on_host and not STACKS["alst-attn"].keep_on_host
    # long-attn-host is the long level keeping the attention in host memory, nothing else
    assert STACKS["long-attn-host"] == dataclasses.replace(
        STACKS["long"], keep_attention=True, keep_on_host=True)
    # and alst-block is alst keeping whole blocks
    assert STACKS["alst-block"] == dataclasses.replace(STACKS["alst"], keep_block=True)


def test_keep_blocks_is_checked_and_names_the_cell():
    cell = Cell.from_dict(BASE | {"method": "upipe", "stack": "alst-attn-host", "keep_blocks": 2})
    assert cell.validate().n_layers == 3 and "-alst-attn-host-k2-" in cell.cell_id()
    assert Cell.from_dict(cell.to_dict()) == cell
    assert cell.cell_id() != dataclasses.replace(cell, keep_blocks=None).cell_id()
    with pytest.raises(ValueError, match="keep_blocks needs a stack that keeps the attention "
                                         r"or whole blocks \(\[.*'alst-block'.*\]\), got stack "
                                         "'alst'"):
        dataclasses.replace(cell, stack="alst").validate()
    assert "-alst-block-k2-" in dataclasses.replace(cell, stack="alst-block").cell_id()
    for bad in (0, 4, True, 1.5):
        with pytest.raises(ValueError, match="keep_blocks must be an int from 1 to the model's 3"):
            dataclasses.replace(cell, keep_blocks=bad).validate()
    # every block keeping it is the level itself, which the fit predicts; fewer it cannot
    assert fit_refusal(dataclasses.replace(cell, keep_blocks=3)) is None
    assert "mixes blocks" in fit_refusal(cell)
    with pytest.raises(ValueError, match="cannot fit .*mixes blocks"):
        fitted(cell, Hardware())


@pytest.mark.slow  # 3 exact emulations, about 8 s on 2 cores
def test_the_recompute_skips_the_attention_and_keeps_its_tensors():
    """Emulated (a GPU, tiny at 8K on 4 ranks, exact): the selective levels launch fewer
    attention kernels and spend less attention time, keep more on the device (alst-attn) or
    in host memory (alst-attn-host) than alst."""
    rows = {s: emulate_cell(Cell.from_dict(BASE | {"method": "upipe", "stack": s,
                                                    "seq_len": 8192, "dtype": "bf16"}),
                            Hardware(), exact=True)
            for s in ("alst", *SELECTIVE)}
    full = rows["alst"]
    for s in SELECTIVE:
        assert rows[s]["status"] == "ok", rows[s]["error"]
        assert rows[s]["time_by_kind_s"]["attention"] < full["time_by_kind_s"]["attention"], s
    assert rows["alst-attn"]["peak_device_bytes"] > full["peak_device_bytes"]
    assert rows["alst-attn-host"]["peak_host_bytes"] > full["peak_host_bytes"]
    assert (rows["alst-attn-host"]["peak_device_bytes"]
            < rows["alst-attn"]["peak_device_bytes"])


@pytest.mark.slow  # 6 exact emulations of a 2-layer tiny step, about 10 s on 2 cores
def test_the_planner_turns_spare_memory_into_speed():
    """Ulysses, tiny at 8K on 4 emulated GPUs: with memory to spare the plan's first row keeps
    the attention on the device; on a GPU between the two selective levels' peaks, in host
    memory; on one below both, it recomputes (alst)."""
    spec = PlanSpec("tiny", 4, 8192, overrides=(("n_layers", "3"),), methods=("ulysses",),
                    stacks=("alst", *SELECTIVE), dtype="bf16")
    rows = plan(spec, Hardware(reserve_gib=0.0), workers=1)  # ranked: fastest fitting first
    assert rows[0]["stack"] == "alst-attn" and all(r["status"] == "ok" for r in rows)
    roomy = {r["stack"]: r for r in rows}
    peak = {s: roomy[s]["peak_device_bytes"] for s in roomy}
    assert peak["alst"] < peak["alst-attn-host"] < peak["alst-attn"]

    def first(gib: float) -> str:
        return plan(spec, Hardware(gpu_mem_gib=gib, reserve_gib=0.0), workers=1)[0]["stack"]

    assert first((peak["alst-attn-host"] + peak["alst-attn"]) / 2 / 2**30) == "alst-attn-host"
    assert first((peak["alst"] + peak["alst-attn-host"]) / 2 / 2**30) == "alst"


# 6 layers: blocks 1-4 offload (alst), so keeping the attention in the last k blocks sends k - 1
# blocks' kept tensors to host memory (the last keeps its own on the device) for k from 1 to 5
DEEP = BASE | {"method": "ulysses", "seq_len": 4096, "dtype": "bf16",
               "overrides": tuple(kv for kv in OVERRIDES if kv[0] != "n_layers") + (
                   ("n_layers", "6"),)}


def _planned(stack: str, hw: Hardware) -> dict:
    """DEEP's Ulysses planned exactly on alst and ``stack``: rows by (stack, keep_blocks)."""
    spec = PlanSpec("tiny", 4, 4096, overrides=DEEP["overrides"], methods=("ulysses",),
                    stacks=("alst", stack), dtype="bf16")
    return {(r["stack"], r.get("keep_blocks")): r for r in plan(spec, hw, workers=1, exact=True)}


def _exact_levels() -> dict:
    """The exact emulations that do not depend on the plan (tests/background.py): alst,
    alst-attn-host in every block, and kept in the last 1 and 5 of them."""
    def job(stack: str, k: int | None = None) -> tuple:
        return (functools.partial(emulate_cell, exact=True),
                Cell.from_dict(DEEP | {"stack": stack, "keep_blocks": k}), Hardware())

    return {"light": job("alst"), "full": job("alst-attn-host"),
            1: job("alst-attn-host", 1), 5: job("alst-attn-host", 5)}


@pytest.mark.slow  # 7 exact emulations of a 6-layer tiny step, about 18 s on 2 cores
@pytest.mark.background(jobs=_exact_levels)
def test_partial_keeping_host_peak_is_affine_and_the_plan_picks_what_fits(background):
    """Exact emulations (a GPU, tiny with 6 layers at 4K on 4 ranks): the host peak keeping
    the attention in the last k blocks is alst's plus k - 1 times an offloading block's share
    of the whole level's, to the byte; each kept block saves time, and the device peak stays
    within the two ends'. Given a host budget between two of those peaks, the plan's rule
    (``host_keep_blocks``) picks the deepest k that fits, and the plan adds that row."""
    rows = background()
    light, full = rows["light"], rows["full"]
    share = (full["peak_host_bytes"] - light["peak_host_bytes"]) // 4
    assert share * 4 == full["peak_host_bytes"] - light["peak_host_bytes"] and share > 0

    # a host budget (per rank: 4 ranks on a node) between k = 3's peak and k = 4's
    budget = light["peak_host_bytes"] + 2.5 * share
    hw = Hardware(gpus_per_node=4, host_mem_gib=4 * budget / GiB)
    cell = Cell.from_dict(DEEP | {"stack": "alst-attn-host"})
    assert host_keep_blocks(light, full, cell, hw) == 3
    by_level = _planned("alst-attn-host", hw)
    assert len(by_level) == 3
    assert by_level[("alst-attn-host", None)]["status"] == "oom"
    assert by_level[("alst-attn-host", 3)]["status"] == "ok"

    partial = {k: rows[k] for k in (1, 5)} | {3: by_level[("alst-attn-host", 3)]}
    for k, r in partial.items():
        assert r["emulation"] == "exact" and r["keep_blocks"] == k
        assert r["peak_host_bytes"] == light["peak_host_bytes"] + (k - 1) * share, k
        assert r["peak_device_bytes"] <= max(light["peak_device_bytes"],
                                             full["peak_device_bytes"]), k
    times = [light["step_time_s"], *(partial[k]["step_time_s"] for k in (1, 3, 5)),
             full["step_time_s"]]
    assert times == sorted(times, reverse=True) and len(set(times)) == len(times)


def _exact_blocks() -> dict:
    """Exact emulations independent of the plan (tests/background.py): alst, alst-block in
    every block, and un-checkpointed in the last 1, 3 and 5 blocks only."""
    def job(stack: str, k: int | None = None) -> tuple:
        return (functools.partial(emulate_cell, exact=True),
                Cell.from_dict(DEEP | {"stack": stack, "keep_blocks": k}), Hardware())

    return {"light": job("alst"), "full": job("alst-block")} | {
        k: job("alst-block", k) for k in (1, 3, 5)}


@pytest.mark.slow  # 8 exact emulations of a 6-layer tiny step, about 20 s on 2 cores
@pytest.mark.background(jobs=_exact_blocks)
def test_uncheckpointed_blocks_stay_under_the_chord_and_the_plan_picks_what_fits(background):
    """Exact emulations (a GPU, tiny with 6 layers at 4K on 4 ranks): each block run without
    its checkpoint saves the same time, keeps its tensors on the device and none on the host,
    and the device peak with the last k blocks kept is at most the chord between alst's
    (k = 0) and alst-block's (k = 6), which is what ``device_keep_blocks`` estimates; the last
    block alone adds nothing (it is freed by the first backward, before alst's peak). Given a
    device budget between the chord's values at 3 and 4, the plan adds k = 3, which fits."""
    rows = background()
    light, full = rows["light"], rows["full"]
    assert full["peak_host_bytes"] == 0 < light["peak_host_bytes"]  # nothing offloaded
    per_block = (full["peak_device_bytes"] - light["peak_device_bytes"]) / 6
    assert per_block > 0
    assert rows[1]["peak_device_bytes"] == light["peak_device_bytes"]
    for k in (1, 3, 5):
        assert rows[k]["emulation"] == "exact" and rows[k]["keep_blocks"] == k
        assert rows[k]["peak_device_bytes"] <= light["peak_device_bytes"] + k * per_block, k
    times = [light["step_time_s"], *(rows[k]["step_time_s"] for k in (1, 3, 5)),
             full["step_time_s"]]
    saved = [a - b for a, b in zip(times, times[1:], strict=False)]  # per 1, 2, 2, 1 blocks
    assert saved[0] > 0 and saved == pytest.approx(
        [saved[0], 2 * saved[0], 2 * saved[0], saved[0]], rel=1e-6)

    budget = light["peak_device_bytes"] + 3.5 * per_block
    hw = Hardware(gpu_mem_gib=budget / GiB, reserve_gib=0.0)
    cell = Cell.from_dict(DEEP | {"stack": "alst-block"})
    assert device_keep_blocks(light, full, cell, hw) == 3
    by_level = _planned("alst-block", hw)
    assert set(by_level) == {("alst", None), ("alst-block", None), ("alst-block", 3)}
    assert by_level[("alst-block", None)]["status"] == "oom"
    assert by_level[("alst-block", 3)]["status"] == "ok"
    assert by_level[("alst-block", 3)]["peak_device_bytes"] == rows[3]["peak_device_bytes"]
    assert by_level[("alst-block", 3)]["step_time_s"] < by_level[("alst", None)]["step_time_s"]


def test_device_keep_blocks_reads_the_chord_and_needs_room():
    """At least one block where alst fits (the last one adds least); none without room; never
    every block (that is the level's own row)."""
    cell = Cell.from_dict(DEEP | {"stack": "alst-block"})
    gib = 2**30
    light, full = {"peak_device_bytes": 10 * gib}, {"peak_device_bytes": 70 * gib}  # 10 per block
    for budget, k in ((10.5, 1), (30, 2), (45, 3), (69, 5), (200, 5)):
        assert device_keep_blocks(light, full, cell,
                                  Hardware(gpu_mem_gib=budget, reserve_gib=0.0)) == k, budget
    assert device_keep_blocks(light, full, cell, Hardware(gpu_mem_gib=9, reserve_gib=0.0)) is None
    assert device_keep_blocks(light, light, cell, Hardware(reserve_gib=0.0)) is None


def test_the_plan_emulates_the_fastest_estimate_of_each_method_and_level(monkeypatch):
    """Two UPipe configurations whose alst-attn-host is over the host budget only: each gets
    the k the host holds and a step time interpolated between alst's and the level's by k / N;
    the faster estimate is emulated, the other is a row saying its estimate."""
    gib, hw = 2**30, Hardware(gpus_per_node=4, host_mem_gib=4 * 100.0)  # 100 GiB per rank
    configs = []
    for u, (light_s, full_s) in ((4, (10.0, 7.0)), (8, (10.0, 8.0))):
        cell = Cell.from_dict(DEEP | {"method": "upipe", "heads_per_stage": u})
        light = {"stack": "alst", "status": "ok", "peak_host_bytes": 10 * gib,
                 "step_time_s": light_s}
        full = {"stack": "alst-attn-host", "status": "oom", "step_time_s": full_s,
                "error": "host peak 130.00 GiB > budget 100.00 GiB per rank",
                "peak_host_bytes": 130 * gib}  # 4 offloading blocks of 30 GiB
        configs.append((cell, [light, full]))
    cands = sorted(partial_candidates(configs, hw), key=lambda c: -c[0])
    # 90 GiB of room: 3 offloading blocks, k = 4 with the last (device); 6 layers
    assert [c[1].keep_blocks for c in cands] == [4, 4]
    assert [c[1].option("heads_per_stage") for c in cands] == [4, 8]
    assert cands[0][0] == pytest.approx(4096 / 4 / (10.0 - 4 / 6 * 3.0))
    emulated = []
    monkeypatch.setattr(plan_keep, "emulate_cell", lambda cell, hw, exact=False: emulated.append(
        cell) or {"stack": cell.stack, "keep_blocks": cell.keep_blocks, "status": "ok"})
    rows = plan_keep.partial_rows(configs, hw, False, planner._done, None)
    assert [c.option("heads_per_stage") for c in emulated] == [4]
    assert rows[0]["status"] == "ok" and rows[1]["status"] == "skipped"
    assert rows[1]["keep_blocks"] == 4 and "not emulated: estimated 118.2 tokens/s" in (
        rows[1]["error"])


def test_a_partial_estimated_below_what_fits_is_not_emulated(monkeypatch):
    """Candidates are taken fastest estimate first, one at a time: one estimated above every
    row that fits is emulated, and once it fits, a candidate of another method estimated below
    it is a row naming it instead of a minute's exact emulation; so is every candidate below a
    fitted configuration that is faster still."""
    gib, hw = 2**30, Hardware(gpus_per_node=4, host_mem_gib=4 * 100.0)  # 100 GiB per rank

    def config(method: str, light_s: float, full_s: float) -> tuple[Cell, list[dict]]:
        cell = Cell.from_dict(DEEP | {"method": method})
        light = {"stack": "alst", "status": "ok", "peak_host_bytes": 10 * gib,
                 "step_time_s": light_s, "method": method,
                 "tokens_per_s_per_gpu": 4096 / 4 / light_s}
        full = {"stack": "alst-attn-host", "status": "oom", "step_time_s": full_s,
                "error": "host peak 130.00 GiB > budget 100.00 GiB per rank",
                "peak_host_bytes": 130 * gib, "method": method}
        return cell, [light, full]

    # estimates (k = 4 of 6): upipe 10 - 4/6 * 3 = 8 s, ulysses 10 - 4/6 * 1.5 = 9 s
    configs = [config("ulysses", 10.0, 8.5), config("upipe", 10.0, 7.0)]
    emulated = []

    def fake_emulate(cell, hw, exact=False):
        emulated.append(cell.method)
        return {"stack": cell.stack, "keep_blocks": cell.keep_blocks, "status": "ok",
                "method": cell.method, "ring_degree": 1, "step_time_s": 8.0,
                "tokens_per_s_per_gpu": 4096 / 4 / 8.0}

    monkeypatch.setattr(plan_keep, "emulate_cell", fake_emulate)
    rows = plan_keep.partial_rows(configs, hw, False, planner._done, None)
    assert emulated == ["upipe"]
    assert [(r["method"], r["status"]) for r in rows] == [("upipe", "ok"), ("ulysses", "skipped")]
    assert "not above the fastest configuration that fits (upipe on alst-attn-host k4" in (
        rows[1]["error"])
    assert "estimated 113.8 tokens/s" in rows[1]["error"]

    # a configuration that fits at 7.5 s is faster than both estimates: neither is emulated
    faster = Cell.from_dict(DEEP | {"method": "ring"})
    configs.append((faster, [{"stack": "alst", "status": "ok", "method": "ring",
                              "ring_degree": 1, "tokens_per_s_per_gpu": 4096 / 4 / 7.5}]))
    emulated.clear()
    rows = plan_keep.partial_rows(configs, hw, False, planner._done, None)
    assert emulated == [] and [r["status"] for r in rows] == ["skipped", "skipped"]
    assert all("(ring on alst, ring degree 1: 136.5 tokens/s per GPU)" in r["error"]
               for r in rows)
