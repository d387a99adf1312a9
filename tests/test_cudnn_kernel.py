"""The ``cudnn`` kernel and ``auto``'s choice, on the CPU: the rule ``auto`` follows per device,
dtype and GPU, the refusals and their reasons, cuDNN's memory model, and what the emulator
prices with it (the GPU comparisons against ``math`` are tests/test_cudnn_gpu.py)."""

from __future__ import annotations

import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from experiments.config import Cell, Hardware
from experiments.emulation.emulate import emulate_cell
from experiments.emulation.kernel_models import auto_on, cuda_kernels
from experiments.harness.launch import unavailable_reason
from experiments.instruments.memory import MemoryTracker
from experiments.timing.profile import PROFILE_DIR, attention_flops, load_profile
from upipe.kernels import (
    KERNELS,
    attention_backward,
    attention_forward,
    auto_kernel,
    cudnn_dtype_reason,
    cudnn_shape_reason,
    kernel_dispatch,
    kernel_unavailable_reason,
    resolve_kernel,
)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
def test_auto_is_sdpa_on_the_cpu(dtype):
    assert auto_kernel("cpu", dtype, None, {"fa3", "flash-attn"}, 128) == "sdpa"
    assert resolve_kernel("auto", torch.empty(1, 4, 2, 8, dtype=dtype)) == "sdpa"


@pytest.mark.parametrize("cap,installed,dtype,head_dim,expected", [
    ((9, 0), {"cudnn"}, BF16, 128, "cudnn"),  # Hopper, PyTorch alone
    ((9, 0), {"cudnn"}, FP16, 128, "cudnn"),
    ((9, 0), set(), BF16, 128, "sdpa"),  # no cuDNN 9 loaded
    ((9, 0), {"fa3", "flash-attn", "cudnn"}, BF16, 128, "fa3"),  # FlashAttention-3 installed
    ((9, 0), {"fa3"}, BF16, 128, "fa3"),
    ((9, 0), {"flash-attn", "cudnn"}, BF16, 128, "cudnn"),  # before FlashAttention-2 on Hopper
    ((9, 0), {"cudnn"}, BF16, 512, "sdpa"),  # a head dim cuDNN refuses
    ((9, 0), {"flash-attn", "cudnn"}, BF16, 512, "flash-attn"),
    ((9, 0), {"fa3", "cudnn"}, FP32, 128, "sdpa"),  # fp32: the memory-efficient kernel
    ((8, 0), {"cudnn"}, BF16, 128, "sdpa"),  # A100: cuDNN is slower than FlashAttention-2 there
    ((8, 0), {"flash-attn", "fa3", "cudnn"}, BF16, 128, "flash-attn"),  # no FA3 off Hopper
    ((10, 0), {"cudnn"}, BF16, 128, "sdpa"),
    (None, {"cudnn"}, BF16, 128, "sdpa"),  # unknown GPU
])
def test_auto_picks_the_fastest_kernel_the_machine_runs(cap, installed, dtype, head_dim,
                                                       expected):
    assert auto_kernel("cuda", dtype, cap, installed, head_dim) == expected


def test_auto_follows_a_dispatch_choice_and_never_stays_auto():
    q = torch.empty(1, 4, 2, 128, dtype=BF16)
    with kernel_dispatch("cuda", auto=auto_on((9, 0))):
        assert resolve_kernel("auto", q) == "cudnn"
        assert resolve_kernel("auto", q.float()) == "sdpa"
        assert resolve_kernel("math", q) == "math"  # a named kernel is itself
    with kernel_dispatch("cuda", auto=auto_on((8, 0))):
        assert resolve_kernel("auto", q) == "sdpa"
    assert "cudnn" in KERNELS and all(resolve_kernel(k, q) != "auto" for k in KERNELS)


def test_refusals_name_the_rule():
    assert "CUDA only" in kernel_unavailable_reason("cudnn", "cpu")
    assert "fp16/bf16" in kernel_unavailable_reason("cudnn", "cuda", "fp32")
    assert "fp16/bf16" in cudnn_dtype_reason(FP32) and cudnn_dtype_reason(BF16) is None
    assert cudnn_dtype_reason("bf16") is None and cudnn_dtype_reason("fp16") is None
    assert "up to 256" in cudnn_shape_reason(512, (9, 0))
    assert "up to 128" in cudnn_shape_reason(192, (8, 0))
    assert "multiples of 8" in cudnn_shape_reason(100, (9, 0))
    assert cudnn_shape_reason(256, (9, 0)) is None and cudnn_shape_reason(128, (8, 6)) is None
    q = torch.randn(1, 4, 2, 8, dtype=BF16)
    with pytest.raises(RuntimeError, match=r"kernel='cudnn' is CUDA only"):
        attention_forward(q, q, q, causal=True, kernel="cudnn")
    with FakeTensorMode(), kernel_dispatch("cuda"):  # the emulator's path: the rule, not CUDA
        q32 = torch.empty(1, 4, 2, 8)
        with pytest.raises(ValueError, match="takes fp16/bf16 only"):
            attention_forward(q32, q32, q32, causal=True, kernel="cudnn")


