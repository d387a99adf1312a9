"""Communication is part of the algorithm: all-to-all counts per forward and backward.

UPipe (per KV block: K and V sent once; per stage: Q in, output back):
  forward  = 2 * n_blocks + 2 * n_stages
  backward = 4 * n_blocks + 4 * n_stages   (recompute K, V; per stage Q, out, dout in and dQ
                                            back; per block dK, dV back)
Ulysses: 4 all-to-alls forward (q, k, v, out) and 4 backward, whatever the head count.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from experiments.comm_counter import CollectiveCounter
from upipe import build_method


def _count(method, h, hkv, options):
    m = build_method(method, 32, h, hkv, 8, group=dist.group.WORLD, **options)
    x = torch.randn(1, 6, 32, requires_grad=True)
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
def test_upipe_all_to_all_count_follows_stage_count(dist_pool, world, h, hkv, u, blocks, stages):
    for res in dist_pool(world).run(_count, "upipe", h, hkv, {"heads_per_stage": u}):
        assert (res["n_blocks"], res["n_stages"]) == (blocks, stages)
        assert res["fwd"] == {"alltoall_base_": 2 * blocks + 2 * stages}
        assert res["bwd"] == {"alltoall_base_": 4 * blocks + 4 * stages}


@pytest.mark.parametrize("world,h,hkv", [(2, 8, 2), (4, 16, 4), (4, 8, 2)])
def test_ulysses_four_all_to_alls_each_way(dist_pool, world, h, hkv):
    for res in dist_pool(world).run(_count, "ulysses", h, hkv, {}):
        assert res["fwd"] == {"alltoall_base_": 4}
        assert res["bwd"] == {"alltoall_base_": 4}
