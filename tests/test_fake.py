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
    from torch._subclasses.fake_tensor import FakeTensorMode

    default = torch.get_default_dtype()
    # Module.to() cannot swap fake parameters, so they are created in bf16 directly.
    torch.set_default_dtype(torch.bfloat16)
    try:
        with FakeTensorMode():
            m = build_method(method, 4096, 32, 8, 128, group=dist.group.WORLD, **options)
            x = torch.randn(1, seq_local, 4096, dtype=torch.bfloat16, requires_grad=True)
            with CollectiveCounter() as cc:
                y = m(x)
                y.sum().backward()
    finally:
        torch.set_default_dtype(default)
    return tuple(y.shape), tuple(x.grad.shape), m.wq.weight.grad.dtype, dict(cc.counts)


@pytest.mark.parametrize(
    "method,options,n_a2a",
    [
        ("upipe", {"heads_per_stage": 8}, 6 * 1 + 6 * 4),  # 1 KV block, 4 stages
        ("upipe", {"heads_per_stage": 16}, 6 * 1 + 6 * 2),
        ("ulysses", {}, 8),
        ("ds-ulysses", {}, 8),
    ],
)
def test_runs_under_fake_tensors_at_paper_scale(dist_pool, method, options, n_a2a):
    seq_local = 128 * 1024  # 1M tokens over 8 ranks
    [(y, dx, wdtype, counts)] = dist_pool(8, fake=True).run(_fake_step, method, seq_local, options)
    assert y == dx == (1, seq_local, 4096)
    assert wdtype == torch.bfloat16
    assert counts == {"alltoall_base_": n_a2a}
