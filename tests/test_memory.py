"""MemoryTracker unit tests, fake-vs-real equality, and the attention-memory accounting (§5).

The accounting tests measure ONE attention layer's forward+backward with the tracker and compare
the peak activation bytes with an analytical list of the tensors alive at the peak moment, read
off the code (upipe/untied.py, baselines/ulysses.py, upipe/comm.py, upipe/rope.py). Every term is
a named line; the terms of the memory formula in docs/design.md#upipe are marked "design", the rest
are what the implementation also holds there (see the comments; some are avoidable and were
reported).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import checkpoint

from experiments.config import Cell, MiB, Status
from experiments.harness.stats import budget_status, memory_figures, summarise
from experiments.instruments.labels import label_modules
from experiments.instruments.memory import MemoryTracker
from experiments.row import unknown_keys
from upipe import build_method

# ---------------------------------------------------------------------------------------------
# tracker unit tests


def test_storage_object_is_preserved():
    """The tracker keys on storage objects: one Python object per storage, shared by views."""
    t = torch.empty(8)
    assert t.untyped_storage() is t.untyped_storage()
    assert t[2:].view(2, 3).untyped_storage() is t.untyped_storage()
    with FakeTensorMode():
        f = torch.empty(8)
        assert f.untyped_storage() is f.untyped_storage()
        assert f.untyped_storage().nbytes() == 32


def test_exact_bytes_frees_views_and_peak():
    with MemoryTracker() as mt:
        a = torch.empty(1000)  # fp32: 4000 B
        b = torch.zeros(10, 10, dtype=torch.bfloat16)  # 200 B
        assert mt.current_bytes == 4200
        v = a.view(10, 100).t()[::2]  # views add nothing
        a.add_(1.0)  # in-place adds nothing
        b.mul_(2)
        assert mt.current_bytes == 4200
        c = a * 2  # 4000 B
        assert mt.current_bytes == mt.peak_bytes == 8200
        del c
        assert mt.current_bytes == 4200
        del a  # the view still holds the storage
        assert mt.current_bytes == 4200
        del v
        assert mt.current_bytes == 200
        assert mt.peak_bytes == 8200
        mt.reset_peak()
        assert mt.peak_bytes == 200
        d = torch.empty(3, dtype=torch.int64)  # 24 B
        assert mt.peak_bytes == 224
        del b, d
    assert mt.current_bytes == 0


def test_untracked_inputs_and_track():
    x = torch.randn(100)  # made outside: unknown until tracked
    lin = torch.nn.Linear(10, 10, bias=False)  # 400 B weight
    with MemoryTracker() as mt:
        x.mul_(2)  # in-place on an untracked tensor is not an allocation
        x.view(10, 10)
        assert mt.current_bytes == 0
        mt.track(lin, x, category="model")
        mt.track(x)  # counted once
        assert mt.current_bytes == 800
        assert mt.current_by_category["model"] == 800
        y = x + 1
        assert mt.current_by_category == {"model": 800, "other": 400}
        assert mt.tracks(y) and mt.tracks(lin.weight)
        del y


def test_out_variant_resize_is_counted():
    with MemoryTracker() as mt:
        out = torch.empty(0)
        torch.add(torch.ones(4), 1, out=out)  # out= resizes the existing storage to 16 B
        assert mt.current_bytes == 16
        del out


def test_host_device_split_and_categories():
    with MemoryTracker() as mt:
        a = torch.empty(100)  # device 400
        with mt.host():
            h = torch.empty(50)  # host 200
        with mt.category("attention"):
            t = torch.empty(25)  # device 100, attention
            with mt.category("inner"):
                u = torch.empty(25)
        assert (mt.current_device_bytes, mt.current_host_bytes) == (600, 200)
        assert mt.current_bytes == 800
        assert mt.current_by_category["attention"] == 100
        assert mt.current_by_category["inner"] == 100
        del t, u
        assert mt.peak_by_category["attention"] == 100
        assert mt.breakdown_at_peak == {"other": 400, "attention": 100, "inner": 100}
        del a, h
        assert (mt.peak_device_bytes, mt.peak_host_bytes, mt.peak_bytes) == (600, 200, 800)


def test_backward_runs_in_calling_thread_and_is_seen():
    """On CPU the autograd engine runs backward in the caller's thread, under the mode."""

    class ThreadLog(MemoryTracker):
        def __init__(self):
            super().__init__()
            self.threads, self.ops = set(), []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.threads.add(threading.get_ident())
            self.ops.append(func.__name__)
            return super().__torch_dispatch__(func, types, args, kwargs)

    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64)
    with ThreadLog() as mt:
        mt.track(w, x)
        loss = (x @ w).sum()
        n_forward = len(mt.ops)
        loss.backward()
        assert mt.threads == {threading.get_ident()}
        assert "mm.default" in mt.ops[n_forward:]  # dL/dw = x^T @ dL/dy
        assert mt.tracks(w.grad)
        assert mt.current_bytes >= 2 * w.numel() * 4 + x.numel() * 4


