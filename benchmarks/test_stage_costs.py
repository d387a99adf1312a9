"""What a UPipe stage costs beside a Ulysses layer, and the small ops around it (issue 30): the
micro-benchmarks the time model's per-stage mechanisms are checked against, outside the CI
suite (``testpaths`` is ``tests``), on CUDA when present, else on the CPU.

    pytest benchmarks --benchmark-only                       # run, print the table
    pytest benchmarks --benchmark-only --benchmark-autosave  # keep the run in .benchmarks/
    pytest benchmarks --benchmark-only --benchmark-compare   # against the last kept run

Saved runs carry pytest-benchmark's machine and commit info, so runs of two commits on one
machine compare. Shapes: one Llama3-8B rank at 32K tokens on CUDA (32 query heads, 8 KV heads,
head dim 128, bf16, one process: C = 1, so a stage is U of the 32 heads), a small fp32 one on
the CPU. Each timed call synchronises the device at its end.
"""

from __future__ import annotations

import datetime
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from baselines.ulysses import ulysses_attention
from upipe.comm import _pack_seq_to_head
from upipe.rope import apply_rope, rope_tables, rotate
from upipe.untied import upipe_attention

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.bfloat16 if CUDA else torch.float32
#: (tokens, heads, kv heads, head dim, model dim)
L, H, HKV, D, DIM = (32768, 32, 8, 128, 4096) if CUDA else (2048, 8, 2, 64, 512)


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


@pytest.fixture(scope="module")
def layer():
    """Weights and input of one attention layer (requires_grad: forward and backward)."""
    g = torch.Generator(device=DEVICE).manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g, device=DEVICE, dtype=DTYPE) * 0.02
                ).requires_grad_()

    x = rnd(1, L, DIM)
    w = {"wq": rnd(H * D, DIM), "wk": rnd(HKV * D, DIM), "wv": rnd(HKV * D, DIM),
         "wo": rnd(DIM, H * D)}
    cos, sin = rope_tables(torch.arange(L, device=DEVICE), D, 500000.0, DTYPE)
    return x, w, cos, sin


@pytest.mark.parametrize("u", [1, 4, H], ids=lambda u: f"U{u}")
def test_upipe_layer(benchmark, layer, u):
    """UPipe's attention layer, forward and backward, H / U stages."""
    x, w, cos, sin = layer

    def step():
        y = upipe_attention(x, w["wq"], w["wk"], w["wv"], cos, sin, w["wo"], n_heads=H,
                            n_kv_heads=HKV, heads_per_stage=u)
        y.backward(torch.ones_like(y))
        _sync()

    benchmark(step)


def test_ulysses_layer(benchmark, layer):
    """The Ulysses layer on the same shapes: projections, RoPE, attention, output projection,
    forward and backward."""
    x, w, cos, sin = layer

    def step():
        q = apply_rope((x @ w["wq"].t()).unflatten(-1, (H, D)), cos, sin)
        k = apply_rope((x @ w["wk"].t()).unflatten(-1, (HKV, D)), cos, sin)
        v = (x @ w["wv"].t()).unflatten(-1, (HKV, D))
        y = ulysses_attention(q, k, v).flatten(2) @ w["wo"].t()
        y.backward(torch.ones_like(y))
        _sync()

    benchmark(step)


@pytest.mark.parametrize("u", [1, 8], ids=lambda u: f"U{u}")
def test_rope_rotate_a_stage(benchmark, layer, u):
    """RoPE on one stage's Q (U heads over the sequence), as UPipe rotates it."""
    _, _, cos, sin = layer
    q = torch.randn(1, L, u, D, device=DEVICE, dtype=DTYPE)
    benchmark(lambda: (rotate(q, cos, sin), _sync()))


def test_pack_a_stage_for_the_all_to_all(benchmark):
    """The all-to-all send buffer of a stage's 8 heads for 8 ranks (one copy)."""
    q = torch.randn(1, L // 8, 8, D, device=DEVICE, dtype=DTYPE)
    benchmark(lambda: (_pack_seq_to_head(q, 8), _sync()))


# -- an all-to-all between two gloo ranks ------------------------------------------------------

WARMUP, ROUNDS = 3, 20
A2A_SHAPE = (2, 1, 4096, 4, 64)  # (C, B, L, heads, D): a stage's Q between two ranks


def _partner(port: int) -> None:
    """Rank 1: the same all-to-alls as rank 0's benchmark, as many times."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1,
                            world_size=2, timeout=datetime.timedelta(seconds=120))
    x = torch.randn(A2A_SHAPE)
    for _ in range(WARMUP + ROUNDS):
        dist.all_to_all_single(torch.empty_like(x), x)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_all_to_all_on_gloo(benchmark):
    """One stage-sized ``all_to_all_single`` between two gloo ranks on this host (rank 1 in a
    spawned process running the same rounds)."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    port = _free_port()
    partner = mp.get_context("spawn").Process(target=_partner, args=(port,))
    partner.start()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=2, timeout=datetime.timedelta(seconds=120))
    try:
        x = torch.randn(A2A_SHAPE)
        out = torch.empty_like(x)
        calls = []

        def a2a():
            calls.append(None)
            dist.all_to_all_single(out, x)

        benchmark.pedantic(a2a, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
        for _ in range(WARMUP + ROUNDS - len(calls)):  # --benchmark-disable runs it once
            a2a()
    finally:
        dist.destroy_process_group()
        partner.join(timeout=60)
    assert partner.exitcode == 0
