"""The plan's configurations keeping the attention (``KEEP_ON_HOST``) or whole blocks
(``KEEP_ON_DEVICE``) in their last blocks only: how many blocks the host or the device holds
(``host_keep_blocks``, ``device_keep_blocks``), each candidate's estimated speed
(``partial_candidates``), and which of them ``runner.plan`` emulates exactly
(``partial_rows``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from experiments.config import STACKS, Cell, Hardware, Status
from experiments.emulation.emulate import emulate_cell, kernel_column
from experiments.harness.launch import unrun
from experiments.harness.model import block_offloads, kept_blocks
from experiments.runner.plan_ladder import over_device_emulated, over_host_only
from experiments.runner.plan_rank import best_fitting, row_identity
from experiments.runner.plan_spec import KEEP_ON_DEVICE, KEEP_ON_HOST


def host_keep_blocks(light: dict, full: dict, cell: Cell, hw: Hardware) -> int | None:
    """The most blocks that can keep their attention within the host budget, below the model's
    depth, on ``cell``'s level (one of ``KEEP_ON_HOST``); None when not even one can.

    ``light`` is the configuration's row on the level that recomputes every attention, ``full``
    its row keeping it in every block. The kept blocks are the last ones
    (``harness.model.kept_blocks``): the last keeps its tensors on the device (it does not
    offload) and every further one sends the same bytes to the host as each offloading block of
    ``full`` does, so the host peak is ``light``'s plus that share per kept offloading block:
    exactly affine (tests/test_selective_recompute.py checks it against exact emulations)."""
    n = cell.validate().n_layers
    stack = STACKS[cell.stack]
    offloading = [i for i in range(n) if block_offloads(stack, i, n)]
    if not stack.keep_on_host or not offloading:
        return None
    per_block = (full["peak_host_bytes"] - light["peak_host_bytes"]) / len(offloading)
    room = hw.host_budget(cell.world) - light["peak_host_bytes"]
    if room < 0 or per_block <= 0:
        return None
    best = None
    for k in range(1, n):
        if sum(block_offloads(stack, i, n) for i in kept_blocks(n, True, k)) * per_block > room:
            break
        best = k
    return best


def device_keep_blocks(light: dict, full: dict, cell: Cell, hw: Hardware) -> int | None:
    """How many of the last blocks may run un-checkpointed within the device budget, below the
    model's depth, on ``cell``'s level (one of ``KEEP_ON_DEVICE``), by estimate; None when the
    level without keeping (``light``) leaves no room or keeping adds nothing.

    ``light`` is the configuration's row recomputing every block, ``full`` its row keeping
    every one. The estimate is the chord between their device peaks: k = room / ((full -
    light) / N), at least 1. The device peak does not grow faster than that chord (exact
    emulations of tiny, tests/test_selective_recompute.py, and of every partial cell of the
    selective sweeps, tests/test_selective_table.py): the last block keeps its tensors only
    until its own backward, the first of the step's, so it adds least, and each further
    middle block adds the same bytes. Unlike the host's rule this is an estimate: the plan
    emulates the configuration it picks exactly (``partial_rows``), so a k that does not fit
    is a row over the budget, not a wrong one."""
    n = cell.validate().n_layers
    room = hw.device_budget(cell) - light["peak_device_bytes"]
    per_block = (full["peak_device_bytes"] - light["peak_device_bytes"]) / n
    if room < 0 or per_block <= 0:
        return None
    return max(1, min(n - 1, int(room // per_block)))


@dataclass(frozen=True)
class _Candidate:
    """A configuration keeping the attention (whole blocks) in its last blocks only, with what
    its estimate came from (``partial_candidates``)."""

    tokens: float
    """estimated tokens/s per GPU"""
    cell: Cell
    """on its level of ``KEEP_ON_HOST`` or ``KEEP_ON_DEVICE``, with ``keep_blocks``"""
    estimate: str
    """the estimate in words, for a row that is not emulated"""
    light: dict
    """its row on the level without keeping"""
    full: dict
    """its row keeping every block"""


def _candidate(cell: Cell, light: dict, full: dict, k: int, after: str = "") -> _Candidate:
    """``cell`` keeping ``k`` blocks, its step time interpolated between ``light``'s and
    ``full``'s by the share of blocks kept (``partial_candidates``); ``after`` ends the
    estimate's wording."""
    n = cell.validate().n_layers
    step = light["step_time_s"] - k / n * (light["step_time_s"] - full["step_time_s"])
    tokens = cell.dp * cell.seq_len / cell.world / step
    lighter = (KEEP_ON_HOST | KEEP_ON_DEVICE)[cell.stack]
    return _Candidate(tokens, Cell.from_dict(cell.to_dict() | {"keep_blocks": k}),
                      f"{tokens:.4g} tokens/s per GPU by interpolating the step time between "
                      f"{lighter} and {cell.stack}{after}", light, full)


def _candidates(configs: list[tuple[Cell, list[dict]]], hw: Hardware) -> list[_Candidate]:
    """``partial_candidates``, each with the rows its estimate came from."""
    out = []
    for config, rows in configs:
        by_stack = {r["stack"]: r for r in rows}
        for stack, lighter in (KEEP_ON_HOST | KEEP_ON_DEVICE).items():
            full, light = by_stack.get(stack), by_stack.get(lighter)
            on_host = stack in KEEP_ON_HOST
            if (full is None or light is None or light["status"] != Status.OK
                    or not (over_host_only(full) if on_host else over_device_emulated(full))
                    or not full.get("step_time_s")):
                continue
            cell = Cell.from_dict(config.to_dict() | {"stack": stack})
            k = (host_keep_blocks if on_host else device_keep_blocks)(light, full, cell, hw)
            if k is not None:
                out.append(_candidate(cell, light, full, k))
    return out


