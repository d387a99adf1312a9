"""One FLOPs formula for every method, and MFU (docs/design.md#measurement).

Per training step of S tokens: ``6 * N * S + 6 * n_layers * H * d_h * S**2``, where N counts the
matrix-multiply parameters (every linear layer and the output head; not the embedding lookup).
With packed documents of lengths l_i, attention runs within each: ``S**2`` becomes the sum of
``l_i**2``.
That is PaLM's formula (Chowdhery et al. 2022, appendix B: 6N + 12·L·H·Q·T per token) with the
attention term halved for causal masking; backward = 2x forward. Activation-checkpoint
recomputation is not counted (MFU, not hardware FLOPs utilisation).
"""

from __future__ import annotations

import itertools

from experiments.config import ModelConfig

# Dense bf16 tensor-core peak per GPU, by a part of the CUDA device name, the more specific
# names first (the first that the name contains is taken). Vendor datasheets give BF16 "with
# sparsity", twice the dense figure: H100 SXM 1,979 / PCIe 1,513 / NVL 1,671 TFLOP/s (NVIDIA
# H100 Tensor Core GPU datasheet), H200 SXM 1,979 / NVL 1,671 (H200 datasheet); A100 312
# dense (A100 datasheet, SXM and PCIe alike). The SXM parts' names carry no form factor
# ("NVIDIA H100 80GB HBM3", "NVIDIA H200"), so a PCIe or NVL part matched "H100" and got the
# SXM peak, its MFU a fifth low.
PEAK_BF16_FLOPS = {"H100 PCIe": 756.5e12, "H100 NVL": 835.5e12, "H200 NVL": 835.5e12,
                   "H100": 989.5e12, "H200": 989.5e12, "A100": 312e12}


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in matrix multiplies (the output head included)."""
    attn = cfg.dim * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    return cfg.n_layers * (attn + 3 * cfg.dim * cfg.ffn_dim) + cfg.vocab_size * cfg.dim


def step_flops(cfg: ModelConfig, seq_len: int, cu_seqlens: list[int] | None = None) -> float:
    """Model FLOPs of one forward+backward over ``seq_len`` tokens (all ranks together), of
    packed documents when ``cu_seqlens`` (global bounds) is given."""
    dense = 6 * matmul_params(cfg) * seq_len
    bounds = cu_seqlens or [0, seq_len]
    squares = sum((b - a) ** 2 for a, b in itertools.pairwise(bounds))
    attention = 6 * cfg.n_layers * cfg.n_heads * cfg.head_dim * squares
    return float(dense + attention)


def peak_flops(device_name: str, dtype: str) -> float | None:
    """The device's dense peak for ``dtype``; None where unknown (MFU is then not reported)."""
    if dtype != "bf16":
        return None
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in device_name), None)


def mfu(flops: float, step_s: float, n_gpus: int, device_name: str, dtype: str) -> float | None:
    """Model FLOPs utilisation of a step taking ``step_s`` seconds on ``n_gpus`` devices."""
    peak = peak_flops(device_name, dtype)
    return None if peak is None else flops / step_s / (n_gpus * peak)
