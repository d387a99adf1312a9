"""The time model (docs/design.md#the-time-model): each price against a hand-computed value, each
overlap rule on windows whose answer is known, the work the fake step records, and the emulated
rows' columns.

Prices use ``tests/data/profile_unit_{cuda,cpu}.json``: round numbers (their sources say so),
so every expected value below is computed by hand from the numbers in the file.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from experiments.config import Cell, Hardware
from experiments.emulation.emulate import emulate_cell
from experiments.emulation.fake_step import critical_rank, fake_world, measure_fake
from experiments.harness.train import build
from experiments.instruments.memory import MemoryTracker, tensor_leaves
from experiments.timing.op_costs import StepWork, launches_kernel
from experiments.timing.profile import ProfileError, attention_flops, load_profile
from experiments.timing.time_model import WindowTime, price, step_time
from experiments.timing.work_fit import _predict_window, predict_work, quadratic_at
from upipe.staging import make_stage_plan

DATA = Path(__file__).parent / "data"
CUDA = str(DATA / "profile_unit_cuda.json")
CPU = str(DATA / "profile_unit_cpu.json")


@pytest.fixture(scope="module")
def cuda():
    return load_profile(CUDA)


@pytest.fixture(scope="module")
def cpu():
    return load_profile(CPU)


# ---------------------------------------------------------------------------------------------
# prices


def test_matmul_price_interpolates_the_rate_in_log2_of_the_cube_side(cuda):
    # bf16 table [[64, 1e14], [1024, 8e14]]: x = 256 is half way in log2 (6 -> 10): 4.5e14
    assert cuda.matmul_rate("bf16", 256, 256, 256) == pytest.approx(4.5e14)
    # beyond the table: its last rate; below: its first
    assert cuda.matmul_rate("bf16", 16, 16, 16) == pytest.approx(1e14)
    # a long, thin product runs at the rate of the square one of the same work: 4096 x 1024 x
    # 256 has the work of 1024^3
    assert cuda.matmul_rate("bf16", 4096, 1024, 256) == pytest.approx(8e14)
    # a product whose FLOPs outlast its bytes is priced by its FLOPs at that rate (the others
    # by their bytes: the roofline, test_matmul_roofline_* below)
    big = ("matmul", "bf16", (8192, 8192, 8192))
    assert price(Counter({big: 8e14}), cuda, True).matmul == pytest.approx(1)


def test_attention_price_by_kernel_pass_head_dim_and_key_length(cuda):
    # fwd_causal, head dim 128: [[1024, 5e13], [4096, 2e14]] -> 1.25e14 at 2048
    flops = attention_flops(1, 8, 2048, 2048, 128, "fwd_causal")
    assert flops == 4 * 8 * 2048 * 2048 * 128 / 2
    key = ("attention", "fa3", "bf16", "fwd_causal", 128, (2048, 8, 1))
    t = price(Counter({key: flops}), cuda, True)
    assert t.attention == pytest.approx(flops / 1.25e14)
    # bwd_causal has no table: the bwd rate (1e14, flat); head dim 100 takes the nearest (128)
    key = ("attention", "sdpa", "bf16", "bwd_causal", 100, (4096, 8, 1))
    t = price(Counter({key: 1e14}), cuda, True)
    assert t.attention == pytest.approx(1.0)
    # head dim 16 has its own table: 1e13
    t = price(Counter({("attention", "sdpa", "fp32", "fwd", 16, (1024, 2, 1)): 1e13}), cuda, True)
    assert t.attention == pytest.approx(1.0)


def test_memory_launch_collective_and_copy_prices(cuda):
    work = Counter({
        ("memory",): 4e12,  # / 2e12 B/s
        ("kernels",): 1000,  # x 5 us
        ("comm", "blocking", "all_to_all", "intra"): 2e11,  # / 1e11 B/s
        ("comm_calls", "blocking", "all_to_all", "intra"): 100,  # x 10 us
        ("comm", "p2p", "p2p", "inter"): 1e10,  # / 1e10 B/s across nodes
        ("comm_calls", "p2p", "p2p", "inter"): 10,  # x 20 us
        ("comm", "fsdp", "all_gather", "intra"): 1e11,
        ("comm", "fsdp", "reduce_scatter", "intra"): 3e11,
        ("copy", "sync", "d2h"): 1e11,  # pinned 5e10 B/s
        ("copy", "side", "h2d"): 5e10,
    })
    t = price(work, cuda, pinned=True)
    assert (t.memory, t.overhead) == pytest.approx((2.0, 5e-3))
    assert t.blocking == pytest.approx(2.0 + 1e-3)
    assert t.p2p == pytest.approx(1.0 + 2e-4)
    assert (t.fsdp_gather, t.fsdp_reduce) == pytest.approx((1.0, 3.0))
    assert (t.copy_sync, t.copy_side) == pytest.approx((2.0, 1.0))
    # pageable host memory: half the pinned rate in the fixture
    assert price(work, cuda, pinned=False).copy_sync == pytest.approx(4.0)


def test_a_buffer_pinned_at_every_length_is_priced_pinned(cuda):
    """DeepSpeed FPDT's chunk buffers are pinned whatever the length (its SequenceChunk pins
    each); the harness's rule pages the offload above 4M tokens. Both had been priced by the
    rule: FPDT's copies at 5M at the pageable rate."""
    work = Counter({("copy", "sync", "d2h", "pinned"): 1e11, ("copy", "sync", "h2d"): 5e10})
    assert price(work, cuda, pinned=False).copy_sync == pytest.approx(2.0 + 2.0)
    assert price(work, cuda, pinned=True).copy_sync == pytest.approx(2.0 + 1.0)


