"""``upipe-bench``: run or emulate one cell, a declared sweep, a max-context search; plot; list.

    upipe-bench run --method upipe --model tiny --seq-len 8K --nproc 4 --stack alst --json
    upipe-bench run --method usp --ring-degree 2 --nproc 4        # a 2 (ulysses) x 2 (ring) mesh
    upipe-bench run --method fpdt --chunk-size 1K --nproc 4
    upipe-bench run --method upipe --model bench-attn --workload attention --seq-len 16K
    upipe-bench max-context --method ulysses --model tiny --nproc 4 --budget-mib 96 --json
    upipe-bench emulate --method upipe --model llama3-8b --world 8 --seq-len 3M --json
    upipe-bench max-context --emulate --method upipe --model llama3-8b --world 8
    upipe-bench emulate --method usp --model qwen3-32b --mesh 8x2 --seq-len 1M
    upipe-bench emulate --method ulysses --model llama3-8b --dp 8 --seq-len 64K  # FSDP only
    upipe-bench sweep table3_llama3_8b_h100x8-cpu [--dry-run]
    upipe-bench plot table3_llama3_8b_h100x8-cpu
    upipe-bench list [methods|presets|stacks|sweeps] [--json]
    upipe-bench plan --model llama3-8b --gpus 8 --seq-len 4M [--hardware h100-sxm]
    upipe-bench calibrate --out my-node.json     # then: emulate ... --hardware my-node.json
    upipe-bench validate-time                    # emulated vs measured CPU step times

``--stack`` defaults to the stack the paper runs the method on (``config.paper_stack``:
``torchtitan`` for torch-cp, ``megatron-ds`` for ds-fpdt, ``alst`` for every other method), for
every command.

``emulate`` and ``max-context --emulate`` run the paper-scale emulator (``experiments.emulation``,
docs/design.md#emulation): one process plays one rank of a ``--world``-rank job on fake tensors and
reports the peak device and host bytes against the emulated hardware's budgets (``--gpu-mem`` minus
``--reserve``; ``--host-mem`` over the node's ranks), the breakdown, FLOPs and communication
per step, and the step's emulated time, tokens/s per GPU and MFU on a hardware profile
(``--hardware``, docs/design.md#the-time-model). No GPU is needed.

Output: stdout carries only the command's result (``--json``: one JSON object); everything
else, from this process, its ranks and the libraries they load (DeepSpeed's notices), goes to
stderr, with progress lines per step, probe and cell unless ``--json`` or ``--no-progress``.

Bad input (unknown method, preset, stack, sweep or override key; a length that does not
shard; an option the method does not take; a results directory in use; a result file that is
not valid) is reported with the rule and exit status 2 before any process starts. A method
that cannot run on this machine (``list methods`` says why) gives a ``skipped`` row, exit
status 1, without launching anything. Ctrl-C ends the command, and its ranks, with one line
(exit status 130). Under torchrun (``WORLD_SIZE`` set) the cells run in the launched process
group; every rank must be given the same command line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import io
import json
import os
import sys
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist

from experiments.cli_args import (
    EMULATED_WORLD,
    add_cell_args,
    add_hardware_args,
    add_plan_args,
    add_progress_arg,
    add_world_args,
    cell_from_args,
    hardware_from_args,
    launch_flag,
    launch_flags_given,
    out_dir,
    plan_spec_from_args,
    positive_int,
    search_from_args,
    seconds,
    size,
)
from experiments.config import (
    PRESETS,
    PROCESS_GROUP_TIMEOUT_S,
    STACKS,
    GiB,
    MiB,
    Status,
    format_size,
)
from experiments.config.options import declared
from experiments.gpu.time_validation_gpu import FOLDER as GPU_FOLDER
from experiments.gpu.time_validation_gpu import NoGPU, reprice, validate_gpu
from experiments.harness.interrupts import Terminated, terminating_signals_raise
from experiments.harness.ranks import exit_without_finalizing
from experiments.reporting.plots import draw_plots
from experiments.reporting.reproduction import mesh as paper_mesh
from experiments.reporting.tables import write_tables
from experiments.runner.executor import Emulator, Launcher
from experiments.runner.plan import inter_node_warning, plan
from experiments.runner.search import print_probe, run_search, summarize
from experiments.runner.sweep_runner import SweepRunner
from experiments.runner.time_validation import SWEEP as TIME_SWEEP
from experiments.runner.time_validation import validate_time
from experiments.store import read_json
from experiments.sweeps import SWEEPS, get_sweep
from experiments.timing.calibrate import calibrate, check_profile_path, write_profile
from upipe.kernels import KERNELS
from upipe.registry import available_methods, get_method

RESULTS = Path("results")


def _methods() -> dict[str, dict]:
    """Every registered method: whether it runs on this machine (else why), the options it
    takes and whether it runs on a (ring, ulysses) mesh (``--ring-degree``)."""
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    out = {}
    for name in available_methods():
        cls = get_method(name)
        reason = cls.unavailable_reason(device_type)
        out[name] = {"available": reason is None, "reason": reason, "device": device_type,
                     "options": list(declared(name))
                     + (["ring_degree"] if cls.supports_mesh else [])}
    return out


def _init_torchrun() -> bool:
    """Join the torchrun process group if launched by torchrun; True when this is rank 0."""
    if "WORLD_SIZE" not in os.environ:
        return True
    if not dist.is_initialized():
        backend = "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            backend = "nccl"
        else:  # DeepSpeed (tiled MLP, ds-ulysses) would probe for accelerators and warn
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        dist.init_process_group(backend,
                                timeout=datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S))
    return dist.get_rank() == 0


def _progress(a) -> bool:
    return not (getattr(a, "json", False) or a.no_progress)


def _print_json(a, obj) -> None:
    print(json.dumps(obj, default=str), file=a.stdout, flush=True)


def _print_row(a, row: dict, keys: list[str]) -> None:
    """``key value`` lines for the keys the row has; byte counts also in GiB."""
    for k in keys:
        v = row.get(k)
        if v in (None, "") or isinstance(v, dict) and not v:
            continue
        unit = ""
        if k.endswith("_bytes") and isinstance(v, int) and v:
            unit = f"  ({v / GiB:.2f} GiB)" if v >= GiB else f"  ({v / MiB:.2f} MiB)"
        print(f"{k:24s} {json.dumps(v) if isinstance(v, dict) else v}{unit}", file=a.stdout)


# cell_id first: it names what the other lines leave out (the method's options, overrides)
RUN_KEYS = ["status", "cell_id", "method", "seq_len", "doc_len", "nproc", "dp", "stack",
            "keep_blocks", "workload", "time_median_s", "tokens_per_s_per_gpu", "peak_device_bytes",
            "peak_host_bytes", "peak_model_bytes", "peak_attention_bytes", "peak_other_bytes",
            "error"]
EMULATE_KEYS = ["status", "cell_id", "method", "model", "seq_len", "doc_len", "nproc", "dp",
                "ring_degree", "stack", "keep_blocks", "dtype", "emulation", "peak_device_bytes",
                "peak_host_bytes", "peak_model_bytes", "peak_attention_bytes", "peak_other_bytes",
                "peak_phase", "device_budget_bytes", "host_budget_bytes", "host_pinned",
                "model_tflops_per_step", "comm_bytes_per_step", "comm_bytes_by_op",
                "hardware_profile", "step_time_s", "tokens_per_s_per_gpu", "mfu",
                "time_compute_s", "time_comm_exposed_s", "time_offload_exposed_s",
                "time_overhead_s", "emulation_s", "error"]


def cmd_run(a) -> int:
    cell = cell_from_args(a)
    rank0 = _init_torchrun()
    row = Launcher(launch_flag(a, "timeout"), progress=_progress(a), shared_gpu=a.shared_gpu
                   ).run(cell)
    if rank0:
        if a.json:
            _print_json(a, row)
        else:
            _print_row(a, row, RUN_KEYS)
    return 0 if row["status"] in Status.RESULTS else 1


def cmd_emulate(a) -> int:
    cell = cell_from_args(a, emulated=True)
    row = Emulator(hardware_from_args(a, cell.world), exact=bool(a.exact)).run(cell)
    if a.json:
        _print_json(a, row)
    else:
        _print_row(a, row, EMULATE_KEYS)
    return 0 if row["status"] in Status.RESULTS else 1


def cmd_max_context(a) -> int:
    given = launch_flags_given(a) if a.emulate else []
    if given:  # as the emulated hardware's flags are refused without --emulate
        raise ValueError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to a "
                         "real search only: max-context --emulate times no step and launches "
                         "nothing")
    cell, spec = search_from_args(a, emulate=a.emulate)
    hw = hardware_from_args(a, cell.world, enabled=a.emulate, why="max-context --emulate")
    if a.emulate:
        executor, rank0 = Emulator(hw, exact=bool(a.exact)), True
    else:
        executor = Launcher(launch_flag(a, "timeout"), progress=_progress(a))
        rank0 = _init_torchrun()
    on_probe = print_probe if _progress(a) and rank0 else None
    res = run_search(executor, cell, spec, on_probe)
    if rank0:
        probe_keys = ["seq_len", "status", "peak_device_bytes"] + (
            ["peak_host_bytes"] if a.emulate else [])
        probes = [{k: p.get(k) for k in probe_keys} for p in res["probes"]]
        out = summarize(cell, res, hw) | {"probes": probes}
        if a.json:
            _print_json(a, out)
        else:
            print(f"max_seq_len {out['max_seq_len']}  first_failing_seq_len "
                  f"{out['first_failing_seq_len']}  ({out['n_probes']} probes, {out['status']}"
                  f"{', ' + out['mode'] if a.emulate else ''})"
                  + (f"\n{out['error']}" if out["error"] else ""), file=a.stdout)
            if out["max_seq_len"] is not None and out.get("peak_device_bytes") is not None:
                print(f"at max_seq_len: peak device {out['peak_device_bytes'] / GiB:.2f} GiB, "
                      f"host {out['peak_host_bytes'] / GiB:.2f} GiB per rank", file=a.stdout)
    return 0 if res["status"] == Status.OK else 1


PLAN_COLUMNS = {  # row key -> column title of the plan table
    "method": "method", "mesh": "mesh", "heads_per_stage": "U", "overlap": "overlap",
    "chunk_size": "chunk", "stack": "stack", "kernel_ran": "kernel",
    "fits": "fits", "peak_device_gib": "device GiB", "peak_host_gib": "host GiB/rank",
    "tokens_per_s_per_gpu": "tokens/s/GPU", "mfu": "MFU", "step_time_s": "step s",
    "why": "why not",
}
WHY_CHARS = 60  # the table's "why not" column (--json has the whole error)


def _plan_line(row: dict) -> dict:
    """One plan row for the table: the configuration, whether it fits (else why), memory
    in GiB, throughput."""
    status, error = row["status"], (row.get("error") or "").splitlines()
    why = error[0] if error else ""
    if status == Status.OK:
        fits = "yes"
    elif status == Status.OOM:
        fits = "no: " + " and ".join(w for w in ("device", "host") if f"{w} peak" in why)
    elif "plan_inferred_from" in row:  # the error says from what (a lighter stack, a smaller U)
        fits = "no: device"
    else:
        fits = status
    # one decimal; two significant digits below 1 GiB (a small --gpu-mem), not a 0
    gib = {k: None if row.get(k) is None else (
        round(row[k] / GiB, 1) if row[k] >= GiB else float(f"{row[k] / GiB:.2g}"))
        for k in ("peak_device_bytes", "peak_host_bytes")}
    if row.get("peak_device_is_lower_bound"):  # a shallower step's host bytes: no prediction
        gib["peak_host_bytes"] = None
    u, dp = row.get("heads_per_stage"), row.get("dp", 1)
    mesh = paper_mesh(row["method"], row["nproc"], row.get("ring_degree", 1))  # UxR: 1x8 a ring
    return {"method": row["method"], "mesh": mesh if dp == 1 else f"{mesh} dp{dp}",
            "heads_per_stage": "-" if u is None else u,
            "overlap": "yes" if row.get("overlap") else "-",
            "chunk_size": format_size(row["chunk_size"]) if row.get("chunk_size") else "-",
            # attention (whole blocks) kept in the last k blocks only: "alst-attn-host k18"
            "stack": row["stack"] + (f" k{row['keep_blocks']}" if row.get("keep_blocks") else ""),
            "kernel_ran": row.get("kernel_ran") or "-",  # not run: none
            "fits": fits,
            "peak_device_gib": gib["peak_device_bytes"], "peak_host_gib": gib["peak_host_bytes"],
            "tokens_per_s_per_gpu": row.get("tokens_per_s_per_gpu"), "mfu": row.get("mfu"),
            "step_time_s": row.get("step_time_s"),
            "why": why if len(why) <= WHY_CHARS else why[:WHY_CHARS - 3] + "..."}


def _plan_number(v: float) -> str:
    """A plan table's number: three significant digits, thousands in full (7,210 s, 1,330
    tokens/s), never an exponent."""
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"


def cmd_plan(a) -> int:
    spec = plan_spec_from_args(a)
    hw = hardware_from_args(a, spec.gpus)
    done = []

    def progress(rows):
        done.extend(rows)
        if _progress(a):
            r = rows[0]
            ov = (" overlap" if r.get("overlap") else "") + (
                f" chunk {format_size(r['chunk_size'])}" if r.get("chunk_size") else "")
            print(f"[plan] {r['method']} {_plan_line(r)['mesh']} U={r.get('heads_per_stage')}{ov}: "
                  + ", ".join(f"{x['stack']} {x['status']}" for x in rows), file=sys.stderr)

    # what the times cannot be trusted for, said before the work and beside the answer
    warnings = [w for w in (inter_node_warning(spec, hw),) if w]
    for w in warnings if _progress(a) else ():
        print(f"[plan] warning: {w}", file=sys.stderr)
    rows = plan(spec, hw, workers=a.workers, exact=bool(a.exact), on_rows=progress)
    lines = [_plan_line(r) for r in rows]
    if a.json:
        # the whole question beside the answer (methods, stacks, ring degrees, dp, dtype, kernel,
        # a config.json's overrides), so a saved plan says what it was asked
        _print_json(a, {"model": spec.label, "gpus": spec.gpus, "seq_len": spec.seq_len,
                        "question": dataclasses.asdict(spec),
                        "hardware": dataclasses.asdict(hw), "warnings": warnings,
                        "plan": lines, "rows": rows})
    else:
        table = pd.DataFrame(lines).rename(columns=PLAN_COLUMNS)
        table.index = range(1, len(table) + 1)
        with pd.option_context("display.width", 250, "display.max_colwidth", WHY_CHARS,
                               "display.float_format", _plan_number):
            # a cpu device has no profile unless given: no time model, so no name to print
            where = rows[0].get("hardware_profile") or hw.profile or (
                "h100-sxm" if hw.device == "cuda" else "an emulated cpu device, no time model")
            notes = "".join(f"warning: {w}\n" for w in warnings)
            print(f"{notes}{spec.label} on {spec.gpus} GPUs at {spec.seq_len} tokens, {where}:\n"
                  f"{table.to_string()}", file=a.stdout)
    return 0 if any(r["status"] == Status.OK for r in rows) else 1


def cmd_calibrate(a) -> int:
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    nproc = a.nproc or (torch.cuda.device_count() if device == "cuda" else 2)
    if a.out is not None:  # refused now, not after the measuring it would lose
        try:
            check_profile_path(a.out)
        except ValueError as e:
            raise ValueError(f"--out must be a file path the profile can be written to: "
                             f"{e}") from None
    profile = calibrate(nproc=nproc, device=device, quick=a.quick, base=a.base)
    if a.out is not None:
        write_profile(profile, a.out)
        print(f"wrote {a.out} (use it with --hardware {a.out})", file=sys.stderr)
    if a.json or a.out is None:
        _print_json(a, profile)
    return 0


def _add_shared_gpu_arg(parser) -> None:
    parser.add_argument("--shared-gpu", action="store_true",
                        help="every rank on one GPU with gloo (the multi-rank GPU path without a "
                             "multi-GPU machine; methods sending K/V by P2P are refused); rows "
                             "say shared_gpu, their times are no speed result")


def _named_path(text: str) -> tuple[str, Path]:
    """NAME=PATH of ``--profile``."""
    name, sep, path = text.partition("=")
    if not sep or not name.isidentifier() or not path:
        raise ValueError(f"--profile: must be NAME=PATH.json (NAME a word), got {text!r}")
    return name, Path(path)


def cmd_validate_time(a) -> int:
    if (a.reprice or a.profile or a.kernel) and a.device != "cuda":
        raise ValueError("--reprice, --profile and --kernel are for --device cuda (a GPU "
                         "run's cells priced again)")
    if (a.profile or a.kernel) and not a.reprice:
        raise ValueError("--profile and --kernel price a finished run's cells: give --reprice "
                         "too")
    if a.device == "cuda":
        return _validate_time_gpu(a)
    if a.quick:
        raise ValueError("--quick is for --device cuda (the CPU validation's calibration is "
                         "its full grid)")
    summary = validate_time(get_sweep(TIME_SWEEP), a.out, recalibrate=a.calibrate,
                            progress=_progress(a))
    if a.json:
        _print_json(a, summary)
    else:
        print(f"{summary['cells']} cells: median |error| {summary['median_abs_error']:.1%}, "
              f"worst {summary['worst_abs_error']:.1%} ({summary['worst_cell']}); targets "
              f"{'met' if summary['meets_targets'] else 'not met'}", file=a.stdout)
    return 0


def _dry_run(a, sweep, runner: SweepRunner) -> int:
    """List what the sweep would do with each cell, run nothing; 2 when a cell is invalid."""
    cells, searches, bad = sweep.cells(), sweep.search_cells(), sweep.validate()
    hw = "" if sweep.hardware is None else f", emulated on {sweep.hardware}"
    print(f"{sweep.name}: {len(cells)} cells, {len(searches)} max-context searches"
          f"{hw} -> {runner.dir}/", file=a.stdout)
    for c in cells:
        print(f"  {runner.action(c):8s} {c.cell_id()}", file=a.stdout)
    for c in searches:
        print(f"  search   {c.cell_id()}  (from {c.seq_len} tokens)", file=a.stdout)
    for c, err in bad:
        print(f"  INVALID  {c.cell_id()}: {err}", file=a.stdout)
    return 2 if bad else 0


def _targets_word(met: bool | None) -> str:
    """How a GPU validation summary's ``meets_targets`` reads."""
    return {True: "targets met", False: "targets not met"}.get(met, "no targets for this name")


