"""Paper-scale emulation of a cell: its row, as a launched row but predicted
(docs/design.md#emulation).

``emulate_cell(cell, hw)`` validates the cell, emulates one rank of its job on fake tensors
(``fake_step``) and returns a row with the columns of a measured one, ``mode`` ``emulated``:
the device and host peaks against the emulated hardware's budgets (over one is ``oom``), the
device peak's breakdown and phase, FLOPs and bytes sent per step, the step's time, tokens/s per
GPU, MFU and where the time goes on a hardware profile (``time_model``), and provenance.

Emulating a paper-scale step op by op costs about 0.1 ms per op on 2 cores (FakeTensorMode's
dispatch, most of it; calls that repeat with the same shapes are replayed instead, ``replay``),
and the tiled MLP and chunked loss make the op count grow with the sequence (about 2.5M ops for
Llama3-8B at 5M tokens on 8 ranks), so ``emulate_cell`` predicts from a fit of exact runs on the
same code at a few small sizes by default (``fit``); ``exact=True`` runs the target size itself,
as do steps no bigger than one of the fit's samples (``fit.exact_is_cheaper``: the CPU-sized
cells of the tests and examples, a fifth of the fit's cost at most) and cells the fit cannot
predict (``fit.fit_refusal``: attention kept in some blocks only).
"""

from __future__ import annotations

import dataclasses
import time
import traceback

from experiments.config import (
    ERROR_TAIL_CHARS,
    STACKS,
    Cell,
    GiB,
    Hardware,
    ModelConfig,
    Status,
)
from experiments.emulation.fake_step import Measurement, emulated_gpu, measure_fake
from experiments.emulation.fit import (
    N_SAMPLE,
    depth_lower_bound,
    exact_is_cheaper,
    fit_refusal,
    fitted,
    sequence_chunk,
)
from experiments.emulation.kernel_models import MODELLED_KERNELS, auto_on, kernel_limit_reason
from experiments.harness.flops import step_flops
from experiments.harness.launch import describe, kernel_ran, method_kernel_refusal, unrun
from experiments.harness.train import packed_cu_seqlens
from experiments.provenance import provenance
from experiments.row import Row
from experiments.timing.profile import Profile, profile_for
from experiments.timing.time_model import price, step_time
from upipe.kernels import cudnn_dtype_reason, cudnn_shape_reason, kernel_unavailable_reason
from upipe.registry import get_method
from upipe.stack import pin_host_memory

PAPER_NODE = Hardware()  # 8x H100 80 GB, the paper's node (config.Hardware's defaults)


def emulation_unavailable(cell: Cell, hw: Hardware) -> str | None:
    """Why the cell's method or kernel cannot be emulated here, or None.

    The emulator runs the method's code on fake CPU tensors: a method whose code needs a real
    CUDA runtime or an absent library (its ``unavailable_reason`` on this machine's CPU) cannot
    run there either, whatever device is emulated. The CUDA-only kernels (flash-attn, fa3) run
    as their memory models (``kernel_models.MODELLED_KERNELS``) on an emulated ``cuda`` device,
    with or without their library here; an emulated ``cpu`` device runs the CPU kernels, which
    they have not.
    """
    if cell.workload != "step":
        return f"cannot be emulated: the emulator runs the training step, not {cell.workload!r}"
    reason = get_method(cell.method).unavailable_reason("cpu") or method_kernel_refusal(cell)
    if reason is None and hw.device == "cuda" and cell.kernel == "cudnn":
        # PyTorch's cuDNN ops run on fake tensors (their meta functions) wherever torch is;
        # what the emulated GPU's cuDNN refuses is refused here
        head_dim = cell.validate().head_dim
        reason = cudnn_dtype_reason(cell.dtype) or cudnn_shape_reason(
            head_dim, emulated_gpu(hw)[0])
    elif reason is None and not (hw.device == "cuda" and cell.kernel in MODELLED_KERNELS):
        reason = kernel_unavailable_reason(cell.kernel, hw.device)
        if reason is not None and hw.device == "cpu":
            reason += "; emulate a cuda device (--emulate-device cuda) for its memory model"
    if reason is None and hw.device == "cuda":
        # the kernel the step runs ("auto" resolved, a method's own library's) refuses the
        # cell's dtype or head dim on the emulated GPU: its rule, not plausible numbers
        cfg = cell.validate()
        reason = kernel_limit_reason(kernel_column(cell, cfg, hw)["kernel_ran"], cell.dtype,
                                     cfg.head_dim)
    reason = reason or profile_refusal(cell, hw)
    return None if reason is None else f"cannot be emulated: {reason}"


