"""The paper's published throughput and memory tables, as plain data (a validation target).

Source: Ghadia, Abraham, Vorobyov, Ryabinin, "Untied Ulysses: Memory-Efficient Context
Parallelism via Headwise Chunking", arXiv 2602.21196, version v1 (24 Feb 2026),
https://arxiv.org/html/2602.21196v1 -- Table 3 (Llama3-8B, one node of 8x H100: tokens/s per
GPU and peak memory per method and context length, 128K..5M) and Table 4 (Qwen3-32B, two nodes,
16x H100, 128K..4M), in the paper's experiments section.

These numbers check the emulator; nothing may be fitted to them.

Status of the transcription: only the v1 abstract could be read (the stored copy of the HTML
page this was written from ends before the experiments section, and no other copy of the tables
was found). So ``PAPER_THROUGHPUT`` and ``PAPER_MEMORY`` hold no cells yet. Every cell of the
tables is listed in ``UNREAD_CELLS`` instead. That grid comes from the benchmark scripts in the
authors' repository (togethercomputer/Untied-Ulysses, whose README says they reproduce
Table 3), so the paper's own table layout is not checked against it. Nothing here is guessed:
a cell moves from ``UNREAD_CELLS`` to ``PAPER_THROUGHPUT`` (and ``PAPER_MEMORY``) only once
someone has read it in the paper. Until then, ``PAPER_CLAIMS`` holds the numbers the abstract
gives, and ``PAPER_SETUP`` the setup facts, each with its source: the abstract, or a file of
the authors' repository where the paper's setup section could not be read.

Row formats (one row per table cell, OOM cells included):

    PAPER_THROUGHPUT: {"table": "table3" | "table4", "model": "llama3-8b" | "qwen3-32b",
        "gpus": 8 | 16, "method": <our method name>, "mesh": "<ulysses>x<ring>",
        "seq_len": <tokens>, "tokens_per_s_per_gpu": float | None (None for OOM),
        "status": "ok" | "oom", "source": "arXiv 2602.21196v1 Table 3"}
    PAPER_MEMORY: the same keys with "peak_memory_gib": float | None in place of
        "tokens_per_s_per_gpu", plus "memory_kind": "allocated" | "reserved" (as the paper
        states it).

Method names, the paper's -> ours: Ring (zigzag ring attention) -> "zigzag-ring"; Ulysses ->
"ulysses". The paper calls it DeepSpeed Ulysses, but the authors' scripts run it as yunchang's
USP with ring degree 1, not DeepSpeed's code; "ds-ulysses" is DeepSpeed's own. FPDT ->
"ds-fpdt": the paper's FPDT is DeepSpeed's (Megatron-DeepSpeed); our "fpdt" is a different,
stronger implementation. PyTorch native CP -> "torch-cp"; UPipe -> "upipe"; hybrid Ulysses x
Ring (USP) -> "usp". "mesh" is always "<Ulysses degree>x<ring degree>" ("8x1" Ulysses-style,
"1x8" ring-style, "8x2" the two-node hybrids), so a method run on two meshes gives two rows.

Sequence lengths: K = 1024 and M = 1024 * 1024 tokens (``SEQ_LEN_TOKENS``). The authors'
scripts list their runs as "Sequence lengths from the paper table (in tokens)": 131072 (128K)
... 5242880 (5M). The paper text's own definition was not read.

Imports nothing from the project (a reporting module may import only experiments.config,
experiments.store and experiments.reporting; this one needs none of them).
"""

from __future__ import annotations

SOURCE = "arXiv 2602.21196v1"
PAPER_URL = "https://arxiv.org/html/2602.21196v1"
REPO = "togethercomputer/Untied-Ulysses"

# K = 2**10, M = 2**20 tokens, as labelled in the authors' torchtitan/exps/llama3_8b/run_all_8B.sh
# ("131072 # 128K" ... "5242880 # 5M").
SEQ_LEN_TOKENS: dict[str, int] = {
    "128K": 131072,
    "256K": 262144,
    "512K": 524288,
    "1M": 1048576,
    "2M": 2097152,
    "3M": 3145728,
    "4M": 4194304,
    "5M": 5242880,
}