def test_device_rounding_like_the_caching_allocator():
    """round_bytes=512: every device storage counts as whole 512 B blocks, host ones as is."""
    spare = torch.empty(0)  # made outside: untracked until resize_ grows it
    with MemoryTracker(round_bytes=512) as mt:
        a = torch.empty(1)  # 4 B -> 512
        b = torch.empty(250)  # 1000 B -> 1024
        c = torch.empty(128)  # 512 B: already whole
        z = torch.empty(0)  # 0 B -> 0
        assert mt.current_device_bytes == 2048
        assert sorted(x.nbytes for x in mt.live_allocations()) == [0, 512, 512, 1024]
        with mt.host():
            h = torch.empty(1)  # host: 4 B, not rounded
        assert (mt.current_device_bytes, mt.current_host_bytes) == (2048, 4)
        del c
        assert mt.current_device_bytes == 1536  # a free returns exactly what was counted
        torch.add(torch.ones(4), 1, out=z)  # out= grows z to 16 B -> 512 (the ones: freed)
        assert mt.current_device_bytes == 2048
        st = b.untyped_storage()
        st.resize_(0)  # FSDP2's free of an unsharded parameter
        assert mt.current_device_bytes == 1024
        st.resize_(1030)  # 1030 B -> 1536
        assert mt.current_device_bytes == 2560
        spare.untyped_storage().resize_(4)  # an untracked storage grown: a new 512 B block
        assert mt.current_device_bytes == 3072
        assert mt.peak_device_bytes == 3072
        del spare, b, st, z
        assert mt.current_device_bytes == 512
        del a, h
        assert (mt.current_device_bytes, mt.current_host_bytes) == (0, 0)
    with pytest.raises(ValueError, match="round_bytes"):
        MemoryTracker(round_bytes=0)


def test_observers_see_what_stacked_modes_see():
    """Instruments on the tracker's dispatch (``observers``) count what they count as modes of
    their own, after the tracker has counted the outputs; device queries reach neither."""
    from experiments.emulation.fake_step import fake_world
    from experiments.instruments.collectives import CollectiveCounter
    from experiments.instruments.op_flops import CountedFlops

    class Seen:
        def __init__(self, tracker):
            self.tracker, self.ops, self.tracked_outputs = tracker, [], 0

        def observe(self, func, args, kwargs, out):
            self.ops.append(func)
            if isinstance(out, torch.Tensor) and self.tracker.tracks(out):
                self.tracked_outputs += 1

    def step():
        a, b = torch.randn(6, 5), torch.randn(5, 7)
        c = a @ b
        c.t().contiguous()  # a view (the fake run asks its device) and a copy
        dist.all_reduce(c)
        return c

    with fake_world(4), FakeTensorMode():
        flops, comm = CountedFlops(), CollectiveCounter()
        with flops, comm, MemoryTracker():
            step()
        tracker = MemoryTracker()
        observed = [CountedFlops(), CollectiveCounter(), Seen(tracker)]
        tracker.observers += observed
        with tracker:
            step()
    assert observed[0].total == flops.total == 2 * 6 * 5 * 7
    assert observed[1].counts == comm.counts and comm.counts["allreduce_"] == 1
    assert observed[1].bytes_sent == comm.bytes_sent and comm.total_bytes_sent > 0
    seen = observed[2]
    assert torch.ops.aten.mm.default in seen.ops and torch.ops.prim.device.default not in seen.ops
    assert seen.tracked_outputs >= 3  # randn, randn, mm: counted before the observer ran


def test_phase_peaks_and_breakdowns():
    """Each phase key keeps the highest device bytes seen while it was the innermost key."""
    with MemoryTracker() as mt:
        a = torch.empty(100)  # 400, at the root key ()
        with mt.phase("step"):  # ("step",) starts at 400
            with mt.category("attention"):
                b = torch.empty(50)  # 600
            with mt.phase("fwd"):  # ("step", "fwd") starts at 600
                c = torch.empty(250)  # 1600: its peak
                del c
                d = torch.empty(25)  # 700: below the peak, nothing changes
                with mt.host():
                    h = torch.empty(1000)  # host bytes are not device bytes
            with mt.phase("idle"):  # allocates nothing: keeps the bytes live while it ran
                pass
            del b  # 500, attention drops to 0 (left out of the breakdowns)
            e = torch.empty(100)  # 900 in ("step",): above its 600
        mt.pop_phase()  # at the root: a no-op, like pop_category
        assert mt.peak_by_phase == {
            (): 400, ("step",): 900, ("step", "fwd"): 1600, ("step", "idle"): 700,
        }
        assert mt.breakdown_by_phase == {
            (): {"other": 400},
            ("step",): {"other": 900},
            ("step", "fwd"): {"other": 1400, "attention": 200},
            ("step", "idle"): {"other": 500, "attention": 200},
        }
        mt.reset_peak()
        assert mt.peak_by_phase == {} and mt.breakdown_by_phase == {}
        f = torch.empty(1)  # 904: refills the current (root) key only
        mt.push_phase("late")
        assert mt.peak_by_phase == {(): 904, ("late",): 904}
        assert mt.breakdown_by_phase[("late",)] == {"other": 904}
        mt.pop_phase()
        del a, d, e, f, h


