"""Every method runs under FakeTensorMode with the fake process group at paper scale.

This is the emulation path (docs/design.md#emulation): one process plays rank 0 of an 8-rank job
with Llama3-8B attention shapes and a 1M-token sequence; nothing is computed or allocated, so any
data-dependent Python (``.item()``, shapes from values) would fail here.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from experiments.instruments.collectives import CollectiveCounter
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


class _HeadRMSNorm(torch.nn.Module):
    """A Qwen3-style per-head RMSNorm (weight over head_dim, ``variance_epsilon``)."""

    def __init__(self, d: int):
        super().__init__()
        self.weight, self.variance_epsilon = torch.nn.Parameter(torch.ones(d)), 1e-6

    def forward(self, x):
        from upipe.norm import rms_norm

        return rms_norm(x, self.weight, self.variance_epsilon)


def _fake_projection_features(method: str) -> dict:
    """Biased q/k/v/o, QK-norm and scaled RoPE frequencies (what the HF integration brings)
    under FakeTensorMode at paper scale: every gradient gets its shape and dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from upipe.rope import default_inv_freq

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with FakeTensorMode():
            m = build_method(method, 4096, 32, 8, 128, group=dist.group.WORLD)
            lin = lambda i, o: torch.nn.Linear(i, o, bias=True)  # noqa: E731
            m.use_projections(lin(4096, 4096), lin(4096, 1024), lin(4096, 1024), lin(4096, 4096),
                              q_norm=_HeadRMSNorm(128), k_norm=_HeadRMSNorm(128),
                              rope_inv_freq=default_inv_freq(128, 500000.0) / 8)
            x = torch.randn(1, 2**17, 4096, dtype=torch.bfloat16, requires_grad=True)
            m(x).sum().backward()
            return {n: (tuple(p.grad.shape), p.grad.dtype) for n, p in m.named_parameters()}
    finally:
        torch.set_default_dtype(default)


@pytest.mark.parametrize("method", ["upipe", "ulysses"])
def test_projection_features_run_under_fake_tensors(dist_pool, method):
    grads = dist_pool(8, fake=True).run(_fake_projection_features, method)[0]
    assert grads["q_norm.weight"] == ((128,), torch.bfloat16)
    assert grads["wk.bias"] == ((1024,), torch.bfloat16)
    assert grads["wo.bias"] == ((4096,), torch.bfloat16)
    assert grads["wq.weight"] == ((4096, 4096), torch.bfloat16)
