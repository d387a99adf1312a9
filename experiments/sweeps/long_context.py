"""UPipe beyond the paper: 8M tokens for Llama3-8B on one 8-GPU node, and how far Qwen3-32B on
16 GPUs gets with the same mechanisms.

UPipe on the paper's ALST stack against UPipe on the ``long`` stack level (the first block's
input offloaded, the residual FFN tiled in place, the attention's pre-norm fused into UPipe:
``experiments/config/stack.py``) with its chunked attention backward (``chunk_size``, 64K-token
chunks: ``upipe/chunked.py``), from 3M tokens up; max context, peak memory, tokens/s and MFU per
GPU. Qwen3-32B also on the paper's 8 x 2 mesh (the chunked backward needs the plain Ulysses
mesh). ``runner.long_ladder`` adds the mechanisms one at a time (the ladder in
docs/results.md#one-node-to-8m-tokens-beyond-the-paper). The CPU counterparts keep the
comparison at CPU size (gloo, 4 ranks, 512-token chunks), with a measured max-context search
under Table 3's CPU budget.
"""

from experiments.config import SearchSpec, Sweep

PAPER = {"method": "upipe"}
LONG = {"method": "upipe", "stack": "long", "chunk_size": "64K"}
# CPU scale: chunks of 512 tokens, 4 to 16 per stage at 2K-8K tokens
CPU_LONG = {"method": "upipe", "stack": "long", "chunk_size": "512"}
PLOTS = ("max_context", "memory_vs_seq", "throughput_vs_seq")

SWEEPS = [
    Sweep(
        name="long_context_llama3_8b_h100x8",
        description="UPipe to 8M tokens on one node: Llama3-8B, 8x H100, ALST vs the long stack "
                    "with the chunked backward",
        scale="paper",
        base={"model": "llama3-8b", "nproc": 8, "dtype": "bf16", "warmup": 1, "iters": 2},
        axes={"variant": [PAPER, LONG], "seq_len": ["3M", "4M", "5M", "6M", "7M", "8M"]},
        search=SearchSpec(start=2**20, block=2**14, limit=2**24),
        plots=PLOTS,
    ),
    Sweep(
        name="long_context_qwen3_32b_h100x16",
        description="UPipe with the same mechanisms: Qwen3-32B, 16x H100 (two nodes)",
        scale="paper",
        base={"model": "qwen3-32b", "nproc": 16, "dtype": "bf16", "warmup": 1, "iters": 2},
        axes={"variant": [PAPER, PAPER | {"ring_degree": 2}, LONG],
              "seq_len": ["3M", "4M", "5M", "6M"]},
        search=SearchSpec(start=2**20, block=2**13, limit=2**24),
        plots=PLOTS,
    ),
    Sweep(
        name="long_context_llama3_8b_h100x8-cpu",
        description="CPU counterpart: tiny preset, 4 gloo ranks, UPipe on ALST vs the long stack "
                    "with 512-token chunks, max context under 48 MiB per rank",
        scale="cpu",
        base={"model": "tiny", "nproc": 4, "dtype": "fp32", "warmup": 1, "iters": 2},
        axes={"variant": [PAPER, CPU_LONG], "seq_len": ["2K", "4K"]},
        # Table 3's CPU budget and granularity (1K tokens); the long stack goes further
        search=SearchSpec(start=4096, block=256, limit=16384),
        search_base={"budget_mib": 48},
        plots=PLOTS,
        timeout_s=900,
    ),
    Sweep(
        name="long_context_qwen3_32b_h100x16-cpu",
        description="CPU counterpart: tiny-wide preset (16 heads, 2 KV), 4 gloo ranks, UPipe on "
                    "ALST (also on 2x2) vs the long stack with 512-token chunks",
        scale="cpu",
        base={"model": "tiny-wide", "nproc": 4, "dtype": "fp32", "warmup": 1, "iters": 2},
        axes={"variant": [PAPER, PAPER | {"ring_degree": 2}, CPU_LONG], "seq_len": ["2K", "4K"]},
        plots=("memory_vs_seq", "throughput_vs_seq"),
        timeout_s=900,
    ),
]
