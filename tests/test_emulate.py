"""The emulator (docs/design.md#emulation): exact against real runs, its fit exact against itself,
and the kernel memory models against the allocations they cite.

1. A cell emulated with ``Hardware(device="cpu")`` (no kernel models, no allocator rounding)
   allocates exactly what a real gloo run of the same cell (2 or 4 ranks) allocates, as the tracker
   measures it: device peak, host peak and the model/attention/other breakdown, per method and
   stack level, to the byte.
2. The fast path (a fit of exact emulations at 4-5 layers and three short lattice lengths)
   predicts exactly what an exact emulation of a deeper model at a longer length gives.
3. The CUDA kernel models allocate, byte for byte, the tensors their sources list (flash-attn,
   fa3, SDPA), and a cell emulated with fa3 differs from one with flash-attn by exactly the
   kernels' workspaces.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from cell_runs import KEYS, emulated_on_cpu, equality_cell, real_run
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from experiments.config import Cell, Hardware
from experiments.emulation.emulate import emulate_cell
from experiments.emulation.fake_step import Measurement, fullest, measure_fake
from experiments.emulation.fit import exact_is_cheaper
from experiments.instruments.memory import MemoryTracker


def _options_id(options: dict) -> str:
    """A case's options in its test id: their values, overrides as key=value."""
    parts = [("-".join(f"{key}={value}" for key, value in v) if k == "overrides" else str(v))
             for k, v in options.items()]
    return "-".join(parts) or "default"


# (method, stack, options, ranks). On 4 ranks (2048 tokens): the hybrids (a 2 x 2 mesh needs
# them) and UPipe on the paper's stack with and without the RoPE table
# (tests/test_global_rope_table.py shares those runs); the rest on 2 ranks (1024 tokens): the
# same 512 tokens a rank and the same code, what a rank allocates being its own, for half the
# ranks' dispatches (each rank makes as many). Sequence chunks are halved with the sequence, so
# every chunked loop keeps its number of chunks.
CASES = [
    # every method on the paper's stack ...
    ("upipe", "alst", {}, 4),
    ("ulysses", "alst", {}, 2),
    ("ds-ulysses", "alst", {}, 2),
    # an odd vocabulary: FSDP2's shards of the embedding and output differ by rank (rank 0's
    # the larger, the ring's last rank played for the time the smaller), and are re-padded at
    # its lazy init; the emulator plays rank 0 too and initialises FSDP2 before tracking
    ("ring", "alst", {"overrides": (("n_layers", "3"), ("vocab_size", "1025"))}, 2),
    ("zigzag-ring", "alst", {}, 2),
    ("usp", "alst", {"ring_degree": 2}, 4),
    ("upipe", "alst", {"ring_degree": 2}, 4),
    ("fpdt", "alst", {"chunk_size": 256}, 2),
    ("ds-fpdt", "alst", {"chunk_size": 256}, 2),  # FPDT with its CPU stand-ins (ds_fpdt_portable)
    # torch's ring: its rank 0 peaks above its last rank here, the rank the emulator plays for
    # the time (docs/emulation.md#how-exact-it-is)
    ("torch-cp", "native", {}, 2),
    # ... and every stack level
    ("upipe", "none", {}, 2),
    ("upipe", "ac", {}, 2),
    ("upipe", "offload", {}, 2),
    ("ulysses", "native", {}, 2),
    ("ds-fpdt", "megatron-ds", {"chunk_size": 256}, 2),  # reentrant, every block input offloaded
    # beyond the paper: the long level (first input offloaded, residual FFN tiled in place,
    # UPipe's fused input norm) with UPipe's chunked attention backward (8 chunks of 128)
    ("upipe", "long", {"chunk_size": 128}, 2),
    # selective recomputation: the attention's saved tensors kept on the device, or offloaded
    ("ulysses", "alst-attn", {}, 2),
    ("upipe", "alst-attn-host", {}, 2),
    # ... in the last two of the three blocks only (the middle one's in host memory), and on the
    # long level (UPipe's fused norm: the block input kept once)
    ("upipe", "alst-attn-host", {"keep_blocks": 2}, 2),
    ("upipe", "long-attn-host", {}, 2),
    # ... and the last two blocks not checkpointed at all (the first recomputes)
    ("upipe", "alst-block", {"keep_blocks": 2}, 2),
    # the paper's TorchTitan RoPE table held on every rank (tests/test_global_rope_table.py)
    ("upipe", "alst", {"global_rope_table": True}, 4),
]