def _validate_time_gpu(a) -> int:
    try:
        if a.reprice:
            more = dict(_named_path(x) for x in a.profile)
            summary = reprice(a.out / GPU_FOLDER, more, kernel=a.kernel,
                              progress=_progress(a))
        else:
            summary = validate_gpu(a.out, quick=a.quick, progress=_progress(a))
    except NoGPU as e:
        print(f"upipe-bench validate-time: {e}", file=sys.stderr)
        return 2
    if a.json:
        _print_json(a, summary)
    else:
        for p in ("shipped", "calibrated", *(_named_path(x)[0] for x in a.profile)):
            if p in summary:
                s = summary[p]
                print(f"{p} profile: {s['cells']} cells, median |error| "
                      f"{s['median_abs_error']:.1%}, worst {s['worst_abs_error']:.1%} "
                      f"({s['worst_cell']}); {_targets_word(s['meets_targets'])}",
                      file=a.stdout)
    return 0


def cmd_sweep(a) -> int:
    sweeps = [get_sweep(n) for n in a.names]
    if a.nproc:
        # a paper-scale (or emulated) sweep's folder names its GPUs (h100x16): run on fewer, its
        # rows would be another experiment under that name
        named = [f"{s.name} ({s.base['nproc']})" for s in sweeps
                 if s.scale != "cpu" and s.base["nproc"] != a.nproc]
        if named:
            raise ValueError(f"--nproc {a.nproc}: these sweeps run on the GPUs they name, not "
                             f"{a.nproc}: {', '.join(named)}; more GPUs than a node has run "
                             "under torchrun --nnodes N, without --nproc")
        sweeps = [s.with_overrides(nproc=a.nproc) for s in sweeps]
    if "WORLD_SIZE" in os.environ and any(s.scale == "emulated" for s in sweeps):
        raise ValueError("emulated sweeps run in one process (the emulator plays every rank): "
                         "run them without torchrun")
    status = 0
    for sweep in sweeps:
        runner = SweepRunner(sweep, a.out, retry_failed=a.retry_failed,
                             progress=not a.no_progress, timeout_s=a.timeout,
                             shared_gpu=a.shared_gpu)
        if a.dry_run:
            status |= _dry_run(a, sweep, runner)
            continue
        rank0 = _init_torchrun()
        paths = runner()
        if rank0:
            print(f"{sweep.name}: done", file=a.stdout)
            for name, path in paths.items():
                print(f"  {name:24s} {path}", file=a.stdout)
    return status


