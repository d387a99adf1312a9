"""UPipe's head schedule: which query and KV heads each stage processes, in all-to-all order.

Notation (docs/design.md#upipe): H query heads, Hkv KV heads, C the CP degree, U heads per stage.

* KV replication: with Hkv < C every KV head is replicated ``rep = C / Hkv`` times so each rank
  owns one; effective KV heads Hkv' = max(Hkv, C), each serving g' = H / Hkv' query heads.
  Effective KV head e holds original head e // rep and serves query heads [e*g', (e+1)*g').
* KV blocks: Hkv' is cut into blocks of Ukv = gcd(U, Hkv') effective heads. A block's K/V are
  projected and all-to-all'd once and reused by all its stages (g'*Ukv/U of them). With the
  paper's default U = C <= Hkv', Ukv = U: "one query head from each of U KV groups per stage".
* Stage order: a stage lists its U query heads slot by slot (a = U/Ukv heads per KV slot), so
  after the sequence->head all-to-all rank r holds query heads whose KV heads are exactly the
  ones rank r holds, in contiguous GQA order (local query m uses local KV head m // a).

Everything here is pure Python on head indices: output heads are written back to their own index,
so UPipe computes attention in the model's own head order (a pretrained checkpoint stays valid).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVBlock:
    """One group of stages sharing K/V.

    kv_heads: original KV head index of each of the block's Ukv slots, in all-to-all order.
    stages: per stage, the U query head indices in all-to-all order.
    """

    kv_heads: tuple[int, ...]
    stages: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class StagePlan:
    """The whole schedule for (n_heads, n_kv_heads, cp, heads_per_stage)."""

    n_heads: int
    n_kv_heads: int
    cp: int
    heads_per_stage: int
    blocks: tuple[KVBlock, ...]

    @property
    def n_stages(self) -> int:
        return sum(len(b.stages) for b in self.blocks)

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)


def check_heads_per_stage(n_heads: int, cp: int, heads_per_stage: int) -> None:
    """U must be a positive multiple of the CP degree that divides the head count."""
    u = heads_per_stage
    # a float or a bool would pass the arithmetic below (4.0 % 2, True for 1) and fail later,
    # or run one head per stage, without naming the option
    if isinstance(u, bool) or not isinstance(u, numbers.Integral):
        raise ValueError(f"heads_per_stage must be an integer, got {u!r}")
    if u <= 0 or u % cp:
        raise ValueError(
            f"heads_per_stage ({u}) must be a positive multiple of the CP degree ({cp})"
        )
    if n_heads % u:
        raise ValueError(f"heads_per_stage ({u}) must divide n_heads ({n_heads})")


def make_stage_plan(n_heads: int, n_kv_heads: int, cp: int, heads_per_stage: int) -> StagePlan:
    """Build the schedule; head-count rules are checked by the caller (``check_ulysses_heads``)."""
    check_heads_per_stage(n_heads, cp, heads_per_stage)
    rep = cp // n_kv_heads if n_kv_heads < cp else 1
    n_eff = n_kv_heads * rep  # Hkv'
    g_eff = n_heads // n_eff  # query heads per effective KV head
    u_kv = math.gcd(heads_per_stage, n_eff)
    a = heads_per_stage // u_kv  # query heads per KV slot in one stage
    blocks = []
    for start in range(0, n_eff, u_kv):
        slots = range(start, start + u_kv)
        stages = tuple(
            tuple(e * g_eff + s * a + t for e in slots for t in range(a)) for s in range(g_eff // a)
        )
        blocks.append(KVBlock(kv_heads=tuple(e // rep for e in slots), stages=stages))
    return StagePlan(n_heads, n_kv_heads, cp, heads_per_stage, tuple(blocks))


@dataclass(frozen=True)
class PlanIndices:
    """A plan's head indices as device tensors: ``kv[b]`` (Ukv,) the KV heads of block b,
    ``q[b][s]`` (U,) the query heads of its stage s; int64 views of one tensor."""

    kv: tuple
    q: tuple


def plan_indices(plan: StagePlan, device: torch.device) -> PlanIndices:
    """Every index tensor a call walks, made in one host->device copy. A tensor built from a
    Python list on a CUDA device is copied from pageable host memory, which synchronises the
    host with the stream (the GPU's queue drains and waits for the host to refill it): made per
    stage, that cost each stage a synchronisation (measured on an H200: 480
    ``cudaStreamSynchronize`` per Llama3-8B step at U = 1, 32 stages,
    results/gpu_costs_h200/steps/ops.csv). Here the one copy is from pinned memory with
    ``non_blocking``: no synchronisation (the caching host allocator keeps the pinned buffer
    until the copy is done)."""
    flat = [h for blk in plan.blocks
            for h in (*blk.kv_heads, *(i for st in blk.stages for i in st))]
    host = torch.tensor(flat, dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    idx = host.to(device, non_blocking=True)
    kv, q, pos = [], [], 0
    for blk in plan.blocks:
        kv.append(idx[pos:pos + len(blk.kv_heads)])
        pos += len(blk.kv_heads)
        stages = []
        for st in blk.stages:
            stages.append(idx[pos:pos + len(st)])
            pos += len(st)
        q.append(tuple(stages))
    return PlanIndices(tuple(kv), tuple(q))


def stage_heads(t, plan: StagePlan, block: int, stage: int):
    """The view of a stage's query heads of t (B, L, H, D) in all-to-all order, split by
    destination rank: (B, L, C, m/a, a, D), m = U/C heads per rank, a = U/Ukv query heads per
    KV slot. Stage s of block b holds heads e*g' + s*a + t for its Ukv effective KV heads e and
    t < a (module docstring), a strided view of t as (B, L, Hkv', g', D); a divides m because C
    divides Ukv (U and Hkv' are multiples of C). Writing to it, or packing it for the
    all-to-all, takes one copy and no gather (``index_select``) of the stage's heads."""
    u_kv = len(plan.blocks[block].kv_heads)
    n_eff = u_kv * plan.n_blocks
    a = plan.heads_per_stage // u_kv
    m = plan.heads_per_stage // plan.cp
    b, l, h, d = t.shape
    heads = t.view(b, l, n_eff, h // n_eff, d)[:, :, block * u_kv:(block + 1) * u_kv,
                                               stage * a:(stage + 1) * a]
    return heads.unflatten(2, (plan.cp, m // a))