@pytest.mark.slow  # a real 2- or 4-rank run per cell: 2-6 s each on 2 cores
@pytest.mark.parametrize("method,stack,options,ranks", CASES,
                         ids=[f"{m}-{s}-{_options_id(o)}-w{w}" for m, s, o, w in CASES])
def test_emulation_equals_the_real_run(dist_pool, method, stack, options, ranks):
    # 512 tokens a rank still take every path of the step (two tiled-MLP shards and two loss
    # chunks per rank, UPipe's head stages, 2 x ranks zigzag chunks); FPDT's chunks (ours and
    # DeepSpeed's) make four, more than its prefetch's steady state needs (three). Three
    # layers: a first, an offloaded middle and a last block.
    cell = equality_cell(method, stack, options, ranks)
    real = real_run(dist_pool, cell)  # once per session
    # memory only (count=False): the same allocations, a third fewer dispatch layers
    emulated = emulated_on_cpu(cell)
    assert emulated["status"] == "ok", emulated["error"]
    assert {k: emulated[k] for k in KEYS} == real



def test_a_row_takes_each_memory_figure_of_its_fullest_rank_and_the_counts_of_the_played_one():
    """``fullest`` combines two ranks as a real row combines its ranks (each figure's max); the
    FLOPs, bytes sent and work stay the critical rank's."""
    played = Measurement(100, 10, {"model": 50, "attention": 30, "other": 20},
                         {("forward",): 100, ("backward",): 90},
                         {("forward",): {"model": 50}, ("backward",): {"model": 45}},
                         flops=7, comm_bytes={"all_to_all_single": 3}, work=[], block_state_bytes=4)
    other = Measurement(95, 12, {"model": 50, "attention": 40, "other": 5},
                        {("forward",): 80, ("backward",): 95, ("optimizer",): 60},
                        {("backward",): {"attention": 40}, ("optimizer",): {"model": 60}},
                        flops=None, comm_bytes=None)
    m = fullest(played, other)
    assert (m.peak_device_bytes, m.peak_host_bytes) == (100, 12)
    assert m.breakdown == {"model": 50, "attention": 40, "other": 20}
    assert m.phase_peaks == {("forward",): 100, ("backward",): 95, ("optimizer",): 60}
    assert m.phase_breakdowns == {("forward",): {"model": 50}, ("backward",): {"attention": 40},
                                  ("optimizer",): {"model": 60}}
    assert (m.flops, m.comm_bytes, m.work, m.block_state_bytes) == (
        7, {"all_to_all_single": 3}, [], 4)

def test_one_rank_is_played_alone_when_named():
    """``measure_fake(rank=r)`` plays rank r only (the GPU validation's rank 0): on a
    contiguous causal ring rank 0 computes one causal block where the critical last rank
    computes two, so its FLOPs are lower; a rank outside the world is refused by name."""
    cell = Cell(method="ring", model="tiny", seq_len=2048, nproc=2, dtype="bf16")
    cfg, hw = cell.validate(), Hardware()  # an emulated GPU: its kernels skip masked blocks
    critical, first = measure_fake(cell, cfg, hw), measure_fake(cell, cfg, hw, rank=0)
    assert first.flops < critical.flops
    assert measure_fake(cell, cfg, hw, rank=1).flops == critical.flops  # the last rank
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        measure_fake(cell, cfg, hw, rank=2)
    row = emulate_cell(cell, hw, exact=True, rank=0)
    assert row["rank_flops_per_step"] == first.flops
    with pytest.raises(ValueError, match="rank is for an exact emulation"):
        emulate_cell(cell, hw, rank=0)


