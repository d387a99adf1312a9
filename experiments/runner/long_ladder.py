"""The ladder to 8M tokens on one node: UPipe from the paper's ALST stack to the ``long`` level,
one mechanism at a time, emulated at paper scale (8x H100 80 GB nodes, 2 TB host each,
FlashAttention-3 as the paper ran it).

Each rung adds one mechanism of the ``long`` stack level (experiments/config/stack.py) or
UPipe's chunked attention backward to the rung before; the last rung is what the library ships
(the ``long`` level with 64K-token chunks, ``runner.plan_spec.LONG``). Per rung, a record: the
emulated step at the ladder's length (peak per rank, its phase and split, the host peak) and a
certified max-context search (its longest fitting length, and what the next length is over).
The intermediate rungs are stack levels registered in this process only: they are steps of an
argument, not levels a user picks.

    python -m experiments.runner.long_ladder                  # Llama3-8B on 8 GPUs, at 8M
    python -m experiments.runner.long_ladder --model qwen3-32b --gpus 16 --seq-len 6M

It writes ``results/long_ladder_<model>_h100x<gpus>-emulated/``: ``ladder.csv`` (a record per
rung, in rung order) and ``env.json`` (the provenance of the run that last wrote a record). A
rung whose record is there for the same cell is kept (as a sweep resumes a cell), so
``./run_all.sh`` re-runs nothing; ``--retry-failed`` (``RETRY_FAILED=1 ./run_all.sh``) runs
again a rung whose step or search ended in an error or a timeout, as a sweep's does; delete
the folder to run the whole ladder again.
``reporting.ladder_table`` renders the records into docs/results.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import pandas as pd

from experiments.config import (
    EMULATED_GRANULARITY,
    STACKS,
    Cell,
    Hardware,
    Status,
    parse_size,
)
from experiments.config.search import SearchSpec
from experiments.emulation.emulate import PAPER_NODE, emulate_cell
from experiments.provenance import provenance
from experiments.runner.executor import Emulator
from experiments.runner.plan_spec import LONG_CHUNK
from experiments.runner.search import run_search
from experiments.store import write_json

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results"
FILE = "ladder.csv"
SEARCH_START = 2**20  # 1M tokens: every rung fits it on both settings
SEARCH_LIMIT = 2**25  # 32M tokens: beyond any rung's host budget

RUNGS = [  # (label, stack fields over ALST, UPipe options)
    ("ALST (the paper's stack)", {}, {}),
    ("+ first block's input offloaded", {"offload_first": True}, {}),
    ("+ input norm fused into UPipe", {"offload_first": True, "fuse_norm": True}, {}),
    ("+ chunked attention backward",
     {"offload_first": True, "fuse_norm": True}, {"chunk_size": LONG_CHUNK}),
    ("+ residual FFN tiled in place (= the long level)",
     {"offload_first": True, "fuse_norm": True, "residual_ffn": True},
     {"chunk_size": LONG_CHUNK}),
]


def folder(model: str, gpus: int, results: Path = RESULTS) -> Path:
    """Where one setting's ladder is written: ``long_ladder_llama3_8b_h100x8-emulated``."""
    return results / f"long_ladder_{model.replace('-', '_')}_h100x{gpus}-emulated"


def rung_cell(i: int, model: str, gpus: int, seq_len: int) -> Cell:
    """Rung ``i``'s cell at ``seq_len`` (its stack level ``ladder-<i>`` registered here)."""
    _, fields, options = RUNGS[i]
    STACKS[f"ladder-{i}"] = dataclasses.replace(STACKS["alst"], **fields)
    return Cell(method="upipe", model=model, seq_len=seq_len, nproc=gpus, dtype="bf16",
                stack=f"ladder-{i}", kernel="fa3", options=options)


def _first_line(text) -> str:
    return str(text or "").splitlines()[0] if text else ""


