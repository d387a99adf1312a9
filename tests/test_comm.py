"""The sequence <-> head all-to-all: exact layout and bit-exact round trips on 2 and 4 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from upipe.comm import head_to_seq, head_to_seq_autograd, seq_to_head, seq_to_head_autograd


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


def test_single_process_is_identity():
    x = torch.randn(1, 4, 2, 3)
    assert seq_to_head(x, None) is x and head_to_seq(x, None) is x