def cmd_plot(a) -> int:
    d = Path(a.target)
    if not d.is_dir():
        d = a.out / a.target
    if not (d / "sweep.json").exists():
        raise ValueError(f"target must be a sweep directory with sweep.json, got {a.target!r}")
    paths = write_tables(d) | draw_plots(d, read_json(d / "sweep.json")["plots"])
    for name, path in paths.items():
        print(f"{name:24s} {path}", file=a.stdout)
    return 0


def cmd_list(a) -> int:
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
        _print_json(a, catalog)
        return 0
    for what, items in catalog.items():
        print(f"{what}:", file=a.stdout)
        for name, detail in items.items():
            if what == "sweeps":
                line = f"  {name:50s} [{detail['scale']}] {detail['description']}"
            elif what in ("presets", "stacks"):
                line = f"  {name:12s} " + " ".join(f"{k}={v}" for k, v in detail.items())
            else:
                opts = f"  (options: {', '.join(detail['options'])})" if detail["options"] else ""
                where = "runs" if detail["available"] else "unavailable"
                line = f"  {name:12s} {where} on {detail['device']}{opts}"
                if detail["reason"]:
                    line += f"\n  {'':12s}   {detail['reason']}"
            print(line, file=a.stdout)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="upipe-bench", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run one cell")
    add_cell_args(run)
    _add_shared_gpu_arg(run)
    run.set_defaults(fn=cmd_run)
    em = sub.add_parser("emulate", help="emulate one cell at paper scale (no GPU needed)")
    add_cell_args(em, dtype="bf16", nproc_default=f"{EMULATED_WORLD}, one node of the paper",
                  measured=False)
    add_world_args(em)
    add_hardware_args(em)
    em.set_defaults(fn=cmd_emulate)
    mc = sub.add_parser("max-context", help="search the longest context that trains")
    add_cell_args(mc, dtype=None, iters_default=0)  # a search's probes: memory only
    add_world_args(mc)
    mc.add_argument("--start", type=size, default=None,
                    help="first length (default --seq-len; with --emulate 1M, rounded to the "
                         "granularity)")
    mc.add_argument("--block", type=size, default=None,
                    help="granularity = nproc * block (default 512)")
    mc.add_argument("--granularity", type=size, default=None, metavar="TOKENS",
                    help="global tokens between the last passing and the first failing length"
                         " (default nproc * --block; with --emulate 64K)")
    mc.add_argument("--limit", type=size, default=2**24,
                    help="longest length probed (default 16M; not below --start)")
    mc.add_argument("--emulate", action="store_true",
                    help="probe with the emulator against the emulated hardware instead of "
                         f"running (--dtype defaults to bf16, --world to {EMULATED_WORLD})")
    add_hardware_args(mc, required="--emulate")
    mc.set_defaults(fn=cmd_max_context)
    pn = sub.add_parser("plan", help="what fits on a cluster and how fast: every method, "
                                     "stack, mesh and U, emulated and ranked")
    add_plan_args(pn)
    add_hardware_args(pn)
    pn.set_defaults(fn=cmd_plan)
    ca = sub.add_parser("calibrate", help="measure a hardware profile of this machine for the "
                                          "time model (--hardware PATH)")
    ca.add_argument("--out", type=Path, default=None, help="write the profile here (JSON)")
    ca.add_argument("--nproc", type=positive_int, default=None,
                    help="ranks timing at once, and measuring collectives among them (default: "
                         "2 on CPU, the GPUs on CUDA)")
    ca.add_argument("--device", choices=["cuda", "cpu"], default=None,
                    help="default cuda when available")
    ca.add_argument("--base", default=None, metavar="NAME|PATH.json",
                    help="shipped profile for what one node cannot measure (inter-node links)")
    ca.add_argument("--quick", action="store_true", help="a small grid (seconds)")
    ca.add_argument("--json", action="store_true", help="print the profile on stdout")
    ca.set_defaults(fn=cmd_calibrate)
    vt = sub.add_parser("validate-time", help="the time model against real runs on this CPU "
                                              "(or GPU: --device cuda): calibrate, measure, "
                                              "predict, compare")
    vt.add_argument("--out", type=out_dir, default=RESULTS,
                    help=f"results root (writes <out>/{TIME_SWEEP}/, with --device cuda "
                         "<out>/time_validation_gpu/; default results)")
    vt.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cpu (default): 2-rank gloo runs of the time_validation_cpu sweep; "
                         "cuda: Llama3-8B-shaped cells on this one GPU (about 5 minutes on an "
                         "H100), exit 2 without one")
    vt.add_argument("--quick", action="store_true",
                    help="with --device cuda: calibrate on the small grid")
    vt.add_argument("--calibrate", action="store_true",
                    help="measure the profile again even if the directory has one")
    vt.add_argument("--reprice", action="store_true",
                    help="with --device cuda: price the finished run in "
                         "<out>/time_validation_gpu/ again with the code and profiles as they "
                         "stand (no GPU needed; the measured columns are kept)")
    vt.add_argument("--profile", action="append", default=[], metavar="NAME=PATH.json",
                    help="with --reprice: one more profile to price the cells on (repeatable)")
    vt.add_argument("--kernel", choices=[k for k in KERNELS if k != "auto"],
                    help="with --reprice: the attention kernel the cells ran, for a run whose "
                         "rows.csv has no kernel column (runs before it)")
    vt.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_progress_arg(vt)
    vt.set_defaults(fn=cmd_validate_time)
    sw = sub.add_parser("sweep", help="run declared sweeps into <out>/<name>/")
    sw.add_argument("names", nargs="+", help="sweep names (upipe-bench list sweeps)")
    sw.add_argument("--dry-run", action="store_true",
                    help="expand and validate, say what each cell would do (run, resume, "
                         "retry), run nothing")
    sw.add_argument("--out", type=out_dir, default=RESULTS,
                    help="results root; each sweep writes <out>/<name>/ (default results)")
    sw.add_argument("--nproc", type=positive_int, default=None,
                    help="the CPU sweeps' rank count; a paper-scale or emulated sweep takes "
                         "only the GPU count it names (h100x8: 8)")
    _add_shared_gpu_arg(sw)
    sw.add_argument("--retry-failed", action="store_true",
                    help="re-run cells whose row is an error or a timeout (others resume)")
    sw.add_argument("--timeout", type=seconds, default=None,
                    help="seconds per cell (default: the sweep's)")
    add_progress_arg(sw, has_json=False)
    sw.set_defaults(fn=cmd_sweep)
    pl = sub.add_parser("plot", help="rebuild a sweep's tables and plots from its runs, run "
                                     "nothing")
    pl.add_argument("target", help="sweep name or directory")
    pl.add_argument("--out", type=out_dir, default=RESULTS,
                    help="results root a sweep name is looked up in (default results)")
    pl.set_defaults(fn=cmd_plot)
    ls = sub.add_parser("list", help="methods, presets, stacks, sweeps")
    ls.add_argument("what", nargs="?", choices=["methods", "presets", "stacks", "sweeps"],
                    help="one catalogue (default: all)")
    ls.add_argument("--json", action="store_true", help="print one JSON object")
    ls.set_defaults(fn=cmd_list)
    return p