def test_a_host_tensor_made_from_a_device_one_is_a_d2h_copy():
    """``.to("cpu")``/``.cpu()`` (``_to_copy`` into a host tensor) copies device to host; it had
    been counted host to device, as a device tensor made from a host one is."""
    with FakeTensorMode():
        tracker = MemoryTracker()
        work = StepWork(tracker, gpus_per_node=8)
        tracker.observers.append(work)
        with tracker, tracker.phase("forward"):
            x = torch.randn(1024, 1024)  # a device tensor, 4 MiB
            with tracker.host():
                h = x.to("cpu", copy=True)
            d = h.clone()  # a device tensor made from the host one
            del d
    copies = {k: v for k, v in work.windows["forward", None].items() if k[0] == "copy"}
    assert copies == {("copy", "sync", "d2h"): 4 * 2**20, ("copy", "sync", "h2d"): 4 * 2**20}


def test_a_copy_into_host_pages_written_before_is_priced_warm(cuda):
    """A pageable device-to-host copy into a new host tensor maps its pages as it copies (1.84
    GB/s on an H200); into pages written before, HostStore's zeroed accumulators and what it
    stored, it runs at 18.18 GB/s (results/gpu_costs_h200/kernels/host_copy.csv). Both had
    been priced at the first."""
    from upipe.host import HostStore

    with FakeTensorMode():
        tracker = MemoryTracker()
        work = StepWork(tracker, gpus_per_node=8)
        tracker.observers.append(work)
        with tracker, tracker.phase("forward"):
            store = HostStore(torch.device("cpu"), host_context=tracker.host)
            x = torch.randn(1024, 1024)  # a device tensor, 4 MiB
            acc = store.zeros(x.shape, x.dtype)  # zeroed on the host: its pages written
            store.write(acc, x)
            kept = store.put(x)  # a new host tensor: the copy maps its pages
            store.write(kept, x)  # overwritten: warm
    copies = {k: v for k, v in work.windows["forward", None].items() if k[0] == "copy"}
    assert copies == {("copy", "side", "d2h", "warm"): 8 * 2**20,
                      ("copy", "side", "d2h"): 4 * 2**20}
    h200 = load_profile("h200")
    warm = Counter({("copy", "side", "d2h", "warm"): 18.18e9})
    assert price(warm, h200, pinned=False).copy_side == pytest.approx(1.0)
    assert price(warm, h200, pinned=True).copy_side == pytest.approx(18.18e9 / 52.77e9)
    # a profile without the warm rate prices it as a new tensor's, the slower
    assert price(warm, cuda, pinned=False).copy_side == price(
        Counter({("copy", "side", "d2h"): 18.18e9}), cuda, pinned=False).copy_side


def test_an_unknown_work_key_is_refused(cuda):
    with pytest.raises(ValueError, match="unknown work key"):
        price(Counter({("teleport",): 1}), cuda, True)


def test_a_kernel_the_profile_has_no_rates_for_is_named(cuda):
    with pytest.raises(ProfileError, match="'math'"):
        price(Counter({("attention", "math", "bf16", "fwd", 128, (1024, 2, 1)): 1.0}), cuda, True)


# ---------------------------------------------------------------------------------------------
# overlap rules


def _w(**kw) -> WindowTime:
    return WindowTime(**kw)


def test_ring_p2p_hides_behind_the_windows_attention(cuda):
    hidden = step_time([(("forward", 0), _w(attention=1.0, matmul=1.0, p2p=0.6))], cuda)
    assert (hidden.step_s, hidden.comm_exposed_s) == pytest.approx((2.0, 0.0))
    # only what exceeds the attention kernels is exposed; the matmuls do not hide it
    over = step_time([(("forward", 0), _w(attention=1.0, matmul=1.0, p2p=1.5))], cuda)
    assert (over.step_s, over.comm_exposed_s) == pytest.approx((2.5, 0.5))


def test_upipes_overlapped_all_to_alls_share_the_attention_with_the_ring(cuda):
    hidden = step_time([(("forward", 0), _w(attention=1.0, matmul=1.0, overlap=0.6))], cuda)
    assert (hidden.step_s, hidden.comm_exposed_s) == pytest.approx((2.0, 0.0))
    # beside the ring's P2P they share the same kernels: only their sum over them shows
    both = step_time([(("forward", 0), _w(attention=1.0, p2p=0.6, overlap=0.6, blocking=0.1))],
                     cuda)
    assert (both.step_s, both.comm_exposed_s) == pytest.approx((1.3, 0.3))


@pytest.mark.slow  # about 2 s on 2 cores (docs/testing.md)
def test_upipe_overlap_work_per_block_window():
    """tiny UPipe on 2 ranks (16 heads over 4 KV heads, U = 2: two KV blocks of 4 stages): per
    pass the first stage's inputs (Q; backward also O, dO), the last stage's output (dQ) and
    each KV block's K/V (backward also dK/dV) block; every other stage's all-to-alls overlap.
    Overlap keeps the forward's last stage for the backward (keep_last_stage follows it): its
    Q and its block's K, V are not sent again. Without overlap all of them block."""
    cells = {ov: Cell("upipe", "tiny", seq_len=2048, nproc=2, stack="ac", options={"overlap": ov})
             for ov in (False, True)}
    work = {ov: dict(measure_fake(c, c.validate(), Hardware(device="cpu")).work)
            for ov, c in cells.items()}
    plan = make_stage_plan(16, 4, 2, 2)
    assert (plan.n_blocks, plan.n_stages) == (2, 8)

    def calls(ov, window, mechanism):
        return work[ov][window].get(("comm_calls", mechanism, "all_to_all", "intra"), 0)

    fwd, bwd = ("forward", 1), ("backward", 1)  # the backward window recomputes the forward
    # forward: K, V of 2 blocks + the first Q + the last output block; 7 Q and 7 outputs overlap
    assert (calls(True, fwd, "blocking"), calls(True, fwd, "overlap")) == (2 * 2 + 1 + 1, 14)
    # backward: the recomputed forward's; K, V of the first block (the kept last one's are not
    # sent), the first stage's O and dO (its Q is kept), the last dQ, dK and dV of 2 blocks
    # block; 7 stages' Q, O, dO and 7 dQ overlap
    assert calls(True, bwd, "blocking") == 6 + 2 + 2 + 1 + 2 * 2
    assert calls(True, bwd, "overlap") == 14 + 7 * 3 + 7
    kept = {fwd: 0, bwd: 3}
    for window in (fwd, bwd):
        total = calls(True, window, "blocking") + calls(True, window, "overlap")
        assert total == calls(False, window, "blocking") - kept[window]
        assert calls(False, window, "overlap") == 0
        sent = {ov: sum(v for k, v in work[ov][window].items()
                        if k[0] == "comm" and k[3] == "intra" and k[2] == "all_to_all")
                for ov in (False, True)}
        # every all-to-all here moves 2 heads (a stage's U = 2, a block's 2 KV heads): the
        # bytes follow the calls
        assert sent[True] * (total + kept[window]) == sent[False] * total


