"""One attention layer's forward+backward per CP method: time and peak memory per rank.

    python -m experiments.bench_attention --nproc 4 --seq-lens 16K,64K \
        --methods ulysses,ds-ulysses,upipe:U=C,upipe:U=2C --out results/bench_attention
    python -m experiments.bench_attention --methods ring,zigzag-ring,usp:R=2,upipe:R=2,fpdt:chunk=8K

A cell is (method, heads per stage, ring degree, FPDT chunk, sequence length, ranks, dtype,
kernel). Method options after a colon, comma-free and joined by ``+``: ``U=<n>|C|<n>C`` (UPipe's
heads per stage), ``R=<n>`` (ring axis of a (ring, ulysses) mesh for usp/upipe),
``chunk=<size>`` (FPDT's global chunk). Each cell runs in its
own freshly spawned gloo process group, so a failure (or an OOM kill) becomes a row with its
status and error text and the sweep goes on. Under torchrun (WORLD_SIZE set) the cells run in
that one group instead, one after another.

Per cell: ``--warmup`` iterations, then ``--iters`` timed ones; a barrier before each; the step
time is the slowest rank's (DESIGN.md §7), reported as median and p20/p80. Memory comes from
``experiments.memory.MemoryTracker`` on the first iteration (the warm-up one when there is one;
the tracker makes collectives synchronous, so it must not overlap the timed ones):
``peak_device_bytes`` is absolute (parameters, input and output gradient included),
``peak_attention_bytes`` is the peak above those; ``peak_host_bytes`` the host (offloaded) peak
(FPDT); all the max over ranks.

Rows are appended to ``<out>/rows.jsonl`` (one per cell, with provenance taken by the process
that ran the cell, and the machine's load average around it) and ``<out>/rows.csv`` is rewritten
from it after every cell.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import socket
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

import upipe
from experiments.config import parse_size
from experiments.memory import MemoryTracker
from experiments.provenance import provenance
from upipe.registry import get_method

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Shape:
    """The layer: Llama-3-8B-like heads at a CPU-sized width."""

    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 64
    dim: int = 2048


@dataclass(frozen=True)
class Cell:
    """One benchmark configuration; ``validate`` raises ValueError naming the field."""

    method: str
    heads_per_stage: int | None  # UPipe's U; None for other methods
    seq_len: int  # global tokens; each rank holds seq_len / nproc
    nproc: int
    dtype: str
    kernel: str
    ring_degree: int = 1  # usp/upipe: ring axis of the (ring, ulysses) mesh
    chunk_size: int | None = None  # fpdt: global tokens per chunk

    def options(self) -> dict:
        """The method's constructor options (the mesh is built on the ranks)."""
        opts = {"heads_per_stage": self.heads_per_stage, "chunk_size": self.chunk_size}
        return {k: v for k, v in opts.items() if v is not None}

    def validate(self, shape: Shape) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.seq_len % self.nproc:
            raise ValueError(f"seq_len ({self.seq_len}) must be divisible by nproc ({self.nproc})")
        get_method(self.method).check_config(
            shape.n_heads, shape.n_kv_heads, cp=self.nproc, ring_degree=self.ring_degree,
            seq_len=self.seq_len, **self.options(),
        )