@contextlib.contextmanager
def _command_output():
    """The stream for the command's result, while everything else written to stdout goes to
    stderr: at the file-descriptor level, so that libraries holding the original stdout (
    DeepSpeed's loggers) and child processes write to stderr too. Where stdout is not file
    descriptor 1 (captured by a test harness), it is kept for the result and Python-level
    writes are redirected."""
    sys.stdout.flush()
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        fd = None
    if fd != 1:
        out = sys.stdout
        with contextlib.redirect_stdout(sys.stderr):
            yield out
        return
    saved = os.dup(1)
    os.dup2(2, 1)
    out = os.fdopen(saved, "w")
    try:
        yield out
    finally:
        out.flush()
        sys.stdout.flush()
        os.dup2(saved, 1)
        out.close()


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        with terminating_signals_raise(), _command_output() as a.stdout:
            code = a.fn(a)
    except ValueError as e:  # bad input: name the field and the rule, no traceback
        print(f"upipe-bench {a.cmd}: error: {e}", file=sys.stderr)
        code = 2
    except Terminated as e:  # SIGTERM / SIGHUP: the launcher has ended the ranks, as on Ctrl-C
        print(f"upipe-bench {a.cmd}: terminated ({e})", file=sys.stderr)
        code = 128 + e.signum  # the shell's status for a process ended by that signal
    except KeyboardInterrupt:  # the launcher has ended the ranks; one line, not tracebacks
        print(f"upipe-bench {a.cmd}: interrupted", file=sys.stderr)
        code = 130
    if "WORLD_SIZE" in os.environ and dist.is_initialized():
        # under torchrun this process joined the group (_init_torchrun): end it as a launched
        # rank ends (harness.ranks.exit_without_finalizing says why)
        if code == 0:
            dist.barrier()
        dist.destroy_process_group()
        exit_without_finalizing(code)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
