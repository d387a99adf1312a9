"""The paper's published throughput tables and figures, as plain data (a validation target).

Source: the UPipe project page, https://rghadia.github.io/untied_ulysses_proj, whose two
throughput tables the README of the official code (togethercomputer/Untied-Ulysses) calls
Table 3 (Llama3-8B, one node of 8x H100 80 GB) and Table 4 (Qwen3-32B shapes, two nodes, 16x
H100): tokens/s per GPU per method and context length, 128K..5M, OOM where a run ran out of
memory. The paper: Ghadia, Abraham, Vorobyov, Ryabinin, "Untied Ulysses: Memory-Efficient
Context Parallelism via Headwise Chunking", arXiv 2602.21196 (v1, 24 Feb 2026).

These numbers check the emulator; nothing may be fitted to them.

Status of the transcription:

- ``PAPER_THROUGHPUT``: every cell of Tables 3 and 4, OOM cells included (67 cells: 35 in
  Table 3, 32 in Table 4). A row of
  the source table stops at its first OOM: the blank cells after it are not cells and are not
  listed (nothing is invented for them; ``paper_grid`` reports an emulated row there as past
  the paper's OOM).
- ``PAPER_MAX_CONTEXT``: the max-context sentences under each table (the last ok cell of each
  row; tests check that they agree).
- ``PAPER_OUTCOMES``: fits / OOM of each cell, derived from ``PAPER_THROUGHPUT``; a peak in GiB
  only where the paper is quoted with one.
- ``PAPER_LADDER_3M``: the memory-wall figure (Llama3-8B, 8x H100, 3M tokens): GiB per GPU of
  model states / attention / other per rung, and the rungs that run out of memory with the GiB
  the figure writes beside OOM.
- ``PAPER_TWO_NODE``: the figure of Llama3-8B on two nodes (USP 8x2 against UPipe 8x2): peaks
  and relative tokens/s, read off a chart, so approximate (``approximate`` is True).
- ``PAPER_LIMITS``: UPipe's limits as the paper states them (its overhead at 128K).
- ``PAPER_CLAIMS``: the abstract's numbers; ``PAPER_SETUP``: setup facts, each with its source.

The tables give tokens/s only, no per-cell memory; the memory the paper shows is in the two
figures.

Row format of ``PAPER_THROUGHPUT`` (one row per table cell, OOM cells included):

    {"table": "table3" | "table4", "model": "llama3-8b" | "qwen3-32b", "gpus": 8 | 16,
     "method": <our method name>, "mesh": "<ulysses>x<ring>", "paper_method": <the table's
     row name>, "seq_len": <tokens>, "tokens_per_s_per_gpu": float | None (None for OOM),
     "status": "ok" | "oom", "source": "UPipe project page, Table 3"}

Method names, the paper's -> ours: native PyTorch CP -> "torch-cp" (mesh 1xN); Ring (zigzag
ring attention) -> "zigzag-ring" (1xN); Ulysses -> "usp-ulysses" 8x1 in Table 3, and Table 4's
"Ulysses (USP 8x2)" -> "usp" 8x2. The paper calls it DeepSpeed Ulysses, but the authors'
scripts run it as yunchang's USP (``usp-ulysses 8 1``, ``usp 8 2``), not DeepSpeed's code;
"ds-ulysses" is DeepSpeed's own and "ulysses" upipe's. yunchang's USP at ring degree 1 runs
its ring over one rank, whose backward keeps fp32 gradient copies (``baselines.usp_ulysses``);
at 8x2 its memory is ``usp``'s (with the RoPE table the paper's TorchTitan holds,
``Cell.global_rope_table``, as the paper-scale sweeps run it).
FPDT (DeepSpeed) -> "ds-fpdt" (Megatron-DeepSpeed's FPDT; our "fpdt" is a different, stronger
implementation): 8x1 in Table 3, 16x1 in Table 4 (sequence-parallel size 16, as the authors'
32B script and our emulated Table 4 sweep run it). UPipe -> "upipe" 8x1 (Table 3), 8x2 (Table
4, UPipe with ring attention over the ring axis). "mesh" is always "<Ulysses degree>x<ring
degree>".

Sequence lengths: K = 1024 and M = 1024 * 1024 tokens (``SEQ_LEN_TOKENS``): "3M" is 3145728 =
3 x 2^20 tokens, as the authors' scripts label their runs ("Sequence lengths from the paper
table (in tokens)": 131072 # 128K ... 5242880 # 5M). Global tokens of one sequence per step
(batch 1), spread over all the GPUs.

Imports nothing from the project (a reporting module may import only experiments.config,
experiments.store and experiments.reporting; this one needs none of them).
"""

