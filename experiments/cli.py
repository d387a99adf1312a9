"""``upipe-bench``: run or emulate one cell, a declared sweep, a max-context search; plot; list.

    upipe-bench run --method upipe --model tiny --seq-len 8K --nproc 4 --stack alst --json
    upipe-bench run --method usp --ring-degree 2 --nproc 4        # a 2 (ulysses) x 2 (ring) mesh
    upipe-bench run --method fpdt --chunk-size 1K --nproc 4
    upipe-bench max-context --method ulysses --model tiny --nproc 4 --budget-mib 96 --json
    upipe-bench emulate --method upipe --model llama3-8b --world 8 --seq-len 3M --json
    upipe-bench max-context --emulate --method upipe --model llama3-8b --world 8
    upipe-bench emulate --method usp --model qwen3-32b --mesh 8x2 --seq-len 1M
    upipe-bench sweep table3_llama3_8b_h100x8-cpu [--dry-run]
    upipe-bench plot table3_llama3_8b_h100x8-cpu
    upipe-bench list [methods|presets|stacks|sweeps] [--json]

``--stack`` defaults to the stack the paper runs the method on (``config.paper_stack``:
``native`` for torch-cp, ``alst`` for every other method), for every command.

``emulate`` and ``max-context --emulate`` run the paper-scale emulator
(``experiments.emulate``, DESIGN.md §8): one process plays rank 0 of a ``--world``-rank job on
fake tensors and reports the peak device and host bytes against the emulated hardware's
budgets (``--gpu-mem`` minus ``--reserve``; ``--host-mem`` over the node's ranks), the
breakdown, FLOPs and communication per step. No GPU is needed, and no time is measured.

Bad input (unknown method, preset, stack, sweep or override key; a length that does not
shard; an option the method does not take) is reported with the valid choices and exit status 2
before any process starts. A method that cannot run on this machine (``list methods`` says
why) gives a ``skipped`` row, exit status 1, without launching anything. Under
torchrun (``WORLD_SIZE`` set) the cells run in the launched process group.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import sys
from pathlib import Path

from experiments.cli_args import (
    EMULATED_WORLD,
    add_cell_args,
    add_hardware_args,
    add_world_args,
    cell_from_args,
    hardware_from_args,
    search_spec_from_args,
    size,
)
from experiments.config import PRESETS, STACKS

RESULTS = Path("results")
GiB = 2**30


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

    cell = cell_from_args(a)
    rank0 = _init_torchrun()
    row = run_cell(cell, timeout_s=a.timeout)
    if rank0:
        if a.json:
            _print_json(row)
        else:
            _print_row(row, ["status", "method", "seq_len", "nproc", "stack", "time_median_s",
                             "tokens_per_s_per_gpu", "peak_device_bytes", "peak_host_bytes",
                             "peak_model_bytes", "peak_attention_bytes", "peak_other_bytes",
                             "error"])
    return 0 if row["status"] in ("ok", "oom") else 1


def _print_row(row: dict, keys: list[str]) -> None:
    """``key value`` lines for the keys the row has; byte counts also in GiB."""
    for k in keys:
        v = row.get(k)
        if v in (None, "") or isinstance(v, dict) and not v:
            continue
        unit = ""
        if k.endswith("_bytes") and isinstance(v, int) and v:
            unit = f"  ({v / GiB:.2f} GiB)" if v >= GiB else f"  ({v / 2**20:.2f} MiB)"
        print(f"{k:24s} {json.dumps(v) if isinstance(v, dict) else v}{unit}")


EMULATE_KEYS = ["status", "method", "model", "seq_len", "nproc", "ring_degree", "stack", "dtype",
                "emulation", "peak_device_bytes", "peak_host_bytes", "peak_model_bytes",
                "peak_attention_bytes", "peak_other_bytes", "peak_phase", "device_budget_bytes",
                "host_budget_bytes", "host_pinned", "model_tflops_per_step",
                "comm_bytes_per_step", "comm_bytes_by_op", "emulation_s", "error"]


@contextlib.contextmanager
def _emulating():
    """Around an emulation: stdout carries only our output (``--json``). The emulator runs
    CPU code on fake tensors, so DeepSpeed (tiled MLP, ds-ulysses) is told its accelerator is
    the CPU; left to probe, it warns on stdout when it finds no GPU."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sys.stdout.flush()
    with contextlib.redirect_stdout(sys.stderr):
        yield


def cmd_emulate(a) -> int:
    from experiments.emulate import emulate_cell

    hw = hardware_from_args(a)
    cell = cell_from_args(a, emulated=True)
    with _emulating():
        row = emulate_cell(cell, hw, exact=bool(a.exact))
    if a.json:
        _print_json(row)
    else:
        _print_row(row, EMULATE_KEYS)
    return 0 if row["status"] in ("ok", "oom") else 1


