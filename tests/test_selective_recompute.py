"""Selective recomputation (the ``alst-attn`` and ``alst-attn-host`` levels): every method
trains exactly as under full checkpointing, and the emulator sees what is kept."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from experiments.config import STACKS, Cell, Hardware
from experiments.emulation.emulate import emulate_cell
from experiments.harness.train import build
from experiments.runner.plan import PlanSpec, plan
from upipe.registry import available_methods

SELECTIVE = ("alst-attn", "alst-attn-host")
# 3 layers (the middle one offloads, so alst-attn-host keeps its attention in host memory),
# 8 heads over 2 KV heads, 128 tokens on 4 ranks, fp32
OVERRIDES = (("n_layers", "3"), ("dim", "64"), ("n_heads", "8"), ("n_kv_heads", "2"),
             ("head_dim", "8"), ("ffn_dim", "96"), ("vocab_size", "128"))
BASE = dict(model="tiny", seq_len=128, nproc=4, overrides=OVERRIDES, warmup=0, iters=0,
            lr=1e-3)
# every method runnable on a CPU, each with the options that change what its attention saves
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
# and one run once: alst (checkpointed) against none (not). DeepSpeed's FPDT checkpoints
# reentrantly, so its first forward runs under no_grad, and its gradients move by up to 4e-4 of
# a tensor's largest (measured: alst against none, this test's cell) where every other method's
# are bitwise equal. For those, the selective levels must land within twice that spread.
NOT_BITWISE = {"ds-fpdt"}


def _spread(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest difference of two gradient lists, relative to each tensor's largest value."""
    return max(((x - y).abs().max() / x.abs().max().clamp_min(1e-30)).item()
               for x, y in zip(a, b, strict=True))


# the inner loop (-m 'not slow') keeps UPipe's and Ulysses' cases; each case is 1.5-6 s
INNER = {("upipe", ()), ("ulysses", ())}


@pytest.mark.parametrize("method,options", [
    pytest.param(m, o, id=m + "".join(f"-{k}{v}" for k, v in o.items()),
                 marks=() if (m, tuple(o)) in INNER else pytest.mark.slow)
    for m, o in METHODS])
def test_selective_levels_train_bitwise_as_full_checkpointing(dist_pool, method, options):
    """Same losses and the same gradients, bit for bit (fp32, deterministic CPU kernels): the
    kept tensors are the ones the recompute would have made again, and the host round trip
    copies them exactly."""
    if method not in available_methods():
        pytest.skip(f"{method} not registered")
    stacks = ("alst", *SELECTIVE) + (("none",) if method in NOT_BITWISE else ())
    cells = [Cell.from_dict(BASE | {"method": method, "stack": s} | options) for s in stacks]
    for rank in dist_pool(4).run(_losses_and_grads, cells):
        (full_losses, full_grads), *selective = rank
        assert full_losses[1] < full_losses[0]  # it trains
        if method in NOT_BITWISE:
            spread = _spread(full_grads, selective.pop()[1])  # against none: once, no recompute
            assert 0 < spread < 1e-3
            for stack, (losses, grads) in zip(SELECTIVE, selective, strict=True):
                torch.testing.assert_close(losses, full_losses, rtol=1e-6, atol=0)
                assert _spread(full_grads, grads) <= 2 * spread, stack
            continue
        for stack, (losses, grads) in zip(SELECTIVE, selective, strict=True):
            assert losses == full_losses, stack
            assert all(torch.equal(a, b) for a, b in zip(full_grads, grads, strict=True)), stack


def test_the_levels_are_alst_with_the_attention_kept():
    for name in SELECTIVE:
        s = STACKS[name]
        assert s.keep_attention and s.checkpoint and s.offload and s.tiled and s.chunked_loss
    assert STACKS["alst-attn-host"].keep_on_host and not STACKS["alst-attn"].keep_on_host


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