def test_blocking_collectives_and_sync_copies_are_always_exposed(cuda):
    t = step_time([(("forward", 0), _w(matmul=1.0, blocking=0.25, copy_sync=0.5))], cuda)
    assert (t.step_s, t.comm_exposed_s, t.offload_exposed_s) == pytest.approx((1.75, 0.25, 0.5))


def test_side_copies_hide_behind_the_windows_compute(cuda):
    t = step_time([(("backward", 2), _w(matmul=1.0, overhead=0.5, copy_side=2.0))], cuda)
    assert (t.step_s, t.offload_exposed_s) == pytest.approx((2.0, 0.5))


def test_fsdp_gathers_hide_behind_the_previous_block_and_reductions_behind_the_next(cuda):
    blocks = [(("forward", None), _w(memory=0.1, fsdp_gather=0.3))]  # the root: nothing hides it
    blocks += [(("forward", i), _w(matmul=1.0, fsdp_gather=0.5)) for i in range(3)]
    blocks += [(("backward", i), _w(matmul=2.0, fsdp_gather=0.5, fsdp_reduce=2.5))
               for i in (2, 1, 0)]
    t = step_time(blocks, cuda)
    # forward: block 0's gather has no block before it (0.5); blocks 1, 2 hide behind 1.0 s.
    # backward: block 2's gather has nothing before it in its stage (0.5), the others hide;
    # reductions: 2.5 - 2.0 behind the next block (twice), block 0's has none after it (2.5)
    fsdp = 0.3 + 0.5 + 0.5 + 2 * 0.5 + 2.5
    assert t.comm_exposed_s == pytest.approx(fsdp)
    assert t.step_s == pytest.approx(0.1 + 3 * 1.0 + 3 * 2.0 + fsdp)


def test_without_side_streams_everything_is_serial(cpu):
    w = _w(attention=1.0, p2p=0.5, fsdp_gather=0.25, fsdp_reduce=0.25, copy_side=1.0,
           overhead=0.5, overlap=0.25)
    t = step_time([(("forward", 0), w), (("forward", 1), w)], cpu)
    assert t.step_s == pytest.approx(2 * 3.75)
    assert (t.comm_exposed_s, t.offload_exposed_s, t.overhead_s) == pytest.approx((2.5, 2.0, 1.0))
    assert t.compute_s + t.comm_exposed_s + t.offload_exposed_s + t.overhead_s == t.step_s


# ---------------------------------------------------------------------------------------------
# the work a fake step records


def test_ulysses_work_per_block_window():
    """tiny Ulysses on 2 ranks: every block's forward window holds its causal attention over the
    full sequence for its 8 of 16 heads, the 4 blocking all-to-alls (q, k, v, out) and FSDP2's
    all-gather of the block; every backward window its reduce-scatter."""
    cell = Cell("ulysses", "tiny", seq_len=2048, nproc=2, stack="ac")
    m = measure_fake(cell, cell.validate(), Hardware(device="cpu"))
    windows = dict(m.work)
    assert [w for w, _ in m.work][:5] == [("forward", None), *[("forward", i) for i in range(4)]]
    fwd = windows[("forward", 1)]
    assert fwd["attention", "sdpa", "fp32", "fwd_causal", 16, (2048, 8, 4)] == attention_flops(
        1, 8, 2048, 2048, 16, "fwd_causal")
    assert fwd["comm_calls", "blocking", "all_to_all", "intra"] == 4
    assert fwd["comm_calls", "fsdp", "all_gather", "intra"] == 1
    assert windows[("backward", 1)]["comm_calls", "fsdp", "reduce_scatter", "intra"] == 1
    # no offload on the "ac" stack
    assert not any(k[0] == "copy" for w in windows.values() for k in w)


def _work(cell: Cell, hw: Hardware, kind: str, rank: int | None = None) -> float:
    """The step's summed work of one kind (FLOPs or bytes) on ``rank`` (default: the critical
    one, the rank the emulator plays)."""
    if rank is None:
        m = measure_fake(cell, cell.validate(), hw)
    else:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("experiments.emulation.fake_step.critical_rank", lambda c: rank)
            m = measure_fake(cell, cell.validate(), hw)
    return sum(v for _, w in m.work for k, v in w.items() if k[0] == kind)


