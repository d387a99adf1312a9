"""One configuration's rows on each stack level it is planned on (``plan_configuration``),
walking the ladder of levels lightest first as ``runner.plan``'s docstring describes: a level
is not emulated where a lighter one below it is over the device budget; and the predicates
that read a row as over the device or over the host budget only."""

from __future__ import annotations

from experiments.config import Cell, Hardware, Status
from experiments.emulation.emulate import device_lower_bound, emulate_cell, kernel_column
from experiments.harness.launch import unrun
from experiments.runner.plan_spec import KEEP_ON_DEVICE, KEEP_ON_HOST, LADDER, LONG


def over_device(row: dict) -> bool:
    """Whether a row is over the device budget: emulated so (not: over the host budget only,
    or not emulated for another reason), or left out because a lighter level was."""
    return ("plan_inferred_from" in row
            or row["status"] == Status.OOM and "device peak" in row.get("error", ""))


def over_device_emulated(row: dict) -> bool:
    """Whether a row was emulated (with its time) and is over the device budget."""
    return (row["status"] == Status.OOM and "device peak" in (row.get("error") or "")
            and "plan_inferred_from" not in row)


def over_host_only(row: dict) -> bool:
    """Whether an emulated row is over the host budget and not over the device's."""
    error = row.get("error") or ""
    return row["status"] == Status.OOM and "host peak" in error and "device peak" not in error


def _keep_row(cell: Cell, light: dict, hw: Hardware, exact: bool) -> dict:
    """``cell`` (a level of ``KEEP_ON_HOST``) keeping the attention in every block: its row,
    timed even when it is over the host budget only (``partial_candidates`` interpolates its
    time). Not emulated when ``light`` (the level without keeping) is over the device: keeping
    holds more on it."""
    if over_device(light):
        row = unrun(cell, None, Status.SKIPPED, f"not emulated: the {light['stack']} stack keeps "
                    "less on the device and does not fit it either", "emulated")
        row["plan_inferred_from"] = light["stack"]
        return row | kernel_column(cell, cell.validate(), hw)
    return emulate_cell(cell, hw, exact=exact, bound_first=True)


def plan_configuration(alst: Cell, hw: Hardware, stacks: tuple[str, ...],
                       exact: bool = False, over: dict[str, int] | None = None) -> list[dict]:
    """Rows of one configuration on each stack of ``stacks``, walking the ladder (see the
    module): a level is emulated unless a lighter level it depends on is over the device.
    ``over``: stack -> a smaller number of UPipe heads per stage already over the device on that
    stack (``_over_by_u``): this configuration is too, on it. A configuration on the ``long``
    level (UPipe's variant) is emulated on that level and, when asked, on ``long-attn-host``.
    A level keeping the attention in host memory is timed even when it is over the host budget
    only (``_keep_row``): ``plan`` may then keep it in some blocks (``partial_candidates``)."""
    if alst.stack == LONG:
        light = emulate_cell(alst, hw, exact=exact, bound_first=True)
        if "long-attn-host" not in stacks:
            return [light]
        keep = Cell.from_dict(alst.to_dict() | {"stack": "long-attn-host"})
        return [light, _keep_row(keep, light, hw, exact)]  # long's row too: the plan pairs them
    rows: dict[str, dict] = {}
    for stack in LADDER:  # lightest first
        if stack not in stacks:
            continue
        cell = Cell.from_dict(alst.to_dict() | {"stack": stack})
        blocking = [s for s in LADDER[stack] if s in rows and over_device(rows[s])]
        if stack in (over or {}):
            also = ", as overlapped stages do" if alst.option("overlap") else ""
            rows[stack] = unrun(cell, None, Status.SKIPPED,
                                f"not emulated: {over[stack]} heads per stage do not fit the "
                                "device on this stack and mesh, and more heads per stage keep "
                                f"more on it{also}", "emulated")
            rows[stack]["plan_inferred_from"] = f"heads_per_stage={over[stack]}"
            rows[stack] |= kernel_column(cell, cell.validate(), hw)
        elif blocking:
            rows[stack] = unrun(cell, None, Status.SKIPPED,
                                f"not emulated: the {blocking[0]} stack keeps less on the device "
                                "and does not fit it either", "emulated")
            rows[stack]["plan_inferred_from"] = blocking[0]
            rows[stack] |= kernel_column(cell, cell.validate(), hw)
        elif stack == "alst":  # the level most likely to fit: its memory and time at once
            rows[stack] = emulate_cell(cell, hw, exact=exact, bound_first=True)
        elif stack in KEEP_ON_HOST and KEEP_ON_HOST[stack] in rows:
            rows[stack] = _keep_row(cell, rows[KEEP_ON_HOST[stack]], hw, exact)
        elif stack in KEEP_ON_DEVICE:
            # memory and time even over the device: partial_candidates interpolates its time
            rows[stack] = emulate_cell(cell, hw, exact=exact)
        else:
            # over the device by a lower bound (one short exact step, where that is cheap), or
            # memory first (no work counted: three dispatch layers fewer per op); the time of
            # what fits only
            row = None if exact else device_lower_bound(cell, hw)
            if row is None:
                row = emulate_cell(cell, hw, exact=exact, count=False, bound_first=True)
            if row["status"] == Status.OK:
                row = emulate_cell(cell, hw, exact=exact)
            rows[stack] = row
    return list(rows.values())