@pytest.mark.slow  # about 15 s on 2 cores: the fit's window, two samples at S, one exact step
def test_a_certified_prediction_off_the_lattice_is_the_exact_step():
    """A packed UPipe cell (doc_len 3072: lattice 3072) at 14336 tokens, off the lattice: the
    chord between the lattice samples was 328 KiB below the exact peak with the row certified,
    and a search took an out-of-memory length; the fit now emulates S itself there."""
    cell = Cell.from_dict(dict(method="upipe", model="tiny", seq_len=14336, nproc=4,
                               dtype="bf16", overrides=(("n_layers", "8"),), doc_len=3072))
    hw = Hardware(gpu_mem_gib=1.0, reserve_gib=0.0)
    fit = emulate_cell(cell, hw, count=False)
    exact = emulate_cell(cell, hw, count=False, exact=True)
    assert fit["emulation"] == "fit" and fit["fit_nonaffine_phases"] == []
    assert 14336 in fit["fit_checked_lens"]
    assert (fit["peak_device_bytes"], fit["peak_host_bytes"]) == (
        exact["peak_device_bytes"], exact["peak_host_bytes"])


# one of each structure: head stages, a hybrid mesh with a ring, sequence chunks (every method's
# fit also checks itself: tests/test_max_context_regression.py requires no unconfirmed phase)
FIT_CASES = [
    ("upipe", {}),
    ("usp", {"ring_degree": 2}),
    ("fpdt", {"chunk_size": 1024}),
    ("upipe", {"stack": "long", "chunk_size": 512}),
    ("ulysses", {"stack": "alst-block"}),  # no block checkpointed
]


def _fit_and_exact(method: str, options: dict) -> dict:
    """tiny with 8 layers at 7K tokens (lattice quantum 1K on 4 ranks), emulated as a GPU (kernel
    models and 512-byte rounding) exactly and by the fit, whose window's samples start at 2K-4K
    tokens at 4 and 5 layers: two independent emulations (tests/background.py)."""
    cell = Cell.from_dict(dict(method=method, model="tiny", seq_len=7 * 1024, nproc=4,
                               dtype="bf16", overrides=(("n_layers", "8"),)) | options)
    hw = Hardware(gpu_mem_gib=1.0, reserve_gib=0.0)
    return {"exact": (functools.partial(emulate_cell, exact=True), cell, hw),
            "fit": (emulate_cell, cell, hw)}


@pytest.mark.slow  # 6 emulations (5 samples and the target) with counters: 7-15 s each
@pytest.mark.parametrize("method,options", FIT_CASES,
                         ids=[m + ("-R2" if o.get("ring_degree") else "")
                              + (f"-{o['stack']}" if "stack" in o else "")
                              for m, o in FIT_CASES])
@pytest.mark.background(jobs=_fit_and_exact)
def test_fit_predicts_the_exact_emulation(method, options, background):
    rows = background()
    exact, fit = rows["exact"], rows["fit"]
    assert exact["status"] == fit["status"] == "ok", (exact["error"], fit["error"])
    assert fit["emulation"] == "fit" and fit["fit_nonaffine_phases"] == []
    # the peaks at the target rest on a sample there: a memory-only one that certifies them
    # beyond a window at 2K-4K, or one of the window's own where a phase that is not yet
    # collinear moved the window past the target (UPipe's long level: to 6K-8K)
    assert fit["fit_certified"] is True
    assert 7 * 1024 in fit["fit_checked_lens"] + fit["fit_seq_lens"], fit["fit_seq_lens"]
    keys = KEYS + ("rank_flops_per_step", "comm_bytes_per_step", "comm_bytes_by_op")
    assert {k: fit[k] for k in keys} == {k: exact[k] for k in keys}
    # the time model's work, predicted window by window (work_fit), prices nearly the same.
    # Not exactly at this size: the loss's chunk count is a step function of the length (its
    # kernels and bytes are not quadratic between lattice lengths), and matmul sizes that
    # coincide with a model dimension at a sample (L = 768 = ffn_dim) are lumped (listed in
    # fit_time_approximate). Both are ~1% of this tiny step and vanish at paper scale, where
    # the loss is a small part of the step and every matmul runs at the same saturated rate.
    times = ("step_time_s", "time_compute_s", "time_comm_exposed_s", "time_offload_exposed_s",
             "time_overhead_s")
    assert {k: fit[k] for k in times} == pytest.approx({k: exact[k] for k in times}, rel=0.02)