class _Scale(torch.nn.Module):
    def __init__(self, k: float):
        super().__init__()
        self.k = k

    def forward(self, x):
        return x * self.k  # saves nothing; backward allocates one grad * k


class _SinDouble(torch.nn.Module):
    def forward(self, x):
        return torch.sin(x * 2)  # sin saves x * 2; backward allocates cos(x * 2) and grad * cos


def _label_phases(modules, mt, name):
    return label_modules(modules, mt, f"{name}:fwd", push=mt.push_phase, pop=mt.pop_phase,
                         backward_name=f"{name}:bwd")


def _run_labelled(model, labelled, x, dy) -> tuple[dict, dict]:
    """Forward and backward of ``model`` with ``labelled`` labelled by phase ("m:fwd"/"m:bwd")
    and by category ("attention"); x and dy are tracked first (800 B at the root key).

    Returns (peak_by_phase, breakdown_by_phase), after checking that the labels are balanced:
    a new allocation lands at the root key and in category "other".
    """
    mt = MemoryTracker()
    handles = label_modules(labelled, mt, "m:fwd", push=mt.push_phase, pop=mt.pop_phase,
                            backward_name="m:bwd")
    handles += label_modules(labelled, mt, "attention")  # the default: categories
    try:
        with mt:
            mt.track(x, dy)
            y = model(x)
            y.backward(dy)
            peaks, breakdowns = dict(mt.peak_by_phase), dict(mt.breakdown_by_phase)
            mt.reset_peak()
            other = mt.current_by_category["other"]
            g = torch.empty(1)
            assert list(mt.peak_by_phase) == [()]
            assert mt.current_by_category["other"] == other + 4
            del y, g
    finally:
        for h in handles:
            h.remove()
    return peaks, breakdowns


def test_label_modules_phases_and_categories():
    """Forward and backward phase keys of one module, beside its category label."""
    model = torch.nn.Sequential(_Scale(2), _Scale(3))
    x, dy = torch.randn(100, requires_grad=True), torch.randn(100)  # 400 B each, "model"
    peaks, breakdowns = _run_labelled(model, [model[0]], x, dy)
    # forward: y0 = 2x (1200, m:fwd), y1 = 3 y0 (1600, root); y0 dies with the forward (1200).
    # backward: g1 = 3 dy (1600, root); m:bwd starts there and makes x.grad = 2 g1 (2000)
    assert peaks == {(): 1600, ("m:fwd",): 1200, ("m:bwd",): 2000}
    assert breakdowns == {
        (): {"model": 800, "attention": 400, "other": 400},  # at y1
        ("m:fwd",): {"model": 800, "attention": 400},
        ("m:bwd",): {"model": 800, "attention": 400, "other": 800},
    }
    assert torch.equal(x.grad, dy * 6)


class _CheckpointedBlock(torch.nn.Module):
    """Checkpoints inside its forward, as experiments/harness/model.py's blocks do."""

    def __init__(self):
        super().__init__()
        self.inner = _SinDouble()

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False)


@pytest.mark.parametrize("wraps", ["block", "checkpoint"])
def test_label_modules_phases_under_checkpointing(wraps):
    """Recomputation belongs to the backward key. ``checkpoint``: the checkpoint wraps the
    labelled module, so its hooks run again on recomputation, which stops early (at the last
    saved tensor, inside the module): the labels must stay balanced all the same."""
    x, dy = torch.randn(100, requires_grad=True), torch.randn(100)
    if wraps == "block":
        model = _CheckpointedBlock()
        labelled = [model]
    else:
        inner = _SinDouble()
        labelled = [inner]

        def model(t):
            return checkpoint(inner, t, use_reentrant=False)

    peaks, _ = _run_labelled(model, labelled, x, dy)
    # forward: 2x (1200), sin (1600); 2x is not kept (1200). backward: recomputed 2x (1600),
    # cos(2x) (2000), dy * cos (2400)
    expected = {(): 800, ("m:fwd",): 1600, ("m:bwd",): 2400}
    if wraps == "checkpoint":  # the recomputation's own forward key, inside the backward's
        expected[("m:bwd", "m:fwd")] = 1600
    assert peaks == expected


# ---------------------------------------------------------------------------------------------
# one attention layer, measured


