"""Table 4 of the paper: Qwen3-32B (Llama-style shapes, 64 heads over 8 KV heads) on 16 H100s
(two nodes, launched with torchrun). The methods of Table 3, plus the two-node hybrids over an
8 x 2 (Ulysses x ring) mesh: USP, and UPipe with ring attention over the ring axis -- the
paper's multi-node UPipe configuration. The CPU counterpart keeps the head structure (8 query
heads per KV head, more heads than ranks) and the hybrids as 2 x 2 on 4 ranks.
"""

from experiments.config import SearchSpec, Sweep
from experiments.sweeps.table3_llama3_8b_h100x8 import TITAN

# on Megatron-DeepSpeed, not TorchTitan: no TorchTitan RoPE table (TITAN: table3's)
DS_FPDT = {"method": "ds-fpdt", "chunk_size": "64K", "stack": "megatron-ds",
           "global_rope_table": False}

METHODS = [
    {"method": "torch-cp", "stack": "torchtitan"},
    {"method": "zigzag-ring"},
    {"method": "ulysses"},
    {"method": "ds-ulysses"},
    {"method": "fpdt", "chunk_size": "64K"},
    DS_FPDT,
    {"method": "usp", "ring_degree": 2},
    {"method": "upipe"},
    {"method": "upipe", "overlap": True},  # beyond the paper: upipe_overlap.py
    {"method": "upipe", "ring_degree": 2},
    {"method": "upipe", "ring_degree": 2, "overlap": True},
]
CPU_METHODS = [
    {"method": "torch-cp", "stack": "torchtitan"},
    {"method": "ulysses"},
    {"method": "usp", "ring_degree": 2},
    {"method": "upipe"},
    {"method": "upipe", "ring_degree": 2},
]
PLOTS = ("max_context", "memory_vs_seq", "throughput_vs_seq", "throughput_vs_ulysses")

SWEEPS = [
    Sweep(
        name="table4_qwen3_32b_h100x16",
        description="Qwen3-32B, 16x H100 (2 nodes): tokens/s per GPU, peak memory, max context",
        scale="paper",
        base={"model": "qwen3-32b", "nproc": 16, "stack": "alst", "dtype": "bf16",
              "warmup": 2, "iters": 8} | TITAN,
        axes={"variant": METHODS, "seq_len": ["128K", "256K", "512K", "1M", "2M", "3M", "4M"]},
        # The paper's Table 4 has two cells at 5M (both OOM): DeepSpeed's FPDT and UPipe 8x2.
        extra_cells=(DS_FPDT | {"seq_len": "5M"},
                     {"method": "upipe", "ring_degree": 2, "seq_len": "5M"}),
        search=SearchSpec(start=2**20, block=2**14, limit=2**23),
        plots=PLOTS,
    ),
    Sweep(
        name="table4_qwen3_32b_h100x16-cpu",
        description="CPU counterpart of Table 4: tiny-wide preset (16 heads, 2 KV), 4 gloo ranks,"
                    " hybrids as 2x2",
        scale="cpu",
        base={"model": "tiny-wide", "nproc": 4, "stack": "alst", "dtype": "fp32",
              "warmup": 1, "iters": 2},
        axes={"variant": CPU_METHODS, "seq_len": ["2K", "4K"]},
        plots=("memory_vs_seq", "throughput_vs_seq", "throughput_vs_ulysses"),
        timeout_s=900,
    ),
]
