"""The memory ladder: what each level of the memory stack saves, for Ulysses and UPipe, at one
length (stacked bars of model states / attention / other, and host bytes).
"""

from experiments.config import Sweep

STACKS = ["none", "ac", "offload", "alst"]
METHODS = [{"method": "ulysses"}, {"method": "upipe"}]

SWEEPS = [
    Sweep(
        name="memory_ladder_llama3_8b_h100x8",
        description="Llama3-8B, 8x H100, 256K tokens: peak memory per stack level",
        scale="paper",
        base={"model": "llama3-8b", "nproc": 8, "seq_len": 2**18, "dtype": "bf16",
              "warmup": 2, "iters": 4},
        axes={"variant": METHODS, "stack": STACKS},
        plots=("memory_ladder",),
    ),
    Sweep(
        name="memory_ladder_llama3_8b_h100x8-cpu",
        description="CPU counterpart of the memory ladder: tiny preset, 4 gloo ranks, 4K tokens",
        scale="cpu",
        base={"model": "tiny", "nproc": 4, "seq_len": 4096, "dtype": "fp32",
              "warmup": 1, "iters": 1},
        axes={"variant": METHODS, "stack": STACKS},
        plots=("memory_ladder",),
        timeout_s=900,
    ),
]
