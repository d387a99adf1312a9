"""Run a declared sweep into ``results/<sweep>/``: cells, max-context searches, tables, plots.

Every cell runs through the sweep's executor (``runner.executor``): a fresh process-group launch
per cell, or, for an emulated sweep (``scale == "emulated"``), the emulator on the sweep's
``hardware`` in this process. Its row is written to ``runs/<cell_id>/row.json`` as soon as it
finishes and the tables are rebuilt, so an interrupted sweep keeps everything measured.

Resuming skips cells that already have a row; ``retry_failed`` re-runs error and timeout rows;
a ``skipped`` row re-runs on a machine where its method is available; a run file that is not a
valid row (truncated, malformed, not a row, another cell's: ``store.read_row``) is set aside as
``row.json.bad`` with a warning naming it, and its cell runs again. A resumed row whose
``cell.json`` is missing gets it back from the declaration. A search's probes are cells too,
cached the same way.

One sweep at a time per results directory (``lock``). Under torchrun every rank walks the same
list; rank 0 decides what to skip, holds the lock and writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from experiments.config import Cell, Status, Sweep, format_size
from experiments.provenance import provenance
from experiments.reporting.plots import draw_plots
from experiments.reporting.tables import write_tables
from experiments.runner.executor import Emulator, Launcher
from experiments.runner.lock import ResultsInUse, results_lock
from experiments.runner.search import print_probe, run_search, summarize
from experiments.store import CELL_FILE, BadResultFile, read_row, set_aside, write_json, write_row


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _agree(value):
    """Rank 0's value on every rank (torchrun: only rank 0 reads the results directory)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _headline(row: dict) -> str:
    """What a progress line shows of a row: tokens/s when measured, the peak when emulated."""
    rate, peak = row.get("tokens_per_s_per_gpu"), row.get("peak_device_bytes")
    if rate:
        return f"  {rate:.0f} tokens/s/gpu"
    if row.get("mode") == "emulated" and peak:
        return f"  peak {peak / 2**30:.2f} GiB/rank (emulated)"
    return ""


def _label(cell: Cell) -> str:
    r = "" if cell.ring_degree == 1 else f":{cell.nproc // cell.ring_degree}x{cell.ring_degree}"
    opts = "".join(f":{m}" for m in cell.option_marks())
    dp = "" if cell.dp == 1 else f":dp={cell.dp}"
    d = "" if cell.doc_len is None else f":doc={format_size(cell.doc_len)}"
    return f"{cell.method}{r}{opts}{dp}{d} {format_size(cell.seq_len)} {cell.stack}"


def sweep_executor(sweep: Sweep, timeout_s: float | None = None, progress: bool = False,
                   shared_gpu: bool = False):
    """The executor a sweep's cells run on: the emulator on its hardware for an emulated sweep,
    else a launcher with the sweep's (or the given) timeout, its ranks on one GPU with
    ``shared_gpu`` (refused for an emulated sweep: nothing is launched)."""
    if sweep.scale == "emulated":
        if shared_gpu:
            raise ValueError(f"--shared-gpu: sweep {sweep.name!r} is emulated (one process "
                             "plays every rank); it is for measured sweeps")
        return Emulator(sweep.hardware, exact=sweep.exact)
    return Launcher(sweep.timeout_s if timeout_s is None else timeout_s, progress=progress,
                    shared_gpu=shared_gpu)