@pytest.mark.slow  # about 1 s on 2 cores (docs/testing.md)
def test_methods_calling_their_own_library_refuse_cudnn_and_say_why():
    for method, kernel in (("torch-cp", "sdpa"), ("ds-fpdt", "flash-attn")):
        # ds-fpdt: whole chunks (its 64K default is longer than the sequence)
        opts = {"chunk_size": 256} if method == "ds-fpdt" else {}
        cell = Cell(method=method, model="tiny", seq_len=1024, nproc=4, dtype="bf16",
                    kernel="cudnn", options=opts)
        row = emulate_cell(cell, Hardware(), exact=True, count=False)
        assert row["status"] == "skipped"
        assert f"method {method!r} does not take kernel 'cudnn'" in row["error"]
        assert f"method {method!r} does not take kernel 'cudnn'" in unavailable_reason(cell)
        auto = emulate_cell(Cell(method=method, model="tiny", seq_len=1024, nproc=4,
                                 dtype="bf16", options=opts), Hardware(), exact=True,
                            count=False)
        assert auto["status"] == "ok" and auto["kernel_ran"] == kernel  # its own, recorded


def test_emulated_cudnn_cells_are_refused_in_fp32_and_on_an_emulated_cpu():
    cell = Cell(method="ulysses", model="tiny", seq_len=1024, nproc=4, dtype="fp32",
                kernel="cudnn")
    row = emulate_cell(cell, Hardware(), exact=True, count=False)
    assert row["status"] == "skipped" and "takes fp16/bf16 only" in row["error"]
    row = emulate_cell(Cell(method="ulysses", model="tiny", seq_len=1024, nproc=4, dtype="bf16",
                            kernel="cudnn"), Hardware(device="cpu"), exact=True, count=False)
    assert row["status"] == "skipped" and "kernel 'cudnn' is CUDA only" in row["error"]


def _kernel_bytes(kernel, b=1, s=1000, h=8, h_kv=2, d=128, causal=True):
    """(forward peak, backward peak) bytes above the inputs, emulated CUDA path."""
    with FakeTensorMode():
        q = torch.empty(b, s, h, d, dtype=BF16)
        k, v = torch.empty(b, s, h_kv, d, dtype=BF16), torch.empty(b, s, h_kv, d, dtype=BF16)
        with cuda_kernels((9, 0)), MemoryTracker() as mt:
            out, lse = attention_forward(q, k, v, causal=causal, kernel=kernel)
            assert out.shape == q.shape and out.is_contiguous()
            assert lse.shape == (b, h, s) and lse.dtype == torch.float32
            fwd = mt.peak_bytes
            mt.reset_peak()
            base = mt.current_bytes
            dq, dk, dv = attention_backward(out, q, k, v, out, lse, causal=causal, kernel=kernel)
            assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
            bwd = mt.peak_bytes - base
    return fwd, bwd


@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_model_allocates_what_the_cudnn_ops_do(causal):
    """PyTorch's cuDNN ops on the emulated GPU: native GQA (no expanded K/V, unlike ``sdpa``),
    out and the (B, H, S, 1) fp32 LSE forward; backward dq, dk, dv with q, k, v's heads and
    cuDNN's workspace, dQ_accum (B, H, S, D) and softmax_sum (B, H, S) fp32
    (kernel_models)."""
    b, s, h, h_kv, d = 1, 1000, 8, 2, 128
    fwd, bwd = _kernel_bytes("cudnn", b, s, h, h_kv, d, causal)
    # out, lse, and the int64 seed and offset scalars the op's meta function makes
    assert fwd == b * s * h * d * 2 + b * h * s * 4 + 16
    grads = (b * s * h * d + 2 * b * s * h_kv * d) * 2
    workspace = b * h * s * d * 4 + b * h * s * 4
    no_rng = 8  # the unused int64 RNG scalar upipe.kernels passes the op
    assert bwd == grads + workspace + no_rng
    sdpa_fwd, _ = _kernel_bytes("sdpa", b, s, h, h_kv, d, causal)
    assert sdpa_fwd - fwd == 2 * b * s * h * d * 2 + 8  # sdpa's expanded K/V, its larger RNG


def _at_1m_by_kernel() -> dict:
    return {kernel: (emulate_cell, Cell(method="ulysses", model="llama3-8b", nproc=8,
                                        seq_len=2**20, dtype="bf16", kernel=kernel), Hardware())
            for kernel in ("sdpa", "cudnn", "auto")}


