"""What fits on a cluster, and how fast (docs/design.md#the-time-model): ``upipe-bench plan``.

Every configuration a cluster of ``gpus`` GPUs can run a model with at one sequence length:
each registered method, on each stack level, with each valid mesh (hybrids: ring degree x
Ulysses degree) and, for UPipe, each valid number of heads per stage U, and its overlapped
stages (``overlap=True``: faster where the all-to-alls show, one more stage's all-to-all
buffers) on the plain Ulysses mesh at the default U (the Ulysses degree): the trade-off shows
there, and a variant per mesh and U would add as many UPipe fits again to every plan; and,
beyond the paper, UPipe on the ``long`` level with its chunked backward (``LONG``) at the same
mesh and U; each emulated on the
hardware (memory and time, ``emulation.emulate_cell``) and ranked: the configurations that fit
first, fastest first (tokens/s per GPU), then those that do not fit (and why: device or host),
then those that cannot be emulated here.

The stack levels form a ladder in device memory (``config.stack``): alst keeps the least on
the device, then offload and native, then ac, then none (each adds back what a lighter level
moves off the device or never materialises). A configuration is emulated on alst first; a
heavier level is not emulated when a lighter level below it on the ladder is over the device
budget: its row says which one (status ``skipped``). A heavier level is first checked against
the device by a lower bound on its peak where that is cheap (``emulation.device_lower_bound``:
a few layers emulated exactly at the full length; a row over the device by it says "at least"),
then emulated for its memory; only what fits is emulated again with its work counted, for its
time (so those that do not fit have no time). Every fit first bounds the device peak from its
4-layer samples (``emulate_cell(bound_first=True)``): a configuration over the device by that
bound is not fitted further and has no time either. Emulations run in ``workers`` processes.

The question and its configurations are ``plan_spec``'s, one configuration's rows on the
ladder ``plan_ladder``'s, the configurations keeping some blocks ``plan_keep``'s and the
ranking ``plan_rank``'s; this module schedules the emulations over the workers.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import multiprocessing
import os
from collections.abc import Callable
from pathlib import Path

from experiments.config import Cell, Hardware, Status, resolve_model
from experiments.config.hardware import RESERVE_SOURCE
from experiments.emulation.fit import sequence_chunk
from experiments.harness.launch import unrun
from experiments.runner.plan_keep import partial_rows
from experiments.runner.plan_ladder import over_device, plan_configuration
from experiments.runner.plan_rank import rank
from experiments.runner.plan_spec import KEEP_ON_DEVICE, PlanSpec, configurations
from experiments.timing.profile import profile_for


def _cost(cell: Cell) -> tuple[bool, int, bool]:
    """A configuration's relative emulation cost, to start the longest first (no long tail on
    the last worker). Methods with sequence chunks first: their fits take the most samples (the
    window moves until the chunk loop's regimes settle) and each sample runs every pair of
    chunks (measured, Llama3-8B on 8 GPUs at 4M: ds-fpdt 69 s and fpdt 26 s of emulation over
    their stacks, no other configuration above 20 s); then UPipe's head stages times the ring
    steps each runs. UPipe's overlapped stages right after their blocking twins (last, they
    would leave one worker alone at the end)."""
    stages, u = 1, cell.option("heads_per_stage")
    if u:
        stages = resolve_model(cell.model, cell.overrides).n_heads // u
    return sequence_chunk(cell) is not None, stages * cell.ring_degree, not cell.option("overlap")


def _family(cell: Cell) -> tuple:
    """What configurations that differ only in UPipe's heads per stage share."""
    return (cell.method, cell.ring_degree, cell.option("overlap"), cell.option("chunk_size"),
            cell.stack)


def _over_by_u(cell: Cell, over_at: dict[tuple, int]) -> dict[str, int]:
    """stack -> the smallest heads per stage of ``cell``'s family found over the device on that
    stack, where it is below ``cell``'s. A UPipe stage's buffers (its heads' Q, K, V, output
    and their gradients) grow with the heads it processes and nothing else does, so the peak
    never falls as U grows (tests/test_plan.py checks it on exact emulations). Overlapped stages
    hold one more stage's buffers than the blocking schedule at the same U: where that does not
    fit (at U or below), neither do they."""
    out: dict[str, int] = {}
    for (f, stack), u in over_at.items():
        if _spares(f, u, cell):
            out[stack] = min(u, out.get(stack, u))
    return out


