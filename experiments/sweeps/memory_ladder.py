"""The memory ladder: what each level of the memory stack saves, for Ulysses and UPipe, at one
length (stacked bars of model states / attention / other, and host bytes); and the memory wall,
the paper's figure of the same at 3M tokens: FSDP only (no CP: each of the 8 GPUs holds a whole
sequence, FSDP over 8 data-parallel ranks), + Ulysses, + activation checkpointing, + offload,
ALST, UPipe -- each bar model / attention / other, the rungs over the device drawn with the GiB
they would need.
"""

from experiments.config import Sweep
from experiments.sweeps.table3_llama3_8b_h100x8 import TITAN

STACKS = ["none", "ac", "offload", "alst"]
METHODS = [{"method": "ulysses"}, {"method": "upipe"}]

# The paper's rungs, bottom to top (its figure; experiments/reporting/ablation_plots.py
# ladder_rung), with the paper's Ulysses: yunchang's USP at ring degree 1 (usp-ulysses)
WALL_RUNGS = [
    {"method": "usp-ulysses", "stack": "none", "nproc": 1, "dp": 8},  # FSDP only
    {"method": "usp-ulysses", "stack": "none"},
    {"method": "usp-ulysses", "stack": "ac"},
    {"method": "usp-ulysses", "stack": "offload"},
    {"method": "usp-ulysses", "stack": "alst"},
    {"method": "upipe", "stack": "alst"},
]
CPU_WALL_RUNGS = [r | {"dp": 4} if r.get("nproc") == 1 else r for r in WALL_RUNGS]

SWEEPS = [
    Sweep(
        name="memory_wall_llama3_8b_h100x8",
        description="Llama3-8B, 8x H100, 3M tokens: the memory wall, rung by rung",
        scale="paper",
        base={"model": "llama3-8b", "nproc": 8, "seq_len": 3 * 2**20, "dtype": "bf16",
              "warmup": 2, "iters": 4} | TITAN,
        axes={"variant": WALL_RUNGS},
        plots=("memory_wall",),
    ),
    Sweep(
        name="memory_wall_llama3_8b_h100x8-cpu",
        description="CPU counterpart of the memory wall: tiny preset, 4 gloo ranks, 4K tokens",
        scale="cpu",
        base={"model": "tiny", "nproc": 4, "seq_len": 4096, "dtype": "fp32",
              "warmup": 1, "iters": 1},
        axes={"variant": CPU_WALL_RUNGS},
        plots=("memory_wall",),
        timeout_s=900,
    ),
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
