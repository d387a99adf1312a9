"""Maximum-context search: the longest sequence a (method, model, world, stack, budget) trains.

Grow the length geometrically from ``start`` until a probe fails, then bisect between the
last passing and the first failing length down to ``granularity`` (the CP degree times a block,
so every probed length shards evenly). A probe is one cell run with ``iters=0``: the warm-up and
memory steps only. It passes when its status is ``ok`` and fails when it is ``oom``: on GPU the
allocator ran out (against the device, or a ``budget_mib`` fraction of it); on CPU the tracked
per-rank peak exceeded ``budget_mib`` (deterministic, so the search is reproducible); emulated,
a peak exceeded the emulated budget. Any other status (an error, a timeout, a rank killed from
outside) says nothing about memory: the search ends with that status and reports no maximum.

``run_search(executor, base, spec)`` is the one entry point (the CLI, the sweep runner and the
CI guard use it): it checks the cell, records a search whose method cannot run or be emulated
here as ``skipped`` without probes (``skipped_search``), and otherwise searches with the
executor's ``run``.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

from experiments.config import Cell, Hardware, SearchSpec, Status, format_size

PASS, FAIL = Status.OK, Status.OOM
Probe = Callable[[dict], None]


def print_probe(row: dict) -> None:
    """A progress line per probe, on stderr."""
    peak = row.get("peak_device_bytes")
    mem = f", peak {peak / 2**20:,.1f} MiB/rank" if isinstance(peak, (int, float)) else ""
    print(f"  probe {format_size(row['seq_len'])} tokens: {row['status']}{mem}", file=sys.stderr,
          flush=True)


def search_max_context(base: Cell, spec: SearchSpec, run: Callable[[Cell], dict],
                       on_probe: Probe | None = None) -> dict:
    """Run the search; ``run(cell) -> row`` runs one probe, ``on_probe(row)`` sees each.

    Returns a dict with ``status`` (ok, or the status of the probe that was neither ok nor oom),
    ``max_seq_len`` (None when even the smallest probe fails, or when a probe ended the search
    with another status), ``first_failing_seq_len`` (None when ``limit`` passes, or on such a
    probe) and ``probes`` (their rows, in order).
    """
    spec.validate(base.nproc)
    gran = spec.granularity(base.nproc)
    probes: list[dict] = []
    lengths: list[int] = []

    def probe(seq_len: int) -> str:
        row = run(dataclasses.replace(base, seq_len=seq_len, iters=0))
        probes.append(row)
        lengths.append(seq_len)
        if on_probe is not None:
            on_probe(row)
        return row["status"]

    def result(status: str, ok: int | None, bad: int | None, error: str = "") -> dict:
        return {"status": status, "max_seq_len": ok, "first_failing_seq_len": bad,
                "granularity": gran, "n_probes": len(probes), "error": error, "probes": probes}

    def interrupted(status: str, ok: int | None, bad: int | None) -> dict:
        """A probe neither passed nor ran out of memory: no maximum can be claimed."""
        bracket = f"; so far {ok} passed" if ok else ""
        bracket += f", {bad} ran out of memory" if bad else ""
        # an error or a timeout may pass another time; an invalid or skipped probe will not
        again = (" (run the search again; a sweep: --retry-failed)"
                 if status in (Status.ERROR, Status.TIMEOUT) else "")
        return result(status, None, None,
                      f"the probe at {lengths[-1]} tokens ended with status {status}{bracket}: "
                      f"no maximum reported{again}. " + probes[-1].get("error", ""))

    # the longest length probed: the limit on the lattice (a limit off it was never reached,
    # and the grow phase probed the same length forever); the shortest: the first lattice
    # length the method takes (ds-fpdt: one whole chunk)
    top = max(gran, spec.limit // gran * gran)
    floor = None  # found when the start fails: a shrinking search needs it
    ok, bad = None, None
    length = spec.start
    while True:  # grow (or, if the start fails, shrink) to bracket the limit
        status = probe(length)
        if status not in (PASS, FAIL):
            return interrupted(status, ok, bad)
        if status == PASS:
            ok = length
            if bad is not None or length >= top:
                break
            length = min(length * spec.growth, top)
        else:
            bad = length
            floor = shortest_valid(base, gran, spec.start) if floor is None else floor
            if ok is not None or length <= floor:
                break
            length = max(floor, (length // spec.growth) // gran * gran)
    while ok is not None and bad is not None and bad - ok > gran:  # bisect
        mid = (ok + bad) // 2 // gran * gran
        status = probe(mid)
        if status not in (PASS, FAIL):
            return interrupted(status, ok, bad)
        ok, bad = (mid, bad) if status == PASS else (ok, mid)
    why = (f"nothing fits: the shortest length probed, {bad} tokens, ran out of memory"
           if ok is None else "")
    return result(Status.OK, ok, bad, why)


def _valid(base: Cell, seq_len: int) -> str | None:
    """Why ``base`` at ``seq_len`` tokens is invalid, or None."""
    try:
        dataclasses.replace(base, seq_len=seq_len).validate()
    except ValueError as e:
        return str(e)
    return None


def shortest_valid(base: Cell, gran: int, start: int) -> int:
    """The shortest lattice length (a multiple of ``gran``) up to ``start`` that ``base``'s
    method takes (``start`` itself was checked)."""
    return next((n for n in range(gran, start, gran) if _valid(base, n) is None), start)


def check_lattice(base: Cell, spec: SearchSpec) -> None:
    """ValueError when the search's lattice has a length ``base``'s method refuses above the
    start (its layout's divisibility: zigzag's 2 x CP, ds-fpdt's whole chunks): the search
    would end there ``invalid``, probes in. One step above the start and the next tell, as
    both are multiples of the granularity."""
    gran = spec.granularity(base.nproc)
    for n in (spec.start + gran, spec.start + 2 * gran):
        if n <= spec.limit and (why := _valid(base, n)) is not None:
            raise ValueError(f"the search's granularity (nproc * block = {gran} tokens) must "
                             f"keep every probed length valid for {base.method!r}; at {n} "
                             f"tokens: {why}")


def skipped_search(status: str, reason: str, granularity: int | None) -> dict:
    """A search that probed nothing (its cell is invalid, or its method cannot run here)."""
    return {"status": status, "max_seq_len": None, "first_failing_seq_len": None,
            "granularity": granularity, "n_probes": 0, "error": reason, "probes": []}


def run_search(executor, base: Cell, spec: SearchSpec, on_probe: Probe | None = None) -> dict:
    """Search ``base``'s maximum context with ``executor`` (``runner.executor``: its
    ``unavailable(cell)`` and ``run(cell)``); an invalid cell or a method that cannot run here
    gives a search without probes."""
    try:
        base.validate()
        spec.validate(base.nproc)
        check_lattice(base, spec)
    except ValueError as e:
        return skipped_search(Status.INVALID, str(e), None)
    reason = executor.unavailable(base)
    if reason is not None:
        return skipped_search(Status.SKIPPED, reason, spec.granularity(base.nproc))
    return search_max_context(base, spec, executor.run, on_probe)


# Memory columns of a probe that a search summary carries from its longest passing probe.
PEAK_KEYS = ("peak_device_bytes", "peak_host_bytes", "peak_model_bytes", "peak_attention_bytes",
             "peak_other_bytes")
EMULATED_KEYS = ("peak_phase", "device_budget_bytes", "host_budget_bytes", "emulation")
# A summary's first keys: the searched cell's identity, in the order committed summaries have
# it (the options that were cell fields among them: ``config.options.COMMITTED_COLUMNS``); the
# options a method declared later follow where set.
IDENTITY = ("method", "heads_per_stage", "ring_degree", "chunk_size", "overlap", "model",
            "nproc", "dp", "stack", "dtype", "budget_mib", "doc_len")


def summarize(base: Cell, res: dict, hardware: Hardware | None = None) -> dict:
    """One flat record of a search: the cell's identity, the result without its probes, the
    memory columns (``PEAK_KEYS``) of the longest passing probe (None when none passed), the
    mode (``measured``, or ``emulated`` when ``hardware``, an ``Hardware``,
    is given), and when emulated the probe's ``EMULATED_KEYS`` and the hardware as ``hw_*``
    columns."""
    passing = [p for p in res["probes"] if p.get("status") == PASS]
    best = max(passing, key=lambda p: p["seq_len"]) if passing else {}
    cell = base.to_dict()
    out = {k: cell[k] for k in IDENTITY}
    if base.global_rope_table:  # only where set: committed summaries predate the field
        out["global_rope_table"] = True
    out |= {k: v for k, v in base.options.items() if k not in out}
    out |= {k: v for k, v in res.items() if k != "probes"}
    out |= {k: best.get(k) for k in PEAK_KEYS}
    out["mode"] = "measured" if hardware is None else "emulated"
    if hardware is not None:
        out |= {k: best.get(k) for k in EMULATED_KEYS}
        out |= hardware.columns(base.method)
    return out