def profile_refusal(cell: Cell, hw: Hardware) -> str | None:
    """Why ``hw``'s hardware profile cannot time ``cell``'s step, or None: it has no matmul
    rates in the cell's dtype, or no attention rates for the kernel the step runs (the row's
    ``kernel_ran``) in that dtype (``fa3`` on ``a100-80gb``: FlashAttention-3 is Hopper's).
    The time model would raise ``ProfileError`` after the whole emulation; this is asked
    first (by ``emulation_unavailable``, so every emulated row, and by argument checks: the
    plan's and ``emulate``'s, which can refuse before emulating anything). The cell must
    validate."""
    profile = profile_for(hw)
    if profile is None:
        return None
    rates = profile.values
    if cell.dtype not in rates["matmul"]:
        return (f"profile {profile.name!r} has no matmul rates in {cell.dtype!r} (has "
                f"{sorted(rates['matmul'])})")
    kernel = kernel_column(cell, cell.validate(), hw)["kernel_ran"]
    # math is plain PyTorch ops, priced as matmuls and memory traffic (no attention rates)
    if kernel != "math" and cell.dtype not in rates["attention"].get(kernel, {}):
        have = {k: sorted(v) for k, v in rates["attention"].items()}
        return (f"profile {profile.name!r} has no attention rates for kernel {kernel!r} in "
                f"{cell.dtype!r} (has {have}): the GPU it describes does not run it there, or "
                "it was not calibrated")
    return None


def kernel_column(cell: Cell, cfg: ModelConfig, hw: Hardware) -> dict:
    """The row's ``kernel_ran``: the attention kernel the emulated step runs (``"auto"``
    resolved as on the emulated GPU, ``kernel_models.auto_on``)."""
    auto = auto_on(*emulated_gpu(hw)) if hw.device == "cuda" else None
    return {"kernel_ran": kernel_ran(cell, cfg, hw.device, auto)}


def exceeds(peak: int, budget: int) -> str:
    """"<peak> GiB > budget <budget> GiB", with two decimals, or as many more as make the two
    differ as printed (a budget of a few MiB: 0.051 > 0.050, not 0.05 > 0.05)."""
    digits = 2
    while f"{peak / GiB:.{digits}f}" == f"{budget / GiB:.{digits}f}" and digits < 12:
        digits += 1
    return f"{peak / GiB:.{digits}f} GiB > budget {budget / GiB:.{digits}f} GiB"


def _row_metrics(cell: Cell, cfg: ModelConfig, hw: Hardware, m: Measurement) -> dict:
    b = m.breakdown
    device_budget, host_budget = hw.device_budget(cell), hw.host_budget(cell.world)
    over = []
    if m.peak_device_bytes > device_budget:
        over.append(f"device peak {exceeds(m.peak_device_bytes, device_budget)}")
    if m.peak_host_bytes > host_budget:
        over.append(f"host peak {exceeds(m.peak_host_bytes, host_budget)} per rank")
    return {
        "status": Status.OOM if over else Status.OK, "error": "; ".join(over),
        "mode": "emulated", "memory_source": "emulated", "world_size": cell.world,
        "device": f"emulated {hw.device} ({hw.gpu_mem_gib:g} GiB)",
        "peak_device_bytes": m.peak_device_bytes, "tracked_peak_device_bytes": m.peak_device_bytes,
        "peak_host_bytes": m.peak_host_bytes, "host_pinned": pin_host_memory(cell.seq_len),
        # where in the step the peak is: the phase labels at that moment, outermost first
        "peak_phase": " > ".join(max(m.phase_peaks, key=m.phase_peaks.get)),
        "peak_model_bytes": b.get("model", 0), "peak_attention_bytes": b.get("attention", 0),
        "peak_other_bytes": sum(v for k, v in b.items() if k not in ("model", "attention")),
        "device_budget_bytes": device_budget, "host_budget_bytes": host_budget,
        "device_memory_bytes": device_budget,
        # this rank's FLOPs counted per op (recomputation included, attention dense, as torch's
        # formulas count it) beside the shared model-FLOPs formula over all ranks (dp sequences)
        "rank_flops_per_step": m.flops,
        "model_tflops_per_step": cell.dp * step_flops(
            cfg, cell.seq_len, packed_cu_seqlens(cell.seq_len, cell.doc_len)) / 1e12,
        "comm_bytes_per_step": None if m.comm_bytes is None else sum(m.comm_bytes.values()),
        "comm_bytes_by_op": m.comm_bytes,
    } | hw.columns(cell.method)


