"""Tidy tables rebuilt from a sweep's run directories (docs/design.md#measurement).

Layout of ``results/<sweep>/``::

    sweep.json            the declaration that ran (and env.json: the invoking process)
    runs/<cell_id>/       cell.json (resolved config) and row.json (metrics, status, provenance)
    searches/<id>.json    one max-context search: summary and the cell ids of its probes
    rows.csv              one row per cell x repetition, every status (rebuilt from runs/);
                          ``mode`` says how: measured (a launch) or emulated (the emulator)
    max_context.csv       one row per search (rebuilt from searches/)
    *.png                 plots, a pure function of the two tables (experiments.reporting.plots)

Tables are always rebuilt from the run directories, never edited, so an interrupted sweep
loses nothing already measured and a resumed one produces the same tables. A reader of the
tables alone checks that one was not cut short (``check_table``).
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pandas as pd

from experiments.store import BadResultFile, read_row, read_search, write_text

ROWS, MAXCTX = "rows.csv", "max_context.csv"
# what each table is rebuilt from, a row per file: (folder, pattern in it)
SOURCES = {ROWS: ("runs", "*/row.json"), MAXCTX: ("searches", "*.json")}
# first columns of rows.csv; the rest follow in the order the rows first name them
ROW_COLUMNS = ["sweep", "cell_id", "method", "heads_per_stage", "ring_degree", "chunk_size",
               "doc_len", "overlap", "model", "seq_len", "nproc", "stack", "dtype", "kernel",
               "kernel_ran", "budget_mib", "overrides", "status", "mode", "emulation",
               "time_median_s", "time_p20_s", "time_p80_s", "step_time_s",
               "tokens_per_s_per_gpu", "mfu",
               "hardware_profile", "time_compute_s", "time_comm_exposed_s",
               "time_offload_exposed_s", "time_overhead_s", "peak_device_bytes", "peak_host_bytes",
               "peak_model_bytes", "peak_attention_bytes", "peak_other_bytes",
               "device_memory_bytes", "device_budget_bytes", "host_budget_bytes",
               "rank_flops_per_step", "comm_bytes_per_step", "comm_bytes_by_op", "device", "error"]
MAXCTX_COLUMNS = ["sweep", "method", "heads_per_stage", "ring_degree", "chunk_size", "doc_len",
                  "overlap", "model",
                  "nproc", "stack", "dtype", "budget_mib", "status", "mode", "max_seq_len",
                  "first_failing_seq_len", "granularity", "n_probes", "peak_device_bytes",
                  "peak_host_bytes", "peak_model_bytes", "peak_attention_bytes",
                  "peak_other_bytes", "device_budget_bytes", "host_budget_bytes", "device",
                  "error"]


def _frame(records: list[dict], first: list[str]) -> pd.DataFrame:
    df = pd.DataFrame.from_records(records)
    # lists (per-step times, losses) and dicts (comm_bytes_by_op) as JSON text in the CSV
    for col in df.columns:
        if df[col].map(lambda v: isinstance(v, (list, dict))).any():
            df[col] = df[col].map(lambda v: json.dumps(v, sort_keys=True)
                                  if isinstance(v, (list, dict)) else v)
    cols = [c for c in first if c in df.columns] + [c for c in df.columns if c not in first]
    return df.reindex(columns=cols)


def load_rows(sweep_dir: Path) -> pd.DataFrame:
    """Every run's row (runs/*/row.json) as one frame, sorted by method and length."""
    folder, pattern = SOURCES[ROWS]
    records = [read_row(p) for p in sorted((Path(sweep_dir) / folder).glob(pattern))]
    if not records:
        return pd.DataFrame(columns=ROW_COLUMNS)
    df = _frame(records, ROW_COLUMNS)
    keys = ["method", "heads_per_stage", "ring_degree", "chunk_size", "seq_len", "stack"]
    return df.sort_values(keys, na_position="first", kind="stable").reset_index(drop=True)


def load_searches(sweep_dir: Path) -> pd.DataFrame:
    records = []
    folder, pattern = SOURCES[MAXCTX]
    for p in sorted((Path(sweep_dir) / folder).glob(pattern)):
        s = read_search(p)
        records.append({k: v for k, v in s.items() if k not in ("probes", "probe_cell_ids")})
    if not records:
        return pd.DataFrame(columns=MAXCTX_COLUMNS)
    return _frame(records, MAXCTX_COLUMNS)


def write_tables(sweep_dir: Path) -> dict[str, Path]:
    """Rebuild rows.csv and max_context.csv from the run directories; returns their paths.
    A run file that is not a valid row or search raises ``store.BadResultFile`` naming it."""
    sweep_dir = Path(sweep_dir)
    out = {}
    # written only when their text changes: a rebuild from unchanged runs touches nothing
    write_text(sweep_dir / ROWS, load_rows(sweep_dir).to_csv(index=False))
    out["rows_csv"] = sweep_dir / ROWS
    searches = load_searches(sweep_dir)
    if len(searches):
        write_text(sweep_dir / MAXCTX, searches.to_csv(index=False))
        out["max_context_csv"] = sweep_dir / MAXCTX
    return out


def check_table(path: Path) -> None:
    """Refuse a ``rows.csv`` or ``max_context.csv`` cut short (a copy or a download stopped
    part way), which a CSV reader would read without a word: ``store.BadResultFile`` naming it
    unless it ends with a newline, every record has the header's fields and, where the sweep
    folder holds what it is rebuilt from (``SOURCES``), it has a row for each such file."""
    path = Path(path)
    text = path.read_text()
    if not text.endswith("\n"):  # write_tables ends every record with one
        raise BadResultFile(path, "cut short: it does not end with a newline")
    header, *records = csv.reader(io.StringIO(text))
    for n, record in enumerate(records, 2):
        if len(record) != len(header):
            raise BadResultFile(path, f"cut short: record {n} (the header is 1) has "
                                      f"{len(record)} fields, the header {len(header)}")
    folder, pattern = SOURCES[path.name]
    sources = path.parent / folder
    if sources.is_dir():
        n_sources = len(list(sources.glob(pattern)))
        if n_sources != len(records):
            raise BadResultFile(path, f"{len(records)} rows, but {sources} has {n_sources} "
                                      f"({pattern}): cut short or stale (rebuild it with "
                                      f"upipe-bench plot {path.parent})")