@pytest.mark.slow  # about 2 s on 2 cores (docs/testing.md)
def test_the_emulator_plays_the_critical_rank():
    ring = Cell("ring", "tiny", seq_len=2048, nproc=4, stack="ac")
    zigzag = dataclasses.replace(ring, method="zigzag-ring")
    usp = dataclasses.replace(ring, method="usp", ring_degree=2)
    assert (critical_rank(ring), critical_rank(zigzag), critical_rank(usp)) == (3, 3, 2)
    assert critical_rank(dataclasses.replace(ring, method="ulysses")) == 0
    hw = Hardware(device="cpu")

    # in units of one rank's b x b block (causal FLOPs counted half): the last rank of the
    # contiguous ring computes its causal diagonal (0.5) and three full blocks (3.5); zigzag
    # balances the whole causal square (4b x 4b / 2 = 8) over 4 ranks (2 each): 3.5 / 2
    assert _work(ring, hw, "attention") / _work(zigzag, hw, "attention") == pytest.approx(1.75)
    # zigzag balances the FLOPs, not the merges: the last rank's steps cover all its queries,
    # rank 0's half of them, so it moves more memory-bound bytes (and the same FLOPs)
    assert _work(zigzag, hw, "attention", 0) == _work(zigzag, hw, "attention")
    assert _work(zigzag, hw, "memory") > _work(zigzag, hw, "memory", 0)


def test_a_ring_step_waits_for_its_slowest_hop():
    """A ring over two nodes: every rank's steps are priced across nodes (the ring moves in
    lockstep), also a rank whose own send stays inside its node."""
    cell = Cell("zigzag-ring", "tiny", seq_len=2048, nproc=4, stack="ac")
    with pytest.MonkeyPatch.context() as mp:  # rank 0: its sends go to rank 1, on its node
        mp.setattr("experiments.emulation.fake_step.critical_rank", lambda c: 0)
        m = measure_fake(cell, cell.validate(), Hardware(device="cpu", gpus_per_node=2))
    scopes = {k[3] for _, w in m.work for k in w if k[:2] == ("comm", "p2p")}
    assert scopes == {"inter"}


def _all_to_all_bytes(cell: Cell, hw: Hardware) -> Counter:
    """The step's all-to-all bytes by scope (rank 0)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("experiments.emulation.fake_step.critical_rank", lambda c: 0)
        m = measure_fake(cell, cell.validate(), hw)
    return Counter({k[3]: v for _, w in m.work for k, v in w.items()
                    if k[0] == "comm" and k[2] == "all_to_all"})


def test_an_all_to_all_across_nodes_sends_only_its_bytes_for_other_nodes_over_the_nic():
    """Ulysses over 4 ranks on nodes of 2: of the bytes rank 0 sends in one node, those for
    ranks 2 and 3 (2 of its 3 peers) leave the node, those for rank 1 stay on it."""
    cell = Cell("ulysses", "tiny", seq_len=2048, nproc=4, stack="ac")
    one_node = _all_to_all_bytes(cell, Hardware(device="cpu"))
    two_nodes = _all_to_all_bytes(cell, Hardware(device="cpu", gpus_per_node=2))
    assert set(one_node) == {"intra"} and set(two_nodes) == {"inter", "node"}
    assert two_nodes["inter"] == 2 * two_nodes["node"]
    assert two_nodes["inter"] + two_nodes["node"] == one_node["intra"]


def test_an_all_to_all_over_an_unevenly_spread_group_is_priced_on_its_slowest_rank():
    """12 ranks on nodes of 8, an even all-to-all of 12 chunks of 1 KiB: the ranks of the
    second node send 8 chunks through their NICs (rank 0: 4), those of the first 7 over NVLink;
    the call ends with its slowest rank, whichever rank is emulated. With split sizes the
    other ranks' splits are unknown: every sent byte is priced on the NIC."""
    def all_to_all(*splits):
        return _op_work(lambda: (torch.zeros(12, 256),), lambda x: dist.all_to_all_single(
            torch.empty_like(x), x, *(splits and (splits, splits))))

    def comm(work):
        return {k[3]: v for k, v in work.items() if k[0] == "comm"}

    with fake_world(12):
        assert comm(all_to_all()) == {"inter": 8 * 1024, "node": 7 * 1024}
        assert comm(all_to_all(*[1] * 12)) == {"inter": 11 * 1024}


def test_a_cross_node_all_to_all_takes_the_longer_of_its_nic_and_nvlink_shares(cuda):
    """Its bytes for other nodes at the inter rate (1e10 B/s, 20 us a call in the fixture)
    beside its bytes for this node at the intra rate (1e11 B/s): the longer counts, not the
    sum; the same for torch's ring's numbered collectives."""
    def blocking(remote: float, local: float, mechanism: str = "blocking") -> WindowTime:
        n = (3,) if mechanism == "async" else ()
        return price(Counter({("comm", mechanism, "all_to_all", "inter", *n): remote,
                              ("comm_calls", mechanism, "all_to_all", "inter", *n): 10,
                              ("comm", mechanism, "all_to_all", "node", *n): local}),
                     cuda, pinned=True)
    # the NIC's 1.0 s + 200 us hide NVLink's 0.07 s
    assert blocking(1e10, 7e9).blocking == pytest.approx(1.0 + 2e-4)
    # most peers on the node: NVLink's 0.7 s is longer than the NIC's 0.1 s + 200 us
    assert blocking(1e9, 7e10).blocking == pytest.approx(0.7)
    assert blocking(1e9, 7e10, "overlap").overlap == pytest.approx(0.7)
    assert blocking(1e9, 7e10, "async").ring_async == pytest.approx(0.7)