def time_columns(cell: Cell, cfg: ModelConfig, profile: Profile | None, m: Measurement) -> dict:
    """The emulated step time and throughput on ``profile`` (docs/design.md#the-time-model): empty
    without a profile or without counted work."""
    if profile is None or m.work is None:
        return {}
    pinned = pin_host_memory(cell.seq_len)
    t = step_time([(w, price(work, profile, pinned)) for w, work in m.work], profile)
    peak = profile.mfu_peak(cell.dtype)  # None where a kernel beats the dtype's peak: no MFU
    # every replica's sequence
    flops = cell.dp * step_flops(cfg, cell.seq_len, packed_cu_seqlens(cell.seq_len, cell.doc_len))
    return {
        "hardware_profile": profile.name, "step_time_s": t.step_s,
        "tokens_per_s_per_gpu": cell.dp * cell.seq_len / cell.world / t.step_s,
        "mfu": None if peak is None else flops / t.step_s / (cell.world * peak),
        "time_compute_s": t.compute_s, "time_comm_exposed_s": t.comm_exposed_s,
        "time_offload_exposed_s": t.offload_exposed_s, "time_overhead_s": t.overhead_s,
        # seconds of each kind of work before overlap (matmul, attention, ..., copy_side)
        "time_by_kind_s": t.detail,
    }


def emulate_cell(cell: Cell, hw: Hardware = PAPER_NODE, *, exact: bool = False,
                 count: bool = True, bound_first: bool = False, certify: bool = True,
                 rank: int | None = None) -> Row:
    """The row of ``cell`` emulated on ``hw`` (statuses as ``run_cell``'s: ok, oom over the
    device or host budget, invalid, skipped, error). ``count=False``: memory only (FLOPs and
    bytes sent are None), for searches that need only the status. ``bound_first``: a cell whose
    fit's 4-layer samples already put it over the device (``fit.depth_lower_bound``) is an
    ``oom`` row with that lower bound, without the fit's 5-layer samples or a time (for the
    planner, whose question about it is only whether it fits). ``certify=False``: the fit's
    window lines, uncertified beyond the window (``fit.Fit.predict``; the CI guard's cheap
    check). ``rank`` (with ``exact``): that rank of the job played alone, memory and time
    (``measure_fake``), to compare with a measurement of that rank."""
    if rank is not None and not exact:
        raise ValueError("emulate_cell: rank is for an exact emulation (exact=True); the fit "
                         "plays the critical rank")
    try:
        cfg = cell.validate()
        hw.validate(world=cell.world)
        profile = profile_for(hw)
    except ValueError as e:
        return unrun(cell, None, Status.INVALID, str(e), "emulated")
    reason = emulation_unavailable(cell, hw)
    if reason is not None:
        return unrun(cell, cfg, Status.SKIPPED, reason, "emulated")
    t0 = time.monotonic()
    try:
        # a step no bigger than one of the fit's samples is cheaper to emulate than the fit
        # (a fifth of it at most, and exact); a cell the fit cannot predict (its blocks not
        # alike) is emulated exactly, as slow as that is
        if (exact or exact_is_cheaper(cell, cfg.n_layers, cfg.dim)
                or fit_refusal(cell) is not None):
            m, extra = measure_fake(cell, cfg, hw, count, rank=rank), {"emulation": "exact"}
        elif bound_first and cfg.n_layers > N_SAMPLE[0] and (
                (b := depth_lower_bound(cell, hw, count)) is not None
                and b.peak_device_bytes > hw.device_budget(cell)):
            return _lower_bound_row(cell, cfg, hw, b, t0, (
                f"the fit's {N_SAMPLE[0]}-layer samples at the full length, and the parameter "
                f"and optimizer shards of the model's {cfg.n_layers - N_SAMPLE[0]} further "
                "layers"))
        else:
            fit = fitted(cell, hw, count)
            m = fit.predict(cell.seq_len, cfg.n_layers, certify)
            extra = fit.summary(certify)
    except Exception as e:  # a method that fails under fake tensors: a row, not a crash
        return describe(cell, cfg) | provenance() | {
            "status": Status.ERROR, "mode": "emulated",
            "error": f"{type(e).__name__}: {e}\n" + traceback.format_exc()[-ERROR_TAIL_CHARS:]}
    # provenance as launched rows carry it (versions, git revision, host, date)
    return describe(cell, cfg) | kernel_column(cell, cfg, hw) | _row_metrics(
        cell, cfg, hw, m) | time_columns(
        cell, cfg, profile, m) | extra | {
        "emulation_s": round(time.monotonic() - t0, 2)} | provenance()


