"""The sequence <-> head all-to-all: exact layout and bit-exact round trips on 2 and 4 ranks;
and the byte accounting of ``CollectiveCounter`` (experiments/instruments/collectives.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from experiments.instruments.collectives import CollectiveCounter
from upipe.comm import (
    head_to_seq,
    head_to_seq_autograd,
    head_to_seq_start,
    seq_to_head,
    seq_to_head_autograd,
    seq_to_head_start,
)


def _check_layout(b, s, n, d, dtype):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(7)
    full = torch.randn(b, s, n, d).to(dtype)  # the same on every rank
    local = full.chunk(world, dim=1)[rank]
    heads = seq_to_head(local, dist.group.WORLD)
    expect = full.chunk(world, dim=2)[rank]  # full sequence, this rank's heads
    back = head_to_seq(heads, dist.group.WORLD)
    # autograd versions: the backward of each is the other all-to-all
    x = local.clone().requires_grad_(True)
    y = seq_to_head_autograd(x, dist.group.WORLD)
    y.backward(expect)
    z = heads.clone().requires_grad_(True)
    head_to_seq_autograd(z, dist.group.WORLD).backward(local)
    return {
        "seq_to_head": torch.equal(heads, expect),
        "round_trip": torch.equal(back, local),
        "autograd_fwd": torch.equal(y.detach(), expect),
        "autograd_bwd": torch.equal(x.grad, local),
        "autograd_bwd2": torch.equal(z.grad, heads),
    }


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("shape", [(2, 12, 8, 5), (1, 28, 4, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_to_all_layout_and_round_trip_bit_exact(dist_pool, world, shape, dtype):
    for r, res in enumerate(dist_pool(world).run(_check_layout, *shape, dtype)):
        assert all(res.values()), f"rank {r}: {res}"


def _check_async(b, s, n, d, dtype):
    """The asynchronous all-to-alls (UPipe's overlapped stages) give bit-for-bit the blocking
    ones' results, also from a non-contiguous (B, L, C, *, D) split view and into one, with two
    transfers in flight at once (the loop's pattern)."""
    group, world = dist.group.WORLD, dist.get_world_size()
    torch.manual_seed(dist.get_rank())
    x = torch.randn(b, s, n, d).to(dtype)
    heads = seq_to_head(x, group)
    t1, t2 = seq_to_head_start(x, group, True), seq_to_head_start(x * 2, group, True)
    got1, got2 = t1.wait(), t2.wait()
    # every other head of a (B, L, 2n, D) buffer, split by destination rank: a strided view
    wide = torch.zeros(b, s, 2 * n, d, dtype=dtype)
    split = wide[:, :, ::2].unflatten(2, (world, n // world))
    from_view = seq_to_head_start(split.copy_(x.unflatten(2, (world, -1))), group, True).wait()
    back_into = torch.zeros_like(wide)
    head_to_seq_start(heads, group, True,
                      into=back_into[:, :, 1::2].unflatten(2, (world, -1))).wait()
    return {
        "async": torch.equal(got1, heads), "second": torch.equal(got2, seq_to_head(x * 2, group)),
        "from_view": torch.equal(from_view, heads),
        "into": torch.equal(back_into[:, :, 1::2], x) and not back_into[:, :, ::2].any(),
        "blocking_start": torch.equal(seq_to_head_start(x, group, False).wait(), heads),
    }


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_async_all_to_alls_bit_exact(dist_pool, world, dtype):
    for r, res in enumerate(dist_pool(world).run(_check_async, 2, 12, 8, 5, dtype)):
        assert all(res.values()), f"rank {r}: {res}"


def _overlap_against_blocking(h: int, h_kv: int, u: int, dtype) -> dict:
    """UPipe's overlapped schedule against the blocking one on the same layer and input: the
    output, dx and every weight gradient bit for bit (dx summed a block's dK, dV before its
    last dQ when that was still in flight: one ulp apart where the plan has 2+ K/V blocks)."""
    from upipe import UPipeAttention

    out = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        m = UPipeAttention(8 * h, h, h_kv, 8, group=dist.group.WORLD, heads_per_stage=u,
                           overlap=overlap).to(dtype)
        x = torch.randn(1, 12, 8 * h, dtype=dtype, generator=torch.Generator().manual_seed(
            1 + dist.get_rank())).requires_grad_(True)
        y = m(x)
        y.square().sum().backward()
        out[overlap] = [y, x.grad, *(p.grad for p in m.parameters())]
    return {"equal": all(torch.equal(a, b) for a, b in zip(out[False], out[True], strict=True))}


@pytest.mark.parametrize("h, h_kv, u", [(8, 8, 2), (8, 8, 4), (16, 4, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_upipe_overlap_is_the_blocking_schedule_bit_for_bit(dist_pool, h, h_kv, u, dtype):
    for r, res in enumerate(dist_pool(2).run(_overlap_against_blocking, h, h_kv, u, dtype)):
        assert res["equal"], f"rank {r}"


def test_single_process_is_identity():
    x = torch.randn(1, 4, 2, 3)
    assert seq_to_head(x, None) is x and head_to_seq(x, None) is x


def _collective_bytes():
    """One of each collective on 2 ranks, with payloads of distinct sizes and dtypes."""
    rank = dist.get_rank()
    with CollectiveCounter() as cc:
        dist.all_to_all_single(torch.empty(12), torch.ones(12))  # input 48 B
        dist.all_gather_into_tensor(torch.empty(12, dtype=torch.bfloat16),
                                    torch.ones(6, dtype=torch.bfloat16))  # output 24 B
        dist.reduce_scatter_tensor(torch.empty(4, dtype=torch.float64),
                                   torch.ones(8, dtype=torch.float64))  # input 64 B
        dist.all_reduce(torch.ones(7))  # 28 B
        dist.broadcast(torch.ones(4), src=0)  # 16 B
        # rank 0 sends 12 B to rank 1, which answers with 20 B (recv before send: no deadlock)
        if rank == 0:
            dist.send(torch.ones(3), 1)
            dist.recv(torch.empty(5), 1)
        else:
            dist.recv(torch.empty(3), 0)
            dist.send(torch.ones(5), 0)
        dist.barrier()
    return dict(cc.counts), dict(cc.bytes_sent), dict(cc.payload_bytes), cc.total_bytes_sent


def test_collective_bytes_on_two_ranks(dist_pool):
    # P = 2: a ring sends (P-1)/P = 1/2 of the payload, an all-reduce 2(P-1)/P = 1 times it.
    ring = {"alltoall_base_": 24, "_allgather_base_": 12, "_reduce_scatter_base_": 32,
            "allreduce_": 28}
    payload = {"alltoall_base_": 48, "_allgather_base_": 24, "_reduce_scatter_base_": 64,
               "allreduce_": 28, "broadcast_": 16}
    p2p_sent = [{"send": 12, "recv_": 0}, {"send": 20, "recv_": 0}]
    p2p_payload = [{"send": 12, "recv_": 20}, {"send": 20, "recv_": 12}]
    broadcast_sent = [16, 0]  # only the root sends
    for r, (counts, sent, moved, total) in enumerate(dist_pool(2).run(_collective_bytes)):
        assert counts == dict.fromkeys([*payload, "send", "recv_", "barrier"], 1), f"rank {r}"
        assert sent == ring | {"broadcast_": broadcast_sent[r]} | p2p_sent[r], f"rank {r}"
        assert moved == payload | p2p_payload[r], f"rank {r}"
        assert total == sum(sent.values()), f"rank {r}"


def _fake_all_gather_bytes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    world = dist.get_world_size()
    with FakeTensorMode():  # paper-scale shapes, nothing allocated
        local = torch.empty(1, 128 * 1024, 4096, dtype=torch.bfloat16)  # 1 GiB per rank
        with CollectiveCounter() as cc:
            dist.all_gather_into_tensor(local.new_empty(world, *local.shape[1:]), local)
            dist.all_reduce(torch.empty(3))  # 12 B: 2 * 7/8 * 12 = 21
    return world, dict(cc.bytes_sent), dict(cc.payload_bytes)


@pytest.mark.slow  # about 2 s on 2 cores (docs/testing.md)
def test_all_gather_bytes_under_fake_group(dist_pool):
    [(world, sent, moved)] = dist_pool(8, fake=True).run(_fake_all_gather_bytes)
    gib = 1 << 30
    assert world == 8
    assert moved == {"_allgather_base_": 8 * gib, "allreduce_": 12}
    assert sent == {"_allgather_base_": 7 * gib, "allreduce_": 21}


def _ring_raises_then_the_group_works(kind: str) -> tuple[str, list[float]]:
    from upipe import ring_attention

    q = torch.randn(1, 4, 2, 8)
    k = torch.randn(1, 4, 2, 8, dtype=torch.float64 if kind == "dtype" else torch.float32)
    try:
        ring_attention(q, k, k.clone(), group=dist.group.WORLD,
                       kernel="flash-attn" if kind == "kernel" else "auto")
        raised = ""
    except RuntimeError as e:
        raised = str(e)
    t = torch.ones(3) * (dist.get_rank() + 1)
    dist.all_reduce(t)  # timed out in gloo when the ring left its sends and receives pending
    return raised, t.tolist()


@pytest.mark.parametrize("kind", ["kernel", "dtype"])
def test_a_ring_that_raises_on_every_rank_leaves_the_group_usable(dist_pool, kind):
    """An unavailable kernel or a dtype mix raises inside the ring loop, after the step's K/V
    were posted to the neighbours: the posted operations complete before the error leaves, so
    the group's next collective works."""
    for raised, summed in dist_pool(2).run(_ring_raises_then_the_group_works, kind):
        assert raised and summed == [3.0, 3.0, 3.0]


def _group_misuse(case: str) -> str:
    from upipe import build_method, upipe_attention
    from upipe.rope import rope_tables

    try:
        if case == "not a member":  # rank 1 given a group of rank 0 only
            alone = dist.new_group([0])
            group = alone if dist.get_rank() == 1 else dist.group.WORLD
            build_method("ring", 32, 4, 2, 8, group=group)
        else:  # the same group as both axes of a hybrid
            x, w, wkv = torch.randn(1, 4, 32), torch.randn(32, 32), torch.randn(16, 32)
            cos, sin = rope_tables(torch.arange(4), 8, 10000.0, torch.float32)
            upipe_attention(x, w, wkv, wkv, cos, sin, n_heads=4, n_kv_heads=2,
                            group=dist.group.WORLD, ring_group=dist.group.WORLD)
    except ValueError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("case,match,ranks", [
    # torch answers -1 for its size and rank, which the methods took as such: an AttributeError
    # in the forward, or "heads_per_stage (-1) must be a positive multiple of the CP degree (-1)"
    ("not a member", "group must contain this rank", [1]),
    # accepted before: a hybrid of 16 tokens out of 8, heads mixed across ranks
    ("one group twice", "two axes of one mesh", [0, 1]),
])
def test_groups_that_cannot_be_the_methods_are_refused(dist_pool, case, match, ranks):
    said = dist_pool(2).run(_group_misuse, case)
    assert [r for r, text in enumerate(said) if match in text] == ranks, said