def test_the_rings_dk_dv_exchange_is_blocking_and_its_k_v_rotation_hidden():
    """upipe/ring.py's backward waits for the previous rank's dK/dV accumulators before each
    step's kernel (so the sent ones are freed before it): that exchange runs beside no kernel
    and is blocking; the K/V rotation runs beside the step's kernel (p2p). The dK/dV bytes had
    been priced as hidden. Zigzag over P = 4 ranks, tiny (4 layers, 2 K/V heads of 16, fp32):
    the backward sends its fp32 dK/dV (local tokens x 2 heads x 16 x 4 B, two tensors) P
    times (after the last step they reach their owner) and its recomputed forward and backward
    rotate K/V P - 1 times each."""
    cell = Cell("zigzag-ring", "tiny", seq_len=2048, nproc=4, stack="ac")
    cfg = cell.validate()
    m = measure_fake(cell, cfg, Hardware(device="cpu"))
    bwd = Counter()
    for (stage, block), w in m.work:
        if stage == "backward" and block == 1:
            bwd.update({k[1]: v for k, v in w.items() if k[:3] in (
                ("comm", "p2p", "p2p"), ("comm", "blocking", "p2p"))})
    local, p = 2048 // 4, 4
    kv_block = local * cfg.n_kv_heads * cfg.head_dim * 4  # fp32 K or V of one rank
    assert bwd["blocking"] == p * 2 * kv_block  # dK and dV, fp32 accumulators
    assert bwd["p2p"] == 2 * (p - 1) * 2 * kv_block  # K and V, recomputed forward + backward


# ---------------------------------------------------------------------------------------------
# rows


@pytest.mark.slow  # about 1 s on 2 cores (docs/testing.md)
def test_emulated_rows_carry_the_time_columns_and_the_parts_sum_to_the_step():
    cell = Cell("upipe", "tiny", seq_len=4096, nproc=2, stack="alst", dtype="bf16")
    row = emulate_cell(cell, Hardware(profile=CUDA), exact=True)
    assert row["status"] == "ok", row["error"]
    assert row["hardware_profile"] == "unit-cuda"
    parts = ("time_compute_s", "time_comm_exposed_s", "time_offload_exposed_s", "time_overhead_s")
    assert sum(row[k] for k in parts) == pytest.approx(row["step_time_s"])
    assert row["tokens_per_s_per_gpu"] == pytest.approx(4096 / 2 / row["step_time_s"])
    assert 0 < row["mfu"] < 1
    assert row["time_offload_exposed_s"] > 0  # the ALST stack's offload is on the compute stream


@pytest.mark.slow  # about 1-2 s on 2 cores (docs/testing.md)
def test_memory_only_rows_and_cpu_rows_without_a_profile_have_no_time():
    cell = Cell("ulysses", "tiny", seq_len=2048, nproc=2, stack="ac")
    assert "step_time_s" not in emulate_cell(cell, Hardware(device="cpu"), exact=True)
    memory_only = emulate_cell(cell, Hardware(profile=CPU, device="cpu"), exact=True, count=False)
    assert "step_time_s" not in memory_only


@pytest.mark.parametrize("profile,match", [
    ("no-such-gpu", "must be one of"),
    (CPU, "is for a cpu device, but the emulated device is 'cuda'"),
])
def test_a_bad_profile_is_an_invalid_row(profile, match):
    cell = Cell("ulysses", "tiny", seq_len=2048, nproc=2)
    row = emulate_cell(cell, Hardware(profile=profile), exact=True)
    assert row["status"] == "invalid" and match in row["error"]


def test_the_work_fit_extrapolates_a_quadratic_exactly():
    """Work amounts are quadratic in S at most: three samples give them anywhere (far below and
    far above the samples: the paper's lengths are 10-50x the fit's)."""
    f = lambda x: 3 + 2 * x + 5 * x * x  # noqa: E731
    xs = (65536, 98304, 131072)
    for x in (1024, 131072 * 40):
        assert quadratic_at(xs, [f(v) for v in xs], x) == f(x)


def test_the_work_fit_grows_the_windows_outside_the_blocks_per_layer():
    """The optimizer's and the root's windows hold per-layer work (AdamW over every layer's
    shards, FSDP2's per-unit copies): a step of N layers has N times a layer's there, not the
    4-layer samples' amount. Predicted from the samples one layer deeper at the first two
    lengths; block windows are per block already, and a sized key (the loss head's matmul) is
    the same at every depth."""
    xs = (2048, 3072, 4096)
    head = ("matmul", "bf16", (1024, 256, 64))

    def step(n_layers: int, x: int) -> list:
        return [(("forward", None), Counter({("kernels",): 10 + n_layers, head: 1e6})),
                *((("forward", b), Counter({("memory",): 8.0 * x})) for b in range(n_layers)),
                (("optimizer", None), Counter({("memory",): 1000.0 * n_layers,
                                               ("kernels",): 3 * n_layers + 1}))]

    def window(work, key):
        return next(c for w, c in work if w == key)

    work, approximate = predict_work([step(4, x) for x in xs], xs, 4, 1 << 20, 32,
                                     [step(5, x) for x in xs[:2]])
    assert window(work, ("optimizer", None)) == {("memory",): 32000.0, ("kernels",): 97}
    assert window(work, ("forward", None)) == {("kernels",): 42, head: 1e6}
    assert window(work, ("forward", 17)) == {("memory",): 8.0 * (1 << 20)}
    assert approximate == []
    # without the deeper samples the 4-layer windows stand (what the fit did before)
    work, _ = predict_work([step(4, x) for x in xs], xs, 4, 1 << 20, 32)
    assert window(work, ("optimizer", None)) == {("memory",): 4000.0, ("kernels",): 13}


