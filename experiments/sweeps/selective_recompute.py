"""Selective recomputation (beyond the paper): memory turned into speed. Ulysses and UPipe on
ALST, which recomputes every block whole, against the same stack keeping the attention's saved
tensors on the device (``alst-attn``) or in host memory (``alst-attn-host``), so the recompute
skips the attention, or running whole blocks without their checkpoint (``alst-block``), so it
skips the block (``experiments/config/stack.py``, docs/design.md#the-memory-stack).

Paper scale (emulated): Llama3-8B on one 8-GPU node from 1M tokens, where the paper's UPipe
runs at 30-55 GiB of 73 and no faster than Ulysses, and Qwen3-32B on two nodes (16 GPUs, the
paper's Table 4 setting; UPipe also on its 8 x 2 mesh with a ring over the nodes). CPU scale:
the tiny presets on 4 gloo ranks, measured. The plot is the memory ladder (device and host bytes
by level); the tokens/s are in the tables (docs/results.md, ``reporting.selective_table``).
"""

from experiments.config import Sweep

METHODS = [{"method": "ulysses"}, {"method": "upipe"}]
STACKS = ["alst", "alst-attn", "alst-attn-host", "alst-block"]
# the long level and long keeping the attention in host memory: paper scale only (the CPU
# sweeps measure what the alst levels keep; the long ones keep less of the same)
PAPER_STACKS = STACKS + ["long", "long-attn-host"]


def kept_in(method: str, stack: str, seq_len: str, keep_blocks: int,
            ring_degree: int = 1) -> dict:
    """A cell keeping the attention (on ``alst-block``: whole blocks) in its last
    ``keep_blocks`` blocks only: where keeping it in every block is over the host budget only,
    the number the planner picks from the two levels' host peaks
    (``runner.plan_keep.host_keep_blocks``); where keeping every block whole is over the device,
    the number it reads from their device peaks' chord (``runner.plan_keep.device_keep_blocks``).
    tests/test_selective_table.py checks each against the committed rows. Emulated exactly:
    the fit cannot mix blocks."""
    return {"method": method, "stack": stack, "seq_len": seq_len, "keep_blocks": keep_blocks,
            "ring_degree": ring_degree}


