"""Sequence layouts: exact token maps, bit-exact shard/unshard round trips, balanced ring work."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from upipe.layout import SeqLayout
from upipe.ring import ALL, FIRST, SECOND, block_plan


def _tokens(layout: SeqLayout, seq: int, world: int) -> list[list[int]]:
    return [layout.positions(seq // world, r, world).tolist() for r in range(world)]


def test_zigzag_holds_chunks_r_and_2w_minus_1_minus_r():
    # 16 tokens, 4 ranks -> 8 chunks of 2; rank r holds chunks r and 7 - r
    assert _tokens(SeqLayout("zigzag"), 16, 4) == [
        [0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]
    ]


def test_hybrid_zigzag_splits_each_pair_over_the_inner_ranks():
    # ring 2 x ulysses 2: ring rank q holds chunks q and 3 - q of 4 (6 tokens each); its two
    # ulysses ranks split that pair contiguously.
    toks = _tokens(SeqLayout("zigzag", inner=2), 24, 4)
    assert toks[0] + toks[1] == list(range(0, 6)) + list(range(18, 24))
    assert toks[2] + toks[3] == list(range(6, 12)) + list(range(12, 18))
    assert toks[0] == [0, 1, 2, 3, 4, 5]


def test_chunked_layout_takes_piece_r_of_every_chunk_last_chunk_shorter():
    # 20 tokens, chunk 8, 2 ranks: chunks [0,8) [8,16) [16,20); rank r takes piece r of each
    assert _tokens(SeqLayout("chunked", chunk_size=8), 20, 2) == [
        [0, 1, 2, 3, 8, 9, 10, 11, 16, 17], [4, 5, 6, 7, 12, 13, 14, 15, 18, 19]
    ]
    assert SeqLayout("chunked", chunk_size=8).local_chunks(10, 2) == [4, 4, 2]


@pytest.mark.parametrize(
    "layout,seq,world",
    [(SeqLayout(), 36, 4), (SeqLayout("zigzag"), 40, 4), (SeqLayout("zigzag", inner=2), 40, 4),
     (SeqLayout("zigzag", inner=4), 24, 4), (SeqLayout("chunked", chunk_size=12), 44, 4),
     (SeqLayout("chunked", chunk_size=100), 44, 4), (SeqLayout("zigzag"), 6, 1)],
    ids=["contiguous", "zigzag", "zigzag-inner2", "zigzag-inner4", "chunked", "chunked-1chunk",
         "zigzag-w1"],
)
def test_every_token_exactly_once_and_assemble_inverts_shard(layout, seq, world):
    toks = _tokens(layout, seq, world)
    assert sorted(t for r in toks for t in r) == list(range(seq))
    x = torch.randn(2, seq, 3, dtype=torch.float64)
    parts = [layout.shard(x, r, world) for r in range(world)]
    for r, part in enumerate(parts):
        assert torch.equal(part, x[:, toks[r]])
    assert torch.equal(layout.assemble(parts), x)


@pytest.mark.parametrize(
    "layout,seq,world,message",
    [(SeqLayout("zigzag"), 36, 4, "divisible by 2 x the CP degree"),
     (SeqLayout(), 10, 4, "divisible by the CP degree"),
     (SeqLayout("chunked", chunk_size=6), 40, 4, "chunk_size"),
     (SeqLayout("zigzag", inner=3), 48, 4, "multiple of inner")],
)
def test_bad_lengths_name_the_rule(layout, seq, world, message):
    with pytest.raises(ValueError, match=message):
        layout.segments(seq, 0, world)


def test_unknown_layout_kind():
    with pytest.raises(ValueError, match="layout must be one of"):
        SeqLayout("striped")


def _round_trip(method: str, options: dict, seq: int):
    from cases import cp_mesh

    from upipe import build_method

    opts, group = dict(options), dist.group.WORLD
    if "mesh" in opts:
        opts["mesh"], group = cp_mesh(*opts["mesh"]), None
    m = build_method(method, 16, 4, 2, 4, group=group, **opts)
    torch.manual_seed(0)
    x = torch.randn(2, seq, 5, dtype=torch.bfloat16)
    local = m.shard(x)
    pos = m.seq_layout.positions(local.shape[1], m.rank, m.cp)
    return torch.equal(m.unshard(local), x), torch.equal(local, x[:, pos]), m.rank


@pytest.mark.parametrize(
    "world,method,options",
    [(2, "zigzag-ring", {}), (4, "zigzag-ring", {}), (4, "ring", {}),
     (4, "usp", {"mesh": (2, 2)}), (4, "upipe", {"mesh": (2, 2)}), (2, "usp", {"mesh": (2, 1)})],
)
def test_method_shard_unshard_round_trip_bit_exact(dist_pool, world, method, options):
    results = dist_pool(world).run(_round_trip, method, options, 8 * world * 3)
    assert [r[2] for r in results] == list(range(world))  # flattened mesh rank = global rank
    assert all(r[0] and r[1] for r in results)


def _work(plan, half: int) -> int:
    """Query x key pairs a block computes (the causal diagonal block counts half)."""
    if plan is None:
        return 0
    qp, kvp, causal = plan
    q = 2 * half if qp is ALL else half
    k = 2 * half if kvp is ALL else half
    return q * k // 2 if causal else q * k


@pytest.mark.parametrize("world", [2, 4, 8])
def test_zigzag_balances_causal_ring_work_and_contiguous_does_not(world):
    half = 4
    for zigzag in (True, False):
        per_rank = [
            [_work(block_plan(s, r, world, zigzag=zigzag, causal=True), half)
             for s in range(world)]
            for r in range(world)
        ]
        totals = [sum(p) for p in per_rank]
        # both cover the same causal triangle: sum = S^2 / 2 with S = world * 2 * half
        assert sum(totals) == (world * 2 * half) ** 2 // 2
        if zigzag:  # every rank, every step after the first: half a block
            assert len(set(totals)) == 1
            assert all(p[1:] == [2 * half * half] * (world - 1) for p in per_rank)
        else:  # rank r computes r full blocks plus its diagonal
            assert totals[-1] == (2 * world - 1) * totals[0]
    assert block_plan(1, 0, 2, zigzag=True, causal=True) == (SECOND, ALL, False)
    assert block_plan(1, 1, 2, zigzag=True, causal=True) == (ALL, FIRST, False)
