"""``experiments.gpu.loopback``: on the ``fake`` process group the collectives a measured step
calls write what rank 0 of ranks with alike data would receive, by position or by name; outside
the context the originals are back."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from experiments.emulation.fake_step import fake_world
from experiments.gpu import loopback
from experiments.gpu.loopback import loopback_collectives

P = 4


def _nan(*shape):
    return torch.full(shape, float("nan"))


@pytest.fixture
def world():
    with fake_world(P):
        yield


def test_all_to_all_receives_this_ranks_own_chunks(world):
    inp = torch.randn(P, 3, 2)
    out = _nan(P, 3, 2)
    with loopback_collectives(always=True):
        dist.all_to_all_single(out, inp)
        assert torch.equal(out, inp)
        kw = _nan(P, 3, 2)
        work = dist.all_to_all_single(output=kw, input=inp, async_op=True)  # DeepSpeed's call
        work.wait()
        assert torch.equal(kw, inp)


def test_gathers_repeat_and_reduce_scatters_take_this_ranks_chunk(world):
    inp = torch.randn(3, 2)
    with loopback_collectives(always=True):
        out = _nan(P * 3, 2)
        dist.all_gather_into_tensor(out, inp)
        assert torch.equal(out, inp.repeat(P, 1))
        outs = [_nan(3, 2) for _ in range(P)]
        dist.all_gather(outs, inp)
        assert all(torch.equal(o, inp) for o in outs)
        big = torch.randn(P * 3, 2)
        part = _nan(3, 2)
        dist.reduce_scatter_tensor(part, big)
        assert torch.equal(part, big[:3])
        if hasattr(dist, "reduce_scatter_single"):  # FSDP2's in torch >= 2.13, by name
            part2 = _nan(3, 2)
            dist.reduce_scatter_single(output=part2, input=big)
            assert torch.equal(part2, big[:3])


def test_a_batched_ring_step_receives_what_it_sends(world):
    k, v = torch.randn(5, 2), torch.randn(5, 2, dtype=torch.float64)
    rk, rv = _nan(5, 2), torch.full((5, 2), float("nan"), dtype=torch.float64)
    with loopback_collectives():  # no torch version writes P2P: wrapped without always
        ops = [dist.P2POp(dist.isend, k, 1), dist.P2POp(dist.isend, v, 1),
               dist.P2POp(dist.irecv, rk, P - 1), dist.P2POp(dist.irecv, rv, P - 1)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    assert torch.equal(rk, k) and torch.equal(rv, v)


def test_the_originals_are_back_after_the_context(world):
    names = ("all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor",
             "all_gather", "batch_isend_irecv")
    before = {n: getattr(dist, n) for n in names}
    with pytest.raises(RuntimeError, match="inside"):
        with loopback_collectives(always=True):
            assert all(getattr(dist, n) is not before[n] for n in names)
            raise RuntimeError("inside")
    assert all(getattr(dist, n) is before[n] for n in names)


def test_only_what_the_stock_backend_leaves_unwritten_is_wrapped(world):
    """Each function is wrapped exactly when the fake backend of this torch leaves its output
    unwritten (torch 2.13 writes the collectives', not P2P's; 2.11 writes neither)."""
    stock = {n: loopback._writes(n) for n in (*loopback.FILLS, "batch_isend_irecv")
             if hasattr(dist, n)}
    assert stock["batch_isend_irecv"] is False  # P2P: no version writes it
    before = {n: getattr(dist, n) for n in stock}
    with loopback_collectives() as wrapped:
        for n, writes in stock.items():
            assert (getattr(dist, n) is before[n]) == writes, n
        assert wrapped == sorted(n for n, writes in stock.items() if not writes)


def test_outside_a_fake_group_nothing_is_wrapped():
    assert not dist.is_initialized()
    before = dist.all_to_all_single
    with loopback_collectives(always=True):
        assert dist.all_to_all_single is before
