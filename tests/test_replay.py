"""The emulator's replay of metadata-pure calls (``upipe.pure``, ``experiments.emulation.replay``).

1. A replayed call leaves the tracker, its observers and the caller where running the function
   would: peaks (device, host, per category, per phase, and the breakdown at each), current
   bytes, FLOPs, collective bytes and the work of the window, the outputs' shapes and strides.
2. What a replay could not repeat is run every time instead: a view of an argument returned,
   memory kept alive past the call, a phase left open, real tensors, unhashable arguments. A
   phase opened and closed inside is replayed with the call.
3. A whole emulated step measures the same with replay as without on an emulated CUDA device
   (UPipe on a 2 x 2 mesh runs every replayed function of upipe; DeepSpeed's FPDT its merge,
   and on the megatron-ds stack its norm tiles and MLP chunks; our FPDT its chunk steps, whose
   host store is made anew in each layer and keyed by its settings), and each names the
   functions it must have replayed;
   on the CPU device tests/test_emulate.py compares every method's emulation, replay included,
   with a real gloo run.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from experiments.config import Cell, Hardware
from experiments.emulation import fake_step
from experiments.emulation.replay import CallReplay
from experiments.instruments.collectives import CollectiveCounter
from experiments.instruments.memory import MemoryTracker
from experiments.instruments.op_flops import CountedFlops
from experiments.timing.op_costs import StepWork
from upipe.chunked import spans
from upipe.host import HostStore
from upipe.pure import metadata_pure, metadata_pure_hook

_KEPT: list[torch.Tensor] = []


@metadata_pure
def _spiky(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A temporary four times x's size (the call's own peak), a matmul, a collective, and two
    outputs: one spanning its storage, one a view into a larger one."""
    big = torch.empty(4, *x.shape, dtype=x.dtype, device=x.device)
    y = (x @ w).relu()
    dist.all_reduce(y)
    del big
    wide = torch.zeros(x.shape[0], 2 * w.shape[1], dtype=torch.float32, device=x.device)
    return y, wide[:, : w.shape[1]]


@metadata_pure
def _view_of_argument(x: torch.Tensor) -> torch.Tensor:
    tmp = x * 2
    del tmp
    return x[1:]


@metadata_pure
def _keeps_a_tensor(x: torch.Tensor) -> torch.Tensor:
    _KEPT.append(x + 1)
    return x * 3


def _run(replay: bool, calls):
    """``calls(tracker)`` under a fresh fake world, FakeTensorMode and a tracker with the three
    instruments as observers; returns (tracker, observers, outputs, the CallReplay or None)."""
    with fake_step.fake_world(4), FakeTensorMode():
        tracker = MemoryTracker(round_bytes=512)
        observers = [CountedFlops(), CollectiveCounter(), StepWork(tracker, 8)]
        tracker.observers += observers
        hook = CallReplay(tracker) if replay else None
        with tracker, metadata_pure_hook(hook), tracker.phase("forward"):
            outs = calls(tracker)
            meta = [(tuple(t.shape), t.stride(), t.storage_offset(), t.dtype)
                    for out in outs for t in (out if isinstance(out, tuple) else (out,))]
            del outs
    return tracker, observers, meta, hook


def _state(tracker: MemoryTracker, observers) -> dict:
    flops, comm, work = observers
    return {"current": dict(tracker.current), "peak": dict(tracker.peak),
            "peak_bytes": tracker.peak_bytes, "by_category": dict(tracker.peak_by_category),
            "at_peak": tracker.breakdown_at_peak, "phases": tracker.peak_by_phase,
            "phase_breakdowns": tracker.breakdown_by_phase, "flops": flops.total,
            "comm": (comm.counts, comm.bytes_sent, comm.payload_bytes),
            "work": dict(work.windows), "order": work.order}


def _three_calls(tracker):
    """The same signature three times in two categories, with a live tensor growing between
    them (so each replay starts from other absolute bytes), plus one call of other shapes."""
    x, w = torch.randn(64, 32), torch.randn(32, 16)
    outs, held = [], []
    with tracker.category("attention"):
        outs.append(_spiky(x, w))
        held.append(torch.empty(1000))
        outs.append(_spiky(x, w))
    outs.append(_spiky(x, w))  # "other": another context, another recording
    held.append(torch.empty(5000))
    outs.append(_spiky(torch.randn(8, 32), w))
    with tracker.category("attention"):
        outs.append(_spiky(x, w))
    return outs


def test_a_replayed_call_leaves_everything_as_running_it_does():
    direct, d_obs, d_outs, _ = _run(False, _three_calls)
    replayed, r_obs, r_outs, hook = _run(True, _three_calls)
    assert (hook.recorded, hook.replayed, hook.direct) == (3, 2, 0)
    assert _state(replayed, r_obs) == _state(direct, d_obs)
    assert r_outs == d_outs
    # the call's own temporary made the peak: a replay that skipped it would be lower
    assert direct.peak["device"] > direct.current["device"]
    assert d_obs[0].total > 0 and d_obs[1].counts["allreduce_"] == 5


