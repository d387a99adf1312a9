"""A per-token module over sequence shards (the ALST stack's tiled MLP).

DeepSpeed's ``TiledMLP`` runs ``module`` on ceil(L / dim) sequence shards without autograd in
forward and recomputes one shard at a time in backward, so the MLP's (L, ffn) intermediates exist
for one shard only. It is the library implementation (ALST, Bekman et al. 2025) and runs on CPU
and under fake tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn


def _call_module(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


def tiled(module: nn.Module, x: torch.Tensor,
          call: Callable[[nn.Module, torch.Tensor], torch.Tensor] = _call_module) -> torch.Tensor:
    """``call(module, x)`` (default ``module(x)``) over ceil(L / dim) sequence shards (ALST).

    Any per-token module fits (the harness tiles RMSNorm too). ``call`` lets a module whose own
    ``forward`` is this tiling (the Hugging Face stack's MLPs) pass its class's forward instead.
    x (B, L, dim) -> (B, L, dim_out); one shard runs ``call`` directly.
    """
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP  # heavy import: lazy

    shards = max(1, math.ceil(x.shape[1] / x.shape[-1]))
    if shards == 1:
        return call(module, x)
    return TiledMLP.apply(call, module, x, shards, list(module.parameters()))
