"""``upipe-bench``: run one cell, a declared sweep, a max-context search; plot; list.

    upipe-bench run --method upipe --model tiny --seq-len 8K --nproc 4 --stack alst --json
    upipe-bench run --method usp --ring-degree 2 --nproc 4        # a 2 (ulysses) x 2 (ring) mesh
    upipe-bench run --method fpdt --chunk-size 1K --nproc 4
    upipe-bench max-context --method ulysses --model tiny --nproc 4 --budget-mib 96 --json
    upipe-bench sweep table3_llama3_8b_h100x8-cpu [--dry-run]
    upipe-bench plot table3_llama3_8b_h100x8-cpu
    upipe-bench list [methods|presets|stacks|sweeps] [--json]

Bad input (unknown method, preset, stack, sweep or override key; a length that does not
shard; an option the method does not take) is reported with the valid choices and exit status 2
before any process starts. A method that cannot run on this machine (``list methods`` says
why) gives a ``skipped`` row, exit status 1, without launching anything. Under
torchrun (``WORLD_SIZE`` set) the cells run in the launched process group.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
from pathlib import Path

from experiments.config import DTYPES, PRESETS, STACKS, Cell, parse_overrides, parse_size

RESULTS = Path("results")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _methods() -> dict[str, dict]:
    """Every registered method: whether it runs on this machine (else why), the options it
    takes and whether it runs on a (ring, ulysses) mesh (``--ring-degree``)."""
    import torch

    from experiments.config import METHOD_OPTIONS, takes_option
    from upipe.registry import available_methods, get_method

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    out = {}
    for name in available_methods():
        cls = get_method(name)
        reason = cls.unavailable_reason(device_type)
        out[name] = {"available": reason is None, "reason": reason, "device": device_type,
                     "options": [o for o in METHOD_OPTIONS if takes_option(cls, o)]
                     + (["ring_degree"] if cls.supports_mesh else [])}
    return out


def _cell_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", required=True, help="registry name (upipe-bench list methods)")
    p.add_argument("--model", default="tiny", help=f"preset: {', '.join(PRESETS)}")
    p.add_argument("--seq-len", type=_size, default=4096, help="global tokens: 131072, 128K, 1M")
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks = CP degree (default: the torchrun world, else 4)")
    p.add_argument("--stack", default="alst", help=f"memory stack: {', '.join(STACKS)}")
    p.add_argument("--heads-per-stage", type=int, default=None, help="UPipe's U")
    p.add_argument("--ring-degree", type=int, default=1,
                   help="hybrids (usp, upipe): ring axis of a (ring, ulysses) mesh; "
                        "Ulysses degree = nproc / ring degree")
    p.add_argument("--chunk-size", type=_size, default=None,
                   help="fpdt, ds-fpdt: global tokens per chunk (64K; default: the method's)")
    p.add_argument("--dtype", default="fp32", help=f"one of {', '.join(DTYPES)}")
    p.add_argument("--kernel", default="auto", help="attention kernel")
    p.add_argument("--budget-mib", type=float, default=None,
                   help="per-rank device budget (CPU: tracked bytes; GPU: allocator limit)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="model field override, repeatable (e.g. n_layers=2)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per launch")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _cell(a: argparse.Namespace) -> Cell:
    nproc = a.nproc or int(os.environ.get("WORLD_SIZE", 4))
    cell = Cell(method=a.method, model=a.model, seq_len=a.seq_len, nproc=nproc, stack=a.stack,
                heads_per_stage=a.heads_per_stage, ring_degree=a.ring_degree,
                chunk_size=a.chunk_size, dtype=a.dtype, kernel=a.kernel,
                overrides=parse_overrides(a.override), budget_mib=a.budget_mib,
                warmup=a.warmup, iters=a.iters)
    cell.validate()
    return cell


def _init_torchrun() -> bool:
    """Join the torchrun process group if launched by torchrun; True when this is rank 0."""
    if "WORLD_SIZE" not in os.environ:
        return True
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            backend = "nccl"
        dist.init_process_group(backend, timeout=datetime.timedelta(hours=2))
    return dist.get_rank() == 0


def _print_json(obj) -> None:
    print(json.dumps(obj, default=str))


def cmd_run(a) -> int:
    from experiments.launch import run_cell

    cell = _cell(a)
    rank0 = _init_torchrun()
    row = run_cell(cell, timeout_s=a.timeout)
    if rank0:
        if a.json:
            _print_json(row)
        else:
            keys = ["status", "method", "seq_len", "nproc", "stack", "time_median_s",
                    "tokens_per_s_per_gpu", "peak_device_bytes", "peak_host_bytes",
                    "peak_model_bytes", "peak_attention_bytes", "peak_other_bytes", "error"]
            for k in keys:
                if row.get(k) not in (None, ""):
                    print(f"{k:24s} {row[k]}")
    return 0 if row["status"] in ("ok", "oom") else 1


def cmd_max_context(a) -> int:
    from experiments.launch import run_cell, unavailable_reason
    from experiments.maxctx import SearchSpec, search_max_context

    cell = _cell(a)
    spec = SearchSpec(start=a.start or cell.seq_len, block=a.block, limit=a.limit)
    spec.validate(cell.nproc)
    rank0 = _init_torchrun()
    reason = unavailable_reason(cell)
    if reason is None:
        res = search_max_context(dataclasses.replace(cell, seq_len=spec.start), spec,
                                 lambda c: run_cell(c, timeout_s=a.timeout))
    else:  # as a sweep records it: no probes
        res = {"status": "skipped", "max_seq_len": None, "first_failing_seq_len": None,
               "n_probes": 0, "error": reason, "probes": []}
    if rank0:
        probes = [{k: p.get(k) for k in ("seq_len", "status", "peak_device_bytes")}
                  for p in res["probes"]]
        out = {k: v for k, v in res.items() if k != "probes"} | {
            "method": cell.method, "heads_per_stage": cell.heads_per_stage,
            "ring_degree": cell.ring_degree, "chunk_size": cell.chunk_size, "model": cell.model,
            "nproc": cell.nproc, "stack": cell.stack, "budget_mib": cell.budget_mib,
            "probes": probes}
        if a.json:
            _print_json(out)
        else:
            print(f"max_seq_len {out['max_seq_len']}  first_failing_seq_len "
                  f"{out['first_failing_seq_len']}  ({out['n_probes']} probes, {out['status']})"
                  + (f"\n{out['error']}" if out["error"] else ""))
    return 0 if res["status"] == "ok" else 1


def cmd_sweep(a) -> int:
    from experiments.runner import SweepRunner
    from experiments.sweeps import get_sweep

    sweeps = [get_sweep(n) for n in a.names]
    if a.nproc:
        sweeps = [s.with_overrides(nproc=a.nproc) for s in sweeps]
    status = 0
    for sweep in sweeps:
        bad = sweep.validate()
        if a.dry_run:
            cells, searches = sweep.cells(), sweep.search_cells()
            print(f"{sweep.name}: {len(cells)} cells, {len(searches)} max-context searches"
                  f" -> {a.out / sweep.name}/")
            for c in cells:
                print(f"  run    {c.cell_id()}")
            for c in searches:
                print(f"  search {c.cell_id()}  (from {c.seq_len} tokens)")
            for c, err in bad:
                print(f"  INVALID {c.cell_id()}: {err}")
            status |= 2 if bad else 0
            continue
        rank0 = _init_torchrun()
        paths = SweepRunner(sweep, a.out, retry_failed=a.retry_failed,
                            progress=not a.no_progress, timeout_s=a.timeout)()
        if rank0:
            print(f"{sweep.name}: done")
            for name, path in paths.items():
                print(f"  {name:24s} {path}")
    return status


def cmd_plot(a) -> int:
    from experiments.plots import draw_plots
    from experiments.report import read_json, write_tables

    d = Path(a.target)
    if not d.is_dir():
        d = a.out / a.target
    if not (d / "sweep.json").exists():
        raise ValueError(f"target must be a sweep directory with sweep.json, got {a.target!r}")
    paths = write_tables(d) | draw_plots(d, read_json(d / "sweep.json")["plots"])
    for name, path in paths.items():
        print(f"{name:24s} {path}")
    return 0


def cmd_list(a) -> int:
    from experiments.sweeps import SWEEPS

    catalog = {
        "methods": _methods(),
        "presets": {k: dataclasses.asdict(v) for k, v in PRESETS.items()},
        "stacks": {k: dataclasses.asdict(v) for k, v in STACKS.items()},
        "sweeps": {k: {"scale": s.scale, "description": s.description}
                   for k, s in SWEEPS.items()},
    }
    if a.what:
        catalog = {a.what: catalog[a.what]}
    if a.json:
        _print_json(catalog)
        return 0
    for what, items in catalog.items():
        print(f"{what}:")
        for name in items:
            detail = items[name] if isinstance(items, dict) else None
            if what == "sweeps":
                print(f"  {name:48s} [{detail['scale']}] {detail['description']}")
            elif what in ("presets", "stacks"):
                print(f"  {name:12s} " + " ".join(f"{k}={v}" for k, v in detail.items()))
            elif what == "methods":
                opts = f"  (options: {', '.join(detail['options'])})" if detail["options"] else ""
                where = "runs" if detail["available"] else "unavailable"
                print(f"  {name:12s} {where} on {detail['device']}{opts}")
                if detail["reason"]:
                    print(f"  {'':12s}   {detail['reason']}")
            else:
                print(f"  {name}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="upipe-bench", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run one cell")
    _cell_args(run)
    run.set_defaults(fn=cmd_run)
    mc = sub.add_parser("max-context", help="search the longest context that trains")
    _cell_args(mc)
    mc.add_argument("--start", type=_size, default=None, help="first length (default --seq-len)")
    mc.add_argument("--block", type=_size, default=512, help="granularity = nproc * block")
    mc.add_argument("--limit", type=_size, default=2**24, help="longest length probed")
    mc.set_defaults(fn=cmd_max_context, iters=0)
    sw = sub.add_parser("sweep", help="run declared sweeps into <out>/<name>/")
    sw.add_argument("names", nargs="+", help="sweep names (upipe-bench list sweeps)")
    sw.add_argument("--dry-run", action="store_true", help="expand and validate, run nothing")
    sw.add_argument("--out", type=Path, default=RESULTS)
    sw.add_argument("--nproc", type=int, default=None, help="override the sweeps' rank count")
    sw.add_argument("--retry-failed", action="store_true", help="re-run error/timeout rows")
    sw.add_argument("--timeout", type=float, default=None, help="seconds per cell")
    sw.add_argument("--no-progress", action="store_true")
    sw.set_defaults(fn=cmd_sweep)
    pl = sub.add_parser("plot", help="rebuild a sweep's tables and plots from its runs")
    pl.add_argument("target", help="sweep name or directory")
    pl.add_argument("--out", type=Path, default=RESULTS)
    pl.set_defaults(fn=cmd_plot)
    ls = sub.add_parser("list", help="methods, presets, stacks, sweeps")
    ls.add_argument("what", nargs="?", choices=["methods", "presets", "stacks", "sweeps"])
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(fn=cmd_list)
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        return a.fn(a)
    except ValueError as e:  # bad input: name the field and the rule, no traceback
        print(f"upipe-bench {a.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
