"""UPipe's head schedule: coverage, GQA consistency per rank, K/V reuse, bit-exact reordering,
its head indices made once per call."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from upipe.rope import rope_tables
from upipe.staging import make_stage_plan, plan_indices, stage_heads
from upipe.untied import upipe_attention

CONFIGS = [  # (n_heads, n_kv_heads, cp, heads_per_stage)
    (32, 8, 4, 4), (32, 8, 4, 8), (32, 8, 8, 8), (64, 8, 8, 8), (64, 8, 8, 16), (64, 8, 8, 64),
    (8, 8, 2, 2), (8, 2, 2, 4), (12, 4, 2, 6), (12, 4, 2, 2), (4, 1, 2, 2), (8, 2, 4, 4),
    (16, 4, 4, 8), (24, 8, 4, 12), (6, 3, 3, 3), (32, 1, 8, 8),
]


@pytest.mark.parametrize("h,hkv,c,u", CONFIGS)
def test_plan_invariants(h, hkv, c, u):
    plan = make_stage_plan(h, hkv, c, u)
    g = h // hkv
    q_heads = [q for b in plan.blocks for s in b.stages for q in s]
    assert sorted(q_heads) == list(range(h)), "every query head exactly once"
    assert plan.n_stages == h // u
    u_kv = len(plan.blocks[0].kv_heads)
    assert u_kv % c == 0, "each rank gets the same number of KV heads"
    for block in plan.blocks:
        a = u // len(block.kv_heads)  # query heads per KV slot in a stage
        for stage in block.stages:
            assert len(stage) == u
            for pos, q in enumerate(stage):
                # local query head pos in the rank's chunk uses the rank's KV slot pos // a,
                # which must hold this query head's own KV head (model order GQA mapping)
                assert block.kv_heads[pos // a] == q // g
    # K/V of a block are sent once and reused by all its stages: blocks cover KV heads once
    # (or each replica once when n_kv_heads < cp).
    kv_slots = [kv for b in plan.blocks for kv in b.kv_heads]
    assert sorted(kv_slots) == sorted(list(range(hkv)) * max(1, c // hkv))


def test_paper_default_one_query_head_per_kv_group():
    """U = C <= H_kv: every stage takes one query head from each of U different KV groups."""
    plan = make_stage_plan(32, 8, 8, 8)
    assert plan.n_blocks == 1 and plan.n_stages == 4  # K/V sent once, reused for g = 4 stages
    for stage in plan.blocks[0].stages:
        assert sorted(q // 4 for q in stage) == list(range(8))


@pytest.mark.parametrize("h,hkv,c,u", CONFIGS)
def test_reordering_round_trip_is_bit_exact(h, hkv, c, u):
    """Gathering each stage's heads and writing them back at their indices is the identity."""
    plan = make_stage_plan(h, hkv, c, u)
    x = torch.randn(2, 5, h, 3)
    out = torch.full_like(x, float("nan"))
    for block in plan.blocks:
        for stage in block.stages:
            idx = torch.tensor(stage)
            out.index_copy_(2, idx, x.index_select(2, idx))
    assert torch.equal(out, x)


@pytest.mark.parametrize("h,hkv,c,u", CONFIGS)
def test_stage_heads_view_is_the_stage_in_all_to_all_order(h, hkv, c, u):
    """``stage_heads`` is a view (no copy) of exactly the stage's heads, in the stage's order,
    split by destination rank: (B, L, C, m/a, a, D) flattens to the plan's head list."""
    plan = make_stage_plan(h, hkv, c, u)
    x = torch.randn(2, 5, h, 3)
    for b, block in enumerate(plan.blocks):
        for s, stage in enumerate(block.stages):
            v = stage_heads(x, plan, b, s)
            assert v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
            assert v.shape[:3] == (2, 5, c) and v.shape[-1] == 3
            assert torch.equal(v.flatten(2, -2), x.index_select(2, torch.tensor(stage)))


@pytest.mark.parametrize("h,hkv,c,u", [
    (32, 8, 4, 4), (32, 8, 4, 8), (64, 8, 8, 16), (8, 2, 2, 4), (4, 1, 2, 2), (32, 1, 8, 8),
    (12, 4, 2, 2), (16, 4, 4, 8),
])
def test_plan_indices_are_the_plans_heads_in_one_tensor(h, hkv, c, u):
    """``plan_indices``: every block's KV heads and every stage's query heads as int64 tensors,
    equal to the plan's tuples (GQA, KV heads fewer than ranks, U = C and U = 2C), all views of
    one storage holding exactly those indices (one host->device copy)."""
    plan = make_stage_plan(h, hkv, c, u)
    idx = plan_indices(plan, torch.device("cpu"))
    assert len(idx.kv) == len(idx.q) == plan.n_blocks
    ptr = idx.kv[0].untyped_storage().data_ptr()
    n = 0
    for b, block in enumerate(plan.blocks):
        kv = idx.kv[b]
        assert kv.dtype == torch.int64 and kv.shape == (len(block.kv_heads),)
        assert tuple(kv.tolist()) == tuple(block.kv_heads)
        assert kv.untyped_storage().data_ptr() == ptr
        assert len(idx.q[b]) == len(block.stages)
        n += kv.numel()
        for s, stage in enumerate(block.stages):
            q = idx.q[b][s]
            assert q.dtype == torch.int64 and q.shape == (u,)
            assert tuple(q.tolist()) == tuple(stage)
            assert q.untyped_storage().data_ptr() == ptr
            n += q.numel()
    assert idx.kv[0].untyped_storage().nbytes() == 8 * n
    # usable as the stage's index: the same heads as the plan's list selects
    x = torch.randn(2, 5, h, 3)
    assert torch.equal(x.index_select(2, idx.q[-1][-1]),
                       x.index_select(2, torch.tensor(plan.blocks[-1].stages[-1])))


class _CountTensorCalls(TorchFunctionMode):
    """Counts ``torch.tensor`` calls (each a host->device copy of a Python list on CUDA)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += func is torch.tensor
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("u", [1, 2, 8])
def test_a_call_makes_its_head_indices_once_whatever_the_stages(u):
    """A UPipe forward makes its head-index tensor once (``plan_indices``), not per stage: on a
    GPU each ``torch.tensor`` of a list is a copy from pageable memory that synchronises the
    host with the stream (480 per Llama3-8B step at U = 1 on an H200 before,
    results/gpu_costs_h200/steps/ops.csv; none after, steps_plan_indices/)."""
    torch.manual_seed(0)
    h, hkv, d, seq, dim = 8, 2, 16, 64, 32
    x = torch.randn(1, seq, dim)
    wq, wk, wv = (torch.randn(n * d, dim) for n in (h, hkv, hkv))
    cos, sin = rope_tables(torch.arange(seq), d, 10000.0, torch.float32)
    count = _CountTensorCalls()
    with count:
        upipe_attention(x, wq, wk, wv, cos, sin, n_heads=h, n_kv_heads=hkv, heads_per_stage=u)
    assert count.n == 1  # 8 / u stages and their KV blocks made one each before
