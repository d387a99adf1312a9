"""One attention layer, forward and backward, per CP method (no paper table).

The ``attention`` workload of the main harness (``experiments.harness.attention_layer``): each
method's attention alone, Llama3-8B's heads (32 query, 8 KV) at a CPU-sized width (head dim
64, dim 2048; the ``bench-attn`` preset), fp32, 4 gloo ranks, at 16K and 64K tokens. Its rows
have the sweep rows' columns (tokens/s per GPU from the slowest rank's median step, peak device
memory, the attention's share of it), so they compare with them.

The cells are the ones measured on 2026-11-22 (two runs: UPipe and Ulysses first, the ring
family and FPDT after), each with the warm-up and timed steps it ran with: one step at 64K
tokens (about 7 to 10 minutes a cell on 2 cores), so the memory of those rows comes from their
one, timed, step (``memory_from``).
"""

from experiments.config import Sweep

LAYER = {"workload": "attention", "model": "bench-attn", "nproc": 4, "dtype": "fp32",
         "stack": "none"}
FIRST_16K = {"seq_len": "16K", "warmup": 1, "iters": 3}
LATER_16K = {"seq_len": "16K", "warmup": 1, "iters": 1}
AT_64K = {"seq_len": "64K", "warmup": 0, "iters": 1}
UPIPE_AND_ULYSSES = [{"method": "ulysses"}, {"method": "ds-ulysses"},
                     {"method": "upipe", "heads_per_stage": 4},
                     {"method": "upipe", "heads_per_stage": 8}]
RING_FAMILY = [{"method": "ring"}, {"method": "zigzag-ring"},
               {"method": "fpdt", "chunk_size": "4K"}]
LATER_16K_ONLY = [{"method": "ulysses"}, {"method": "upipe", "heads_per_stage": 4},
                  {"method": "usp", "ring_degree": 2}, {"method": "upipe", "ring_degree": 2}]

SWEEPS = [
    Sweep(
        name="bench_attention",
        description="One attention layer (forward + backward) per CP method: time and memory "
                    "per rank, 4 gloo ranks, 16K and 64K tokens",
        scale="cpu",
        base=LAYER,
        axes={"cell": [m | FIRST_16K for m in UPIPE_AND_ULYSSES]
              + [m | AT_64K for m in UPIPE_AND_ULYSSES + RING_FAMILY]
              + [m | LATER_16K for m in LATER_16K_ONLY + RING_FAMILY]},
        plots=("throughput_vs_ulysses",),
        timeout_s=1800,
    ),
]