# Table 3 and Table 4 cells, transcribed from the paper. Empty: the tables could not be read
# (see the module docstring); every cell is in UNREAD_CELLS.
PAPER_THROUGHPUT: list[dict] = []
PAPER_MEMORY: list[dict] = []

# Numbers stated in the v1 abstract, read directly.
PAPER_CLAIMS: list[dict] = [
    {"claim": "max_context_tokens", "model": "llama3-8b", "gpus": 8, "method": "upipe",
     "value": SEQ_LEN_TOKENS["5M"],
     "text": "UPipe can support the context length of 5M tokens when training Llama3-8B on a "
             "single 8xH100 node",
     "source": f"{SOURCE} Abstract"},
    {"claim": "max_context_gain_over_prior_pct", "model": "llama3-8b", "gpus": 8,
     "method": "upipe", "value": 25.0, "bound": "over",
     "text": "improving upon prior methods by over 25%",
     "source": f"{SOURCE} Abstract"},
    {"claim": "attention_intermediate_memory_reduction_pct", "model": "32B Transformers",
     "gpus": None, "method": "upipe", "value": 87.5, "bound": "up to",
     "text": "reduces intermediate tensor memory usage in the attention layer by as much as "
             "87.5% for 32B Transformers",
     "source": f"{SOURCE} Abstract"},
]

# UPipe's tokens/s over Ulysses', as quoted from the paper (its discussion of UPipe's limits) in
# this project's issue 17: read there, not in the paper's tables, which could not be read here.
PAPER_UPIPE_VS_ULYSSES: list[dict] = [
    {"table": "table3", "model": "llama3-8b", "gpus": 8, "seq_len": SEQ_LEN_TOKENS["128K"],
     "ratio": 0.98, "source": f"{SOURCE}, as quoted in issue 17 ('0.98x Ulysses on Llama3-8B "
                              "at 128K')"},
    {"table": "table4", "model": "qwen3-32b", "gpus": 16, "seq_len": SEQ_LEN_TOKENS["128K"],
     "ratio": 0.89, "source": f"{SOURCE}, as quoted in issue 17 ('0.89x on Qwen3-32B (16 "
                              "GPUs) at 128K')"},
]


# Fits / OOM outcomes of grid cells that are known without the tables: stated in the abstract,
# quoted from the paper in this project's issue 15, or implied by the abstract (each says which).
# status: "ok" (trains) or "oom"; peak_memory_gib: the allocated peak where the quote gives it.
_ISSUE15 = f"{SOURCE}, as quoted in issue 15"
_BEYOND = ("implied by the Abstract: UPipe's 5M improves on every prior method by over 25%, "
           "so no prior method trains 5M / 1.25 = 4M tokens or more")
PAPER_OUTCOMES: list[dict] = [
    {"table": "table3", "model": "llama3-8b", "gpus": 8, "method": "upipe", "mesh": "8x1",
     "seq_len": SEQ_LEN_TOKENS["5M"], "status": "ok", "peak_memory_gib": None,
     "source": f"{SOURCE} Abstract"},
    {"table": "table3", "model": "llama3-8b", "gpus": 8, "method": "zigzag-ring", "mesh": "1x8",
     "seq_len": SEQ_LEN_TOKENS["3M"], "status": "ok", "peak_memory_gib": 73.5,
     "source": f"{_ISSUE15} ('Ring fits 3M at 73.5 GiB allocated')"},
] + [
    {"table": "table3", "model": "llama3-8b", "gpus": 8, "method": method, "mesh": mesh,
     "seq_len": SEQ_LEN_TOKENS["5M"], "status": "oom", "peak_memory_gib": None,
     "source": f"{SOURCE} Abstract ({_BEYOND})"}
    for method, mesh in (("ulysses", "8x1"), ("zigzag-ring", "1x8"), ("torch-cp", "1x8"),
                         ("ds-fpdt", "8x1"))
]

# The memory wall at 3M tokens, Llama3-8B on 8x H100 (the paper's figure, as quoted in issue
# 15): GiB per rank by part, and which rungs run out of memory. Rungs in the ladder's names
# (experiments/sweeps/memory_ladder.py).
PAPER_LADDER_3M: list[dict] = [
    {"rung": "alst", "method": "ulysses", "model_gib": 15.0, "attention_gib": 33.0,
     "other_gib": 16.6, "source": _ISSUE15},
    {"rung": "upipe", "method": "upipe", "model_gib": 15.0, "attention_gib": 19.5,
     "other_gib": 16.6, "source": _ISSUE15},
]