@dataclass(frozen=True)
class Shape:
    """One layer's shapes. dim < H*D on purpose: keeps weights small so activations dominate."""

    n_heads: int = 32
    n_kv_heads: int = 8
    cp: int = 4
    heads_per_stage: int = 4
    head_dim: int = 64
    dim: int = 256
    seq_local: int = 512
    dtype: torch.dtype = torch.float32
    overlap: bool = False  # UPipe's overlapped stages (upipe/untied.py)
    keep: bool | None = None  # UPipe's keep_last_stage (None: as overlap)
    chunk_size: int | None = None  # UPipe's chunked attention backward (upipe/chunked.py)


def _build(method: str, s: Shape, group):
    opts = ({"heads_per_stage": s.heads_per_stage, "overlap": s.overlap,
             "chunk_size": s.chunk_size, "keep_last_stage": s.keep}
            if method == "upipe" else {})
    # construct in the target dtype: Module.to() cannot swap fake parameters
    old = torch.get_default_dtype()
    torch.set_default_dtype(s.dtype)
    try:
        return build_method(method, s.dim, s.n_heads, s.n_kv_heads, s.head_dim, group=group,
                            causal=True, **opts)
    finally:
        torch.set_default_dtype(old)


def measure_layer(method: str, s: Shape) -> dict[str, int]:
    """Peaks of one layer's forward, its backward, and both; runs on a real or fake group.

    baseline = parameters + input x + output gradient dy, tracked before the step; ``*_peak``
    are absolute, ``*_act`` above the baseline; ``unsettled``: collectives the tracker counted
    while gloo still held them after its long wait (0 on the fake group).
    """
    group = dist.group.WORLD
    m = _build(method, s, group)
    torch.manual_seed(0)
    x = torch.randn(1, s.seq_local, s.dim, dtype=s.dtype, requires_grad=True)
    dy = torch.randn(1, s.seq_local, s.dim, dtype=s.dtype)
    with MemoryTracker() as mt:
        mt.track(m, x, dy)
        base = mt.current_bytes
        y = m(x)
        fwd = mt.peak_bytes
        mt.reset_peak()  # the backward's own peak, from the saved tensors up
        y.backward(dy)
        bwd = mt.peak_bytes
    peak = max(fwd, bwd)
    return {"baseline": base, "fwd_peak": fwd, "bwd_peak": bwd, "peak": peak,
            "fwd_act": fwd - base, "bwd_act": bwd - base, "act": peak - base,
            "unsettled": mt.unsettled_collectives}


def measure_fake(method: str, s: Shape) -> dict[str, int]:
    """``measure_layer`` on fake tensors; run it in a ``dist_pool(C, fake=True)`` process."""
    with FakeTensorMode():
        return measure_layer(method, s)


@pytest.mark.slow  # about 17 s on 2 cores (docs/testing.md)
def test_fake_equals_real_gloo(dist_pool):
    """Emulation predicts the real CPU run to the byte (docs/design.md#emulation), for both methods,
    UPipe with and without overlapped stages (whose asynchronous all-to-alls gloo runs on its worker
    threads while the fake group completes them at once: the bytes are the same), and with its
    chunked backward (2048 tokens per stage in chunks of 300: seven, the last shorter).

    Every rank is symmetric, so a real run whose ranks disagree was disturbed: one loaded CI
    run measured one rank of the chunked case differently (cause not found: 88 runs of that
    case on 2 cores, idle, beside spinning processes and pinned to one busy core, never did;
    see the tracker's collectives comment). Such a case is measured once more, and the
    emulation must equal a run whose ranks agree."""
    for method, s in (("ulysses", Shape()), ("upipe", Shape()), ("upipe", Shape(overlap=True)),
                      ("upipe", Shape(chunk_size=300))):
        runs = [dist_pool(s.cp).run(measure_layer, method, s)]
        if any(r != runs[0][0] for r in runs[0]):
            runs.append(dist_pool(s.cp).run(measure_layer, method, s))
        real = runs[-1]
        assert all(r == real[0] for r in real), (method, s, _rank_differences(runs))
        (fake,) = dist_pool(s.cp, fake=True).run(measure_fake, method, s)
        assert fake == real[0], (method, s)


def _rank_differences(runs: list[list[dict[str, int]]]) -> list[dict[int, dict]]:
    """Per run, {rank: {field: (rank's value, rank 0's)}} for the fields where a rank differs
    from rank 0 (the failure message of a run whose ranks disagree)."""
    return [{k: {f: (r[f], rs[0][f]) for f in r if r[f] != rs[0][f]}
             for k, r in enumerate(rs) if r != rs[0]} for rs in runs]