from __future__ import annotations

PAPER = "arXiv 2602.21196v1"
PAPER_URL = "https://arxiv.org/html/2602.21196v1"
PROJECT_PAGE = "https://rghadia.github.io/untied_ulysses_proj"
REPO = "togethercomputer/Untied-Ulysses"
PAGE = "UPipe project page"  # the sources below: f"{PAGE}, Table 3", ...

# K = 2**10, M = 2**20 tokens, as labelled in the authors' torchtitan/exps/llama3_8b/run_all_8B.sh
# ("131072 # 128K" ... "5242880 # 5M"). The columns of Tables 3 and 4, in order.
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
_M = 2**20
OOM = None  # a table cell that ran out of memory

# (our method, mesh, the table's row name): tokens/s per GPU from 128K on, in the columns'
# order; a row ends at its first OOM (the source leaves the cells after it blank).
_TABLE3 = [
    ("torch-cp", "1x8", "native PyTorch CP", (1373.87, 845.99, 474.30, 249.85, OOM)),
    ("zigzag-ring", "1x8", "Ring", (2064.90, 1387.67, 841.05, 458.51, 237.99, 159.96, OOM)),
    ("usp-ulysses", "8x1", "Ulysses", (2320.47, 1503.80, 878.63, 475.33, 246.05, 162.41, OOM)),
    ("ds-fpdt", "8x1", "FPDT (DeepSpeed)",
     (1171.68, 884.75, 621.20, 382.42, 219.53, 153.48, 119.76, OOM)),
    ("upipe", "8x1", "UPipe", (2281.05, 1487.29, 867.17, 472.53, 246.07, 166.32, 125.56, 98.25)),
]
_TABLE4 = [
    ("torch-cp", "1x16", "native PyTorch CP", (127.03, 112.20, 91.39, OOM)),
    ("zigzag-ring", "1x16", "Ring", (418.39, 308.88, 194.44, 110.27, 58.45, OOM)),
    ("usp", "8x2", "Ulysses (USP 8x2)", (545.29, 370.70, 217.04, 117.02, 59.98, OOM)),
    ("ds-fpdt", "16x1", "FPDT (DeepSpeed)",
     (286.40, 217.85, 151.91, 95.88, 55.41, 38.86, 27.66, OOM)),
    ("upipe", "8x2", "UPipe (8x2)", (483.29, 339.56, 204.46, 113.26, 59.56, 40.42, 29.97, OOM)),
]
TABLES = {"table3": ("llama3-8b", 8, "Table 3", _TABLE3),
          "table4": ("qwen3-32b", 16, "Table 4", _TABLE4)}


def _cells() -> list[dict]:
    out = []
    for table, (model, gpus, name, rows) in TABLES.items():
        for method, mesh, paper_method, values in rows:
            for length, value in zip(SEQ_LEN_TOKENS, values, strict=False):
                out.append({"table": table, "model": model, "gpus": gpus, "method": method,
                            "mesh": mesh, "paper_method": paper_method,
                            "seq_len": SEQ_LEN_TOKENS[length], "tokens_per_s_per_gpu": value,
                            "status": "oom" if value is OOM else "ok",
                            "source": f"{PAGE}, {name}"})
    return out


PAPER_THROUGHPUT: list[dict] = _cells()