def _grid(table: str, model: str, gpus: int, runs: list[tuple[str, str, list[str], str]]):
    return [{"table": table, "model": model, "gpus": gpus, "method": method, "mesh": mesh,
             "seq_len": SEQ_LEN_TOKENS[s], "script": script}
            for method, mesh, lengths, script in runs for s in lengths]


_ALL8 = ["128K", "256K", "512K", "1M", "2M", "3M", "4M", "5M"]
_ALL7 = ["128K", "256K", "512K", "1M", "2M", "3M", "4M"]
_TT8 = "torchtitan/exps/llama3_8b/run_all_8B.sh"
_TT32 = "torchtitan/exps/qwen3_32b/run_all_multinode_32B.sh"
_FPDT8 = "FPDT/Megatron-DeepSpeed/examples_deepspeed/sequence_parallel/run_all_8B.sh"
_FPDT32 = "FPDT/Megatron-DeepSpeed/examples_deepspeed/sequence_parallel/run_all_multinode_32B.sh"

# The cells not transcribed, one per (table, method, mesh, seq_len): the runs of the authors'
# benchmark scripts (``script``, a path in REPO). Whether each of them is a cell of the
# paper's table, and its value or OOM, are unread. The FPDT 8B sweep has no 3M run; the FPDT
# 32B sweep runs to 5M where the other Table 4 sweeps stop at 4M.
UNREAD_CELLS: list[dict] = (
    _grid("table3", "llama3-8b", 8, [
        ("upipe", "8x1", _ALL8, _TT8),          # "upipe upipe_fa3_offload_tiled_mlp 8 1"
        ("ulysses", "8x1", _ALL8, _TT8),        # "usp-ulysses usp_fa3_offload_tiled_mlp 8 1"
        ("zigzag-ring", "1x8", _ALL8, _TT8),    # "usp-ring usp_fa3_offload_tiled_mlp 1 8"
        ("torch-cp", "1x8", _ALL8, _TT8),       # "torch torch_ring_alltoall 1 8"
        ("ds-fpdt", "8x1", [s for s in _ALL8 if s != "3M"], _FPDT8),  # sp_size=8
    ])
    + _grid("table4", "qwen3-32b", 16, [
        ("upipe", "8x2", _ALL7, _TT32),         # "upipe upipe_fa3_offload_tiled_mlp 8 2"
        ("usp", "8x2", _ALL7, _TT32),           # "orig_usp_ulysses usp_fa3_offload_tiled_mlp 8 2"
        ("zigzag-ring", "1x16", _ALL7, _TT32),  # "orig_usp_ring usp_fa3_offload_tiled_mlp 1 16"
        ("torch-cp", "1x16", _ALL7, _TT32),     # "torch_ring torch_ring_alltoall 1 16"
        ("ds-fpdt", "16x1", _ALL8, _FPDT32),    # sp_size=16
    ])
)