@pytest.mark.parametrize("fn", [_view_of_argument, _keeps_a_tensor])
def test_what_a_replay_cannot_repeat_runs_every_time(fn):
    def calls(tracker):
        x = torch.randn(16, 8)
        return [fn(x) for _ in range(3)]

    _KEPT.clear()
    direct, d_obs, d_outs, _ = _run(False, calls)
    replayed, r_obs, r_outs, hook = _run(True, calls)
    _KEPT.clear()
    assert (hook.recorded, hook.replayed, hook.direct) == (1, 0, 2)
    assert _state(replayed, r_obs) == _state(direct, d_obs)
    assert r_outs == d_outs


def test_a_call_with_a_phase_inside_replays_it_at_its_turn():
    """A module's phase label (pushed and popped by its hooks) inside a pure call: the replay
    opens and closes it again around the same counts, so the nested phase's peak (the call's
    temporary, above the bytes live before it) comes out as running the call gives it."""

    @metadata_pure
    def phased(tracker, x):
        y = x * 2
        with tracker.phase("inner"):
            tmp = torch.empty(3, *x.shape)
            out = y + 1
            del tmp
        return out

    def calls(tracker):
        x = torch.randn(64, 8)
        outs = [phased(tracker, x)]
        held = torch.empty(777)  # the second call starts from more live bytes
        outs.append(phased(tracker, x))
        del held
        return outs

    direct, d_obs, d_outs, _ = _run(False, calls)
    replayed, r_obs, r_outs, hook = _run(True, calls)
    assert (hook.recorded, hook.replayed, hook.direct) == (1, 1, 0)
    assert _state(replayed, r_obs) == _state(direct, d_obs) and r_outs == d_outs
    assert direct.peak_by_phase[("forward", "inner")] > direct.peak_by_phase[("forward",)]


def test_a_call_leaving_a_phase_open_or_taking_unhashable_or_real_arguments_runs_every_time():
    seen = []

    @metadata_pure
    def phased(tracker, x):
        tracker.push_phase("inner")  # closed by the caller
        return x + 1

    @metadata_pure
    def takes(x, options):
        seen.append(type(x))
        return x + 1

    def calls(tracker):
        x = torch.randn(4)
        outs = []
        for _ in range(2):
            outs.append(phased(tracker, x))
            tracker.pop_phase()
        outs += [takes(x, {"a": {1}}) for _ in range(2)]  # a set inside: unhashable
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            outs += [takes(torch.ones(2), None) for _ in range(2)]  # real tensors
        return outs

    direct, d_obs, _, _ = _run(False, calls)
    replayed, r_obs, _, hook = _run(True, calls)
    assert (hook.recorded, hook.replayed, hook.direct) == (1, 0, 5)
    assert _state(replayed, r_obs) == _state(direct, d_obs)
    assert direct.peak_by_phase.get(("forward", "inner"))  # the phase ran, and ran inside


def test_an_object_with_a_metadata_key_is_the_same_argument_by_its_key():
    """Two host stores with the same settings are one argument (each layer makes its own); a
    store holding a prefetched copy is none (``get`` would hand that copy over), nor is an
    object whose key is unhashable: the call then runs."""

    class Keyed:
        def __init__(self, key):
            self.key = key

        def metadata_key(self):
            return self.key

    @metadata_pure
    def fetch(store, h):
        return store.get(h) * 2

    @metadata_pure
    def scale(obj, x):
        return x * 3

    def calls(tracker):
        h = torch.randn(8, 4)
        outs = [fetch(HostStore(torch.device("cpu")), h) for _ in range(2)]
        held = HostStore(torch.device("cpu"))
        held.prefetch(h)
        assert held.metadata_key() is None
        outs.append(fetch(held, h))
        outs += [scale(Keyed(("a", 1)), h) for _ in range(2)]
        outs += [scale(Keyed(("a", [1])), h) for _ in range(2)]  # a list inside: unhashable
        return outs

    direct, d_obs, d_outs, _ = _run(False, calls)
    replayed, r_obs, r_outs, hook = _run(True, calls)
    # fetch: recorded, replayed, run (prefetched); scale: recorded, replayed, run twice
    assert (hook.recorded, hook.replayed, hook.direct) == (2, 2, 3)
    assert _state(replayed, r_obs) == _state(direct, d_obs) and r_outs == d_outs


def test_a_call_inside_a_call_being_recorded_is_recorded_and_replayed_there():
    """The first outer call records its first inner call and replays the next two (the outer
    recording keeps their temporaries as counts); the second outer call replays whole. Each
    measures what running every call measures."""

    @metadata_pure
    def inner(x):
        return (x * 2).sum(0)  # a temporary (x * 2), an output

    @metadata_pure
    def outer(x):
        return torch.stack([inner(x) for _ in range(3)])

    def calls(tracker):
        x = torch.randn(8, 4)
        return [outer(x), outer(x)]

    direct, d_obs, d_outs, _ = _run(False, calls)
    replayed, r_obs, r_outs, hook = _run(True, calls)
    # recorded: outer, and inner inside it; replayed: inner twice there, then outer
    assert (hook.recorded, hook.replayed, hook.direct) == (2, 3, 0)
    assert _state(replayed, r_obs) == _state(direct, d_obs) and r_outs == d_outs