# The sentence under each table: "Max context: native 1M, Ring 3M, Ulysses 3M, FPDT 4M, UPipe
# 5M (+25% over FPDT)" (Table 3); "native 512K, Ring 2M, Ulysses 2M, FPDT 4M, UPipe 4M" (Table 4).
_MAX3 = {"torch-cp": "1M", "zigzag-ring": "3M", "usp-ulysses": "3M", "ds-fpdt": "4M", "upipe": "5M"}
_MAX4 = {"torch-cp": "512K", "zigzag-ring": "2M", "usp": "2M", "ds-fpdt": "4M", "upipe": "4M"}
PAPER_MAX_CONTEXT: list[dict] = [
    {"table": table, "model": TABLES[table][0], "gpus": TABLES[table][1], "method": method,
     "mesh": mesh, "max_context": SEQ_LEN_TOKENS[maxima[method]],
     "source": f"{PAGE}, {TABLES[table][2]} (max context)"}
    for table, maxima in (("table3", _MAX3), ("table4", _MAX4))
    for method, mesh, _, _ in TABLES[table][3]
]

def paper_row(model: str, gpus: int, method: str, mesh: str) -> dict | None:
    """The row of the paper's Table 3 or 4 that runs `method` on `mesh` ("<Ulysses>x<ring>")
    for `model` on `gpus` GPUs: {"table": "table3" | "table4", "name": "Table 3", "max_context":
    tokens (``PAPER_MAX_CONTEXT``), "tokens_per_s_per_gpu": {seq_len: value} of its ok cells};
    None where the tables have no such row."""
    key = (model, gpus, method, mesh)
    for top in PAPER_MAX_CONTEXT:
        if (top["model"], top["gpus"], top["method"], top["mesh"]) == key:
            table = top["table"]
            return {"table": table, "name": TABLES[table][2], "max_context": top["max_context"],
                    "tokens_per_s_per_gpu": {
                        c["seq_len"]: c["tokens_per_s_per_gpu"] for c in PAPER_THROUGHPUT
                        if (c["table"], c["method"], c["mesh"], c["status"])
                        == (table, method, mesh, "ok")}}
    return None


# Numbers stated in the v1 abstract, read directly.
PAPER_CLAIMS: list[dict] = [
    {"claim": "max_context_tokens", "model": "llama3-8b", "gpus": 8, "method": "upipe",
     "value": SEQ_LEN_TOKENS["5M"],
     "text": "UPipe can support the context length of 5M tokens when training Llama3-8B on a "
             "single 8xH100 node",
     "source": f"{PAPER} Abstract"},
    {"claim": "max_context_gain_over_prior_pct", "model": "llama3-8b", "gpus": 8,
     "method": "upipe", "value": 25.0, "bound": "over",
     "text": "improving upon prior methods by over 25%",
     "source": f"{PAPER} Abstract"},
    {"claim": "attention_intermediate_memory_reduction_pct", "model": "32B Transformers",
     "gpus": None, "method": "upipe", "value": 87.5, "bound": "up to",
     "text": "reduces intermediate tensor memory usage in the attention layer by as much as "
             "87.5% for 32B Transformers",
     "source": f"{PAPER} Abstract"},
]

# UPipe's limits as the paper states them: more kernel launches and smaller collectives cost
# throughput at short lengths; U (heads per stage) must be a multiple of C (the Ulysses degree).
# The percentages are UPipe's tokens/s against Ulysses' (Table 4: USP 8x2) at 128K, which the
# tables give too (tests check that they agree).
PAPER_LIMITS: list[dict] = [
    {"table": "table3", "model": "llama3-8b", "gpus": 8, "seq_len": SEQ_LEN_TOKENS["128K"],
     "upipe_vs_ulysses_pct": -1.7, "source": f"{PAGE} (UPipe's stated limits)"},
    {"table": "table4", "model": "qwen3-32b", "gpus": 16, "seq_len": SEQ_LEN_TOKENS["128K"],
     "upipe_vs_ulysses_pct": -11.4, "source": f"{PAGE} (UPipe's stated limits)"},
]

# Peaks quoted from the paper for single cells, in GiB allocated: (table, method, mesh, length).
_QUOTED_PEAKS = {("table3", "zigzag-ring", "1x8", SEQ_LEN_TOKENS["3M"]): (
    73.5, f"{PAPER}, as quoted in issue 15 ('Ring fits 3M at 73.5 GiB allocated')")}



