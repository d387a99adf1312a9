"""Run a declared sweep into ``results/<sweep>/``: cells, max-context searches, tables, plots.

Every cell runs in its own process-group launch (``experiments.launch.run_cell``); its row is
written to ``runs/<cell_id>/row.json`` as soon as it finishes and the tables are rebuilt, so an
interrupted sweep keeps everything measured. Resuming skips cells that already have a row
(``retry_failed`` re-runs error and timeout rows; a ``skipped`` row re-runs on a machine where
its method is available). A search's probes are cells too, cached the same way; a search whose
method is unavailable here is recorded as ``skipped`` without probes. Under torchrun every rank
walks the same list; rank 0 decides what to skip and writes.

An emulated sweep (``scale == "emulated"``) runs its cells and probes in this process through
``experiments.emulate.emulate_cell`` on the sweep's ``hardware`` instead (rows with ``mode``
``emulated``); a method that cannot be emulated (``emulation_unavailable``) gives skipped rows.
"""

from __future__ import annotations

import dataclasses
import datetime
import sys
from pathlib import Path

import torch.distributed as dist
from tqdm import tqdm

from experiments.config import Cell, format_size
from experiments.launch import run_cell, unavailable_reason
from experiments.maxctx import search_max_context, summarize
from experiments.provenance import provenance
from experiments.report import read_json, write_json, write_tables
from experiments.sweep import Sweep

RETRYABLE = ("error", "timeout")


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
    u = "" if cell.heads_per_stage is None else f":U={cell.heads_per_stage}"
    r = "" if cell.ring_degree == 1 else f":{cell.nproc // cell.ring_degree}x{cell.ring_degree}"
    c = "" if cell.chunk_size is None else f":c={format_size(cell.chunk_size)}"
    return f"{cell.method}{u}{r}{c} {format_size(cell.seq_len)} {cell.stack}"


class SweepRunner:
    """Runs one sweep into ``out_root / sweep.name``."""

    def __init__(self, sweep: Sweep, out_root: Path, *, retry_failed: bool = False,
                 progress: bool = True, timeout_s: float | None = None):
        self.sweep, self.dir = sweep, Path(out_root) / sweep.name
        self.retry_failed, self.progress = retry_failed, progress
        self.timeout_s = sweep.timeout_s if timeout_s is None else timeout_s
        self.run_id = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        self.counts: dict[str, int] = {}
        self.emulated = sweep.scale == "emulated"
        self._env_recorded = False

    def _record_env(self) -> None:
        """env.json: the invocation that last ran a cell. A resume that runs none keeps the
        one that did, so the file keeps describing the process that made the rows."""
        if _is_writer() and not self._env_recorded:
            write_json(self.dir / "env.json", provenance() | {"argv": sys.argv,
                                                               "run_id": self.run_id})
            self._env_recorded = True

    # -- cells ---------------------------------------------------------------------------------

    def unavailable(self, cell: Cell) -> str | None:
        """Why the cell cannot run (or be emulated, in an emulated sweep) here, or None."""
        if self.emulated:
            from experiments.emulate import emulation_unavailable

            return emulation_unavailable(cell, self.sweep.hardware)
        return unavailable_reason(cell)

    def launch(self, cell: Cell) -> dict:
        """The cell's fresh row: measured in its own launch, or emulated in this process."""
        if self.emulated:
            from experiments.emulate import emulate_cell

            return emulate_cell(cell, self.sweep.hardware, exact=self.sweep.exact)
        return run_cell(cell, timeout_s=self.timeout_s)

    def cached_row(self, cell: Cell) -> dict | None:
        path = self.dir / "runs" / cell.cell_id() / "row.json"
        row = read_json(path) if _is_writer() and path.exists() else None
        if row is not None and self.retry_failed and row.get("status") in RETRYABLE:
            row = None
        if row is not None and row.get("status") == "skipped" and self.unavailable(cell) is None:
            row = None  # skipped elsewhere (a CPU machine), runnable here
        return _agree(row)

    def run(self, cell: Cell) -> dict:
        """The cell's row: cached, or run now and written."""
        row = self.cached_row(cell)
        if row is not None:
            self.counts["cached"] = self.counts.get("cached", 0) + 1
            return row
        self._record_env()
        row = self.launch(cell) | {"sweep": self.sweep.name, "run_id": self.run_id}
        self.counts[row["status"]] = self.counts.get(row["status"], 0) + 1
        if _is_writer():
            d = self.dir / "runs" / cell.cell_id()
            write_json(d / "cell.json", cell.to_dict())
            write_json(d / "row.json", row)
            write_tables(self.dir)
        return row

    # -- the sweep -----------------------------------------------------------------------------

    def __call__(self) -> dict:
        """Run every cell, then every search; returns the table and plot paths."""
        from experiments.plots import draw_plots  # seaborn/matplotlib import only when drawing

        bad = self.sweep.validate()
        if _is_writer():
            self.dir.mkdir(parents=True, exist_ok=True)
            write_json(self.dir / "sweep.json", {
                "name": self.sweep.name, "description": self.sweep.description,
                "scale": self.sweep.scale, "base": self.sweep.base, "axes": self.sweep.axes,
                "search": None if self.sweep.search is None else vars(self.sweep.search),
                "search_methods": self.sweep.search_methods,
                "search_base": self.sweep.search_base,
                "repeats": self.sweep.repeats, "plots": list(self.sweep.plots),
                "hardware": None if self.sweep.hardware is None
                else dataclasses.asdict(self.sweep.hardware), "exact": self.sweep.exact,
                "invalid_cells": [[c.cell_id(), e] for c, e in bad]})
            if not (self.dir / "env.json").exists():
                self._record_env()
        cells = self.sweep.cells()
        searches = self.sweep.search_cells()
        bar = tqdm(total=len(cells) + len(searches), desc=self.sweep.name, unit="cell",
                   disable=not (self.progress and _is_writer()), file=sys.stderr)
        with bar:
            for cell in cells:
                bar.set_postfix_str(_label(cell))
                row = self.run(cell)
                if _is_writer():
                    bar.write(f"  [{row['status']}] {_label(cell)}{_headline(row)}")
                bar.update()
            for base in searches:
                bar.set_postfix_str(f"max context {_label(base)}")
                self.search(base)
                bar.update()
        paths = write_tables(self.dir) if _is_writer() else {}
        if _is_writer():
            paths |= draw_plots(self.dir, self.sweep.plots)
        return paths

    def search(self, base: Cell) -> dict:
        try:
            base.validate()
            reason = self.unavailable(base)
        except ValueError as e:  # recorded like an invalid cell; nothing to probe
            status, reason = "invalid", str(e)
        else:
            status = "skipped"
        if reason is None:
            res = search_max_context(base, self.sweep.search, self.run)
        else:
            res = {"status": status, "max_seq_len": None, "first_failing_seq_len": None,
                   "n_probes": 0, "error": reason, "probes": []}
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