def test_a_row_says_when_its_peak_may_count_a_collective_the_backend_still_held():
    """The tracker's count of collectives it could not settle reaches the row, the largest
    rank's, as ``unsettled_collectives``; a row where no rank had one has no such column, so
    rows measured before it are unchanged."""
    cell = Cell(method="ulysses", model="tiny", seq_len=256, nproc=2)
    cfg, cpu = cell.validate(), torch.device("cpu")
    settled, unsettled = MemoryTracker(), MemoryTracker()
    unsettled.unsettled_collectives = 2

    def row(*trackers):
        per_rank = [{"times": [], **memory_figures(t, cpu)} for t in trackers]
        return summarise(cell, cfg, per_rank, cpu, flops=None)

    flagged = row(settled, unsettled)
    assert flagged["unsettled_collectives"] == 2 and unknown_keys(flagged) == []
    assert "unsettled_collectives" not in row(settled, settled)


def test_a_rows_split_of_the_peak_is_the_fullest_ranks_own():
    """The model / attention / other split comes from the rank with the largest peak, so it
    adds up to the row's peak; each part's maximum over ranks mixed ranks (140 B of parts for
    a 100 B peak here, on ranks that hold their bytes in different places)."""
    cell = Cell(method="ulysses", model="tiny", seq_len=256, nproc=2)
    cfg, cpu = cell.validate(), torch.device("cpu")
    ranks = [{"times": [], "tracked_peak_device_bytes": 100, "peak_host_bytes": 0,
              "peak_model_bytes": 60, "peak_attention_bytes": 10, "peak_other_bytes": 30},
             {"times": [], "tracked_peak_device_bytes": 90, "peak_host_bytes": 7,
              "peak_model_bytes": 20, "peak_attention_bytes": 50, "peak_other_bytes": 20}]
    row = summarise(cell, cfg, ranks, cpu, flops=None)
    assert row["peak_device_bytes"] == 100 and row["peak_host_bytes"] == 7
    assert (row["peak_model_bytes"], row["peak_attention_bytes"],
            row["peak_other_bytes"]) == (60, 10, 30)


@pytest.mark.parametrize("over", [0, 1, 63, 64])
def test_a_peak_a_byte_over_the_budget_is_an_oom(over):
    """The budget is checked on the exact tracked bytes (a float32 peak rounded a peak up to
    63 B over a 1000 MiB budget to within it)."""
    cell = Cell(method="ulysses", model="tiny", seq_len=256, nproc=1, budget_mib=1000)
    status, _ = budget_status(cell, {"tracked_peak_device_bytes": 1000 * MiB + over},
                              torch.device("cpu"))
    assert status == (Status.OOM if over else Status.OK)


def _reduce_scatter_then_allocate() -> tuple[float, int, int]:
    """One gloo reduce-scatter under a tracker whose settle timeout is 5 s, the send buffer
    dropped, then one allocation: (seconds taken, live bytes, peak bytes)."""
    world = dist.get_world_size()
    with MemoryTracker(settle_timeout_s=5.0) as mt:
        t0 = time.monotonic()
        out = torch.zeros(64)
        send = torch.ones(64 * world)
        dist.reduce_scatter_single(out, send)
        del send
        kept = torch.empty(16)
        took = time.monotonic() - t0
        live, peak = mt.current_bytes, mt.peak_bytes
    del out, kept
    return took, live, peak


def test_a_reduce_scatter_settles_without_waiting_on_itself(dist_pool):
    """Gloo runs a reduce-scatter's own split and copy through the dispatcher inside ``wait()``,
    while its Work holds the collective's tensors: the tracker settles the collective's buffers
    before the next allocation, not at those ops, so it never waits out its timeout (5 s here;
    FSDP2 reduce-scatters every gradient) and the dropped send buffer is gone before the
    allocation is counted."""
    runs = dist_pool(2).run(_reduce_scatter_then_allocate)
    for took, live, peak in runs:
        assert took < 2.5, f"the tracker waited {took:.1f} s on a finished reduce-scatter"
        assert live == 64 * 4 + 16 * 4  # out and kept; the send buffer is freed
        assert peak == 64 * 4 + 2 * 64 * 4  # out and send, before kept: never all three


def _blocking_all_to_alls(n: int) -> tuple[list[int], int]:
    """``n`` blocking gloo all-to-alls, each send buffer dropped before the next allocation,
    under a tracker that gives async collectives no time at all (``settle_timeout_s=0``):
    (the iterations whose live or peak bytes counted the dropped send buffer, the collectives
    still unsettled after the long wait)."""
    world, numel = dist.get_world_size(), 4096
    wrong = []
    with MemoryTracker(settle_timeout_s=0.0) as mt:
        for i in range(n):
            mt.reset_peak()
            out = torch.empty(numel * world)
            send = torch.ones(numel * world)
            dist.all_to_all_single(out, send)
            del send
            kept = torch.empty(numel)
            # out and send before kept; then out and kept: never all three
            if (mt.peak_bytes, mt.current_bytes) != (2 * world * numel * 4,
                                                     (world + 1) * numel * 4):
                wrong.append(i)
            del out, kept
    return wrong, mt.unsettled_collectives