def _outcomes() -> list[dict]:
    """Fits / OOM of each table cell (its status in PAPER_THROUGHPUT), with the allocated peak
    where the paper is quoted with one (else None)."""
    out = []
    for c in PAPER_THROUGHPUT:
        peak, source = _QUOTED_PEAKS.get((c["table"], c["method"], c["mesh"], c["seq_len"]),
                                         (None, None))
        out.append({k: c[k] for k in ("table", "model", "gpus", "method", "mesh", "seq_len",
                                      "status")}
                   | {"peak_memory_gib": peak,
                      "source": c["source"] + (f"; peak: {source}" if source else "")})
    return out


PAPER_OUTCOMES: list[dict] = _outcomes()

# The memory wall at 3M tokens (3 x 2^20), Llama3-8B on 8x H100: GiB per GPU by part, rung by
# rung. A rung is matched to the emulated rows by (method, stack, nproc) (the memory_wall
# sweep, experiments/sweeps/memory_ladder.py); ``label`` is its name in our plots
# (ablation_plots.ladder_rung; the figure says "+ AC" for "+ checkpointing"). An OOM rung gives
# the GiB the figure writes beside OOM (``oom_gib``): for FSDP only, its attention activations
# (``oom_part``); for + offload, in the place of "other" after 15.0 / 33.0; for + Ulysses and
# + AC the figure does not name the part.
_WALL = f"{PAGE}, memory-wall figure (Llama3-8B, 8x H100, 3M tokens)"
PAPER_LADDER_3M: list[dict] = [
    {"rung": "fsdp", "label": "FSDP only", "method": "usp-ulysses", "stack": "none", "nproc": 1,
     "status": "oom", "model_gib": None, "attention_gib": None, "other_gib": None,
     "oom_gib": 7680.0, "oom_part": "attention", "source": _WALL},
    {"rung": "ulysses", "label": "+ Ulysses", "method": "usp-ulysses", "stack": "none", "nproc": 8,
     "status": "oom", "model_gib": None, "attention_gib": None, "other_gib": None,
     "oom_gib": 960.0, "oom_part": None, "source": _WALL},
    {"rung": "ac", "label": "+ checkpointing", "method": "usp-ulysses", "stack": "ac", "nproc": 8,
     "status": "oom", "model_gib": None, "attention_gib": None, "other_gib": None,
     "oom_gib": 126.0, "oom_part": None, "source": _WALL},
    {"rung": "offload", "label": "+ offload", "method": "usp-ulysses", "stack": "offload",
     "nproc": 8, "status": "oom", "model_gib": 15.0, "attention_gib": 33.0, "other_gib": None,
     "oom_gib": 368.0, "oom_part": "other", "source": _WALL},
    {"rung": "alst", "label": "ALST", "method": "usp-ulysses", "stack": "alst", "nproc": 8,
     "status": "ok", "model_gib": 15.0, "attention_gib": 33.0, "other_gib": 16.6,
     "oom_gib": None, "oom_part": None, "source": _WALL},
    {"rung": "upipe", "label": "UPipe", "method": "upipe", "stack": "alst", "nproc": 8,
     "status": "ok", "model_gib": 15.0, "attention_gib": 19.5, "other_gib": 16.6,
     "oom_gib": None, "oom_part": None, "source": _WALL},
]

# Llama3-8B on two nodes (16x H100): USP 8x2 against UPipe 8x2, peak GiB per GPU and UPipe's
# tokens/s over USP's. Read off a chart: every number is approximate (to the chart's
# resolution). At 8M USP runs out of memory and only UPipe trains.
_TWO = f"{PAGE}, two-node figure (Llama3-8B, 16x H100; read off the chart, approximate)"
PAPER_TWO_NODE: list[dict] = [
    {"model": "llama3-8b", "gpus": 16, "mesh": "8x2", "seq_len": n, "usp_status": us,
     "usp_peak_gib": u, "upipe_status": "ok", "upipe_peak_gib": p,
     "upipe_vs_usp_tokens_per_s": r, "approximate": True, "source": _TWO}
    for n, us, u, p, r in ((SEQ_LEN_TOKENS["512K"], "ok", 16.2, 15.7, 0.955),
                           (2 * _M, "ok", 28.7, 26.4, 0.985),
                           (4 * _M, "ok", 45.3, 40.8, 0.995),
                           (6 * _M, "ok", 62.0, 55.2, 1.00),
                           (8 * _M, "oom", None, 69.5, None))
]

