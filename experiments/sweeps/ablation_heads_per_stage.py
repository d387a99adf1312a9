"""Chunk-size ablation: UPipe's heads per stage U (a multiple of the CP degree) against
Ulysses (which is UPipe with every head in one stage, minus the staging).
"""

from experiments.config import Sweep

SWEEPS = [
    Sweep(
        name="ablation_heads_per_stage_llama3_8b_h100x8",
        description="Llama3-8B, 8x H100, 1M tokens: memory and tokens/s for U = 8, 16, 32",
        scale="paper",
        base={"model": "llama3-8b", "nproc": 8, "seq_len": 2**20, "stack": "alst",
              "dtype": "bf16", "warmup": 2, "iters": 4},
        axes={"variant": [{"method": "ulysses"}] + [
            {"method": "upipe", "heads_per_stage": u} for u in (8, 16, 32)]},
        plots=("heads_per_stage",),
    ),
    Sweep(
        name="ablation_heads_per_stage_llama3_8b_h100x8-cpu",
        description="CPU counterpart of the U ablation: tiny-wide (16 heads), 4 ranks, 4K tokens",
        scale="cpu",
        base={"model": "tiny-wide", "nproc": 4, "seq_len": 4096, "stack": "alst",
              "dtype": "fp32", "warmup": 1, "iters": 2},
        axes={"variant": [{"method": "ulysses"}] + [
            {"method": "upipe", "heads_per_stage": u} for u in (4, 8, 16)]},
        plots=("heads_per_stage",),
        timeout_s=900,
    ),
]