class SweepRunner:
    """Runs one sweep into ``out_root / sweep.name``."""

    def __init__(self, sweep: Sweep, out_root: Path, *, retry_failed: bool = False,
                 progress: bool = True, timeout_s: float | None = None,
                 shared_gpu: bool = False):
        self.sweep, self.dir = sweep, Path(out_root) / sweep.name
        self.retry_failed, self.progress = retry_failed, progress
        self.executor = sweep_executor(sweep, timeout_s, progress, shared_gpu)
        self.run_id = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        self.counts: dict[str, int] = {}
        self.resumed = False  # whether the last cell's row was resumed rather than run
        self._env_recorded = False

    def _record_env(self) -> None:
        """env.json: the invocation that last ran a cell. A resume that runs none keeps the
        one that did, so the file keeps describing the process that made the rows."""
        if _is_writer() and not self._env_recorded:
            write_json(self.dir / "env.json", provenance() | {"argv": sys.argv,
                                                               "run_id": self.run_id})
            self._env_recorded = True

    # -- cells ---------------------------------------------------------------------------------

    def _row_path(self, cell: Cell) -> Path:
        return self.dir / "runs" / cell.cell_id() / "row.json"

    def action(self, cell: Cell) -> str:
        """What the sweep will do with ``cell`` (rank 0's view): ``resume`` (its row stands),
        ``run`` (no row), ``retry`` (an error/timeout row under ``retry_failed``), ``run here``
        (skipped elsewhere, runnable here) or ``re-run`` (its run file is not a valid row)."""
        path = self._row_path(cell)
        if not path.exists():
            return "run"
        try:
            row = read_row(path)
        except BadResultFile:
            return "re-run"
        if self.retry_failed and row["status"] in Status.RETRYABLE:
            return "retry"
        if row["status"] == Status.SKIPPED and self.executor.unavailable(cell) is None:
            return "run here"  # skipped elsewhere (a CPU machine), runnable here
        return "resume"

    def cached_row(self, cell: Cell) -> dict | None:
        """The cell's stored row if it stands (``action`` is ``resume``), else None; a bad run
        file is set aside first, with a warning naming it. A standing row's missing
        ``cell.json`` is written again from ``cell``, with a warning naming it."""
        row = None
        if _is_writer():
            path = self._row_path(cell)
            action = self.action(cell)
            if action == "re-run":
                try:
                    read_row(path)
                except BadResultFile as e:
                    kept = set_aside(path)
                    print(f"warning: {e}; kept as {kept.name}, running the cell again",
                          file=sys.stderr, flush=True)
            elif action == "resume":
                row = read_row(path)
                # The row stands, but what reads the run's config (the time validation) needs its
                # cell.json; the declaration's cell is that config: its id is the folder's name,
                # and so the row's (read_row)
                cell_path = path.with_name(CELL_FILE)
                if not cell_path.exists():
                    write_json(cell_path, cell.to_dict())
                    print(f"warning: {cell_path} was missing; written again from the sweep's "
                          f"declaration", file=sys.stderr, flush=True)
        return _agree(row)

    def run(self, cell: Cell) -> dict:
        """The cell's row: cached, or run now and written."""
        row = self.cached_row(cell)
        self.resumed = row is not None
        if row is not None:
            self.counts["cached"] = self.counts.get("cached", 0) + 1
            return row
        self._record_env()
        row = self.executor.run(cell) | {"sweep": self.sweep.name, "run_id": self.run_id}
        self.counts[row["status"]] = self.counts.get(row["status"], 0) + 1
        if _is_writer():
            d = self.dir / "runs" / cell.cell_id()
            write_json(d / CELL_FILE, cell.to_dict())
            write_row(d / "row.json", row, tuple(cell.extra))
            write_tables(self.dir)
        return row

    # -- the sweep -----------------------------------------------------------------------------

    def _write_declaration(self) -> None:
        s = self.sweep
        write_json(self.dir / "sweep.json", {
            "name": s.name, "description": s.description, "scale": s.scale, "base": s.base,
            "axes": s.axes, "search": None if s.search is None else vars(s.search),
            "search_methods": s.search_methods, "search_base": s.search_base,
            "repeats": s.repeats, "plots": list(s.plots),
            "hardware": None if s.hardware is None else dataclasses.asdict(s.hardware),
            "exact": s.exact, "invalid_cells": [[c.cell_id(), e] for c, e in s.validate()]}
            # only where declared: the other sweeps' declarations stay as they were written
            | ({"extra_cells": list(s.extra_cells)} if s.extra_cells else {}))

    def __call__(self) -> dict:
        """Run every cell, then every search; returns the table and plot paths. Refused
        (``ResultsInUse``, on every rank) while another sweep runs on the same directory, and
        (``ValueError``, on every rank, before any cell) for a paper-scale sweep on a machine
        without CUDA: its cells are GPU-sized (a Llama3-8B rank at 1M tokens), and launched on
        CPU ranks they exhaust host memory and are killed one by one."""
        if self.sweep.scale == "paper" and not torch.cuda.is_available():
            raise ValueError(
                f"sweep {self.sweep.name!r} is paper scale: its cells run on GPUs, and torch sees "
                f"no CUDA device here; run {self.sweep.name}-emulated (its emulated twin) "
                f"or {self.sweep.name}-cpu (its CPU counterpart) instead")
        with contextlib.ExitStack() as held:
            refused = None
            if _is_writer():
                try:
                    held.enter_context(results_lock(self.dir))
                except ResultsInUse as e:
                    refused = str(e)
            refused = _agree(refused)  # under torchrun only rank 0 holds the lock
            if refused is not None:
                raise ResultsInUse(refused)
            if _is_writer():
                self._write_declaration()
                if not (self.dir / "env.json").exists():
                    self._record_env()
            return self._run_all()

    def _run_all(self) -> dict:
        cells = self.sweep.cells()
        searches = self.sweep.search_cells()
        bar = tqdm(total=len(cells) + len(searches), desc=self.sweep.name, unit="cell",
                   disable=not (self.progress and _is_writer()), file=sys.stderr)
        with bar:
            for cell in cells:
                bar.set_postfix_str(_label(cell))
                row = self.run(cell)
                if self.progress and _is_writer():
                    how = "resumed " if self.resumed else ""
                    bar.write(f"  [{how}{row['status']}] {_label(cell)}{_headline(row)}",
                              file=sys.stderr)
                bar.update()
            for base in searches:
                bar.set_postfix_str(f"max context {_label(base)}")
                self.search(base)
                bar.update()
        if not _is_writer():
            return {}
        return write_tables(self.dir) | draw_plots(self.dir, self.sweep.plots)

    def search(self, base: Cell) -> dict:
        """Search ``base``'s maximum context (probes cached as cells); its summary, written to
        ``searches/``."""
        on_probe = print_probe if self.progress and _is_writer() else None
        res = run_search(_Cached(self), base, self.sweep.search, on_probe)
        summary = {"sweep": self.sweep.name, **summarize(base, res, self.sweep.hardware),
                   "device": next((p.get("device") for p in res["probes"] if p.get("device")),
                                  None),
                   "probe_cell_ids": [p.get("cell_id") for p in res["probes"]],
                   "probe_statuses": [p.get("status") for p in res["probes"]]}
        if _is_writer():
            name = base.cell_id().replace(f"-{format_size(base.seq_len)}-", "-")
            write_json(self.dir / "searches" / f"{name}.json", summary)
            write_tables(self.dir)
        return summary


@dataclasses.dataclass(frozen=True)
class _Cached:
    """The runner's executor, with every probe resumed from (and written to) ``runs/``."""

    runner: SweepRunner

    def unavailable(self, cell: Cell) -> str | None:
        return self.runner.executor.unavailable(cell)

    def run(self, cell: Cell) -> dict:
        return self.runner.run(cell)
