"""UPipe's chunked attention backward (``upipe.chunked``) against one kernel call, on a GPU.

One UPipe stage at U = C holds one query head and its KV head over the full sequence on each
rank: B = 1, H = Hkv = 1, D = 128, bf16, causal. Per length S and chunk: the backward's time
(median of ``--reps`` after a warm-up, CUDA-synchronised wall clock), the allocator's peak above
the inputs while it runs, and the largest difference of dq, dk, dv from the one-call backward
(in units of that gradient's largest magnitude). Written to ``<out>/rows.csv`` and ``env.json``:

    python -m experiments.gpu.gpu_chunk_bench --out results/chunked_backward_gpu  # a GPU

The kernel is ``sdpa`` (PyTorch's flash backend), what ``kernel="auto"`` picked when the
committed results/chunked_backward_gpu was measured (``auto`` now picks ``cudnn`` on Hopper).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import pandas as pd
import torch

from experiments.provenance import provenance
from experiments.store import write_json
from upipe.chunked import chunked_attention_backward
from upipe.kernels import attention_backward, attention_forward


def _timed(fn, reps: int) -> tuple[float, int, object]:
    """(median seconds, peak allocated bytes above the start, last result) of ``fn()``."""
    fn()  # warm-up
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times, res = [], None
    for _ in range(reps):
        res = None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), torch.cuda.max_memory_allocated() - base, res


def bench(seq_len: int, chunks: list[int], reps: int) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (1, seq_len, 1, 128)
    q, k, v, dout = (torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    kw = dict(causal=True, kernel="sdpa")
    t_fwd, _, (out, lse) = _timed(lambda: attention_forward(q, k, v, **kw), reps)
    t_ref, m_ref, ref = _timed(lambda: attention_backward(dout, q, k, v, out, lse, **kw), reps)
    rows = [{"seq_len": seq_len, "chunk": None, "fwd_s": t_fwd, "bwd_s": t_ref,
             "bwd_over_one_call": 1.0, "bwd_peak_bytes": m_ref}]
    for c in chunks:
        def run(c=c):
            dk = torch.zeros(shape, device="cuda", dtype=torch.float32)
            dv = torch.zeros_like(dk)
            dq = chunked_attention_backward(dout, q, k, v, out, lse, dk, dv, chunk=c, **kw)
            return dq, dk, dv

        t, m, (dq, dk, dv) = _timed(run, reps)
        diff = {f"max_diff_{n}": ((a.float() - b.float()).abs().max()
                                  / b.float().abs().max()).item()
                for n, a, b in (("dq", dq, ref[0]), ("dk", dk, ref[1]), ("dv", dv, ref[2]))}
        rows.append({"seq_len": seq_len, "chunk": c, "fwd_s": t_fwd, "bwd_s": t,
                     "bwd_over_one_call": t / t_ref, "bwd_peak_bytes": m, **diff})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("results/chunked_backward_gpu"))
    p.add_argument("--seq-lens", default="131072,524288")
    p.add_argument("--chunks", default="65536,131072")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device (none present)")
    rows = []
    for s in map(int, args.seq_lens.split(",")):
        rows += bench(s, [int(c) for c in args.chunks.split(",")], args.reps)
        for r in rows[-3:]:
            print({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()},
                  flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    df = pd.DataFrame(rows)
    df["device"] = torch.cuda.get_device_name()
    df.to_csv(args.out / "rows.csv", index=False)
    write_json(args.out / "env.json", {
        "command": f"python -m experiments.gpu.gpu_chunk_bench --out {args.out} "
                   f"--seq-lens {args.seq_lens} --chunks {args.chunks} --reps {args.reps}",
        **provenance()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