def parse_method(spec: str, nproc: int) -> tuple[str, dict]:
    """'upipe:U=2C+R=2' -> ('upipe', {'heads_per_stage': 2*nproc, 'ring_degree': 2}).

    Options: ``U=<n>``, ``U=C``, ``U=<n>C`` (C = nproc / R, the all-to-all degree), ``R=<n>``,
    ``chunk=<size>`` (e.g. 8K).
    """
    name, _, opts = spec.partition(":")
    out: dict = {}
    for opt in filter(None, opts.split("+")):
        key, _, val = opt.partition("=")
        if key == "R" and val.isdigit():
            out["ring_degree"] = int(val)
        elif key == "chunk" and val:
            out["chunk_size"] = parse_size(val)
        elif key == "U" and (m := re.fullmatch(r"(\d*)(C?)", val)) and (m[1] or m[2]):
            out["U"] = (int(m[1] or 1), bool(m[2]))
        else:
            raise ValueError(
                f"method option must be U=<n>|C|<n>C, R=<n> or chunk=<size>, got {opt!r} "
                f"in {spec!r}"
            )
    if "U" in out:
        n, per_c = out.pop("U")
        out["heads_per_stage"] = n * (nproc // out.get("ring_degree", 1) if per_c else 1)
    return name, out


# ---------------------------------------------------------------------------------------------
# one cell, on every rank


def run_cell(cell: Cell, shape: Shape, warmup: int, iters: int) -> dict:
    """Build the method, run warm-up + timed steps; returns the cross-rank metrics (all ranks)."""
    dtype = DTYPES[cell.dtype]
    opts, group = cell.options(), dist.group.WORLD
    if cell.ring_degree > 1:
        opts["mesh"], group = init_device_mesh(
            "cpu", (cell.ring_degree, cell.nproc // cell.ring_degree),
            mesh_dim_names=("ring", "ulysses"),
        ), None
    torch.manual_seed(0)
    m = upipe.build_method(cell.method, shape.dim, shape.n_heads, shape.n_kv_heads,
                           shape.head_dim, group=group, causal=True,
                           kernel=cell.kernel, **opts).to(dtype)
    x = torch.randn(1, cell.seq_len // cell.nproc, shape.dim, dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)
    # provenance of the code this process actually imported (a commit may land mid-sweep)
    prov = provenance() if dist.get_rank() == 0 else {}

    def step() -> float:
        m.zero_grad(set_to_none=True)
        x.grad = None
        dist.barrier()
        t0 = time.perf_counter()
        m(x).backward(dy)
        return time.perf_counter() - t0

    times, mem = [], (0, 0, 0)
    for i in range(warmup + iters):
        if i == 0:
            with MemoryTracker() as mt:
                if hasattr(m, "host_context"):  # offloading methods: count their host bytes
                    m.host_context = mt.host
                mt.track(m, x, dy)
                base = mt.current_device_bytes
                dt = step()
            mem = (mt.peak_device_bytes, mt.peak_device_bytes - base, mt.peak_host_bytes)
        else:
            dt = step()
        if i >= warmup:
            times.append(dt)
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (times, mem))
    step_s = np.max([t for t, _ in per_rank], axis=0)  # slowest rank per step
    return {
        "time_median_s": float(np.median(step_s)),
        "time_p20_s": float(np.percentile(step_s, 20)),
        "time_p80_s": float(np.percentile(step_s, 80)),
        "tokens_per_s_per_rank": cell.seq_len / cell.nproc / float(np.median(step_s)),
        "peak_device_bytes": max(mm[0] for _, mm in per_rank),
        "peak_attention_bytes": max(mm[1] for _, mm in per_rank),
        "peak_host_bytes": max(mm[2] for _, mm in per_rank),
        "times_s": [float(t) for t in step_s],
        "memory_from": "warmup" if warmup else "timed",
    } | prov


def _spawned_rank(rank, cell, shape, warmup, iters, threads, port, queue):
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=cell.nproc, timeout=datetime.timedelta(hours=2))
    try:
        result = run_cell(cell, shape, warmup, iters)
        if rank == 0:
            queue.put(result)
    finally:
        dist.destroy_process_group()


def run_spawned(cell: Cell, shape: Shape, warmup: int, iters: int, threads: int) -> dict:
    """The cell in a fresh process group of ``cell.nproc`` spawned ranks; failures -> status."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    try:
        mp.start_processes(_spawned_rank, (cell, shape, warmup, iters, threads, port, queue),
                           nprocs=cell.nproc, join=True, start_method="spawn")
        return {"status": "ok", "error": ""} | queue.get()
    except mp.ProcessExitedException as e:  # killed: SIGKILL on CPU is the OOM killer
        return {"status": "oom" if e.signal_name == "SIGKILL" else "error", "error": str(e)}
    except Exception as e:  # a rank raised: its traceback is in the message
        status = "oom" if "MemoryError" in str(e) or "out of memory" in str(e) else "error"
        return {"status": status, "error": str(e)[-4000:]}


def run_in_torchrun(cell: Cell, shape: Shape, warmup: int, iters: int) -> dict:
    try:
        return {"status": "ok", "error": ""} | run_cell(cell, shape, warmup, iters)
    except Exception:
        return {"status": "error", "error": traceback.format_exc()[-4000:]}


# ---------------------------------------------------------------------------------------------
# sweep, rows, table


def method_label(row: dict) -> str:
    """'upipe:U=4', 'usp:R=2', 'fpdt:chunk=8192' -- the method and its non-default options."""
    opts = [f"{k}={int(row[c])}" for k, c in (("U", "heads_per_stage"), ("R", "ring_degree"),
                                               ("chunk", "chunk_size"))
            if c in row and not pd.isna(row[c]) and not (c == "ring_degree" and row[c] == 1)]
    return row["method"] + (":" + "+".join(opts) if opts else "")


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Compact table; UPipe (and every other method) relative to Ulysses at the same length."""
    metrics = ["time_median_s", "time_p20_s", "time_p80_s", "tokens_per_s_per_rank",
               "peak_device_bytes", "peak_attention_bytes"]
    df = df.reindex(columns=[*df.columns, *(c for c in metrics if c not in df)])
    extra = ("ring_degree", "chunk_size", "peak_host_bytes")
    df = df.reindex(columns=[*df.columns, *(c for c in extra if c not in df)])
    df["method"] = [method_label(r) for r in df.to_dict("records")]
    ref = df[(df.method == "ulysses") & (df.status == "ok")].set_index("seq_len")
    df["time_vs_ulysses"] = df.time_median_s / df.seq_len.map(ref.time_median_s)
    df["attn_mem_vs_ulysses"] = df.peak_attention_bytes / df.seq_len.map(ref.peak_attention_bytes)
    df["peak_MiB"] = df.peak_device_bytes / 2**20
    df["attn_MiB"] = df.peak_attention_bytes / 2**20
    df["host_MiB"] = df.peak_host_bytes.fillna(0) / 2**20
    cols = ["method", "seq_len", "status", "time_median_s", "time_p20_s", "time_p80_s",
            "tokens_per_s_per_rank", "peak_MiB", "attn_MiB", "host_MiB", "time_vs_ulysses",
            "attn_mem_vs_ulysses"]
    return df[cols].round(3)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=4, help="ranks (ignored under torchrun)")
    p.add_argument("--seq-lens", default="16K,64K", help="global lengths, e.g. 16K,64K,131072")
    p.add_argument("--methods", default="ulysses,ds-ulysses,upipe:U=C,upipe:U=2C",
                   help="registry names; upipe:U=C, U=2C or U=<n> set heads per stage")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--kernel", default="auto")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per rank (default OMP_NUM_THREADS, else cores / nproc)")
    p.add_argument("--out", type=Path, default=Path("results/bench_attention"))
    p.add_argument("--dry-run", action="store_true", help="validate and list the cells only")
    a = p.parse_args(argv)
    if a.iters < 1 or a.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")

    torchrun = "WORLD_SIZE" in os.environ
    if torchrun and not a.dry_run:
        dist.init_process_group("gloo", timeout=datetime.timedelta(hours=2))
        a.nproc = dist.get_world_size()
    threads = a.threads or int(os.environ.get("OMP_NUM_THREADS", 0)) or max(
        1, (os.cpu_count() or 1) // a.nproc)
    if torchrun:
        torch.set_num_threads(threads)
    shape = Shape()
    cells, rows = [], []
    seq_lens = [parse_size(s) for s in a.seq_lens.split(",")]
    for spec in a.methods.split(","):
        for seq in seq_lens:
            name, opts = parse_method(spec, a.nproc)
            cells.append(Cell(name, opts.pop("heads_per_stage", None), seq, a.nproc, a.dtype,
                              a.kernel, **opts))
    rank0 = not torchrun or a.dry_run or dist.get_rank() == 0
    write = rank0 and not a.dry_run
    run_id = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    prov = provenance() if rank0 else {}  # cells that ran overwrite it with their own
    if write:
        a.out.mkdir(parents=True, exist_ok=True)
    for cell in sorted(cells, key=lambda c: c.seq_len):  # short lengths first: early results
        try:
            cell.validate(shape)
        except ValueError as e:
            res = {"status": "invalid", "error": str(e)}
        else:
            reason = get_method(cell.method).unavailable_reason("cpu")
            res = {"status": "skipped", "error": reason} if reason else None
        if res is None:
            if a.dry_run:
                print("would run", cell)
                continue
            t0, load0 = time.monotonic(), os.getloadavg()[0]
            res = (run_in_torchrun(cell, shape, a.warmup, a.iters) if torchrun
                   else run_spawned(cell, shape, a.warmup, a.iters, threads))
            # load averages flag other work on the machine during the cell (timing noise)
            res |= {"wall_s": round(time.monotonic() - t0, 1), "load_1m_start": load0,
                    "load_1m_end": os.getloadavg()[0]}
        row = {"run_id": run_id, **asdict(cell), **asdict(shape), "batch": 1, "causal": True,
               "warmup": a.warmup, "iters": a.iters, "threads_per_rank": threads,
               "launcher": "torchrun" if torchrun else "spawn", **prov, **res}
        rows.append(row)
        if rank0:
            print(f"[{row['status']}] {method_label(row)} S={cell.seq_len}: "
                  f"{row.get('time_median_s', '-')} s  {row.get('error', '')[-300:]}", flush=True)
        if write:
            with open(a.out / "rows.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            pd.read_json(a.out / "rows.jsonl", lines=True).to_csv(a.out / "rows.csv", index=False)
    if rank0 and rows:
        with pd.option_context("display.width", 200, "display.max_columns", 20):
            print(summary(pd.DataFrame(rows)).to_string(index=False))
    if torchrun and not a.dry_run:
        dist.destroy_process_group()
    return 1 if any(r["status"] == "error" for r in rows) else 0  # oom/invalid are results


if __name__ == "__main__":
    raise SystemExit(main())