def test_a_blocking_collectives_buffers_are_gone_before_the_next_allocation(dist_pool):
    """A blocking call's Work is the backend's alone once the call returns: the tracker waits
    for it to let go (up to 10 s) before counting the next allocation, whatever the short
    timeout of async collectives. With no wait at all, 53 of these 400 counted the dropped
    send buffer beside the next allocation (measured on 2 cores): what made a CI run's
    attention peak differ between two identical steps. With the wait none did here, and one
    did in one loaded CI run, with no wait timed out (cause not found): at most 1% may."""
    runs = dist_pool(2).run(_blocking_all_to_alls, 200)
    assert sum(len(wrong) for wrong, _ in runs) <= 4, runs
    assert all(unsettled == 0 for _, unsettled in runs)


# ---------------------------------------------------------------------------------------------
# analytical accounting (bytes on one rank, batch 1)


def _units(s: Shape):
    b = s.dtype.itemsize
    acc = 4 if s.dtype in (torch.float16, torch.bfloat16) else b
    # one head over the L local tokens; a head-layout tensor (n/C heads x C*L tokens) is n*hb too
    hb = s.seq_local * s.head_dim * b
    return b, acc, hb


def ulysses_terms(s: Shape) -> tuple[dict[str, int], dict[str, int]]:
    """(forward peak terms, backward peak terms) of baselines/ulysses.py, above the baseline."""
    H, Hkv, L, D, dim = s.n_heads, s.n_kv_heads, s.seq_local, s.head_dim, s.dim
    b, _, hb = _units(s)
    assert Hkv >= s.cp  # no KV replication in these shapes
    common = {
        "qkv_heads (design)": (H + 2 * Hkv) * hb,  # Q/K/V after the all-to-all, saved by kernel
        "attn_out (design)": H * hb,  # kernel output, head layout, saved by the kernel
        "lse": H * L * 4,  # kernel LSE (1, H/C, C*L) fp32, saved
        "rope_tables": 2 * L * D * b,  # cos, sin: saved by RoPE's mul nodes
    }
    # Forward peak: head_to_seq(o) copying its receive buffer into sequence layout.
    fwd = common | {
        "out_recv (design)": H * hb,  # all-to-all receive buffer of the output
        "out_unpack": H * hb,  # comm.head_to_seq's permute+reshape copy, recv still alive
        # rotated Q, K and V in sequence layout: nothing in autograd needs them, but the locals
        # q, k, v of UlyssesAttention.forward and ulysses_attention's parameters hold them until
        # forward returns (baselines/ulysses.py). Avoidable.
        "qkv_seq (python locals)": (H + 2 * Hkv) * hb,
    }
    # Backward peak: backward of head_to_seq = seq_to_head(dO), at its receive buffer.
    bwd = common | {
        "d_out_seq": H * hb,  # dL/d(attention output) = dy @ wo, held by the autograd engine
        "d_out_send": H * hb,  # comm.seq_to_head's packed (C, ...) send copy
        "d_out_recv (design)": H * hb,  # receive buffer
        "layer_output": L * dim * b,  # y, held by the caller during backward
        "dwo": dim * H * D * b,  # wo's weight gradient, made before the attention backward
    }
    return fwd, bwd