def partial_candidates(configs: list[tuple[Cell, list[dict]]],
                       hw: Hardware) -> list[tuple[float, Cell, str]]:
    """(estimated tokens/s per GPU, cell, the estimate's wording) of every configuration (its
    cell and rows, ``plan_configuration``'s) whose level of ``KEEP_ON_HOST`` is over the host
    budget only while its level without keeping fits: kept in the last ``host_keep_blocks``
    blocks; likewise a level of ``KEEP_ON_DEVICE`` over the device, in the last
    ``device_keep_blocks``. The estimate interpolates the step time between the two levels' by
    the share of blocks kept, as each kept block skips the same recompute (exact emulations of tiny,
    tests/test_selective_recompute.py; Llama3-8B on 8 GPUs, the six cells of
    results/selective_recompute_llama3_8b_h100x8-emulated from 1M to 5M: within 0.12% of their
    exact emulations); it only chooses which to emulate."""
    return [(c.tokens, c.cell, c.estimate) for c in _candidates(configs, hw)]


def _fewer_blocks(cand: _Candidate, row: dict, hw: Hardware) -> _Candidate | None:
    """The configuration of ``cand`` keeping fewer blocks, after its exact emulation (``row``)
    came back over a budget; None below one block. Over the device, k is read again from the
    secant through the exact peak (the chord's k was an estimate: ``device_keep_blocks``),
    at most k - 1; over the host (whose rule is exact: not expected), k - 1."""
    k = cand.cell.keep_blocks
    fewer = k - 1
    on_device = over_device_emulated(row)
    light_peak = cand.light.get("peak_device_bytes")
    if on_device and row.get("peak_device_bytes") and light_peak is not None:
        per_block = (row["peak_device_bytes"] - light_peak) / k
        if per_block > 0:
            room = hw.device_budget(cand.cell) - light_peak
            fewer = min(fewer, int(room // per_block))
    if fewer < 1:
        return None
    level = "device" if on_device else "host"
    return _candidate(cand.cell, cand.light, cand.full, fewer,
                      f" (k{k} was over the {level} budget when emulated)")


def _configuration_name(row: dict) -> str:
    """How a skipped row names another row: method, level, heads per stage, ring degree."""
    keep = f" k{row['keep_blocks']}" if row.get("keep_blocks") else ""
    u = f", U={row['heads_per_stage']}" if row.get("heads_per_stage") else ""
    return f"{row['method']} on {row['stack']}{keep}{u}, ring degree {row.get('ring_degree', 1)}"


def partial_rows(configs: list[tuple[Cell, list[dict]]], hw: Hardware, exact: bool, submit,
                 on_rows: Callable[[list[dict]], None] | None) -> list[dict]:
    """The configurations keeping the attention, or whole blocks, in some blocks
    (``partial_candidates``), fastest estimate first, one at a time: a candidate is emulated
    (exactly: 17 s to 8 minutes at paper scale) when its estimate is above every row that fits
    so far (``configs``' and the candidates' emulated before it) and no candidate of its method
    and level has fitted yet (the leader); otherwise it is a row saying its estimate and what it
    is below. One emulated over a budget leads nothing (its k was an estimate): the next
    candidate of its method and level may be emulated, and the same configuration keeping
    fewer blocks (``_fewer_blocks``) joins the candidates at its own estimate.

    The estimate is the step time interpolated by the share of blocks kept, within 0.12% of
    the exact emulations (``partial_candidates``); what it is not sure of is the memory (the
    device's k is read from a chord). So a candidate estimated slower than a configuration that
    fits is no faster than the plan's answer by more than that error, and emulating it would
    tell only whether it fits. One at a time, so which are emulated does not depend on
    ``submit``'s workers (the table is the same for any number); the plan of Llama3-8B on 8
    GPUs at 4M emulates one of its ten (docs/emulation.md#the-planner)."""
    pending = _candidates(configs, hw)
    best = best_fitting([r for _, rows in configs for r in rows])
    leaders: dict[tuple, Cell] = {}  # (method, level) -> its candidate that fits
    emulate = functools.partial(emulate_cell, exact=exact)  # keyword-only; pickles for a pool
    out = []
    while pending:
        pending.sort(key=lambda c: (-c.tokens, row_identity(c.cell.to_dict())))
        cand = pending.pop(0)
        cell, key = cand.cell, (cand.cell.method, cand.cell.stack)
        if key in leaders:
            why = f"below {_configuration_name(leaders[key].to_dict())}, which fits"
        elif best is not None and cand.tokens <= best["tokens_per_s_per_gpu"]:
            why = (f"not above the fastest configuration that fits "
                   f"({_configuration_name(best)}: {best['tokens_per_s_per_gpu']:.4g} tokens/s "
                   "per GPU), so not the plan's answer by its estimate")
        else:
            row = submit(emulate, cell, hw).result()
            out.append(row)
            if on_rows is not None:
                on_rows([row])
            if row["status"] == Status.OK:
                leaders[key] = cell
                best = best_fitting([r for r in (best, row) if r is not None])
            elif row["status"] == Status.OOM and (fewer := _fewer_blocks(cand, row, hw)):
                pending.append(fewer)
            continue
        row = unrun(cell, None, Status.SKIPPED, f"not emulated: estimated {cand.estimate}, {why}",
                    "emulated")
        out.append(row | kernel_column(cell, cell.validate(), hw))
    return out
