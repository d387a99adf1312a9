"""The row: what one run of a cell leaves behind, as one typed record (docs/design.md#measurement).

A row is a flat JSON object (``runs/<cell_id>/row.json``, one line of ``rows.csv``), so it
stays a dict; :class:`Row` types it. Every key a producer writes (the launcher,
``harness.launch.describe``, the emulator, the sweep runner) is declared here once with its type,
and :func:`unknown_keys` names any other, so a misspelt column fails where it is written or read
instead of becoming a new, empty column. Besides the keys below, a row carries four families
whose members are declared elsewhere: ``model_<field>`` (the resolved ``ModelConfig``),
``hw_<field>`` (the emulated ``Hardware``), the method's options (``upipe.options``, beside the
cell's fields) and the cell's free-form ``extra`` labels.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import TypedDict

from experiments.config.hardware import Hardware
from experiments.config.model import ModelConfig
from experiments.config.options import every_option


class _Identity(TypedDict):
    """What every row carries: the cell it ran, what became of it and how it ran."""

    cell_id: str
    """the run folder's name (``Cell.cell_id``)"""
    method: str
    model: str
    seq_len: int
    nproc: int
    ring_degree: int
    stack: str
    status: str
    """``config.status.Status``: ok, oom, timeout, error, invalid, skipped"""
    mode: str
    """measured (a launch) or emulated (the emulator)"""


class Row(_Identity, total=False):
    """One run's row. The cell's other fields (``Cell.to_dict``), then what the run gives."""

    # -- the rest of the cell (its dict form) and the job it was --------------------------------
    dtype: str
    kernel: str
    overrides: str
    """``key=value`` pairs joined by ``;``"""
    budget_mib: float | None
    warmup: int
    iters: int
    lr: float
    seed: int
    workload: str
    dp: int
    doc_len: int | None
    keep_blocks: int | None
    """blocks that keep the attention (selective recomputation), the last ones; null: all"""
    global_rope_table: bool
    """the paper's TorchTitan RoPE table held on every rank (``Cell.global_rope_table``)"""
    world_size: int
    """dp x nproc ranks"""
    sweep: str
    run_id: str
    error: str | None
    """why a run did not end ``ok`` (empty or null when it did)"""

    # -- memory per rank (bytes) ----------------------------------------------------------------
    peak_device_bytes: int | None
    peak_host_bytes: int | None
    peak_model_bytes: int | None
    peak_attention_bytes: int | None
    peak_other_bytes: int | None
    attention_peak_bytes: int | None
    """the attention category's own peak, wherever in the step it falls (measured rows)"""
    tracked_peak_device_bytes: int | None
    peak_device_is_lower_bound: bool
    """an emulated ``oom`` row whose device peak is a lower bound that is already over the
    budget (``emulation.emulate``: fewer layers exactly, or the fit's 4-layer samples), not the
    step's peak; its memory columns are the bound's"""
    unsettled_collectives: int
    """gloo collectives whose buffers the backend still held 10 s after the program waited on
    them, on the rank with most (``MemoryTracker.unsettled_collectives``): the tracked peaks may
    count those buffers. Absent when none (measured CPU rows)"""
    device_memory_bytes: int | None
    device_budget_bytes: int | None
    host_budget_bytes: int | None
    host_pinned: bool
    peak_phase: str
    memory_source: str
    memory_from: str

    # -- time and work --------------------------------------------------------------------------
    time_median_s: float | None
    time_p20_s: float | None
    time_p80_s: float | None
    times_s: list
    step_time_s: float | None
    tokens_per_s_per_gpu: float | None
    mfu: float | None
    model_tflops_per_step: float | None
    rank_flops_per_step: int | None
    comm_bytes_per_step: int | None
    comm_bytes_by_op: dict
    time_compute_s: float | None
    time_comm_exposed_s: float | None
    time_offload_exposed_s: float | None
    time_overhead_s: float | None
    time_by_kind_s: dict
    losses: list
    kernel_ran: str | None
    """the attention kernel that ran (a method with its own library runs that one)"""

    # -- how it was measured or emulated --------------------------------------------------------
    device: str
    wall_s: float | None
    load_1m_start: float | None
    load_1m_end: float | None
    threads_per_rank: int
    launcher: str
    shared_gpu: bool
    """present (true) when every rank ran on one GPU with gloo (``--shared-gpu``): the row's
    times are no speed result"""
    hardware_profile: str | None
    emulation: str
    """exact, or fit (``emulation.fit``)"""
    emulation_s: float | None
    fit_seq_lens: list
    fit_layers: list
    fit_nonaffine_phases: list
    fit_time_approximate: list
    fit_certified: bool
    """the fit's peaks certified by samples around the length (``emulation.certify``), nothing
    in ``fit_nonaffine_phases``; False: its window's lines (the CI guard's check), or a series
    named there (older rows said True for a certifying run whatever they named:
    docs/emulation.md)"""
    fit_checked_lens: list
    """the fit's samples besides its window's: those before it (the window moved past them) and
    those its predictions sampled to certify their peaks"""
    converted_from: str
    plan_inferred_from: str
    """a plan's row not emulated: from which lighter stack or smaller U it follows"""

    # -- provenance (``experiments.provenance``) ------------------------------------------------
    torch_version: str
    deepspeed_version: str | None
    upipe_version: str | None
    git_rev: str | None
    hostname: str
    cpu_model: str | None
    cpu_count: int | None
    gpu_name: str | None
    cuda_version: str | None
    python: str
    date_utc: str


REQUIRED: tuple[str, ...] = tuple(_Identity.__annotations__)


def _is_number(hint) -> bool:
    """int or float, alone or with None (a bool is no number here)."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    kinds = {a for a in args if a is not type(None)}
    return bool(kinds) and kinds <= {int, float}


_HINTS = typing.get_type_hints(Row)
NUMBERS: tuple[str, ...] = tuple(k for k, hint in _HINTS.items() if _is_number(hint))
"""A row's numbers: a number or null, never text, which would reach a table's arithmetic and
fail there without naming the file."""
FAMILIES = (tuple(f"model_{f.name}" for f in dataclasses.fields(ModelConfig))
            + tuple(f"hw_{f.name}" for f in dataclasses.fields(Hardware)))


def unknown_keys(row: dict, labels: tuple[str, ...] | frozenset[str] = ()) -> list[str]:
    """The keys of ``row`` that :class:`Row` does not declare, nor its families (``labels``:
    the cell's own ``extra`` labels)."""
    known = set(_HINTS) | set(FAMILIES) | set(every_option()) | set(labels)
    return [k for k in row if k not in known]