def _attention_backward_peak(cell: Cell, n_layers: int) -> int:
    """The peak bytes of ``cell``'s attention backward, emulated memory-only at ``n_layers``."""
    cfg = dataclasses.replace(cell.validate(), n_layers=n_layers)
    m = measure_fake(cell, cfg, Hardware(), count=False)
    return max(v for k, v in m.phase_peaks.items() if k and k[-1] == "attention:bwd")


def _chunked_upipe_lengths() -> dict:
    q = 65536
    cell = Cell(method="upipe", model="llama3-8b", seq_len=q, nproc=8, dtype="bf16",
                kernel="fa3", stack="long", options={"chunk_size": q})
    return {s: (_attention_backward_peak, dataclasses.replace(cell, seq_len=s * q), 2)
            for s in (3, 4, 16)}


@pytest.mark.slow  # three memory-only emulations of 2 layers at paper scale: ~15 s
@pytest.mark.background(jobs=_chunked_upipe_lengths)
def test_chunked_upipe_attention_backward_stays_affine_far_past_the_fit_window(background):
    """The fit extrapolates each phase's peak from three lattice lengths (about 200K-330K tokens
    here) to millions: UPipe's chunked backward (the long level's 64K chunks, Llama3-8B on 8
    ranks) must not change which event peaks further on. It did: the stage's dO, O and Q
    all-to-alls held five stage-sized tensors, which overtook the kernel's four plus its chunk
    scratch past ~450K tokens, so the fit said 8M tokens fit at 72.1 GiB where the step needs
    74.0. The inputs now peak at four (upipe.untied: dO, O, then Q rotated into its send
    buffer): from the fit's window to 1M the attention backward grows by the same bytes per
    quantum."""
    peaks = [background()[s] for s in (3, 4, 16)]
    assert peaks[2] - peaks[1] == 12 * (peaks[1] - peaks[0]) > 0


def test_a_step_no_bigger_than_a_sample_is_emulated_exactly():
    """The fit runs at least five steps of 4-5 layers at its window's lengths (tiny on 4 ranks:
    2K, 3K and 4K tokens); a cell no bigger than one of them is emulated exactly instead, and a
    deeper or longer one is predicted by the fit."""
    tiny = Cell(method="upipe", model="tiny", seq_len=4096, nproc=4, dtype="fp32")
    cfg = tiny.validate()
    assert exact_is_cheaper(tiny, cfg.n_layers, cfg.dim)  # 4 layers, the window's last length
    assert exact_is_cheaper(tiny, 5, cfg.dim) and exact_is_cheaper(tiny, 2, cfg.dim)
    assert not exact_is_cheaper(tiny, 6, cfg.dim)
    assert not exact_is_cheaper(dataclasses.replace(tiny, seq_len=5120), 4, cfg.dim)
    # a chunked method's window starts at its chunk loop's steady state (three 1K chunks here)
    fpdt = dataclasses.replace(tiny, options={"chunk_size": 1024}, method="fpdt")
    assert exact_is_cheaper(fpdt, 4, cfg.dim)
    assert emulate_cell(tiny, Hardware(device="cpu"), count=False)["emulation"] == "exact"


@pytest.mark.slow  # about 2 s on 2 cores (docs/testing.md)
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
    row = emulate_cell(Cell(method="rfa-zigzag", model="tiny", seq_len=4096, nproc=4,
                            dtype="bf16"), Hardware())
    assert row["status"] == "skipped" and "cannot be emulated" in row["error"]
    row = emulate_cell(Cell(method="upipe", model="tiny", seq_len=4095, nproc=4), Hardware())
    assert row["status"] == "invalid" and "seq_len" in row["error"]
    row = emulate_cell(Cell(method="upipe", model="tiny", seq_len=4096, nproc=4),
                       Hardware(reserve_gib=100.0))
    assert row["status"] == "invalid" and "reserve_gib" in row["error"]


