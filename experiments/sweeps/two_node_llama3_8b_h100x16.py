"""The paper's two-node figure: Llama3-8B on 16 H100s (two nodes of 8), USP 8x2 against UPipe
8x2 -- peak memory per GPU and UPipe's tokens/s relative to USP's, 512K to 8M tokens.

Both methods on Table 4's 8 (Ulysses) x 2 (ring) mesh and its stack (ALST): USP with ring
attention over the ring axis, and UPipe with ring attention over the ring axis -- the paper's
multi-node UPipe configuration (``table4_qwen3_32b_h100x16``). The figure's lengths, with 1M
added between 512K and 2M. The CPU counterpart keeps the two hybrids as 2 x 2 on 4 ranks.
The figure's numbers: ``experiments/reporting/paper_tables.PAPER_TWO_NODE``.
"""

from experiments.config import Sweep
from experiments.sweeps.table3_llama3_8b_h100x8 import TITAN

METHODS = [
    {"method": "usp", "ring_degree": 2},
    {"method": "upipe", "ring_degree": 2},
]

SWEEPS = [
    Sweep(
        name="two_node_llama3_8b_h100x16",
        description="Llama3-8B, 16x H100 (2 nodes): USP 8x2 vs UPipe 8x2, peak memory and "
                    "tokens/s per GPU, 512K-8M tokens",
        scale="paper",
        base={"model": "llama3-8b", "nproc": 16, "stack": "alst", "dtype": "bf16",
              "warmup": 2, "iters": 8} | TITAN,
        axes={"variant": METHODS, "seq_len": ["512K", "1M", "2M", "4M", "6M", "8M"]},
        plots=("memory_vs_seq", "throughput_vs_seq"),
    ),
    Sweep(
        name="two_node_llama3_8b_h100x16-cpu",
        description="CPU counterpart of the two-node figure: tiny preset, 4 gloo ranks, USP and "
                    "UPipe as 2x2",
        scale="cpu",
        base={"model": "tiny", "nproc": 4, "stack": "alst", "dtype": "fp32",
              "warmup": 1, "iters": 2},
        axes={"variant": METHODS, "seq_len": ["1K", "2K", "4K"]},
        plots=("memory_vs_seq", "throughput_vs_seq"),
        timeout_s=900,
    ),
]