# Depths of the lower bound's exact steps, cheapest first: one layer is a quarter of the fit's
# first depth and proves most cells that are over by far (an untiled MLP at millions of
# tokens); the fit's depth proves more and runs only when one layer did not.
BOUND_DEPTHS = (1, N_SAMPLE[0])


def device_lower_bound(cell: Cell, hw: Hardware = PAPER_NODE) -> dict | None:
    """The row of ``cell`` over the device budget by a lower bound on its peak, or None when the
    bound does not prove it (then only ``emulate_cell`` can tell).

    The bound: the exact peak of the step with fewer layers (``BOUND_DEPTHS``, in turn) at the
    full length. More layers never keep less on the device at a given length (each adds its
    parameter, gradient and optimizer shards, and its checkpoint, all live at once), so the
    model's own peak is at least that. Cheap where the step's op count does not grow with the
    length: stacks without the tiled MLP, methods without sequence chunks; for the others (and
    for one-layer models) it returns None without emulating.
    """
    cfg = cell.validate()
    if (STACKS[cell.stack].tiled or sequence_chunk(cell) is not None
            or emulation_unavailable(cell, hw) is not None):
        return None
    t0 = time.monotonic()
    budget = hw.device_budget(cell)
    for depth in (d for d in BOUND_DEPTHS if d < cfg.n_layers):
        try:
            m = measure_fake(cell, dataclasses.replace(cfg, n_layers=depth), hw, count=False)
        except Exception:  # noqa: BLE001 -- proves nothing; emulate_cell reports the error as a row
            return None
        if m.peak_device_bytes > budget:
            break
    else:
        return None
    return _lower_bound_row(cell, cfg, hw, m, t0, (
        f"{depth} of the model's {cfg.n_layers} layers emulated at the full length: more "
        "layers keep at least as much"))


def _lower_bound_row(cell: Cell, cfg: ModelConfig, hw: Hardware, m: Measurement, t0: float,
                     how: str) -> dict:
    """The ``oom`` row of a cell whose device peak is at least ``m``'s (its memory columns
    are the bounds), saying ``how`` the bound was found."""
    return describe(cell, cfg) | kernel_column(cell, cfg, hw) | _row_metrics(cell, cfg, hw, m) | {
        "error": (f"device peak at least {exceeds(m.peak_device_bytes, hw.device_budget(cell))}"
                  f" ({how})"),
        "peak_device_is_lower_bound": True, "emulation": "lower bound",
        "emulation_s": round(time.monotonic() - t0, 2)} | provenance()