def upipe_terms(s: Shape) -> tuple[dict[str, int], dict[str, int]]:
    """(forward peak terms, backward peak terms) of upipe/untied.py, above the baseline."""
    H, Hkv, C, U, L, D, dim = (s.n_heads, s.n_kv_heads, s.cp, s.heads_per_stage, s.seq_local,
                               s.head_dim, s.dim)
    b, acc, hb = _units(s)  # acc: UPipe's dK/dV accumulator dtype (fp32 for bf16/fp16)
    assert Hkv >= C
    ukv = math.gcd(U, Hkv)  # KV heads per block (upipe/staging.py)
    n_stages = H // U
    fixed = {
        "out_buffer (design)": H * hb,  # the persistent (1, L, H, D) output, saved
        "rope_tables": 2 * L * D * b,
        "kv_heads (design)": 2 * ukv * hb,  # the block's K, V after the all-to-all
        # every block's KV heads and every stage's query heads: one int64 tensor per call
        # (upipe.staging.plan_indices; Hkv >= C, so the plan's KV slots are the Hkv heads)
        "head_index": (Hkv + H) * 8,
    }
    # Forward peak, blocking: the last stage's kernel, with every stage's LSE, its Q and the
    # output it writes (equal to the output's all-to-all back after it: the output, a view of
    # which is the send buffer at batch 1, and the receive buffer). Q's all-to-all before it
    # holds one LSE fewer: Q is rotated straight into the send buffer (rope.rotate's split),
    # beside the receive buffer. With overlap, the second-last stage's kernel: one LSE fewer
    # than stages, its own Q, its output being made, and two stages' all-to-alls in flight,
    # each a send and a receive buffer (the earlier stage's output, the kernel's output of
    # which is the send buffer at batch 1, and the last stage's prefetched Q). The fused
    # output projection at the end holds out + y (L x dim) instead: lower while dim < 6U*D.
    assert dim < 6 * U * D, "the forward peak would be the output projection: model it"
    if s.overlap:
        fwd = fixed | {
            "lses_before": (n_stages - 1) * U * L * 4,  # earlier stages' LSEs and its own, fp32
            "q_o (design)": 2 * U * hb,  # the stage's Q and the output its kernel writes
            "next_q (overlap)": 2 * U * hb,  # the last stage's Q in flight: send and receive
            "out_in_flight (overlap)": 2 * U * hb,  # the previous stage's output going back
        }
    else:
        fwd = fixed | {
            "lses": n_stages * U * L * 4,  # every stage's LSE, fp32
            "q_o (design)": 2 * U * hb,  # the stage's Q and the output its kernel writes
        }
    # Backward peak: a stage's attention_backward returning dq, dk_s, dv_s. The output gradient
    # exists only per stage (dy @ wo[:, stage], fused output projection), freed by then.
    bwd = fixed | {
        "lses": n_stages * U * L * 4,  # all stages' LSEs, saved
        "layer_output": L * dim * b,  # y, held by the caller during backward
        "dwo": dim * H * D * b,  # dy^T @ out, computed when the backward starts
        "dx_acc": L * dim * b,  # dx, accumulated in place (addmm_) in the input dtype
        "dw_acc": (H + 2 * Hkv) * D * dim * b,  # dwq/dwk/dwv, alive for the whole backward
        "w_rows": (2 * ukv + U) * D * dim * b,  # wk/wv rows of the block + wq rows of the stage
        "dkv_acc": 2 * ukv * hb * acc // b,  # dk, dv summed over the block's stages (fp32 for bf16)
        "q_o_do_dq": 4 * U * hb,  # recomputed Q, all-to-all'd O and dO, kernel's dQ
        "dk_dv_stage": 2 * ukv * hb,  # kernel's dK, dV of this stage
    }
    if s.overlap:  # one more stage's all-to-all buffers, and the rows and heads they go with
        bwd |= {
            # the next stage's Q, O, dO in flight: each a send and a receive buffer
            "next_q_o_do (overlap)": 6 * U * hb,
            # the previous stage's dQ in flight: the kernel's dQ (the send buffer is a view of
            # it at batch 1) and the receive buffer
            "prev_dq (overlap)": 2 * U * hb,
            "wq_rows (overlap)": 2 * U * D * dim * b,  # the next and previous stages' rows
        }
    if _keeps(s):  # the forward's last stage, saved: without activation checkpointing (here)
        # autograd frees saved tensors when the layer's backward returns, so they stay
        bwd |= {
            "kept_q (keep)": U * hb,  # its Q, used by the backward's first stage only
            # its block's K, V: the block's own while it runs, more while the others do
            "kept_kv (keep)": 2 * ukv * hb if Hkv // ukv > 1 else 0,  # Hkv // ukv blocks
        }
    return fwd, bwd


def _keeps(s: Shape) -> bool:
    return s.overlap if s.keep is None else s.keep


# Head-proportional terms: the ones that scale with the heads in flight (H for Ulysses, U for
# UPipe), as opposed to the persistent (L, H, D) output/gradient and weight-sized terms.
ULYSSES_HEAD_TERMS = ("qkv_heads (design)", "attn_out (design)", "d_out_seq", "d_out_send",
                      "d_out_recv (design)")
UPIPE_HEAD_TERMS = ("kv_heads (design)", "dkv_acc", "q_o_do_dq", "dk_dv_stage",
                    "next_q_o_do (overlap)", "prev_dq (overlap)", "kept_q (keep)",
                    "kept_kv (keep)")

CONFIGS = [
    Shape(),  # the shape also measured on real gloo above
    Shape(heads_per_stage=8, seq_local=2048),  # U = 2C: a KV block of 8 heads
    Shape(seq_local=4096, dtype=torch.bfloat16),  # bf16: fp32 dK/dV accumulators in UPipe
    # UPipe's overlapped stages alone: one more stage's all-to-all buffers
    Shape(overlap=True, keep=False),
    # and with the last stage kept for the backward (overlap's default): two KV blocks here
    Shape(seq_local=4096, dtype=torch.bfloat16, overlap=True),
]


def _ids(s: Shape) -> str:
    ov = ("-overlap" if s.overlap else "") + ("-keep" if _keeps(s) else "")
    return f"L{s.seq_local}-U{s.heads_per_stage}-{str(s.dtype).removeprefix('torch.')}{ov}"