def run_rung(i: int, model: str, gpus: int, seq_len: int, hw: Hardware = PAPER_NODE) -> dict:
    """Rung ``i``'s record: its emulated step at ``seq_len`` and its certified search."""
    t0 = time.monotonic()
    cell = rung_cell(i, model, gpus, seq_len)
    row = emulate_cell(cell, hw)
    spec = SearchSpec(start=SEARCH_START, block=EMULATED_GRANULARITY // gpus, limit=SEARCH_LIMIT)
    res = run_search(Emulator(hw), dataclasses.replace(cell, seq_len=SEARCH_START), spec)
    bad = res.get("first_failing_seq_len")
    failing = next((p for p in res["probes"] if p.get("seq_len") == bad), {})
    label, fields, options = RUNGS[i]
    return {
        "rung": i, "label": label, "model": model, "nproc": gpus, "seq_len": seq_len,
        "kernel": cell.kernel, "device": row.get("device"),
        "stack_fields": json.dumps(fields, sort_keys=True),
        "options": json.dumps(options, sort_keys=True), "cell_id": cell.cell_id(),
        "status": row["status"], "error": _first_line(row.get("error")),
        "peak_device_bytes": row.get("peak_device_bytes"), "peak_phase": row.get("peak_phase"),
        "peak_model_bytes": row.get("peak_model_bytes"),
        "peak_attention_bytes": row.get("peak_attention_bytes"),
        "peak_other_bytes": row.get("peak_other_bytes"),
        "peak_host_bytes": row.get("peak_host_bytes"),
        "device_budget_bytes": row.get("device_budget_bytes"),
        "host_budget_bytes": row.get("host_budget_bytes"),
        "fit_certified": row.get("fit_certified"),
        "fit_nonaffine_phases": ";".join(row.get("fit_nonaffine_phases") or []),
        "search_status": res["status"], "max_seq_len": res.get("max_seq_len"),
        "first_failing_seq_len": bad,
        # what the first failing length is over: "device peak 73.86 GiB > budget ..."
        "failing_error": _first_line(failing.get("error")),
        "failing_is_lower_bound": bool(failing.get("peak_device_is_lower_bound")),
        "search_error": _first_line(res.get("error")),
        "emulation_s": round(time.monotonic() - t0, 1),
    }


def read(path: Path) -> pd.DataFrame:
    """A ladder's records (empty without the file)."""
    return pd.read_csv(path) if path.exists() else pd.DataFrame()


def _failed(record: dict) -> bool:
    """Whether a rung's step or its search ended in an error or a timeout (what a retry can
    change; an OOM or a refusal it cannot)."""
    return (record["status"] in Status.RETRYABLE
            or record["search_status"] in Status.RETRYABLE)


def run_ladder(model: str, gpus: int, seq_len: int, results: Path = RESULTS,
               progress=print, retry_failed: bool = False) -> Path:
    """Every rung's record into ``folder(model, gpus)/ladder.csv``, keeping a rung whose record
    is there for the same cell (with ``retry_failed``, but one that failed: ``_failed``); the
    file is rewritten after each rung, so an interrupted run keeps what it measured.
    ValueError, naming the field and its rule, for a cell that is not valid (before anything
    runs or is written)."""
    for i in range(len(RUNGS)):  # bad input (a model, a rank count, a length) before any run
        rung_cell(i, model, gpus, seq_len).validate()
    out = folder(model, gpus, results)
    path = out / FILE
    have = read(path)
    # a record stands for its cell and its rung's mechanisms (the stack's name is the rung's
    # number, so the name alone would keep a record of a rung since redefined)
    kept = {(r["cell_id"], r["stack_fields"]): r for r in have.to_dict("records")
            if not (retry_failed and _failed(r))}
    keys = [(rung_cell(i, model, gpus, seq_len).cell_id(), json.dumps(fields, sort_keys=True))
            for i, (_, fields, _) in enumerate(RUNGS)]
    records = []
    for i, (label, _, _) in enumerate(RUNGS):
        if keys[i] in kept:
            records.append(kept[keys[i]])
            progress(f"  [kept] rung {i}: {label}")
            continue
        records.append(run_rung(i, model, gpus, seq_len))
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "env.json", provenance() | {"argv": sys.argv})
        # the later rungs' standing records too: an interrupted run loses none
        later = [kept[k] for k in keys[i + 1:] if k in kept]
        pd.DataFrame(records + later).to_csv(path, index=False)
        r = records[-1]
        progress(f"  rung {i}: {label}: {r['status']} at {seq_len}, max {r['max_seq_len']} "
                 f"({r['emulation_s']} s)")
    pd.DataFrame(records).to_csv(path, index=False)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--seq-len", default="8M", help="the length each rung's step is shown at")
    p.add_argument("--results", type=Path, default=RESULTS, help="results root")
    p.add_argument("--retry-failed", action="store_true",
                   help="run again the rungs whose step or search ended in an error or a timeout")
    a = p.parse_args(argv)
    try:
        path = run_ladder(a.model, a.gpus, parse_size(a.seq_len), a.results,
                          retry_failed=a.retry_failed)
    except ValueError as e:  # the rule a field breaks, without a traceback or a record
        print(f"long_ladder: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
