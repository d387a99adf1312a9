"""Every method runs under FakeTensorMode with the fake process group at paper scale.

This is the emulation path (DESIGN.md §8): one process plays rank 0 of an 8-rank job with
Llama3-8B attention shapes and a 1M-token sequence; nothing is computed or allocated, so any
data-dependent Python (``.item()``, shapes from values) would fail here.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from experiments.comm_counter import CollectiveCounter
from upipe import build_method


def _fake_step(method, seq_local, options):
    from cases import cp_mesh
    from torch._subclasses.fake_tensor import FakeTensorMode

    options, group = dict(options), dist.group.WORLD
    if "mesh" in options:  # a (ring, ulysses) mesh over the fake world
        options["mesh"], group = cp_mesh(*options["mesh"]), None
    default = torch.get_default_dtype()
    # Module.to() cannot swap fake parameters, so they are created in bf16 directly.
    torch.set_default_dtype(torch.bfloat16)
    try:
        with FakeTensorMode():
            m = build_method(method, 4096, 32, 8, 128, group=group, **options)
            x = torch.randn(1, seq_local, 4096, dtype=torch.bfloat16, requires_grad=True)
            with CollectiveCounter() as cc:
                y = m(x)
                y.sum().backward()
    finally:
        torch.set_default_dtype(default)
    return tuple(y.shape), tuple(x.grad.shape), m.wq.weight.grad.dtype, dict(cc.counts)


def _p2p(n: int) -> dict:
    return {"send": n, "recv_": n}


@pytest.mark.parametrize(
    "method,options,counts",
    [
        # 1 KV block, 4 stages
        ("upipe", {"heads_per_stage": 8}, {"alltoall_base_": 6 * 1 + 6 * 4}),
        ("upipe", {"heads_per_stage": 16}, {"alltoall_base_": 6 * 1 + 6 * 2}),
        ("ulysses", {}, {"alltoall_base_": 8}),
        ("ds-ulysses", {}, {"alltoall_base_": 8}),
        # ring over 8: 2*7 sends forward, 2*7 + 2*8 backward (test_collectives.py)
        ("ring", {}, _p2p(14 + 30)),
        ("zigzag-ring", {}, _p2p(14 + 30)),
        # 4 (ulysses) x 2 (ring): 8 all-to-alls, one ring pass of 2 (2 + 6 hops) per attention
        ("usp", {"mesh": (2, 4)}, {"alltoall_base_": 8} | _p2p(2 + 6)),
        ("upipe", {"mesh": (2, 4)}, {"alltoall_base_": 6 * 2 + 6 * 8} | _p2p(8 * (2 + 6))),
    ],
)
def test_runs_under_fake_tensors_at_paper_scale(dist_pool, method, options, counts):
    seq_local = 128 * 1024  # 1M tokens over 8 ranks
    [(y, dx, wdtype, got)] = dist_pool(8, fake=True).run(_fake_step, method, seq_local, options)
    assert y == dx == (1, seq_local, 4096)
    assert wdtype == torch.bfloat16
    assert got == counts