SWEEPS = [
    Sweep(
        name="selective_recompute_llama3_8b_h100x8",
        description="Selective recomputation: Llama3-8B, 8x H100, Ulysses and UPipe on ALST "
                    "with the attention recomputed, kept on the device or kept in host memory, "
                    "and whole blocks un-checkpointed",
        scale="paper",
        base={"model": "llama3-8b", "nproc": 8, "dtype": "bf16", "warmup": 1, "iters": 2},
        axes={"variant": METHODS, "stack": PAPER_STACKS,
              "seq_len": ["1M", "2M", "3M", "4M", "5M"]},
        # each configuration whose whole keeping level is over the host budget only, on the
        # level that keeps the most blocks (both when they keep different numbers)
        extra_cells=(
            kept_in("ulysses", "alst-attn-host", "1M", 30),
            kept_in("ulysses", "alst-attn-host", "2M", 13),
            kept_in("ulysses", "alst-attn-host", "3M", 8),
            kept_in("ulysses", "long-attn-host", "4M", 5),
            kept_in("upipe", "alst-attn-host", "3M", 18),
            kept_in("upipe", "long-attn-host", "3M", 26),
            kept_in("upipe", "alst-attn-host", "4M", 11),
            kept_in("upipe", "long-attn-host", "4M", 16),
            kept_in("upipe", "long-attn-host", "5M", 10),
            # and where every block un-checkpointed is over the device while alst fits
            kept_in("ulysses", "alst-block", "1M", 5),
            kept_in("ulysses", "alst-block", "2M", 2),
            kept_in("ulysses", "alst-block", "3M", 1),
            kept_in("upipe", "alst-block", "1M", 9),
            kept_in("upipe", "alst-block", "2M", 3),
            kept_in("upipe", "alst-block", "3M", 1),
            kept_in("ulysses", "alst-block", "4M", 1),
            kept_in("upipe", "alst-block", "4M", 1),
            kept_in("upipe", "alst-block", "5M", 1),
        ),
        plots=("memory_ladder",),
    ),
    Sweep(
        name="selective_recompute_qwen3_32b_h100x16",
        description="Selective recomputation: Qwen3-32B, 16x H100 (2 nodes), Ulysses and UPipe "
                    "(also 8x2) on ALST with the attention recomputed, kept on the device or "
                    "kept in host memory, and whole blocks un-checkpointed",
        scale="paper",
        base={"model": "qwen3-32b", "nproc": 16, "dtype": "bf16", "warmup": 1, "iters": 2},
        axes={"variant": METHODS + [{"method": "upipe", "ring_degree": 2}],
              "stack": PAPER_STACKS, "seq_len": ["1M", "2M", "3M", "4M"]},
        # as above (UPipe's 8 x 2 mesh keeps as many blocks as its plain one)
        extra_cells=(
            kept_in("ulysses", "alst-attn-host", "1M", 35),
            kept_in("ulysses", "alst-attn-host", "2M", 15),
            kept_in("ulysses", "long-attn-host", "3M", 8),
            kept_in("upipe", "alst-attn-host", "2M", 38),
            kept_in("upipe", "long-attn-host", "2M", 51),
            kept_in("upipe", "alst-attn-host", "3M", 20),
            kept_in("upipe", "long-attn-host", "3M", 27),
            kept_in("upipe", "long-attn-host", "4M", 15),
            kept_in("upipe", "alst-attn-host", "2M", 38, ring_degree=2),
            kept_in("upipe", "long-attn-host", "2M", 51, ring_degree=2),
            kept_in("upipe", "alst-attn-host", "3M", 20, ring_degree=2),
            kept_in("upipe", "long-attn-host", "3M", 27, ring_degree=2),
            kept_in("upipe", "long-attn-host", "4M", 15, ring_degree=2),
            kept_in("ulysses", "alst-block", "1M", 4),
            kept_in("upipe", "alst-block", "1M", 8),
            kept_in("upipe", "alst-block", "2M", 2),
            kept_in("upipe", "alst-block", "1M", 8, ring_degree=2),
            kept_in("upipe", "alst-block", "2M", 2, ring_degree=2),
            kept_in("ulysses", "alst-block", "2M", 1),
            kept_in("ulysses", "alst-block", "3M", 1),
            kept_in("upipe", "alst-block", "3M", 1),
            kept_in("upipe", "alst-block", "4M", 1),
            kept_in("upipe", "alst-block", "3M", 1, ring_degree=2),
            kept_in("upipe", "alst-block", "4M", 1, ring_degree=2),
        ),
        plots=("memory_ladder",),
    ),
    Sweep(
        name="selective_recompute_llama3_8b_h100x8-cpu",
        description="CPU counterpart: tiny preset, 4 gloo ranks, the same methods and levels",
        scale="cpu",
        base={"model": "tiny", "nproc": 4, "dtype": "fp32", "warmup": 1, "iters": 2},
        axes={"variant": METHODS, "stack": STACKS, "seq_len": ["2K", "4K"]},
        plots=("memory_ladder",),
        timeout_s=900,
    ),
    Sweep(
        name="selective_recompute_qwen3_32b_h100x16-cpu",
        description="CPU counterpart: tiny-wide preset (16 heads, 2 KV), 4 gloo ranks, the same "
                    "levels, UPipe's mesh as 2x2",
        scale="cpu",
        base={"model": "tiny-wide", "nproc": 4, "dtype": "fp32", "warmup": 1, "iters": 2},
        axes={"variant": METHODS + [{"method": "upipe", "ring_degree": 2}], "stack": STACKS,
              "seq_len": ["2K", "4K"]},
        plots=("memory_ladder",),
        timeout_s=900,
    ),
]