def _spares(family: tuple, u: int | None, cell: Cell) -> bool:
    """Whether a UPipe configuration of ``family`` with ``u`` heads per stage, over the device
    on a stack, rules ``cell`` out on it (``_over_by_u``'s rule): same family and fewer heads
    per stage, or, for overlapped stages, their blocking twin at as many or fewer."""
    u_cell = cell.option("heads_per_stage")
    if not u or not u_cell:
        return False
    twin = (cell.method, cell.ring_degree, None, None, "alst") if cell.option("overlap") else None
    return (family == _family(cell) and u < u_cell) or (family == twin and u <= u_cell)


def _next_startable(pending: list[Cell], running: list[Cell]) -> int | None:
    """The index of the first of ``pending`` that no other pending or running configuration
    could rule out (``_spares``), or None: each waits until those have their rows, so whether
    it is emulated or inferred does not depend on which worker finished first."""
    for i, cell in enumerate(pending):
        others = [*pending[:i], *pending[i + 1:], *running]
        if not any(_spares(_family(o), o.option("heads_per_stage"), cell) for o in others):
            return i
    return None


def _record_over(cell: Cell, rows: list[dict], over_at: dict[tuple, int]) -> None:
    """Note the stacks on which ``cell`` (a UPipe configuration) was emulated over the
    device."""
    u = cell.option("heads_per_stage")
    if not u:
        return
    for row in rows:
        # a level keeping whole blocks is over the device by design wherever keeping them all
        # is: that row is what its candidates keeping some blocks are read from
        # (``partial_candidates``), so a larger U still needs its own, not an inference
        if row["stack"] in KEEP_ON_DEVICE:
            continue
        if over_device(row) and "plan_inferred_from" not in row:
            key = (_family(cell), row["stack"])
            over_at[key] = min(over_at.get(key, u), u)


def _done(fn, *args) -> concurrent.futures.Future:
    """``fn(*args)`` run here, as a finished future (the serial plan's executor)."""
    f: concurrent.futures.Future = concurrent.futures.Future()
    f.set_result(fn(*args))
    return f


# Memory one plan worker may take: an exact 32-layer Llama3-8B step at 2M tokens, the plan's
# dearest kind of emulation, peaked at 370 MB resident (``/usr/bin/time -v`` on this
# project's 2-core CI machine; the fake tensors hold no data), rounded up to 1 GiB for the
# pool's own processes and headroom.
WORKER_BYTES = 2**30


