"""``ds-ulysses``: DeepSpeed's legacy Ulysses (``deepspeed.sequence.layer.DistributedAttention``).

An adapter, not a re-implementation: the library users actually run does the four all-to-alls
(q, k, v forward, out back; mirrored in backward) around a local attention callable, and this
module supplies what DeepSpeed leaves to its caller -- the projections, RoPE at global positions
before the all-to-all (as ``baselines/ulysses.py``), KV-head replication when there are fewer KV
heads than ranks, and the output projection.

DeepSpeed is imported when the module is built, so ``import baselines`` stays cheap. Its comm
layer (``deepspeed.comm``) is a process-global singleton; when torch.distributed is initialised
the constructor attaches it to the existing process group (no new world, no collective),
without building DeepSpeed's shared-memory all-reduce op, which it does not use
(``_attach_deepspeed_comm``). Without torch.distributed the CP degree is 1, every all-to-all is
the identity, and the local attention runs directly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from upipe.kernels import attention
from upipe.module import ContextParallelAttention, replicate_kv_heads
from upipe.registry import register_method

# Batch-first [b, s/p, h, d]: DeepSpeed scatters dim ``scatter_idx`` (heads) and gathers dim
# ``gather_idx`` (sequence) on the way in, the reverse on the way out (sequence/layer.py,
# ``_generate_layout_params`` with batch_dim_idx=0). gather_idx is only read on DeepSpeed's
# uneven-heads path, which the KV replication below keeps us off.
BATCH_DIM, SCATTER_IDX, GATHER_IDX = 0, 2, 1


def _import_distributed_attention() -> type:
    try:
        from deepspeed.sequence.layer import DistributedAttention
    except ImportError as e:
        raise ImportError("method 'ds-ulysses' needs DeepSpeed: pip install deepspeed") from e
    return DistributedAttention


def _attach_deepspeed_comm() -> None:
    """Point ``deepspeed.comm`` at the already-initialised torch.distributed world.

    With torch.distributed initialised and no DeepSpeed backend yet, ``init_distributed`` wraps
    the existing world in a ``TorchBackend`` and returns (comm.py: "The user initialized
    torch.dist themselves"); later calls see the backend and return at once. MPI discovery is
    off so that no code path can try to form a world of its own.
    """
    import deepspeed.comm as ds_comm
    import deepspeed.ops

    if not ds_comm.is_initialized():
        # Starting its comm layer on a CPU, DeepSpeed JIT-builds its shared-memory all-reduce op
        # (C++ with ninja: 20 s to a minute on a fresh machine). The op serves only
        # ``inference_all_reduce`` (deepspeed/comm/torch.py), which nothing here calls: the
        # Ulysses all-to-alls go through torch.distributed. Marked incompatible, it is not built.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        ds_comm.init_distributed(
            dist_backend=dist.get_backend(), auto_mpi_discovery=False, verbose=False
        )


class _LocalAttention(nn.Module):
    """DeepSpeed's ``local_attention``: (B, S, H/C, D) head-sharded full-sequence q, k, v.

    ``blocks``: the packed documents' blocks over the full sequence for the current call (set
    around it by :class:`DSUlyssesAttention`: DeepSpeed passes only q, k, v through).
    """

    def __init__(self, causal: bool, kernel: str):
        super().__init__()
        self.causal, self.kernel = causal, kernel
        self.blocks = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention(q, k, v, causal=self.causal, kernel=self.kernel, blocks=self.blocks)


@register_method("ds-ulysses")
class DSUlyssesAttention(ContextParallelAttention):
    """DeepSpeed Ulysses behind the common interface; forward(x_local (B, L, dim),
    cu_seqlens=None) -> (B, L, dim).

    ``group`` (default: the world) becomes DeepSpeed's ``sequence_process_group``. Head rules are
    the base class's (ValueError before any collective); DeepSpeed itself would need
    ``n_kv_heads >= C``, which the replication below guarantees.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)  # the common constructor and its validation
        distributed_attention = _import_distributed_attention()
        self.local_attn = _LocalAttention(self.causal, self.kernel)
        self.dist_attn = None  # stays None only without torch.distributed (C == 1)
        if dist.is_available() and dist.is_initialized():
            _attach_deepspeed_comm()
            group = self.group if self.group is not None else dist.group.WORLD
            # num_kv_heads is left to DeepSpeed, which reads it off the key tensor: after the
            # replication below it is a multiple of C, so DeepSpeed takes its even-split path.
            self.dist_attn = distributed_attention(
                self.local_attn, group, scatter_idx=SCATTER_IDX, gather_idx=GATHER_IDX
            )

    def forward(self, x: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
        self.check_input(x)
        docs = self.documents(cu_seqlens, x)
        # RoPE before the all-to-all, at this rank's global positions (within their document
        # when packed), rather than DeepSpeed's post-all-to-all rotary_pos_emb, whose tables are
        # laid out sequence-first.
        q, k, v = self.project_qkv(x, docs)
        # DeepSpeed splits KV heads over ranks and asserts Hkv >= C: replicate below that.
        k, v = replicate_kv_heads(k, self.cp), replicate_kv_heads(v, self.cp)
        # after DeepSpeed's all-to-all a rank holds the whole sequence: the global documents
        self.local_attn.blocks = None if docs is None else docs.full_blocks()
        try:
            if self.dist_attn is None:
                o = self.local_attn(q, k, v)
            else:
                o = self.dist_attn(q, k, v, BATCH_DIM)
        finally:
            self.local_attn.blocks = None
        return self.wo(o.flatten(2))