@pytest.mark.slow  # about 12 s on 2 cores (docs/testing.md), on idle cores (tests/background.py)
@pytest.mark.background(jobs=_at_1m_by_kernel)
def test_emulated_llama3_8b_at_1m_is_faster_with_cudnn_by_the_ratio_of_the_rates(background):
    """8 ranks at 1M tokens on the h100-sxm profile: the attention kernels' time falls by the
    ratio of the profile's sdpa and cudnn rates at the calls' shape (Ulysses: 4 query heads of
    the full sequence per rank), and so does the step; ``auto`` runs cudnn there."""
    rows = background()
    for kernel, row in rows.items():
        assert row["status"] == "ok", (kernel, row["error"])
    p, s, heads = load_profile("h100-sxm"), 2**20, 4
    fwd = attention_flops(1, heads, s, s, 128, "fwd_causal")
    bwd = attention_flops(1, heads, s, s, 128, "bwd_causal")

    def seconds(kernel):  # per layer: ALST's checkpointing runs the forward twice
        return (2 * fwd / p.attention_rate(kernel, "bf16", "fwd_causal", 128, s, heads)
                + bwd / p.attention_rate(kernel, "bf16", "bwd_causal", 128, s, heads))

    att = {k: r["time_by_kind_s"]["attention"] for k, r in rows.items()}
    assert att["sdpa"] / att["cudnn"] == pytest.approx(seconds("sdpa") / seconds("cudnn"),
                                                       rel=1e-9)
    assert seconds("sdpa") / seconds("cudnn") > 1.5
    assert rows["cudnn"]["step_time_s"] < rows["sdpa"]["step_time_s"]
    assert rows["auto"]["kernel_ran"] == "cudnn" and rows["sdpa"]["kernel_ran"] == "sdpa"
    assert rows["auto"]["step_time_s"] == rows["cudnn"]["step_time_s"]
    # the same FLOPs counted (GQA's K/V as if expanded: op_flops counts cuDNN's ops itself)
    assert rows["cudnn"]["rank_flops_per_step"] == rows["sdpa"]["rank_flops_per_step"]
    # no K/V expanded to the query heads: less memory too
    assert rows["cudnn"]["peak_device_bytes"] < rows["sdpa"]["peak_device_bytes"]


@pytest.mark.slow  # about 1-2 s on 2 cores (docs/testing.md)
def test_auto_on_an_emulated_a100_is_sdpa():
    cell = Cell(method="ulysses", model="tiny", seq_len=1024, nproc=4, dtype="bf16")
    row = emulate_cell(cell, Hardware(profile="a100-80gb"), exact=True, count=False)
    assert row["status"] == "ok" and row["kernel_ran"] == "sdpa"
    row = emulate_cell(cell, Hardware(), exact=True, count=False)
    assert row["kernel_ran"] == "cudnn"


@pytest.mark.parametrize("method,ring", [("ulysses", 1), ("upipe", 1), ("upipe", 2), ("ring", 1),
                                         ("zigzag-ring", 1), ("usp", 2), ("fpdt", 1),
                                         ("ds-ulysses", 1)])
def test_every_method_taking_a_kernel_emulates_with_cudnn(method, ring):
    """Each method's fake step on an emulated Hopper with ``cudnn``: it runs the cuDNN ops
    (and records so), and keeps no more on the device than with ``sdpa``, whose CUDA path
    expands K/V to the query heads and whose dQ accumulator pads the head dim."""
    rows = {}
    for kernel in ("cudnn", "sdpa"):
        cell = Cell(method=method, model="tiny", seq_len=1024, nproc=4, ring_degree=ring,
                    dtype="bf16", kernel=kernel, overrides=(("n_layers", "1"),))
        rows[kernel] = emulate_cell(cell, Hardware(), exact=True, count=False)
        assert rows[kernel]["status"] == "ok", rows[kernel]["error"]
        assert rows[kernel]["kernel_ran"] == kernel
    assert rows["cudnn"]["peak_device_bytes"] <= rows["sdpa"]["peak_device_bytes"]


def test_auto_on_an_emulated_hopper_whose_profile_prices_no_cudnn_is_sdpa(tmp_path):
    """A calibration on a Hopper without cuDNN 9 states compute capability 9.0 but times no
    cudnn: ``auto`` must not pick a kernel the time model cannot price."""
    raw = json.loads((PROFILE_DIR / "h100-sxm.json").read_text())
    del raw["attention"]["cudnn"]
    path = tmp_path / "hopper-no-cudnn.json"
    path.write_text(json.dumps(raw))
    cell = Cell(method="ulysses", model="tiny", seq_len=1024, nproc=4, dtype="bf16")
    row = emulate_cell(cell, Hardware(profile=str(path)), exact=True)
    assert row["status"] == "ok" and row["kernel_ran"] == "sdpa"
    assert row["step_time_s"] > 0  # priced: sdpa has rates
