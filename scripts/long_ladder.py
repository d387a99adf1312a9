"""The ladder to 8M tokens on one node: UPipe, Llama3-8B, 8x H100 80 GB, 2 TB host, emulated.

Each rung adds one of the mechanisms of the ``long`` stack level (experiments/config/stack.py)
or UPipe's chunked attention backward to the rung before, starting from the paper's ALST stack
(the last rung is what the library ships: the ``long`` level with 64K-token chunks);
per rung: the emulated peak at 8M tokens per rank, the phase it is in and its split, the host
peak, and the longest context that fits (a max-context search on the emulator, FlashAttention-3
as the paper ran it). The intermediate rungs are stack levels registered in this process only.

    python scripts/long_ladder.py [--seq-len 8M] [--model llama3-8b] [--gpus 8]
"""

from __future__ import annotations

import argparse
import dataclasses

from experiments.config import (
    EMULATED_GRANULARITY,
    STACKS,
    Cell,
    GiB,
    format_size,
    parse_size,
)
from experiments.config.search import SearchSpec
from experiments.emulation.emulate import PAPER_NODE, emulate_cell
from experiments.runner.executor import Emulator
from experiments.runner.plan import LONG_CHUNK
from experiments.runner.search import run_search

RUNGS = [  # (label, stack fields over ALST, UPipe options)
    ("ALST (the paper's stack)", {}, {}),
    ("+ first block's input offloaded", {"offload_first": True}, {}),
    ("+ input norm fused into UPipe", {"offload_first": True, "fuse_norm": True}, {}),
    (f"+ chunked attention backward ({format_size(LONG_CHUNK)})",
     {"offload_first": True, "fuse_norm": True}, {"chunk_size": LONG_CHUNK}),
    ("+ residual FFN tiled in place (= the long level)",
     {"offload_first": True, "fuse_norm": True, "residual_ffn": True},
     {"chunk_size": LONG_CHUNK}),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", default="8M")
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--gpus", type=int, default=8)
    a = p.parse_args()
    seq = parse_size(a.seq_len)
    print(f"| rung | device peak at {a.seq_len} (GiB) | peak phase | model / attention / other "
          f"(GiB) | host at {a.seq_len} (GiB/rank) | max context (what the next length is over) |")
    print("|---|---|---|---|---|---|")
    for i, (label, fields, options) in enumerate(RUNGS):
        name = f"ladder-{i}"
        STACKS[name] = dataclasses.replace(STACKS["alst"], **fields)
        cell = Cell(method="upipe", model=a.model, seq_len=seq, nproc=a.gpus, dtype="bf16",
                    stack=name, kernel="fa3", **options)
        row = emulate_cell(cell, PAPER_NODE)
        res = run_search(Emulator(PAPER_NODE), dataclasses.replace(cell, seq_len=2**20),
                         SearchSpec(start=2**20, block=EMULATED_GRANULARITY // a.gpus,
                                    limit=2**25))
        best, bad = res.get("max_seq_len"), res.get("first_failing_seq_len")
        why = next((q.get("error", "") for q in res["probes"] if q.get("seq_len") == bad), "")
        split = " / ".join(f"{row.get(f'peak_{k}_bytes', 0) / GiB:.2f}"
                           for k in ("model", "attention", "other"))
        # a fit whose phases are not affine in the length predicts other lengths wrongly
        # (emulation.fit): its search is not to be trusted, and the row says so
        shaky = ", ".join(row.get("fit_nonaffine_phases") or [])
        print(f"| {label} | {row['peak_device_bytes'] / GiB:.2f} ({row['status']}) | "
              f"{row.get('peak_phase')} | {split} | {row['peak_host_bytes'] / GiB:.1f} | "
              f"{format_size(best) if best else '-'} ({why.split(' >')[0] or 'the search limit'})"
              + (f"; fit not affine in: {shaky}" if shaky else "") + " |", flush=True)


if __name__ == "__main__":
    main()
