"""The emulator (DESIGN.md §8): exact against real runs, its fit exact against itself, and the
kernel memory models against the allocations they cite.

1. A cell emulated with ``Hardware(device="cpu")`` (no kernel models, no allocator rounding)
   allocates exactly what a real 4-rank gloo run of the same cell allocates, as the tracker
   measures it: device peak, host peak and the model/attention/other breakdown, per method and
   stack level, to the byte.
2. The fast path (a fit of exact emulations at 4-5 layers and three short lattice lengths)
   predicts exactly what an exact emulation of a deeper model at a longer length gives.
3. The CUDA kernel models allocate, byte for byte, the tensors their sources list.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from experiments.config import Cell, Hardware
from experiments.emulation.emulate import emulate_cell
from experiments.instruments.memory import MemoryTracker

KEYS = ("tracked_peak_device_bytes", "peak_host_bytes", "peak_model_bytes",
        "peak_attention_bytes", "peak_other_bytes")


def _real_run(cell_dict: dict) -> dict:
    """One rank of the real gloo run (runs in the DistPool's worker processes)."""
    from experiments.harness.measure import measure_cell

    cell = Cell.from_dict(cell_dict)
    row = measure_cell(cell, cell.validate())
    return {k: row[k] for k in KEYS}


CASES = [
    # every method on the paper's stack ...
    ("upipe", "alst", {}),
    ("ulysses", "alst", {}),
    ("ds-ulysses", "alst", {}),
    ("ring", "alst", {}),
    ("zigzag-ring", "alst", {}),
    ("usp", "alst", {"ring_degree": 2}),
    ("upipe", "alst", {"ring_degree": 2}),
    ("fpdt", "alst", {"chunk_size": 1024}),
    # ... and every stack level
    ("upipe", "none", {}),
    ("upipe", "ac", {}),
    ("upipe", "offload", {}),
    ("ulysses", "native", {}),
]


@pytest.mark.slow  # a real 4-rank run per cell: 6-12 s each on 2 cores
@pytest.mark.parametrize("method,stack,options", CASES,
                         ids=[f"{m}-{s}-{'-'.join(map(str, o.values())) or 'default'}"
                              for m, s, o in CASES])
def test_emulation_equals_the_real_run(dist_pool, method, stack, options):
    # 2048 tokens: 512 per rank still take every path of the step (two tiled-MLP shards and two
    # loss chunks per rank, four UPipe stages, eight zigzag chunks); FPDT's 1024-token chunks
    # need 4096 for more than two of them (its prefetch reaches its steady state at three)
    seq_len = 4096 if method == "fpdt" else 2048
    cell = Cell(method=method, model="tiny", seq_len=seq_len, nproc=4, stack=stack,
                dtype="fp32", warmup=1, iters=0, **options)
    real = dist_pool(4).run(_real_run, cell.to_dict())[0]  # rank 0, as the emulator plays
    emulated = emulate_cell(cell, Hardware(device="cpu"), exact=True)
    assert emulated["status"] == "ok", emulated["error"]
    assert {k: emulated[k] for k in KEYS} == real


# one of each structure: head stages, a hybrid mesh with a ring, sequence chunks (every method's
# fit also checks itself: tests/test_max_context_regression.py requires no unconfirmed phase)
FIT_CASES = [
    ("upipe", {}),
    ("usp", {"ring_degree": 2}),
    ("fpdt", {"chunk_size": 1024}),
]


@pytest.mark.slow  # 6 emulations (5 samples and the target) with counters: 7-15 s each
@pytest.mark.parametrize("method,options", FIT_CASES,
                         ids=[m + ("-R2" if o.get("ring_degree") else "") for m, o in FIT_CASES])
def test_fit_predicts_the_exact_emulation(method, options):
    """tiny with 8 layers at 7K tokens (lattice quantum 1K on 4 ranks), emulated as a GPU (kernel
    models and 512-byte rounding): the fit's samples are 2K-4K tokens at 4 and 5 layers."""
    cell = Cell(method=method, model="tiny", seq_len=7 * 1024, nproc=4, dtype="bf16",
                overrides=(("n_layers", "8"),), **options)
    hw = Hardware(gpu_mem_gib=1.0, reserve_gib=0.0)
    exact = emulate_cell(cell, hw, exact=True)
    fit = emulate_cell(cell, hw)
    assert exact["status"] == fit["status"] == "ok", (exact["error"], fit["error"])
    assert fit["emulation"] == "fit" and fit["fit_nonaffine_phases"] == []
    keys = KEYS + ("rank_flops_per_step", "comm_bytes_per_step", "comm_bytes_by_op")
    assert {k: fit[k] for k in keys} == {k: exact[k] for k in keys}


def test_budgets_decide_the_status():
    # memory only (count=False): the budgets read the peaks, which counting does not change
    # (test_memory_only_emulation_allocates_the_same)
    cell = Cell(method="upipe", model="tiny", seq_len=4096, nproc=4, dtype="fp32")
    ok = emulate_cell(cell, Hardware(device="cpu"), exact=True, count=False)
    peak, host = ok["peak_device_bytes"], ok["peak_host_bytes"]
    gib = 2**30
    tight = Hardware(device="cpu", gpu_mem_gib=(peak - 1) / gib, reserve_gib=0.0)
    row = emulate_cell(cell, tight, exact=True, count=False)
    assert row["status"] == "oom" and "device peak" in row["error"]
    hosts = Hardware(device="cpu", host_mem_gib=(host - 1) / gib, gpus_per_node=1)
    row = emulate_cell(cell, hosts, exact=True, count=False)
    assert row["status"] == "oom" and "host peak" in row["error"]
    assert row["host_budget_bytes"] == host - 1


def test_unavailable_and_invalid_cells_are_rows():
    row = emulate_cell(Cell(method="torch-cp", model="tiny", seq_len=4096, nproc=4,
                            stack="native"), Hardware())
    assert row["status"] == "skipped" and "cannot be emulated" in row["error"]
    row = emulate_cell(Cell(method="upipe", model="tiny", seq_len=4095, nproc=4), Hardware())
    assert row["status"] == "invalid" and "seq_len" in row["error"]
    row = emulate_cell(Cell(method="upipe", model="tiny", seq_len=4096, nproc=4),
                       Hardware(reserve_gib=100.0))
    assert row["status"] == "invalid" and "reserve_gib" in row["error"]


# ---------------------------------------------------------------------------------------------
# kernel models


def _kernel_bytes(kernel: str, dtype: torch.dtype, b=1, s=1000, h=8, h_kv=2, d=128):
    """(forward peak, backward peak) bytes a kernel allocates above its inputs, CUDA path."""
    from experiments.emulation.kernel_models import cuda_kernels
    from upipe.kernels import attention_backward, attention_forward

    with FakeTensorMode():
        q = torch.empty(b, s, h, d, dtype=dtype)
        k, v = torch.empty(b, s, h_kv, d, dtype=dtype), torch.empty(b, s, h_kv, d, dtype=dtype)
        with cuda_kernels(), MemoryTracker() as mt:
            out, lse = attention_forward(q, k, v, causal=True, kernel=kernel)
            fwd = mt.peak_bytes
            mt.reset_peak()
            base = mt.current_bytes
            attention_backward(out, q, k, v, out, lse, causal=True, kernel=kernel)
            bwd = mt.peak_bytes - base
    return fwd, bwd


def test_flash_attn_model_allocates_what_flash_attn_does():
    b, s, h, h_kv, d = 1, 1000, 8, 2, 128
    s_r = 1024  # rounded to 128
    fwd, bwd = _kernel_bytes("flash-attn", torch.bfloat16, b, s, h, h_kv, d)
    assert fwd == b * s * h * d * 2 + b * h * s * 4 + 2 * 8  # out, softmax_lse, rng_state
    grads = (b * s * h * d + 2 * b * s * h_kv * d) * 2  # dq, dk, dv (the wrapper's)
    dq_accum = b * s_r * h * d * 4
    expanded = 2 * b * s * h * d * 2  # dk_expanded, dv_expanded (GQA)
    softmax_d = b * h * s_r * 4
    assert bwd == grads + dq_accum + expanded + softmax_d


def test_sdpa_model_is_upipes_cuda_path_plus_the_flash_workspace():
    b, s, h, h_kv, d = 1, 1000, 8, 2, 128
    fwd, bwd = _kernel_bytes("sdpa", torch.bfloat16, b, s, h, h_kv, d)
    kv_expanded = 2 * b * s * h * d * 2  # upipe.kernels expands K/V to H heads for the op
    # + out, lse and the op's int64 RNG seed (2,) and offset () (its meta function's outputs)
    assert fwd == kv_expanded + b * s * h * d * 2 + b * h * s * 4 + 16 + 8
    # backward: expanded K/V again, dq/dk/dv over H heads from the op, softmax_d and dq_accum;
    # the summed dk/dv are made after the expanded ones are dropped
    workspace = b * h * 1024 * 4 + b * 1024 * h * d * 4
    no_rng = 8  # the unused int64 RNG scalar upipe.kernels passes the op
    assert bwd == kv_expanded + 3 * b * s * h * d * 2 + workspace + no_rng


def test_memory_only_emulation_allocates_the_same():
    """Searches skip the FLOP and byte counters (``count=False``): same memory, no counts."""
    cell = Cell(method="zigzag-ring", model="tiny", seq_len=4096, nproc=4, dtype="fp32")
    full = emulate_cell(cell, Hardware(device="cpu"), exact=True)
    memory = emulate_cell(cell, Hardware(device="cpu"), exact=True, count=False)
    assert {k: memory[k] for k in KEYS} == {k: full[k] for k in KEYS}
    assert full["rank_flops_per_step"] > 0 and full["comm_bytes_per_step"] > 0
    assert memory["rank_flops_per_step"] is None and memory["comm_bytes_per_step"] is None
