"""FPDT (baselines/fpdt.py) and its host store (upipe/host.py).

Per-rank bodies are module-level functions of this module: the spawned ranks unpickle them by
importing ``test_fpdt``, whose top-level ``import baselines.fpdt`` registers the method there.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from cases import Case, compare_with_reference
from test_correctness import assert_close_to_reference
from test_fake import _fake_step
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import checkpoint

import baselines.fpdt  # noqa: F401  registers "fpdt" (until it is in the entry points)
from baselines.fpdt import FPDTAttention
from experiments.instruments.collectives import CollectiveCounter
from experiments.instruments.memory import MemoryTracker
from upipe import build_method
from upipe.host import HostStore
from upipe.layout import SeqLayout

# ---------------------------------------------------------------------------------------------
# correctness against the single-device reference (tests/cases.py recipe, same tolerance rule)

# (world, n_heads, n_kv_heads, seq, chunk sizes). Chunk sizes per case: several chunks with a
# shorter last one (37 = 4*8 + 5; 30 = 3*8 + 6; 44 = 5*8 + 4 -> 8,8,8,8,8,4 on 4 ranks), one
# dividing the sequence (6 | 30), and one >= the sequence (a single chunk: Ulysses' schedule).
# 4 heads / 1 KV head on 2 ranks and 8/2 on 4 ranks replicate KV heads to the CP degree.
MATRIX = [
    (1, 8, 2, 37, (8, 64)),
    (2, 8, 8, 30, (8, 12)),
    (2, 8, 2, 30, (8, 30)),
    (2, 4, 1, 30, (6, 64)),
    (4, 8, 2, 44, (8, 12, 44)),
    (4, 16, 4, 44, (8,)),
]


def _correctness_cases() -> list:
    out = []
    for world, h, hkv, seq, chunks in MATRIX:
        for chunk in chunks:
            for causal in (True, False):
                for dtype in ("fp32", "bf16"):
                    case = Case("fpdt", h, hkv, seq, causal=causal, dtype=dtype,
                                options={"chunk_size": chunk})
                    cid = (f"w{world}-h{h}kv{hkv}-s{seq}-c{chunk}-"
                           f"{'causal' if causal else 'full'}-{dtype}")
                    out.append(pytest.param(world, case, id=cid))
    # the no-offload baseline runs the same schedule with chunks left on the device
    for dtype in ("fp32", "bf16"):
        case = Case("fpdt", 8, 2, 30, dtype=dtype, options={"chunk_size": 8, "offload": False})
        out.append(pytest.param(2, case, id=f"w2-h8kv2-s30-c8-causal-{dtype}-no-offload"))
    return out


def _compare(case: Case) -> dict[str, float]:
    return compare_with_reference(case)


@pytest.mark.parametrize("world,case", _correctness_cases())
def test_matches_reference(dist_pool, world, case):
    results = dist_pool(world).run(_compare, case)
    assert len(results) == world
    assert_close_to_reference(results, case)


# ---------------------------------------------------------------------------------------------
# configuration rules


def test_options_layout_and_class_level_checks():
    assert FPDTAttention.layout_for(hybrid=False, ulysses_degree=4, chunk_size=64) == SeqLayout(
        "chunked", chunk_size=64)
    FPDTAttention.check_config(32, 8, cp=8, seq_len=2**20, chunk_size=65536, offload=True)
    with pytest.raises(ValueError, match=r"chunk_size \(12\) must be divisible by the CP degree"):
        FPDTAttention.check_config(32, 8, cp=8, chunk_size=12)
    with pytest.raises(ValueError, match="chunk_size must be a positive integer, got 0"):
        FPDTAttention.check_config(32, 8, cp=8, chunk_size=0)
    with pytest.raises(ValueError, match=r"ring_degree > 1 applies to hybrid methods"):
        FPDTAttention.check_config(32, 8, cp=8, ring_degree=2, chunk_size=64)
    m = build_method("fpdt", 32, 8, 2, 8, chunk_size=16, offload=False)
    assert m.options() == {"chunk_size": 16, "offload": False}
    assert m.seq_layout == SeqLayout("chunked", chunk_size=16)
    assert m.host_context is contextlib.nullcontext and m.pin_memory is True


def _bad_chunk_sizes() -> list[tuple[str, int]]:
    out = []
    for chunk in (3, 0, 2.5):
        with CollectiveCounter() as cc:
            try:
                build_method("fpdt", 32, 8, 2, 8, group=dist.group.WORLD, chunk_size=chunk)
                out.append(("no ValueError", cc.total))
            except ValueError as e:
                out.append((str(e), cc.total))
    return out


def test_bad_chunk_size_raises_before_any_collective(dist_pool):
    expected = ["chunk_size (3) must be divisible by the CP degree (2)",
                "chunk_size must be a positive integer, got 0",
                "chunk_size must be a positive integer, got 2.5"]
    for results in dist_pool(2).run(_bad_chunk_sizes):
        for (msg, n_collectives), text in zip(results, expected, strict=True):
            assert text in msg
            assert n_collectives == 0


# ---------------------------------------------------------------------------------------------
# host store (CPU path)


def test_host_store_counts_host_and_device_bytes():
    with MemoryTracker() as mt:
        store = HostStore(torch.device("cpu"), host_context=mt.host)
        t = torch.arange(10.0)  # device 40 B
        h = store.put(t)  # host 40 B
        acc = store.zeros((10,), torch.float64)  # host 80 B
        assert (mt.current_device_bytes, mt.current_host_bytes) == (40, 120)
        d = store.get(h)  # a device copy, equal to t
        assert torch.equal(d, t) and d.data_ptr() != h.data_ptr()
        a = store.get(acc)
        a.add_(d)
        store.write(acc, a)  # in place: no allocation
        assert torch.equal(acc, t.double())
        assert (mt.current_device_bytes, mt.current_host_bytes) == (40 + 40 + 80, 120)
        store.prefetch(h)
        store.sync()  # drops the unused prefetched copy
    off = HostStore(torch.device("cpu"), enabled=False)
    assert off.put(t) is t and off.get(t) is t
    off.prefetch(t)  # disabled: nothing to copy
    assert off.get(t) is t


def test_host_store_cpu_prefetch_allocates_at_prefetch_time():
    """Off CUDA, prefetch makes the device copy at once (as the side-stream copy does on a GPU),
    so the tracker sees the prefetched chunk from prefetch until the copy is used."""
    with MemoryTracker() as mt:
        store = HostStore(torch.device("cpu"), host_context=mt.host)
        h = store.put(torch.arange(10.0))  # host 40 B; the source's 40 B device are freed
        assert (mt.current_device_bytes, mt.current_host_bytes) == (0, 40)
        store.prefetch(h)
        assert (mt.current_device_bytes, mt.current_host_bytes) == (40, 40)
        store.prefetch(h)  # already prefetched: no second copy
        assert mt.current_device_bytes == 40
        h.add_(1)  # after the prefetch: not in the copy (as on CUDA; the doc's caveat)
        d = store.get(h)  # hands over the prefetched copy: no new allocation
        assert mt.current_device_bytes == 40
        assert torch.equal(d, torch.arange(10.0)) and d.data_ptr() != h.data_ptr()
        del d  # the store kept no reference
        assert mt.current_device_bytes == 0
        d = store.get(h)  # consumed: the next get makes a fresh copy, of the current h
        assert mt.current_device_bytes == 40 and torch.equal(d, h)


def test_activation_checkpointing_recomputes_host_chunks():
    """The chunks go through save_for_backward, so non-reentrant checkpointing (the memory
    stack's) drops them after the forward and recomputes them, instead of every layer's host
    chunks living until its backward; gradients are unchanged."""
    torch.manual_seed(0)
    m = build_method("fpdt", 32, 4, 2, 8, chunk_size=8)
    x = torch.randn(2, 20, 32, requires_grad=True)
    dy = torch.randn(2, 20, 32)
    m(x).backward(dy)
    grads = [x.grad.clone(), *(p.grad.clone() for p in m.parameters())]
    x.grad = None
    m.zero_grad()
    with MemoryTracker() as mt:
        m.host_context = mt.host
        y = checkpoint(m, x, use_reentrant=False)
        assert mt.current_host_bytes == 0 < mt.peak_host_bytes
        y.backward(dy)
    for a, b in zip(grads, [x.grad, *(p.grad for p in m.parameters())], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same ops in the same order


# ---------------------------------------------------------------------------------------------
# all-to-all counts: 4 per chunk forward (q, k, v, out) and 4 per chunk backward (dO, dQ and,
# per K/V chunk, dK, dV), so one chunk is Ulysses' 4 + 4 (tests/test_collectives.py)


def _count(h, hkv, seq_local, chunk):
    m = build_method("fpdt", 32, h, hkv, 8, group=dist.group.WORLD, chunk_size=chunk)
    x = torch.randn(1, seq_local, 32, requires_grad=True)
    with CollectiveCounter() as fwd:
        y = m(x)
    with CollectiveCounter() as bwd:
        y.sum().backward()
    return len(m.seq_layout.local_chunks(seq_local, m.cp)), dict(fwd.counts), dict(bwd.counts)


@pytest.mark.parametrize(
    "world,h,hkv,seq_local,chunk,n_chunks",
    [
        (2, 8, 2, 12, 24, 1),  # one chunk
        (2, 8, 2, 12, 8, 3),  # divides 24
        (2, 8, 8, 12, 10, 3),  # 10, 10, 4
        (4, 8, 2, 6, 4, 6),  # KV heads replicated to 4
        (4, 16, 4, 11, 8, 6),  # 8 x 5 + 4
    ],
)
def test_all_to_all_count_is_four_per_chunk_each_way(dist_pool, world, h, hkv, seq_local,
                                                     chunk, n_chunks):
    for n, fwd, bwd in dist_pool(world).run(_count, h, hkv, seq_local, chunk):
        assert n == n_chunks
        assert fwd == {"alltoall_base_": 4 * n_chunks}
        assert bwd == {"alltoall_base_": 4 * n_chunks}


# ---------------------------------------------------------------------------------------------
# emulation at paper scale (docs/design.md#emulation): Llama3-8B attention, 8 ranks, 1M tokens, 64K
# chunks


@pytest.mark.slow  # about 1-2 s on 2 cores (docs/testing.md)
def test_runs_under_fake_tensors_at_paper_scale(dist_pool):
    seq_local, chunk = 2**20 // 8, 65536  # 16 chunks of 8K local tokens
    [(y, dx, wdtype, counts)] = dist_pool(8, fake=True).run(
        _fake_step, "fpdt", seq_local, {"chunk_size": chunk}
    )
    assert y == dx == (1, seq_local, 4096)
    assert wdtype == torch.bfloat16
    assert counts == {"alltoall_base_": 2 * 4 * 16}


# ---------------------------------------------------------------------------------------------
# tracked memory (experiments/instruments/memory.py) of one layer's forward + backward, batch 1,
# fp32, on 2 ranks; every rank is symmetric, so rank 0's numbers are checked against every rank's

CP, DIM, H, HKV, D, B4 = 2, 64, 8, 2, 16, 4  # B4: fp32 itemsize (and the fp32 LSE/accumulators)
HKV_A2A = max(HKV, CP)  # KV heads after replication to the CP degree (none here)


def _measure(method: str, seq_local: int, options: dict, grad: bool = True) -> dict[str, int]:
    """Device peak above the step's inputs (params, x, dy) and host peak, on this rank."""
    torch.manual_seed(0)
    m = build_method(method, DIM, H, HKV, D, group=dist.group.WORLD, **options)
    x = torch.randn(1, seq_local, DIM, requires_grad=grad)
    dy = torch.randn(1, seq_local, DIM)
    with MemoryTracker() as mt:
        m.host_context = mt.host  # only FPDT reads it
        mt.track(m, x, dy)
        base = mt.current_device_bytes
        with torch.set_grad_enabled(grad):
            y = m(x)
        if grad:
            y.backward(dy)
        del y
    return {"device": mt.peak_device_bytes - base, "host": mt.peak_host_bytes}


def _host_bytes(seq_local: int) -> int:
    """FPDT's host peak on one rank (batch 1), read off baselines/fpdt.py.

    Saved by the forward, per local token (every chunk's head-layout tensor holds c_i/C tokens
    of H/C heads, i.e. n_i tokens' worth of all heads): q and the output in head layout
    (H*D each), the output in sequence layout (H*D: the input of wo), k and v (H'*D each,
    H' = KV heads after replication), the merged LSE (H values, fp32). The backward adds the
    fp32 dK/dV accumulators (2*H'*D) for every chunk while all of the above is still saved.
    """
    saved = (3 * H + 2 * HKV_A2A) * D * B4 + H * 4
    return seq_local * (saved + 2 * HKV_A2A * D * 4)


def _interface_bytes(seq_local: int) -> int:
    """The layer's O(L*dim) interface tensors made by the step: its output y and dx."""
    return 2 * seq_local * DIM * B4


# the weight gradients (fp32 accumulators in the backward), the same for every sequence length
WEIGHT_GRADS = ((H + 2 * HKV) * D * DIM + DIM * H * D) * B4


@pytest.mark.slow  # about 1-2 s on 2 cores (docs/testing.md)
def test_memory_host_bytes_flat_device_and_chunk_proportional(dist_pool):
    pool = dist_pool(CP)
    run = lambda *a: pool.run(_measure, *a)  # noqa: E731
    short, long = 128, 512  # local tokens: 4x
    res = {
        "fpdt": {L: run("fpdt", L, {"chunk_size": 64}) for L in (short, long)},
        "ulysses": {L: run("ulysses", L, {}) for L in (short, long)},
        "no-offload": {L: run("fpdt", L, {"chunk_size": 64, "offload": False})
                       for L in (short, long)},
        "big-chunk": run("fpdt", long, {"chunk_size": 256}),
        "no-grad": run("fpdt", long, {"chunk_size": 64}, False),
    }
    for rows in [*res["fpdt"].values(), *res["ulysses"].values(), res["big-chunk"]]:
        assert all(r == rows[0] for r in rows)  # symmetric ranks
    one = {k: (v[0] if isinstance(v, list) else {L: r[0] for L, r in v.items()})
           for k, v in res.items()}
    fpdt, uly, no_off = one["fpdt"], one["ulysses"], one["no-offload"]

    # (a) host bytes are exactly what is offloaded (deterministic on CPU: no kernel scratch is
    # seen, every host allocation is one of the terms); without a backward only K/V are kept,
    # plus the Q chunk in use (chunk 64 = 32 local tokens' worth)
    for L in (short, long):
        assert fpdt[L]["host"] == _host_bytes(L)
        assert no_off[L]["host"] == 0
    assert one["no-grad"]["host"] == (2 * long * HKV_A2A + 32 * H) * D * B4

    # (b) without the interface tensors the device peak is the same at 4x the sequence: the
    # working set is one chunk's (plus the weight gradients). 2% margin for any small per-chunk
    # bookkeeping a future change may add (it is exactly flat now); Ulysses' grows ~4x (3.7x
    # here: its head-layout Q/K/V/O all scale with L), and so does FPDT's without offload
    resid = {L: fpdt[L]["device"] - _interface_bytes(L) for L in (short, long)}
    assert abs(resid[long] - resid[short]) <= 0.02 * resid[short], resid
    uly_resid = {L: uly[L]["device"] - _interface_bytes(L) for L in (short, long)}
    assert uly_resid[long] >= 3 * uly_resid[short], uly_resid
    off_resid = {L: no_off[L]["device"] - _interface_bytes(L) for L in (short, long)}
    assert off_resid[long] >= 2 * off_resid[short], off_resid  # the chunks pile up on device
    assert fpdt[long]["device"] < uly[long]["device"]

    # (c) at a fixed length, what is left beyond the weight gradients is proportional to the
    # chunk: 4x the chunk, 4x the working set (every working tensor is chunk-sized; 2% margin)
    big = one["big-chunk"]["device"] - _interface_bytes(long) - WEIGHT_GRADS
    small = resid[long] - WEIGHT_GRADS
    assert small > 0 and abs(big - 4 * small) <= 0.02 * 4 * small, (small, big)


def _measure_fake(seq_local: int, options: dict) -> dict[str, int]:
    with FakeTensorMode():
        return _measure("fpdt", seq_local, options)


@pytest.mark.slow  # about 2 s on 2 cores (docs/testing.md)
def test_emulation_predicts_the_real_run(dist_pool):
    """Fake tensors on the fake process group give the real gloo run's peaks to the byte
    (docs/design.md#emulation), device and host."""
    opts = {"chunk_size": 48}  # 128 local tokens -> chunks of 24, 24, 24, 24, 24, 8
    real = dist_pool(CP).run(_measure, "fpdt", 128, opts)
    (fake,) = dist_pool(CP, fake=True).run(_measure_fake, 128, opts)
    assert fake == real[0]
