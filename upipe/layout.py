"""Sequence layouts: which global tokens each CP rank holds, and shard/unshard helpers.

A layout maps (global length S, rank r, world W) to this rank's tokens as an ordered list of
contiguous global segments ``(start, length)``; every helper (shard, unshard, RoPE positions) is
derived from that one function, so all three agree by construction. Pure Python on ints: it runs
unchanged under FakeTensorMode.

Kinds (``SeqLayout.kind``):

* ``contiguous`` -- rank r holds tokens [r*S/W, (r+1)*S/W).
* ``zigzag`` -- the sequence cut into 2W' chunks; "outer" rank q holds chunks q and 2W'-1-q,
  in that order, which balances causal ring attention (every rank holds one early and one late
  chunk; zhuzilin/ring-flash-attention's zigzag, Brandon et al. arXiv 2311.09431 call it
  "striped"/load-balanced). With ``inner`` > 1 (the USP hybrid), W' = W/inner outer ranks each own
  that zigzag pair and split it contiguously over ``inner`` consecutive ranks (rank = q*inner + i),
  so a sequence->head all-to-all over the inner group hands every inner rank its outer rank's
  whole zigzag pair, in order.
* ``chunked`` -- FPDT's layout (Yao et al., arXiv 2408.16978): the sequence cut into global chunks
  of ``chunk_size`` tokens (the last may be shorter), each chunk split contiguously over the W
  ranks; rank r holds piece r of every chunk, in chunk order. A sequence->head all-to-all of one
  local chunk then yields one contiguous global span. ``chunk_size >= S`` is ``contiguous``.

Tests and the harness always go through these helpers (via a method's ``shard``/``unshard``), so
no caller special-cases a method.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from upipe.comm import group_size

LAYOUTS = ("contiguous", "zigzag", "chunked")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


@dataclass(frozen=True)
class SeqLayout:
    """A sequence layout over W ranks.

    kind: one of :data:`LAYOUTS`.
    inner: zigzag only: ranks that split each outer rank's zigzag pair contiguously (USP's
        Ulysses degree); W must be a multiple of it.
    chunk_size: chunked only: global tokens per chunk (a multiple of W).
    """

    kind: str = "contiguous"
    inner: int = 1
    chunk_size: int = 0

    def __post_init__(self):
        check_layout(self.kind)
        if self.inner < 1:
            raise ValueError(f"inner must be >= 1, got {self.inner}")
        if self.kind == "chunked" and self.chunk_size < 1:
            raise ValueError(
                f"chunk_size must be >= 1 for the chunked layout, got {self.chunk_size}"
            )

    # -- rules --------------------------------------------------------------------------------

    def check(self, seq_len: int, world: int) -> None:
        """Divisibility rules for a global length over ``world`` ranks; ValueError otherwise."""
        if world % self.inner:
            raise ValueError(f"the CP degree ({world}) must be a multiple of inner ({self.inner})")
        if self.kind == "zigzag":
            if seq_len % (2 * world):
                raise ValueError(
                    f"seq_len ({seq_len}) must be divisible by 2 x the CP degree ({2 * world}) "
                    "for the zigzag layout; pad the sequence"
                )
        elif self.kind == "chunked":
            if self.chunk_size % world:
                raise ValueError(
                    f"chunk_size ({self.chunk_size}) must be divisible by the CP degree ({world})"
                )
        if seq_len % world:
            raise ValueError(
                f"seq_len ({seq_len}) must be divisible by the CP degree ({world}); "
                "pad the sequence"
            )

    def check_local(self, seq_local: int, world: int) -> None:
        """:meth:`check` from a rank's local length (global = seq_local * world)."""
        self.check(seq_local * world, world)

    # -- the layout itself --------------------------------------------------------------------

    def segments(self, seq_len: int, rank: int, world: int) -> list[tuple[int, int]]:
        """Rank ``rank``'s tokens: ordered ``(global start, length)`` segments."""
        self.check(seq_len, world)
        if self.kind == "contiguous":
            n = seq_len // world
            return [(rank * n, n)]
        if self.kind == "zigzag":
            outer, i = divmod(rank, self.inner)
            w_out = world // self.inner
            c = seq_len // (2 * w_out)  # zigzag chunk
            pair = [(outer * c, c), ((2 * w_out - 1 - outer) * c, c)]
            n = 2 * c // self.inner  # this rank's contiguous piece of the pair
            return slice_segments(pair, i * n, n)
        out = []  # chunked
        for start in range(0, seq_len, self.chunk_size):
            n = min(self.chunk_size, seq_len - start) // world
            out.append((start + rank * n, n))
        return out

    def local_chunks(self, seq_local: int, world: int) -> list[int]:
        """Local token counts of this layout's chunks (chunked: one per global chunk)."""
        if self.kind != "chunked":
            return [seq_local]
        return [n for _, n in self.segments(seq_local * world, 0, world)]

    def positions(self, seq_local: int, rank: int, world: int, device=None) -> torch.Tensor:
        """Global token indices (seq_local,) of this rank's tokens, used for RoPE."""
        segs = self.segments(seq_local * world, rank, world)
        return torch.cat([torch.arange(s, s + n, device=device) for s, n in segs])

    def shard(self, x: torch.Tensor, rank: int, world: int, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of the full-sequence ``x`` along ``dim`` (a view when contiguous)."""
        segs = self.segments(x.shape[dim], rank, world)
        if len(segs) == 1:
            return x.narrow(dim, *segs[0])
        return torch.cat([x.narrow(dim, s, n) for s, n in segs], dim=dim)

    def assemble(self, parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """The full sequence from every rank's part (``parts[r]`` = rank r's tokens)."""
        world = len(parts)
        seq_len = parts[0].shape[dim] * world
        shape = list(parts[0].shape)
        shape[dim] = seq_len
        full = parts[0].new_empty(shape)
        for r, part in enumerate(parts):
            offset = 0
            for s, n in self.segments(seq_len, r, world):
                full.narrow(dim, s, n).copy_(part.narrow(dim, offset, n))
                offset += n
        return full


def slice_segments(segs: list[tuple[int, int]], start: int, n: int) -> list[tuple[int, int]]:
    """Tokens [start, start+n) of the concatenation of ``segs``, as segments."""
    out, offset = [], 0
    for s, length in segs:
        lo, hi = max(start, offset), min(start + n, offset + length)
        if lo < hi:
            out.append((s + lo - offset, hi - lo))
        offset += length
    return out


def _as_layout(layout: str | SeqLayout) -> SeqLayout:
    return layout if isinstance(layout, SeqLayout) else SeqLayout(layout)


def gather_parts(x_local: torch.Tensor, groups: list[ProcessGroup | None]) -> list[torch.Tensor]:
    """Every rank's ``x_local``, in flattened-rank order (no autograd).

    ``groups`` lists the CP mesh's axes from inner to outer (one group for a 1-D CP group; for
    a (ring, ulysses) mesh ``[ulysses, ring]``): flattened rank = outer_rank * inner_size +
    inner_rank. Gathering axis by axis needs no flattened process group.
    """
    parts = [x_local.contiguous()]
    for g in groups:
        w = group_size(g)
        if w == 1:
            continue
        block = torch.stack(parts)  # (n_parts, ...) this rank's parts so far
        recv = [torch.empty_like(block) for _ in range(w)]
        dist.all_gather(recv, block, group=g)
        parts = [p for b in recv for p in b.unbind(0)]
    return parts


def unshard_sequence(
    x_local: torch.Tensor, group: ProcessGroup | None, layout: str | SeqLayout = "contiguous",
    dim: int = 1, outer_group: ProcessGroup | None = None,
) -> torch.Tensor:
    """Gather every rank's shard back into the full sequence (all_gather; no autograd)."""
    # None means the default group, so an absent outer axis is left out rather than passed
    parts = gather_parts(x_local, [group] + ([outer_group] if outer_group is not None else []))
    if len(parts) == 1:
        return x_local
    return _as_layout(layout).assemble(parts, dim)

