"""One-off migration of the committed results to today's row format (issue 13; run once, then
removed: it lives in the git history of the commit that applied it).

1. Rows (and search summaries) written before the ``mode``, ``ring_degree``, ``chunk_size``
   and ``workload`` columns existed get them, from their own ``cell.json`` (``mode``: such
   rows were all launched, so ``measured``); every ``cell.json`` gets the cell fields it
   lacked, at their defaults. Nothing measured changes; readers no longer guess the missing
   columns.
2. ``results/bench_attention/rows.jsonl`` (the retired ``experiments/bench_attention.py``) becomes
   the ``bench_attention`` sweep's run files: one ``runs/<cell_id>/`` per row, the cell it
   measured (workload ``attention``, preset ``bench-attn``: the same 32/8 heads, head dim 64,
   dim 2048), its metrics under today's names (``tokens_per_s_per_rank`` ->
   ``tokens_per_s_per_gpu``; ``peak_attention_bytes`` is the same quantity: the peak above
   parameters and inputs), its provenance as recorded, and ``converted_from``.

    python scripts/migrate_results.py && upipe-bench plot <each sweep>
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from experiments.config import Cell
from experiments.harness.launch import describe
from experiments.provenance import provenance
from experiments.runner.sweep_runner import SweepRunner
from experiments.store import read_json, write_json
from experiments.sweeps import get_sweep

RESULTS = Path("results")

def upgrade_runs() -> int:
    n = 0
    for cell_path in sorted(RESULTS.glob("*/runs/*/cell.json")):
        stored = read_json(cell_path)
        cell = Cell.from_dict(stored)
        full = cell.to_dict()
        if full != stored:
            write_json(cell_path, full)
        row_path = cell_path.with_name("row.json")
        row = read_json(row_path)
        added = {"mode": "measured"} if "mode" not in row else {}
        added |= {k: getattr(cell, k) for k in ("ring_degree", "chunk_size", "workload")
                  if k not in row}
        if added:
            write_json(row_path, row | added)
            n += 1
    for path in sorted(RESULTS.glob("*/searches/*.json")):  # summaries before ``mode``
        summary = read_json(path)
        if "mode" not in summary:
            write_json(path, summary | {"mode": "measured"})
    return n


def convert_bench() -> int:
    d = RESULTS / "bench_attention"
    lines = (d / "rows.jsonl").read_text().splitlines()
    sweep = get_sweep("bench_attention")
    declared = {c.cell_id() for c in sweep.cells()}
    # the one cell measured twice (64K ulysses, lines 1 and 6): line 1 is repetition 0, line 6
    # the declared cell
    for i, line in enumerate(lines, 1):
        old = json.loads(line)
        extra = {"rep": 0} if i == 1 else {}
        cell = Cell(method=old["method"], model="bench-attn", seq_len=old["seq_len"],
                    nproc=old["nproc"], stack="none", heads_per_stage=old["heads_per_stage"],
                    ring_degree=old.get("ring_degree") or 1, chunk_size=old.get("chunk_size"),
                    dtype=old["dtype"], kernel=old["kernel"], warmup=old["warmup"],
                    iters=old["iters"], workload="attention", extra=extra)
        assert extra or cell.cell_id() in declared, cell.cell_id()
        cfg = cell.validate()
        assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dim) == (
            old["n_heads"], old["n_kv_heads"], old["head_dim"], old["dim"]), old
        metrics = {k: old.get(k) for k in (
            "status", "error", "time_median_s", "time_p20_s", "time_p80_s", "times_s",
            "peak_device_bytes", "peak_attention_bytes", "peak_host_bytes", "memory_from",
            "wall_s", "load_1m_start", "load_1m_end", "threads_per_rank", "launcher",
            "torch_version", "deepspeed_version", "upipe_version", "git_rev", "hostname",
            "cpu_model", "cpu_count", "python", "date_utc", "gpu_name", "cuda_version")}
        row = describe(cell, cfg) | metrics | {
            "mode": "measured", "world_size": old["nproc"], "device": "cpu (x86_64)",
            "memory_source": "tracked", "tracked_peak_device_bytes": old["peak_device_bytes"],
            "tokens_per_s_per_gpu": old["tokens_per_s_per_rank"], "device_memory_bytes": None,
            "sweep": sweep.name, "run_id": old["run_id"],
            "converted_from": f"results/bench_attention/rows.jsonl line {i} "
                              "(experiments/bench_attention.py, retired in issue 13)"}
        run_dir = d / "runs" / cell.cell_id()
        assert not run_dir.exists(), run_dir
        write_json(run_dir / "cell.json", cell.to_dict())
        write_json(run_dir / "row.json", row)
    SweepRunner(sweep, RESULTS)._write_declaration()
    write_json(d / "env.json", provenance() | {
        "argv": sys.argv, "run_id": None,
        "note": "written by the conversion of rows.jsonl into run files; each row carries the "
                "provenance of the run that measured it"})
    (d / "rows.jsonl").unlink()
    return len(lines)


if __name__ == "__main__":
    print(f"upgraded {upgrade_runs()} rows")
    if (RESULTS / "bench_attention" / "rows.jsonl").exists():
        print(f"converted {convert_bench()} bench_attention rows")