def test_the_work_fit_sizes_a_cover_key_as_its_kernels_key():
    """A kernel an async collective ran beside (``("cover", n, *key)``) is predicted as the
    kernel's own key: its key length followed as a fraction of S, its FLOPs quadratic."""
    xs = (2048, 3072, 4096)
    samples = [Counter({("cover", 3, "attention", "fa3", "bf16", "fwd", 128, (x // 4, 8, 1)):
                        float(x * x), ("cover", 3, "kernels"): 2}) for x in xs]
    approximate: list[str] = []
    out = _predict_window(samples, xs, 1 << 20, approximate, "test")
    assert out == {("cover", 3, "attention", "fa3", "bf16", "fwd", 128, (1 << 18, 8, 1)): 2.0 ** 40,
                   ("cover", 3, "kernels"): 2}
    assert approximate == []


# ---------------------------------------------------------------------------------------------
# torch's ring: each exchange beside the kernels issued before its wait


@pytest.mark.slow  # about 1-2 s on 2 cores (docs/testing.md)
def test_torch_rings_exchanges_each_run_beside_the_kernels_before_their_wait():
    """torch's ring with the all-gather rotation (the paper's), 4 ranks: a block's forward
    gathers every rank's K/V once, beside the first step's kernel only (it is waited for at the
    second step); in backward each dK/dV exchange runs beside the next step's kernel, and the
    last one, waited for as the ring returns, beside none."""
    cell = Cell("torch-cp", "tiny", seq_len=2048, nproc=4, stack="native", iters=0,
                overrides=(("n_layers", "2"),))
    work = dict(measure_fake(cell, cell.validate(), Hardware(device="cpu")).work)
    fwd = work["forward", 0]
    (n,) = [k[4] for k in fwd if k[:2] == ("comm", "async")]
    assert fwd["comm", "async", "all_gather", "intra", n] == 2048 * 2 * 256 * 4 * 3 // 4
    # step 0 is the rank's own 512 tokens, causal (16 heads of 16); steps 1-3 half-blocks, as
    # much again each (the load-balanced ring): the gather hides behind a quarter of the FLOPs
    first = attention_flops(1, 16, 512, 512, 16, "fwd_causal")
    assert {k[2:]: v for k, v in fwd.items() if k[:3] == ("cover", n, "attention")} == {
        ("attention", "sdpa", "fp32", "fwd_causal", 16, (512, 16, 1)): first}
    assert sum(v for k, v in fwd.items() if k[0] == "attention") == 4 * first
    bwd = work["backward", 1]
    dkv = sorted(k[4] for k in bwd if k[:3] == ("comm", "async", "all_to_all"))
    beside = [sum(v for k, v in bwd.items() if k[:3] == ("cover", n, "attention")) for n in dkv]
    step = attention_flops(1, 16, 512, 256, 16, "bwd")
    assert beside == [step, step, step, 0]


def test_each_torch_ring_exchange_is_exposed_by_what_exceeds_its_own_cover(cuda, cpu):
    """Two exchanges in a window: 1.0 s beside 0.4 s of kernels, 0.2 s beside 0.8 s. Each
    exposes its own excess (0.6 s): the second's slack does not hide the first (pooled, the
    window's 1.2 s of kernels would hide all 1.2 s). Without side streams all of it is serial."""
    for profile, exposed in ((cuda, 0.6), (cpu, 1.2)):
        bandwidth, _ = profile.collective("all_gather", "inter")
        speed = profile.memory_bandwidth
        work = Counter({("memory",): 1.2 * speed,
                        ("comm", "async", "all_gather", "inter", 0): 1.0 * bandwidth,
                        ("cover", 0, "memory"): 0.4 * speed,
                        ("comm", "async", "all_gather", "inter", 1): 0.2 * bandwidth,
                        ("cover", 1, "memory"): 0.8 * speed})
        w = price(work, profile, pinned=True)
        assert (w.ring_async, w.ring_async_exposed) == pytest.approx((1.2, 0.6))
        t = step_time([(("forward", 0), w)], profile)
        assert (t.compute_s, t.comm_exposed_s) == pytest.approx((1.2, exposed))
        assert "ring_async_exposed" not in t.detail  # the detail is before overlap


# ---------------------------------------------------------------------------------------------
# the matmul roofline, attention by heads, the host's issue time, accumulating matmuls


def _edited_cuda(tmp_path, name: str, edit) -> object:
    """The unit cuda profile with ``edit(raw JSON)`` applied, written under tmp_path, loaded."""
    raw = json.loads(Path(CUDA).read_text())
    edit(raw)
    path = tmp_path / name
    path.write_text(json.dumps(raw))
    return load_profile(str(path))


def _src(value) -> dict:
    return {"value": value, "source": "test fixture"}


def _with_host_op(tmp_path):
    return _edited_cuda(tmp_path, "host.json", lambda raw: raw.update(host_op_s=_src(1e-5)))


def test_a_matmul_whose_bytes_take_longer_is_priced_by_them(cuda):
    # 3 products of (65536 x 4096) @ (4096 x 16): 2^33 FLOPs each; square side 2^(32/3) > 1024,
    # so 8e14 FLOP/s: 3 * 2^33 / 8e14 = 3.2e-5 s. Bytes (A, B, C once) in bf16: 3 * (2^28 +
    # 2^16 + 2^20) * 2 = 1_617_297_408, / 2e12 B/s = 8.09e-4 s: the bytes win
    key = ("matmul", "bf16", (65536, 16, 4096))
    t = price(Counter({key: 3 * 2**33}), cuda, True)
    assert t.matmul == pytest.approx(1_617_297_408 / 2e12)
    assert t.matmul > 20 * (3 * 2**33 / 8e14)
    # fp32: 4 bytes an element (and a 10x slower rate, 3.2e-4 s, still under the bytes)
    t = price(Counter({("matmul", "fp32", (65536, 16, 4096)): 3 * 2**33}), cuda, True)
    assert t.matmul == pytest.approx(2 * 1_617_297_408 / 2e12)
    # 256^3 at 4.5e14 FLOP/s: 9e14 FLOPs take 2 s; its 9e14 / 2^25 products move 3 * 2^16 * 2
    # bytes each: 9e14 * 3 / 256 B / 2e12 B/s = 5.2734375 s
    t = price(Counter({("matmul", "bf16", (256, 256, 256)): 9e14}), cuda, True)
    assert t.matmul == pytest.approx(5.2734375)


def test_a_big_square_matmul_is_priced_by_its_flops(cuda):
    # 4096^3 at 8e14 FLOP/s: 8e14 FLOPs take 1 s; bytes 8e14 / 2^37 * 3 * 2^24 * 2 = 5.86e11 B,
    # 0.29 s at 2e12 B/s: under the FLOPs
    t = price(Counter({("matmul", "bf16", (4096, 4096, 4096)): 8e14}), cuda, True)
    assert t.matmul == pytest.approx(1.0)


def test_attention_price_uses_the_calls_heads(tmp_path):
    def edit(raw):
        raw["attention"]["sdpa"]["bf16"]["fwd"] = _src(
            {"128": {"2": [[1024, 1e14]], "8": [[1024, 3e14]]}})

    p = _edited_cuda(tmp_path, "heads.json", edit)

    def seconds(heads, flops):
        key = ("attention", "sdpa", "bf16", "fwd", 128, (1024, heads, 1))
        return price(Counter({key: flops}), p, True).attention

    assert seconds(2, 1e14) == pytest.approx(1.0)
    assert seconds(4, 2e14) == pytest.approx(1.0)  # log2 half way: 2e14 FLOP/s
    assert seconds(8, 3e14) == pytest.approx(1.0)
    assert seconds(64, 3e14) == pytest.approx(1.0)  # clamped to the most heads' table
    assert seconds(1, 1e14) == pytest.approx(1.0)


def test_attention_price_uses_the_calls_gqa_group(tmp_path):
    """A call whose K/V heads each serve 4 query heads is priced at the group's rate."""
    def edit(raw):
        raw["attention"]["sdpa"]["bf16"]["fwd"] = _src({"128": {"4": [[1024, 2e14]]}})
        raw["attention_gqa"] = {"sdpa": {"bf16": {"fwd": _src({"128": {"4": {
            "4": [[1024, 4e14]]}}})}}}

    p = _edited_cuda(tmp_path, "gqa.json", edit)

    def seconds(group):
        key = ("attention", "sdpa", "bf16", "fwd", 128, (1024, 4, group))
        return price(Counter({key: 4e14}), p, True).attention

    assert seconds(1) == pytest.approx(2.0)
    assert seconds(4) == pytest.approx(1.0)
    assert seconds(2) == pytest.approx(4e14 / 3e14)  # log2 half way: 3e14 FLOP/s


def test_kernels_cost_the_host_its_issue_time(tmp_path, cuda):
    host = _with_host_op(tmp_path)
    assert cuda.host_op_s == 0.0 and host.host_op_s == 1e-5
    work = Counter({("kernels",): 1000, ("memory",): 2e8})
    t = price(work, host, True)
    assert (t.overhead, t.host, t.memory) == pytest.approx((5e-3, 1e-2, 1e-4))
    assert price(work, cuda, True).host == 0.0


def test_a_window_of_many_small_kernels_takes_the_hosts_time(tmp_path, cuda):
    host = _with_host_op(tmp_path)
    small = Counter({("kernels",): 1000, ("memory",): 2e8})  # GPU 1e-4 + 5e-3, host 1e-2
    big = Counter({("kernels",): 10, ("memory",): 2e12})  # GPU 1 + 5e-5, host 1e-4
    windows = [(("forward", 0), price(small, host, True)), (("forward", 1), price(big, host, True))]
    t = step_time(windows, host)
    # the small window waits 1e-2 - 5.1e-3 = 4.9e-3 for the host; the big one does not
    assert t.step_s == pytest.approx(1e-2 + 1.00005)
    assert t.compute_s == pytest.approx(1.0001)
    assert t.overhead_s == pytest.approx(5e-3 + 5e-5 + 4.9e-3)
    assert (t.comm_exposed_s, t.offload_exposed_s) == (0.0, 0.0)
    assert t.detail["host"] == pytest.approx(1.01e-2)
    assert t.detail["host_wait"] == pytest.approx(4.9e-3)
    assert t.detail["overhead"] == pytest.approx(5.05e-3)
    assert t.compute_s + t.comm_exposed_s + t.offload_exposed_s + t.overhead_s == \
        pytest.approx(t.step_s)
    # without a host issue time the small window is its GPU time
    plain = step_time([(w, price(c, cuda, True)) for w, c in
                       ((("forward", 0), small), (("forward", 1), big))], cuda)
    assert plain.step_s == pytest.approx(1.0001 + 5.05e-3)
    assert plain.detail["host_wait"] == 0.0
    # a window of big work is unchanged by the host's time
    alone = step_time([(("forward", 1), price(big, host, True))], host)
    alone_plain = step_time([(("forward", 1), price(big, cuda, True))], cuda)
    assert alone.step_s == alone_plain.step_s == pytest.approx(1.00005)
    assert alone.overhead_s == alone_plain.overhead_s and alone.detail["host_wait"] == 0.0


def test_the_host_bound_counts_the_windows_exposed_comm_and_copies(cuda, cpu):
    # side streams: p2p 1.5 beside attention 1.0 exposes 0.5; the GPU's 1.5 s < the host's 3 s
    t = step_time([(("forward", 0), _w(attention=1.0, p2p=1.5, host=3.0))], cuda)
    assert (t.step_s, t.comm_exposed_s, t.overhead_s) == pytest.approx((3.0, 0.5, 1.5))
    # blocking comm and sync copies keep the GPU busy past the host: no wait
    t = step_time([(("forward", 0), _w(matmul=1.0, blocking=0.5, copy_sync=0.25, host=1.5))],
                  cuda)
    assert (t.step_s, t.overhead_s, t.detail["host_wait"]) == pytest.approx((1.75, 0.0, 0.0))
    # serial (no side streams): 1.0 + 0.5 on the stream, the host 2.0: waits 0.5
    t = step_time([(("forward", 0), _w(memory=1.0, p2p=0.5, host=2.0))], cpu)
    assert (t.step_s, t.comm_exposed_s, t.overhead_s) == pytest.approx((2.0, 0.5, 0.5))
    assert t.compute_s + t.comm_exposed_s + t.offload_exposed_s + t.overhead_s == \
        pytest.approx(t.step_s)


def _op_work(make, op) -> Counter:
    """The work ``StepWork`` records for ``op(*make())`` alone, on fake CPU tensors."""
    with FakeTensorMode():
        tracker = MemoryTracker()
        work = StepWork(tracker, gpus_per_node=8)
        tracker.observers.append(work)
        with tracker, tracker.phase("forward"):
            tensors = make()
            before = Counter(work.windows[("forward", None)])
            op(*tensors)
            return work.windows[("forward", None)] - before


def test_an_accumulating_matmul_reads_its_c_as_memory_work():
    def mk(dtype=torch.float32, batch=()):
        return (torch.randn(*batch, 64, 32, dtype=dtype), torch.randn(*batch, 32, 16, dtype=dtype),
                torch.randn(*batch, 64, 16, dtype=dtype))

    mm = {("matmul", "fp32", (64, 16, 32)): 2 * 64 * 16 * 32, ("kernels",): 1}
    # C += A @ B: C's 64 x 16 fp32 elements are read, 4096 bytes
    assert _op_work(mk, lambda a, b, c: c.addmm_(a, b)) == Counter({**mm, ("memory",): 4096})
    assert _op_work(mk, lambda a, b, c: torch.addmm(c, a, b)) == Counter(
        {**mm, ("memory",): 4096})
    # a plain product, or a broadcast bias (not the output's size), adds no memory work
    assert _op_work(mk, lambda a, b, c: a @ b) == Counter(mm)
    assert _op_work(mk, lambda a, b, c: torch.addmm(c[0], a, b)) == Counter(mm)
    # bf16: 2 bytes an element
    assert _op_work(lambda: mk(torch.bfloat16), lambda a, b, c: c.addmm_(a, b)) == Counter(
        {("matmul", "bf16", (64, 16, 32)): 2 * 64 * 16 * 32, ("kernels",): 1,
         ("memory",): 2048})
    # batched: 3 products, C of 3 x 64 x 16 fp32
    assert _op_work(lambda: mk(batch=(3,)), lambda a, b, c: c.baddbmm_(a, b)) == Counter(
        {("matmul", "fp32", (64, 16, 32)): 3 * 2 * 64 * 16 * 32, ("kernels",): 1,
         ("memory",): 3 * 4096})


def test_an_attention_calls_key_carries_its_key_length_and_heads():
    sdpa = torch.nn.functional.scaled_dot_product_attention
    # batch 2 x 3 heads, 128 queries over 256 keys, head dim 16 (sdpa layout B, H, S, D)
    work = _op_work(lambda: (torch.randn(2, 3, 128, 16), torch.randn(2, 3, 256, 16)),
                    lambda q, k: sdpa(q, k, k))
    assert work == Counter({("attention", "sdpa", "fp32", "fwd", 16, (256, 6, 1)):
                            attention_flops(2, 3, 128, 256, 16, "fwd"), ("kernels",): 1})

    def fwd_bwd(q, k):
        sdpa(q, k, k, is_causal=True).sum().backward()

    work = _op_work(lambda: (torch.randn(2, 3, 128, 16, requires_grad=True),
                             torch.randn(2, 3, 128, 16, requires_grad=True)), fwd_bwd)
    attention = {k: v for k, v in work.items() if k[0] == "attention"}
    assert attention == {
        ("attention", "sdpa", "fp32", "fwd_causal", 16, (128, 6, 1)):
            attention_flops(2, 3, 128, 128, 16, "fwd_causal"),
        ("attention", "sdpa", "fp32", "bwd_causal", 16, (128, 6, 1)):
            attention_flops(2, 3, 128, 128, 16, "bwd_causal"),
    }


class _KernelCount(TorchDispatchMode):
    """Counts the ops of a real step that launch a kernel (``op_costs.launches_kernel``, on a
    tensor): what ``StepWork`` counts op by op in the fake step, replays aside."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if launches_kernel(func) and (tensor_leaves((args, kwargs), []) or
                                      tensor_leaves(out, [])):
            self.n += 1
        return out


@pytest.mark.parametrize("method,nproc,extra", [
    ("ulysses", 1, {}), ("upipe", 1, {"heads_per_stage": 1}), ("upipe", 2, {}),
    ("zigzag-ring", 2, {})], ids=["ulysses", "upipe-U1", "upipe-P2", "zigzag-P2"])
@pytest.mark.slow  # about 3 s on 2 cores (docs/testing.md)
def test_the_fake_steps_kernels_are_a_real_steps(method, nproc, extra):
    """The kernels the time model prices are the ones a real step launches: rank 0 of the job
    on the fake process group with real CPU tensors (collectives do nothing, every other op
    runs), counted in its second step, equals the fake step's count, replayed calls included.
    The ``ac`` stack: the ALST offload's host copies are kernels on neither side, but on a CPU
    the real run cannot tell them from device ops."""
    cell = Cell(method=method, model="tiny", nproc=nproc, seq_len=256, stack="ac", options=extra)
    cfg = cell.validate()
    fake = measure_fake(cell, cfg, Hardware(device="cpu"))
    with fake_world(cell.world):
        state = build(cell, cfg, distributed=True, device=torch.device("cpu"))
        state.step()  # the optimizer's states, as the fake step has them
        count = _KernelCount()
        with count:
            state.step()
    assert count.n == sum(w.get(("kernels",), 0) for _, w in fake.work) > 0