def paper_peaks(model: str, gpus: int, method: str, mesh: str, stack: str) -> list[dict]:
    """The peaks per GPU the paper gives for `method` on `mesh` ("<Ulysses>x<ring>") with
    `model` on `gpus` GPUs: [{"seq_len", "gib", "figure"}]: the memory-wall figure's rungs that
    train (model states + attention + other at 3M; Table 3's model and GPUs, matched on the
    stack too), a single cell's quoted peak (``PAPER_OUTCOMES``), and the two-node figure's
    (approximate: read off its chart)."""
    out = []
    wall_model, wall_gpus = TABLES["table3"][:2]
    for r in PAPER_LADDER_3M:
        if r["status"] == "ok" and (model, gpus, method, mesh, stack) == (
                wall_model, wall_gpus, r["method"], f"{r['nproc']}x1", r["stack"]):
            out.append({"seq_len": SEQ_LEN_TOKENS["3M"], "figure": "memory-wall figure",
                        "gib": r["model_gib"] + r["attention_gib"] + r["other_gib"]})
    out += [{"seq_len": c["seq_len"], "gib": c["peak_memory_gib"], "figure": TABLES[c["table"]][2]}
            for c in PAPER_OUTCOMES if c["peak_memory_gib"] is not None
            and (c["model"], c["gpus"], c["method"], c["mesh"]) == (model, gpus, method, mesh)]
    out += [{"seq_len": r["seq_len"], "gib": r[f"{method}_peak_gib"],
             "figure": "two-node figure, approx."} for r in PAPER_TWO_NODE
            if method in ("usp", "upipe") and r[f"{method}_status"] == "ok"
            and (r["model"], r["gpus"], r["mesh"]) == (model, gpus, mesh)]
    return out


# The authors' benchmark scripts (paths in REPO) behind each row of the tables. The FPDT 8B
# sweep lists no 3M run, yet Table 3 has FPDT at 3M; the FPDT 32B sweep runs to 5M where the
# other Table 4 sweeps stop at 4M.
_TT8 = "torchtitan/exps/llama3_8b/run_all_8B.sh"
_TT32 = "torchtitan/exps/qwen3_32b/run_all_multinode_32B.sh"
_FPDT = "FPDT/Megatron-DeepSpeed/examples_deepspeed/sequence_parallel/"
PAPER_SCRIPTS: dict[tuple[str, str], str] = {
    ("table3", "upipe"): f"{_TT8} (upipe upipe_fa3_offload_tiled_mlp 8 1)",
    ("table3", "usp-ulysses"): f"{_TT8} (usp-ulysses usp_fa3_offload_tiled_mlp 8 1)",
    ("table3", "zigzag-ring"): f"{_TT8} (usp-ring usp_fa3_offload_tiled_mlp 1 8)",
    ("table3", "torch-cp"): f"{_TT8} (torch torch_ring_alltoall 1 8)",
    ("table3", "ds-fpdt"): f"{_FPDT}run_all_8B.sh (sp_size=8)",
    ("table4", "upipe"): f"{_TT32} (upipe upipe_fa3_offload_tiled_mlp 8 2)",
    ("table4", "usp"): f"{_TT32} (orig_usp_ulysses usp_fa3_offload_tiled_mlp 8 2)",
    ("table4", "zigzag-ring"): f"{_TT32} (orig_usp_ring usp_fa3_offload_tiled_mlp 1 16)",
    ("table4", "torch-cp"): f"{_TT32} (torch_ring torch_ring_alltoall 1 16)",
    ("table4", "ds-fpdt"): f"{_FPDT}run_all_multinode_32B.sh (sp_size=16)",
}

# Setup facts bearing on throughput, each with its source: the abstract, or a file of the
# authors' repository (REPO).
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