@pytest.mark.parametrize("s", CONFIGS, ids=_ids)
def test_attention_memory_matches_accounting(s, dist_pool):
    pool = dist_pool(s.cp, fake=True)  # emulation: rank 0 of a C-rank job, in one process
    meas = {m: pool.run(measure_fake, m, s)[0] for m in ("ulysses", "upipe")}
    terms = {"ulysses": ulysses_terms(s), "upipe": upipe_terms(s)}
    for m, (fwd, bwd) in terms.items():
        pred = {"fwd_act": sum(fwd.values()), "bwd_act": sum(bwd.values())}
        pred["act"] = max(pred.values())
        for key, p in pred.items():
            # exact: on CPU a dispatch mode sees no kernel workspaces, and every live tensor is
            # listed (the tolerance was 10%)
            assert meas[m][key] == p, (m, key, meas[m][key], p, fwd, bwd)

    up, ul = meas["upipe"], meas["ulysses"]
    assert up["peak"] < ul["peak"] and up["act"] < ul["act"]
    assert up["fwd_act"] < ul["fwd_act"]

    # Head-proportional parts at the backward peaks. UPipe's stage holds K, V, their fp32-or-not
    # accumulators, the kernel's dK, dV (Ukv heads each) and Q, O, dO, dQ (U heads):
    # Ukv*(4 + 2*acc/b) + 4U <= 12U; Ulysses holds Q, K, V, O and dO three times: 5H + 2Hkv > 5H.
    # So the part that scales with the heads in flight shrinks to <= 2.4 U/H (the design's U/H
    # times the ratio of buffers per head); the (L, H, D) output and its gradient do not shrink.
    # Overlap holds one more stage's all-to-all buffers (8U): <= (12U + 8U) / 5H = 4 U/H.
    ul_bwd, up_bwd = terms["ulysses"][1], terms["upipe"][1]
    ul_head = ul["bwd_act"] - sum(v for k, v in ul_bwd.items() if k not in ULYSSES_HEAD_TERMS)
    up_head = up["bwd_act"] - sum(v for k, v in up_bwd.items() if k not in UPIPE_HEAD_TERMS)
    # The kept last stage, unsaved only when the layer's backward returns (no checkpointing
    # here), adds Q and a second block's K, V: 3U more, 0.6 U/H.
    bound = 2.4 + 1.6 * s.overlap + 0.6 * _keeps(s)
    assert up_head / ul_head <= bound * s.heads_per_stage / s.n_heads, (up_head, ul_head)


def test_cpu_attention_flops_are_counted_by_the_sdpa_formulas():
    """The CPU flash kernel (what ``--emulate-device cpu`` steps run) has no formula in torch's
    registry: its attention counted 0 FLOPs, and such rows' ``rank_flops_per_step`` came out
    below the model's own FLOPs. GQA counts every query head over its KV head's keys."""
    import torch.nn.functional as F
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    from experiments.instruments.op_flops import CountedFlops

    q = torch.randn(1, 4, 64, 16, requires_grad=True)
    k, v = (torch.randn(1, 2, 64, 16, requires_grad=True) for _ in range(2))
    with CountedFlops() as fwd:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with CountedFlops() as bwd:
        out.sum().backward()
    shape = (1, 4, 64, 16)
    assert fwd.total == sdpa_flop_count(shape, shape, shape) > 0
    assert bwd.total == sdpa_backward_flop_count(shape, shape, shape, shape) > 0


def _fsdp_parameter_categories() -> set[str]:
    """One tracked step of the tiny model under FSDP2 on this rank: the categories of the
    unsharded parameters' storages still live after it (FSDP2 keeps the last gathered group)."""
    import experiments.harness.measure as measure

    trackers = []

    class Kept(MemoryTracker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            trackers.append(self)

    cell = Cell(method="ulysses", model="tiny", seq_len=256, nproc=dist.get_world_size(),
                stack="alst", warmup=0, iters=0)
    state = measure.build(cell, cell.validate())
    measure.MemoryTracker = Kept
    try:
        measure.memory_steps(state, 1, torch.device("cpu"))
    finally:
        measure.MemoryTracker = MemoryTracker
    live = trackers[0]._live
    gathered = {id(t.untyped_storage()) for m in state.model.modules()
                if hasattr(m, "_get_fsdp_state") and m._get_fsdp_state()._fsdp_param_group
                for p in m._get_fsdp_state()._fsdp_param_group.fsdp_params
                for t in getattr(p, "all_gather_outputs", [])}
    return {live[k][0].category for k in gathered if k in live}


@pytest.mark.slow  # about 7 s on 2 cores: a tiny model's tracked step on 2 ranks
def test_fsdp_gathered_parameters_are_model_states(dist_pool):
    """FSDP2 allocates the unsharded parameters with plain ops in its hooks: they were counted
    as "other", so a row's ``peak_model_bytes`` left out a block's full parameters."""
    for categories in dist_pool(2).run(_fsdp_parameter_categories):
        assert categories == {"model"}