# ---------------------------------------------------------------------------------------------
# kernel models


def _kernel_bytes(kernel: str, dtype: torch.dtype, b=1, s=1000, h=8, h_kv=2, d=128,
                  causal=True):
    """(forward peak, backward peak) bytes a kernel allocates above its inputs, CUDA path."""
    from experiments.emulation.kernel_models import cuda_kernels
    from upipe.kernels import attention_backward, attention_forward

    with FakeTensorMode():
        q = torch.empty(b, s, h, d, dtype=dtype)
        k, v = torch.empty(b, s, h_kv, d, dtype=dtype), torch.empty(b, s, h_kv, d, dtype=dtype)
        with cuda_kernels(), MemoryTracker() as mt:
            out, lse = attention_forward(q, k, v, causal=causal, kernel=kernel)
            fwd = mt.peak_bytes
            mt.reset_peak()
            base = mt.current_bytes
            attention_backward(out, q, k, v, out, lse, causal=causal, kernel=kernel)
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


@pytest.mark.parametrize("causal", [True, False])
def test_fa3_model_allocates_what_fa3_does(causal):
    """hopper/flash_api.cpp mha_fwd/mha_bwd on sm90 at head dim 128 (rounded: 128): backward
    kBlockM 64 when causal, else 80; kBlockN 128."""
    b, s, h, h_kv, d = 1, 1000, 8, 2, 128
    fwd, bwd = _kernel_bytes("fa3", torch.bfloat16, b, s, h, h_kv, d, causal=causal)
    tile_semaphore = 4 if causal else 0  # (1,) int32, the persistent scheduler's (causal only)
    assert fwd == b * s * h * d * 2 + b * h * s * 4 + tile_semaphore  # out, softmax_lse
    block_m = 64 if causal else 80
    s_q_r = 1024 if causal else 1040  # 1000 rounded up to kBlockM
    grads = (b * s * h * d + 2 * b * s * h_kv * d) * 2  # dq, dk, dv (the wrapper's)
    softmax_d = softmax_lse_log2 = b * h * s_q_r * 4
    dq_accum = b * h * s_q_r * 128 * 4
    dkv_accum = 2 * b * h_kv * 1024 * 128 * 4  # GQA: S_k rounded to kBlockN = 128
    dq_semaphore = -(-s // block_m) * b * h * 4  # (ceil(S_q / kBlockM), B, H) int32
    assert bwd == grads + softmax_d + softmax_lse_log2 + dq_accum + dkv_accum + dq_semaphore


def test_flash_ops_carry_the_causal_flag():
    """A dispatch-level observer reads whether an attention call is causal from the modelled
    ops' arguments (``causal``, after the tensors)."""
    from experiments.emulation.kernel_models import cuda_kernels
    from upipe.kernels import attention_backward, attention_forward

    ops = {torch.ops.upipe_emul.flash_fwd.default, torch.ops.upipe_emul.flash_bwd.default,
           torch.ops.upipe_emul.fa3_fwd.default, torch.ops.upipe_emul.fa3_bwd.default}
    seen = []

    class Observer(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in ops:
                causal = kwargs["causal"] if "causal" in kwargs else args[-1]
                seen.append((func.name(), causal))
            return func(*args, **kwargs)

    with FakeTensorMode():
        q, k, v = (torch.empty(1, 256, h, 64, dtype=torch.bfloat16) for h in (4, 2, 2))
        with cuda_kernels(), Observer():
            for kernel in ("flash-attn", "fa3"):
                for causal in (True, False):
                    out, lse = attention_forward(q, k, v, causal=causal, kernel=kernel)
                    attention_backward(out, q, k, v, out, lse, causal=causal, kernel=kernel)
    assert seen == [(f"upipe_emul::{op}_{p}", c) for op in ("flash", "fa3")
                    for c in (True, False) for p in ("fwd", "bwd")]


# tiny with a narrow MLP and one layer, so that the device peak is attention's backward (Ulysses
# at cp 4: the kernels see 4 query heads, 1 KV head, head dim 16, all 1024 tokens)
SMALL_FF = (("ffn_dim", "16"), ("dim", "64"), ("n_layers", "1"))


def test_fa3_cell_emulates_on_cuda_and_differs_from_flash_attn_by_its_workspace():
    rows = {}
    for kernel in ("flash-attn", "fa3"):
        cell = Cell(method="ulysses", model="tiny", seq_len=1024, nproc=4, dtype="bf16",
                    kernel=kernel, overrides=SMALL_FF, warmup=0, iters=0)
        rows[kernel] = emulate_cell(cell, Hardware(), exact=True, count=False)
        assert rows[kernel]["status"] == "ok", rows[kernel]["error"]
        assert rows[kernel]["peak_phase"].endswith("attention:bwd")
    h, h_kv, s = 4, 1, 1024  # B = 1; every size below is a multiple of the 512-byte block
    # flash-attn 2: softmax_d (S rounded to 128), dq_accum (head dim rounded to 32 = 32) fp32,
    # dk/dv expanded to the query heads (GQA) in bf16
    fa2 = h * s * 4 + s * h * 32 * 4 + 2 * s * h * 16 * 2
    # fa3 (head dim 16 rounded to 64; kBlockM = kBlockN = 128): softmax_d and softmax_lse_log2,
    # dq_accum, dk/dv_accum over the KV head (GQA) fp32, dq_semaphore (8, 1, 4) int32 (128
    # bytes: one 512-byte block)
    fa3 = 2 * h * s * 4 + h * s * 64 * 4 + 2 * h_kv * s * 64 * 4 + 512
    peak = {k: r["peak_device_bytes"] for k, r in rows.items()}
    assert peak["fa3"] - peak["flash-attn"] == fa3 - fa2 == 803328


def test_cuda_only_kernel_cells_are_refused_where_they_cannot_run():
    from experiments.harness.launch import unavailable_reason

    for kernel in ("flash-attn", "fa3"):
        cell = Cell(method="upipe", model="tiny", seq_len=1024, nproc=4, dtype="bf16",
                    kernel=kernel)
        row = emulate_cell(cell, Hardware(device="cpu"), exact=True, count=False)
        assert row["status"] == "skipped"
        assert f"kernel {kernel!r} is CUDA only" in row["error"]
        assert "cannot be emulated" in row["error"]
        if not torch.cuda.is_available():  # a launched cell on this CPU machine: skipped too
            assert f"kernel {kernel!r} is CUDA only" in unavailable_reason(cell)


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


@pytest.mark.slow  # about 3 s on 2 cores (docs/testing.md)
def test_memory_only_emulation_allocates_the_same():
    """Searches skip the FLOP and byte counters (``count=False``): same memory, no counts."""
    cell = Cell(method="zigzag-ring", model="tiny", seq_len=4096, nproc=4, dtype="fp32")
    full = emulate_cell(cell, Hardware(device="cpu"), exact=True)
    memory = emulate_cell(cell, Hardware(device="cpu"), exact=True, count=False)
    assert {k: memory[k] for k in KEYS} == {k: full[k] for k in KEYS}
    assert full["rank_flops_per_step"] > 0 and full["comm_bytes_per_step"] > 0
    assert memory["rank_flops_per_step"] is None and memory["comm_bytes_per_step"] is None
    # the fit's 5-layer samples: FLOPs and bytes sent counted, the work per window not
    cfg = cell.validate()
    counted = measure_fake(cell, cfg, Hardware(device="cpu"))
    no_work = measure_fake(cell, cfg, Hardware(device="cpu"), work=False)
    assert counted.work and no_work.work is None
    assert (no_work.flops, no_work.comm_bytes) == (counted.flops, counted.comm_bytes)
    assert no_work.phase_peaks == counted.phase_peaks