def cmd_max_context(a) -> int:
    from experiments.maxctx import search_max_context, summarize

    hw = hardware_from_args(a, enabled=a.emulate, why="max-context --emulate")
    if a.emulate:
        from experiments.emulate import emulate_cell, emulation_unavailable

        cell = cell_from_args(a, emulated=True)
        reason = emulation_unavailable(cell, hw)

        def run(c):
            return emulate_cell(c, hw, exact=bool(a.exact))
    else:
        from experiments.launch import run_cell, unavailable_reason

        cell = cell_from_args(a)
        reason = unavailable_reason(cell)

        def run(c):
            return run_cell(c, timeout_s=a.timeout)
    spec = search_spec_from_args(a, cell, a.emulate)
    rank0 = True if a.emulate else _init_torchrun()
    if reason is None:
        with _emulating() if a.emulate else contextlib.nullcontext():
            res = search_max_context(dataclasses.replace(cell, seq_len=spec.start), spec, run)
    else:  # as a sweep records it: no probes
        res = {"status": "skipped", "max_seq_len": None, "first_failing_seq_len": None,
               "granularity": cell.nproc * spec.block, "n_probes": 0, "error": reason,
               "probes": []}
    if rank0:
        probe_keys = ["seq_len", "status", "peak_device_bytes"] + (
            ["peak_host_bytes"] if a.emulate else [])
        probes = [{k: p.get(k) for k in probe_keys} for p in res["probes"]]
        out = summarize(cell, res, hw) | {"probes": probes}
        if a.json:
            _print_json(out)
        else:
            print(f"max_seq_len {out['max_seq_len']}  first_failing_seq_len "
                  f"{out['first_failing_seq_len']}  ({out['n_probes']} probes, {out['status']}"
                  f"{', ' + out['mode'] if a.emulate else ''})"
                  + (f"\n{out['error']}" if out["error"] else ""))
            if out.get("peak_device_bytes") is not None:
                print(f"at max_seq_len: peak device {out['peak_device_bytes'] / GiB:.2f} GiB, "
                      f"host {out['peak_host_bytes'] / GiB:.2f} GiB per rank")
    return 0 if res["status"] == "ok" else 1


def cmd_sweep(a) -> int:
    from experiments.runner import SweepRunner
    from experiments.sweeps import get_sweep

    sweeps = [get_sweep(n) for n in a.names]
    if a.nproc:
        sweeps = [s.with_overrides(nproc=a.nproc) for s in sweeps]
    if "WORLD_SIZE" in os.environ and any(s.scale == "emulated" for s in sweeps):
        raise ValueError("emulated sweeps run in one process (the emulator plays every rank): "
                         "run them without torchrun")
    status = 0
    for sweep in sweeps:
        bad = sweep.validate()
        if a.dry_run:
            cells, searches = sweep.cells(), sweep.search_cells()
            hw = "" if sweep.hardware is None else f", emulated on {sweep.hardware}"
            print(f"{sweep.name}: {len(cells)} cells, {len(searches)} max-context searches"
                  f"{hw} -> {a.out / sweep.name}/")
            for c in cells:
                print(f"  run    {c.cell_id()}")
            for c in searches:
                print(f"  search {c.cell_id()}  (from {c.seq_len} tokens)")
            for c, err in bad:
                print(f"  INVALID {c.cell_id()}: {err}")
            status |= 2 if bad else 0
            continue
        rank0 = _init_torchrun()
        with _emulating() if sweep.scale == "emulated" else contextlib.nullcontext():
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
                print(f"  {name:50s} [{detail['scale']}] {detail['description']}")
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
    add_cell_args(run)
    run.set_defaults(fn=cmd_run)
    em = sub.add_parser("emulate", help="emulate one cell at paper scale (no GPU needed)")
    add_cell_args(em, dtype="bf16", nproc_default=f"{EMULATED_WORLD}, one node of the paper",
               measured=False)
    add_world_args(em)
    add_hardware_args(em)
    em.set_defaults(fn=cmd_emulate)
    mc = sub.add_parser("max-context", help="search the longest context that trains")
    add_cell_args(mc, dtype=None)
    add_world_args(mc)
    mc.add_argument("--start", type=size, default=None,
                    help="first length (default --seq-len; with --emulate 1M, rounded to the "
                         "granularity)")
    mc.add_argument("--block", type=size, default=None,
                    help="granularity = nproc * block (default 512)")
    mc.add_argument("--granularity", type=size, default=None, metavar="TOKENS",
                    help="global tokens between the last passing and the first failing length"
                         " (default nproc * --block; with --emulate 64K)")
    mc.add_argument("--limit", type=size, default=2**24, help="longest length probed")
    mc.add_argument("--emulate", action="store_true",
                    help="probe with the emulator against the emulated hardware instead of "
                         f"running (--dtype defaults to bf16, --world to {EMULATED_WORLD})")
    add_hardware_args(mc, required="--emulate")
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