# Setup facts bearing on throughput. The paper's setup section was not readable, so each names
# its source: the abstract, or a file of the authors' repository (REPO).
PAPER_SETUP: dict[str, str] = {
    "hardware": "Llama3-8B on a single node of 8x H100 (Abstract); Qwen3-32B on 2 nodes x 8 "
                "H100 = 16 GPUs (repo README: 'Qwen3 32B ... Full benchmark (128K-4M, "
                "multinode)'; run_all_multinode_32B.sh NNODES=2, NPROC_PER_NODE=8).",
    "attention_kernel": "FlashAttention-3 (Hopper) for every method, FPDT included: the "
                        "benchmark scripts use the *_fa3_* attn_impl variants and FPDT passes "
                        "--use-flash-attn-v3; the README says FA3 is 'Required to reproduce "
                        "exact tokens/second numbers from the paper'.",
    "frameworks": "UPipe, Ulysses, zigzag Ring (yunchang long-context-attention / USP) and "
                  "PyTorch CP run in the authors' TorchTitan fork (torch 2.9); FPDT runs in "
                  "Megatron-DeepSpeed with deepspeed 0.17.4 (repo README).",
    "sharding": "TorchTitan runs: FSDP2 (fully_shard) over all ranks (data_parallel_shard_degree "
                "-1, the dp_shard_cp mesh), no FSDP CPU offload (FSDP_OFFLOADING=false); FPDT "
                "runs: DeepSpeed ZeRO stage 3 (zero_stage=3) (parallelize_llama.py, "
                "run_all_8B.sh, FPDT run_single_8B.sh).",
    "precision": "TorchTitan runs: FSDP2 MixedPrecisionPolicy with bf16 parameters and fp32 "
                 "reductions (torchtitan defaults mixed_precision_param='bfloat16', "
                 "mixed_precision_reduce='float32', not overridden); the FPDT scripts pass "
                 "--fp16 (config_manager.py, FPDT run_single_8B.sh). Paper wording unread.",
    "activation_checkpointing": "Full per-transformer-block checkpointing "
                                "(CHECKPOINTING='full') in the Table 3/4 scripts; FPDT: "
                                "--checkpoint-activations with --deepspeed-activation-"
                                "checkpointing --checkpoint-in-cpu (run_all_8B.sh, FPDT "
                                "run_single_8B.sh).",
    "activation_offloading": "The methods run as *_offload_tiled_mlp attn_impl variants "
                             "(offload and tiled MLP in the variant name; what the variant "
                             "offloads was not read); the separate checkpoint-offload switch "
                             "OFFLOADING defaults to 'no' in the Table 3/4 scripts ('cpu' in "
                             "the later chunk-size ablation script); FPDT uses "
                             "--ds-sequence-parallel-fpdt-offloading.",
    "loss": "Chunked loss (chunked_loss = true in llama3_8b_test_2d.toml, the config all "
            "TorchTitan runs load).",
    "batch_size": "One sequence per step: BATCH_SIZE=1 (TorchTitan), global and micro batch 1 "
                  "(FPDT) (run_all_8B.sh, FPDT run_single_8B.sh).",
    "steps_measured": "Runs are short: STEPS=10 for the Llama3-8B TorchTitan sweep, STEPS=3 "
                      "for the Qwen3-32B sweep; FPDT 10 steps, 3 at seq_len >= 1M (and 3 for "
                      "32B). Which steps the reported tokens/s averages over (warm-up "
                      "excluded or not) was not read from the paper.",
    "torch_cp_rotation": "The PyTorch-CP baseline runs as attn_impl 'torch_ring_alltoall' on a "
                         "1xN ring mesh, while the shared config sets "
                         "context_parallel_rotate_method = 'allgather' (also torchtitan's "
                         "default); which rotation the paper's rows used is not confirmed "
                         "(llama3_8b_test_2d.toml, run_all_8B.sh).",
    "fpdt_chunk_size": "FPDT chunk of 65536 tokens (--ds-sequence-parallel-fpdt-chunk-size "
                       "65536) with offloading, sequence-parallel size 8 (8B) or 16 (32B) "
                       "(FPDT run_single_8B.sh, run_single_multinode_32B.sh).",
    "fpdt_qwen3_32b_shape": "The FPDT Qwen3-32B script declares num_key_value_heads=16 "
                            "(Qwen3-32B has 8 KV heads) with 64 query heads, 64 layers, hidden "
                            "5120, FFN 25600, kv_channels 128 (run_single_multinode_32B.sh).",
    "ring_kv_heads": "Ring passes the GQA K/V heads unexpanded (RING_COMM_HEADS='gqa_kv' in "
                     "the benchmark scripts).",
    "table4_meshes": "Qwen3-32B on 16 GPUs: UPipe and USP on an 8x2 (Ulysses x ring) mesh, "
                     "zigzag Ring and PyTorch CP on 1x16, FPDT with sequence-parallel size 16 "
                     "(run_all_multinode_32B.sh, FPDT run_single_multinode_32B.sh).",
    "allocator": "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for the TorchTitan runs "
                 "(run_all_8B.sh).",
    "u_ablation": "No ablation over U (heads per stage) with throughput could be read from "
                  "v1. The repo's chunk-size ablation script (run_all_8B_chunk_size_abl.sh, "
                  "output folder 'v2_rebuttal_...', 4 GPUs, 128K-1M) postdates v1.",
}