def default_workers() -> int:
    """The plan's emulations at once by default: one per CPU this process may run on
    (``os.sched_getaffinity``, ``os.cpu_count`` where that does not exist), but no more than
    the machine's physical memory holds at ``WORKER_BYTES`` each."""
    if hasattr(os, "sched_getaffinity"):
        cpus = len(os.sched_getaffinity(0))
    else:
        cpus = os.cpu_count() or 1
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # not POSIX: the CPUs alone decide
        memory = None
    if memory and memory > 0:
        cpus = min(cpus, memory // WORKER_BYTES)
    return max(1, cpus)


def plan(spec: PlanSpec, hw: Hardware, *, workers: int | None = None, exact: bool = False,
         on_rows: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Every configuration of ``spec`` on ``hw``, ranked (``rank``). ``on_rows`` sees each
    configuration's rows as they arrive (progress).

    Configurations start longest first (``_cost``), at most ``workers`` at once (default
    ``default_workers()``: the table is the same for any number), each when a
    worker is free, except that a UPipe configuration waits until the smaller numbers of heads
    per stage of its mesh (and, overlapped, its blocking twin) have their rows
    (``_next_startable``): it is not emulated on a stack where one of them was over the device
    (``_over_by_u``; not on a level of ``KEEP_ON_DEVICE``, over the device by design), whatever
    the number of workers. A method whose measured reserve leaves no device budget is an
    invalid row, not emulated (``_within_reserve``). Then the configurations keeping the
    attention (whole blocks) in as many blocks as the host (the device) holds, on the levels of
    ``KEEP_ON_HOST`` (``KEEP_ON_DEVICE``), fastest estimate first (``partial_candidates``): one
    is emulated exactly (17 s to 8 minutes each at paper scale: its mix of blocks is beyond
    the fit) when no candidate of its method and level has fitted yet and it is above every
    row that fits so far (``partial_rows``); the others are rows saying their estimate."""
    hw.validate(world=spec.gpus)
    workers = default_workers() if workers is None else workers
    cells, rows = configurations(spec)
    cells, refused = _within_reserve(cells, hw)  # before any emulation, which would raise
    rows += refused
    stacks = tuple(spec.stacks)
    pending = sorted(cells, key=_cost, reverse=True)
    over_at: dict[tuple, int] = {}
    configs: list[tuple[Cell, list[dict]]] = []  # each configuration's cell and rows
    with contextlib.ExitStack() as exits:
        if workers > 1 and len(cells) > 1:
            # spawn: workers start clean (no fake process group or dispatch mode of this one)
            pool = exits.enter_context(concurrent.futures.ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("spawn")))
            submit = pool.submit
        else:
            submit = _done
        running: dict[concurrent.futures.Future, Cell] = {}
        while pending or running:
            while pending and len(running) < max(1, workers):
                i = _next_startable(pending, list(running.values()))
                if i is None and not running:  # a cycle in ``_spares``: never, but never hang
                    raise RuntimeError("plan: every pending configuration waits on another")
                if i is None:  # every pending one waits on a running one
                    break
                cell = pending.pop(i)
                running[submit(plan_configuration, cell, hw, stacks, exact,
                               _over_by_u(cell, over_at))] = cell
            finished, _ = concurrent.futures.wait(
                running, return_when=concurrent.futures.FIRST_COMPLETED)
            for f in finished:
                got = f.result()
                cell = running.pop(f)
                _record_over(cell, got, over_at)
                configs.append((cell, got))
                rows += got
                if on_rows is not None:
                    on_rows(got)
        rows += partial_rows(configs, hw, exact, submit, on_rows)
    return rank(rows)


def _within_reserve(cells: list[Cell], hw: Hardware) -> tuple[list[Cell], list[dict]]:
    """(``cells`` whose method's reserve leaves the device a budget, an invalid row for each
    method whose measured reserve does not). ``hw.validate`` checked a given reserve and the
    default; a method's own measured one (fpdt's 10 GiB against ``--gpu-mem 8``) rules out that
    method only, so its row says so instead of the plan stopping at its first emulation."""
    if hw.reserve_gib is not None:
        return cells, []
    kept, refused = [], {}
    for cell in cells:
        reserve = hw.measured_reserve(cell.method)
        if reserve < hw.gpu_mem_gib:
            kept.append(cell)
        elif cell.method not in refused:
            refused[cell.method] = unrun(cell, None, Status.INVALID, (
                f"{cell.method}'s measured reserve, {reserve:g} GiB (the caching allocator's "
                f"cache beyond its tensors, {RESERVE_SOURCE}), is not below --gpu-mem "
                f"({hw.gpu_mem_gib:g} GiB): no device budget is left; give --reserve to set "
                "another"), "emulated")
    return kept, list(refused.values())


# calibrate.py's source of an inter-node figure it could not measure on one node
COPIED_FROM_INTRA = "a copy of collectives.intra"


def inter_node_warning(spec: PlanSpec, hw: Hardware) -> str | None:
    """A warning when the plan's ranks span nodes but its profile's inter-node collectives are
    copies of its intra-node ones (``upipe-bench calibrate`` on one node without ``--base``;
    each such constant's source says so), or None: the plan would price inter-node
    communication at intra-node speed without saying it."""
    if spec.gpus <= hw.gpus_per_node:
        return None
    profile = profile_for(hw)
    if profile is None:
        return None
    # the loaded profile keeps the values only; the sources are in its file
    inter = json.loads(Path(profile.path).read_text()).get("collectives", {}).get("inter", {})
    copied = [op for op, tree in inter.items()
              if any(COPIED_FROM_INTRA in source for source in _sources(tree))]
    if not copied:
        return None
    nodes = -(-spec.gpus // hw.gpus_per_node)
    return (f"inter-node times not measured: the {spec.gpus} GPUs span {nodes} nodes, but "
            f"profile {profile.name!r} was calibrated on one node and its inter-node "
            f"collectives ({', '.join(sorted(copied))}) are copies of its intra-node ones, so "
            "they are priced at intra-node speed; calibrate with --base NAME to take them from "
            "a shipped profile")


def _sources(tree) -> list[str]:
    """Every constant's source in a profile's raw JSON ``tree``."""
    if isinstance(tree, dict) and "value" in tree:
        return [str(tree.get("source", ""))]
    if isinstance(tree, dict):
        return [s for v in tree.values() for s in _sources(v)]
    return []