def test_spans_are_splits_views_and_one_argument_by_their_length():
    """``spans`` makes ``split``'s views (and ``torch.chunk``'s); a pure call over a span of a
    whole tensor replays for every span of the same length, the shorter last one recorded
    apart, and measures what the calls measure when they run."""
    t = torch.randn(3, 10, 4)
    for dim, chunk in ((1, 3), (1, 10), (0, 2), (-1, 3)):
        got = [s.of(t) for s in spans(t.shape[dim], chunk, dim)]
        assert [(v.shape, v.storage_offset()) for v in got] == [
            (v.shape, v.storage_offset()) for v in t.split(chunk, dim)]
    assert [s.of(t).shape for s in spans(10, math.ceil(10 / 4), 1)] == [
        v.shape for v in torch.chunk(t, 4, 1)]

    @metadata_pure
    def double_into(out, x, span):
        span.of(out).copy_(span.of(x) * 2)

    def calls(tracker):
        x, out = torch.randn(10, 4), torch.zeros(10, 4)
        for s in spans(10, 3):
            double_into(out, x, s)
        return [out]

    direct, d_obs, d_outs, _ = _run(False, calls)
    replayed, r_obs, r_outs, hook = _run(True, calls)
    # rows 0-2, 3-5, 6-8 and 9: lengths 3 (recorded, replayed twice) and 1 (recorded)
    assert (hook.recorded, hook.replayed, hook.direct) == (2, 2, 0)
    assert _state(replayed, r_obs) == _state(direct, d_obs) and r_outs == d_outs


def test_without_a_hook_a_pure_function_is_the_function():
    x = torch.randn(6, 4)
    w = torch.randn(4, 3)
    assert torch.equal(_view_of_argument(x), x[1:])
    calls = []
    with metadata_pure_hook(lambda fn, args, kwargs: calls.append(fn) or fn(*args, **kwargs)):
        _view_of_argument(x)
    assert calls == [_view_of_argument.__wrapped__]
    with fake_step.fake_world(2):
        y, _ = _spiky(x, w)
    assert torch.equal(y, (x @ w).relu())


# the loops each method replays, on an emulated CUDA device (its kernel models, 512-byte
# rounding); on the CPU device every method's emulation is compared with a real gloo run, replay
# included (tests/test_emulate.py)
STEPS = [
    # ring loops, all-to-alls, attention calls, merges and projections of every stage
    # with the ALST stack's tiled MLP and norms (upipe/stack/tiled.py)
    # and the chunked loss's chunks (upipe/stack/loss.py)
    ("upipe", {"ring_degree": 2, "heads_per_stage": 2},
     {"ring_attention_forward", "ring_attention_backward", "_shard_forward", "_shard_backward",
      "_chunk_loss_into", "_chunk_backward_into"}),
    # the long level's residual FFN, shard by shard (upipe.stack.tiled_residual)
    ("upipe", {"chunk_size": 256, "stack": "long"}, {"_residual_forward", "_residual_backward"}),
    ("ds-fpdt", {"chunk_size": 1024}, {"_update_out_and_lse"}),  # per chunk pair
    # per chunk: its projection, its attention over the chunks it sees, and both backward steps
    # (a new host store each layer, keyed by its settings: upipe.pure)
    ("fpdt", {"chunk_size": 1024}, {"_project", "_attend", "_query_chunk", "_kv_chunk"}),
    # the megatron-ds stack's fused-norm tiles and FPDT_FFN chunks (baselines/megatron_stack.py)
    ("ds-fpdt", {"chunk_size": 1024, "stack": "megatron-ds"},
     {"rms_norm", "rms_norm_backward", "_swiglu_into", "_swiglu_backward_into"}),
]


@pytest.mark.slow  # about 3 s on 2 cores (docs/testing.md)
@pytest.mark.parametrize("method,options,functions", STEPS,
                         ids=[f"{m}-{o.get('stack', 'alst')}" for m, o, _ in STEPS])
def test_a_replayed_step_measures_what_a_dispatched_one_does(monkeypatch, method, options,
                                                             functions):
    hooks = []

    class Spy(CallReplay):
        def __init__(self, tracker):
            super().__init__(tracker)
            self.names: set[str] = set()  # the functions replayed at least once
            hooks.append(self)

        def __call__(self, fn, args, kwargs):
            before = self.replayed
            out = super().__call__(fn, args, kwargs)
            if self.replayed > before:
                self.names.add(fn.__name__)
            return out

    monkeypatch.setattr(fake_step, "CallReplay", Spy)
    cell = Cell.from_dict(dict(method=method, model="tiny", nproc=4, seq_len=4096,
                               stack="alst", dtype="bf16") | options)
    cfg = dataclasses.replace(cell.validate(), n_layers=2)
    replayed = fake_step.measure_fake(cell, cfg, Hardware())
    direct = fake_step.measure_fake(cell, cfg, Hardware(), replay=False)
    assert len(hooks) == 1 and functions <= hooks[0].names, functions - hooks[0].names
    assert replayed == direct
