"""Communication is part of the algorithm: all-to-all counts per forward and backward.

UPipe (per KV block: K and V sent once; per stage: Q in, output back), with overlapped stages or
without (the same all-to-alls, issued earlier):
  forward  = 2 * n_blocks + 2 * n_stages
  backward = 4 * n_blocks + 4 * n_stages   (recompute K, V; per stage Q, out, dout in and dQ
                                            back; per block dK, dV back)
           - 3 with keep_last_stage (the default with overlap): the backward starts from the
             forward's last stage, whose Q and K, V are not sent again
Ulysses: 4 all-to-alls forward (q, k, v, out) and 4 backward, whatever the head count.

Ring over W ranks (P2P, each exchange one send and one recv per tensor):
  forward  = W-1 K/V exchanges              -> 2(W-1) sends, 2(W-1) recvs
  backward = W-1 K/V exchanges + W dK/dV hops -> 2(W-1) + 2W sends, as many recvs
Hybrids on a (ring R, ulysses C) mesh: the Ulysses all-to-alls over C, plus one ring pass per
attention call (once for USP, once per stage for UPipe).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from experiments.instruments.collectives import CollectiveCounter
from upipe import build_method


def _count(method, h, hkv, options):
    from cases import cp_mesh

    options, group = dict(options), dist.group.WORLD
    if "mesh" in options:
        options["mesh"], group = cp_mesh(*options["mesh"]), None
    m = build_method(method, 32, h, hkv, 8, group=group, **options)
    x = torch.randn(1, 8, 32, requires_grad=True)
    with CollectiveCounter() as fwd:
        y = m(x)
    with CollectiveCounter() as bwd:
        y.sum().backward()
    plan = getattr(m, "plan", None)
    return {
        "fwd": dict(fwd.counts), "bwd": dict(bwd.counts),
        "n_blocks": plan.n_blocks if plan else None, "n_stages": plan.n_stages if plan else None,
    }


@pytest.mark.parametrize(
    "world,h,hkv,u,blocks,stages",
    [
        (2, 8, 2, 2, 1, 4),   # U = C: one KV block reused by g = 4 stages
        (2, 8, 2, 4, 1, 2),
        (2, 8, 8, 2, 4, 4),   # MHA: a KV block per stage
        (2, 8, 2, 8, 1, 1),   # U = H: Ulysses' schedule
        (4, 8, 2, 4, 1, 2),   # KV replicated to 4
        (4, 16, 4, 8, 1, 2),
    ],
)
@pytest.mark.parametrize("overlap,keep", [(True, False), (False, False), (True, None),
                                          (False, True)],
                         ids=["overlap", "blocking", "overlap-keep", "blocking-keep"])
def test_upipe_all_to_all_count_follows_stage_count(dist_pool, world, h, hkv, u, blocks, stages,
                                                    overlap, keep):
    opts = {"heads_per_stage": u, "overlap": overlap, "keep_last_stage": keep}
    kept = 3 if (overlap if keep is None else keep) else 0
    for res in dist_pool(world).run(_count, "upipe", h, hkv, opts):
        assert (res["n_blocks"], res["n_stages"]) == (blocks, stages)
        assert res["fwd"] == {"alltoall_base_": 2 * blocks + 2 * stages}
        assert res["bwd"] == {"alltoall_base_": 4 * blocks + 4 * stages - kept}


@pytest.mark.parametrize("world,h,hkv", [(2, 8, 2), (4, 16, 4), (4, 8, 2)])
def test_ulysses_four_all_to_alls_each_way(dist_pool, world, h, hkv):
    for res in dist_pool(world).run(_count, "ulysses", h, hkv, {}):
        assert res["fwd"] == {"alltoall_base_": 4}
        assert res["bwd"] == {"alltoall_base_": 4}


def _ring_counts(r: int) -> tuple[dict, dict]:
    fwd = {"send": 2 * (r - 1), "recv_": 2 * (r - 1)} if r > 1 else {}
    bwd = {"send": 4 * r - 2, "recv_": 4 * r - 2} if r > 1 else {}
    return fwd, bwd


@pytest.mark.parametrize("world,method", [(2, "ring"), (4, "ring"), (4, "zigzag-ring")])
def test_ring_p2p_count_per_step(dist_pool, world, method):
    fwd, bwd = _ring_counts(world)
    for res in dist_pool(world).run(_count, method, 8, 2, {}):
        assert res["fwd"] == fwd
        assert res["bwd"] == bwd


def _scaled(counts: dict, n: int) -> dict:
    return {k: n * v for k, v in counts.items()}


@pytest.mark.parametrize("world,ring,uly", [(4, 2, 2), (2, 2, 1), (2, 1, 2)])
def test_usp_all_to_alls_over_ulysses_and_one_ring_pass(dist_pool, world, ring, uly):
    fwd, bwd = _ring_counts(ring)
    a2a = {"alltoall_base_": 4} if uly > 1 else {}
    for res in dist_pool(world).run(_count, "usp", 8, 2, {"mesh": (ring, uly)}):
        assert res["fwd"] == a2a | fwd
        assert res["bwd"] == a2a | bwd


@pytest.mark.parametrize("u,blocks,stages", [(2, 1, 4), (4, 1, 2)])
def test_upipe_on_a_mesh_rings_once_per_stage(dist_pool, u, blocks, stages):
    fwd, bwd = _ring_counts(2)
    for res in dist_pool(4).run(_count, "upipe", 8, 2, {"mesh": (2, 2), "heads_per_stage": u}):
        assert (res["n_blocks"], res["n_stages"]) == (blocks, stages)
        assert res["fwd"] == {"alltoall_base_": 2 * blocks + 2 * stages} | _scaled(fwd, stages)
        assert res["bwd"] == {"alltoall_base_": 4 * blocks + 4 * stages} | _scaled(bwd, stages)


def _uneven_all_to_alls() -> list[int]:
    """Rank 0 keeps 1 of its 4 rows of 1 KiB and sends 3; rank 1 keeps 3 and sends 1: the bytes
    each all-to-all with split sizes counts as sent (c10d, functional; gloo's list form takes
    equal tensors only)."""
    import torch.distributed._functional_collectives as funcol

    rank = dist.get_rank()
    splits = [1, 3]  # rows to rank 0, to rank 1: rank 0 keeps 1, rank 1 keeps 3
    x = torch.zeros(4, 256)
    recv = [[1, 1], [3, 3]][rank]  # rows from rank 0, from rank 1
    with CollectiveCounter() as cc:
        dist.all_to_all_single(torch.empty(sum(recv), 256), x, recv, splits)
        funcol.wait_tensor(funcol.all_to_all_single(x, recv, splits, dist.group.WORLD))
    return [cc.bytes_sent[k] for k in ("alltoall_base_", "all_to_all_single")]


def test_an_uneven_all_to_all_counts_what_leaves_the_rank(dist_pool):
    """An all-to-all sends its input but the rows it keeps: 3 KiB from rank 0 (which keeps its
    first row) and 1 KiB from rank 1 (which keeps its last 3), where 1/P kept counted 2 KiB
    and 1 KiB."""
    sent = dist_pool(2).run(_uneven_all_to_alls)
    assert sent == [[3072] * 2, [1024] * 2]


def _shares_on_a_fake_world() -> dict[str, tuple]:
    """What ``describe_collective`` says rank 0 of 4 (fake process group) sends and the bytes
    of its input for each rank: an even all-to-all of 4 rows of 1 KiB, an uneven one (rows 1,
    0, 2, 1; c10d and functional) and the list form."""
    import torch.distributed._functional_collectives as funcol

    from experiments.emulation.fake_step import fake_world
    from experiments.instruments.collectives import describe_collective

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.got = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            call = describe_collective(func, args, kwargs or {})
            if call is not None:
                self.got[call.op] = (call.sent, call.shares)
            return func(*args, **(kwargs or {}))

    x = torch.zeros(4, 256)
    with fake_world(4), Calls() as calls:
        dist.all_to_all_single(torch.empty_like(x), x)
        funcol.wait_tensor(funcol.all_to_all_single(x, [1, 1, 1, 1], [1, 0, 2, 1],
                                                    dist.group.WORLD))
        rows = (2, 1, 1, 3)  # the fake group copies each input to its output: same shapes
        dist.all_to_all([torch.empty(n, 256) for n in rows], [torch.zeros(n, 256) for n in rows])
    return calls.got


def test_an_uneven_all_to_all_says_its_bytes_for_each_rank():
    """Split sizes give each destination's bytes (the time model cannot split such a call
    across nodes by the group's layout); even splits give none, the payload's P-th each."""
    got = _shares_on_a_fake_world()
    assert got["alltoall_base_"] == (3072, None)
    assert got["all_to_all_single"] == (3072, (1024, 0, 2048, 1024))
    assert got["alltoall_"] == (5120, (2048, 1024, 1024, 3072))
