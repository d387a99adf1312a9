"""Bad input: a ValueError naming the field and the rule, raised before any collective.

Each rule runs on 2 real gloo ranks inside a collective counter; a rank that entered a
collective while its peer raised would hang (the pool's timeout turns that into a failure).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from experiments.instruments.collectives import CollectiveCounter
from upipe import build_method

METHODS = ("upipe", "ulysses", "ds-ulysses")

# (constructor kwargs, methods it applies to, text the message must contain)
RULES = [
    (dict(dim=32, n_heads=6, n_kv_heads=3, head_dim=8), METHODS,
     "n_kv_heads (3) must divide or be divisible by the CP degree (2)"),
    (dict(dim=32, n_heads=5, n_kv_heads=5, head_dim=8), METHODS,
     "n_heads (5) must be divisible by the CP degree (2)"),
    (dict(dim=32, n_heads=8, n_kv_heads=3, head_dim=8), METHODS,
     "n_heads (8) must be a positive multiple of n_kv_heads (3)"),
    (dict(dim=32, n_heads=8, n_kv_heads=2, head_dim=8, heads_per_stage=3), ("upipe",),
     "heads_per_stage (3) must be a positive multiple of the CP degree (2)"),
    (dict(dim=32, n_heads=8, n_kv_heads=2, head_dim=8, heads_per_stage=6), ("upipe",),
     "heads_per_stage (6) must divide n_heads (8)"),
    # 0 is not "the default" (U = C): it is refused like any other non-positive U
    (dict(dim=32, n_heads=8, n_kv_heads=2, head_dim=8, heads_per_stage=0), ("upipe",),
     "heads_per_stage (0) must be a positive multiple of the CP degree (2)"),
    (dict(dim=32, n_heads=8, n_kv_heads=2, head_dim=8, kernel="cudnn-v9"), METHODS,
     "kernel must be one of"),
    (dict(dim=30, n_heads=8, n_kv_heads=2), METHODS,
     "dim (30) must be divisible by n_heads (8)"),
    (dict(dim=32, n_heads=8, n_kv_heads=2, head_dim=7), METHODS,
     "head_dim must be positive and even"),
]


def _expect_value_error(fn) -> tuple[str, int]:
    with CollectiveCounter() as cc:
        try:
            fn()
        except ValueError as e:
            return str(e), cc.total
    return "no ValueError", cc.total


def _check_rules(method):
    out = []
    for kwargs, methods, _ in RULES:
        if method in methods:
            out.append(_expect_value_error(
                lambda kw=kwargs: build_method(method, group=dist.group.WORLD, **kw)))
    m = build_method(method, 32, 8, 2, 8, group=dist.group.WORLD)
    out.append(_expect_value_error(lambda: m.shard(torch.randn(1, 37, 32))))
    out.append(_expect_value_error(lambda: m(torch.randn(1, 6, 31))))
    out.append(_expect_value_error(lambda: m(torch.randn(6, 32))))
    return out


@pytest.mark.parametrize("method", METHODS)
def test_bad_input_raises_before_any_collective(dist_pool, method):
    expected = [text for _, methods, text in RULES if method in methods] + [
        "seq_len (37) must be divisible by the CP degree (2)",
        "x_local must have shape (batch, seq_local, dim=32)",
        "x_local must have shape (batch, seq_local, dim=32)",
    ]
    for rank, results in enumerate(dist_pool(2).run(_check_rules, method)):
        for (msg, n_collectives), text in zip(results, expected, strict=True):
            assert text in msg, f"rank {rank}: expected {text!r}, got {msg!r}"
            assert n_collectives == 0, f"rank {rank}: {n_collectives} collectives before {msg!r}"


@pytest.mark.slow  # about 1 s on 2 cores (docs/testing.md)
def test_unknown_method_lists_valid_choices():
    with pytest.raises(ValueError, match=r"method must be one of \[.*'upipe'.*\], got 'nope'"):
        build_method("nope", 32, 8, 2)
