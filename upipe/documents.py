"""Packed sequences: documents of one global sequence, and what attention and RoPE need of them.

Long-context SFT packs many documents into one sequence. ``cu_seqlens`` (flash-attn's
convention) are the *global* cumulative document lengths ``[0, l0, l0+l1, ..., S]``, the same
on every rank: host metadata (Python ints), so the code runs unchanged under FakeTensorMode.
Attention never crosses a document boundary and RoPE positions restart at 0 in each document.

Every token set a method attends over is an ordered list of global segments ``(start, length)``
(``upipe.layout``) whose local order is increasing in global position: a contiguous shard, a
zigzag pair (chunk r before chunk 2W-1-r), a ring block or half of one, an FPDT chunk, the full
sequence after the all-to-all. So the tokens of one document inside such a set are one
contiguous range of *local* indices, and attention of a query set over a key set splits into
one dense block per shared document: :meth:`Documents.blocks`. A causal block of one token set
over itself stays causal within each document (the local -> global map is monotone, so "key
index <= query index" is "key position <= query position"); a full block stays full. No
(L, L) mask is ever built, and no per-document padding is needed.

Pure Python on ints, like ``upipe.layout``.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from upipe.layout import SeqLayout, slice_segments

#: per shared document, (q_start, q_end, k_start, k_end): local index ranges of its queries and
#: keys in a (query set, key set) pair of token sets
DocBlocks = tuple[tuple[int, int, int, int], ...]
Segments = Sequence[tuple[int, int]]


def _as_ints(cu_seqlens) -> list[int]:
    """cu_seqlens as a list of Python ints (a sequence of ints or a 1-D integer CPU tensor)."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.is_complex():
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor, got {cu_seqlens.dtype} "
                             f"of shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.device.type != "cpu" or type(cu_seqlens) is not torch.Tensor:
            # a device (or fake) tensor cannot be read without a sync (or at all)
            raise ValueError("cu_seqlens must be host metadata: Python ints or a CPU tensor, "
                             f"got a {type(cu_seqlens).__name__} on {cu_seqlens.device}")
        return [int(v) for v in cu_seqlens.tolist()]
    if isinstance(cu_seqlens, (str, bytes)) or not isinstance(cu_seqlens, Sequence):
        raise ValueError(f"cu_seqlens must be a sequence of ints, got {type(cu_seqlens).__name__}")
    values = list(cu_seqlens)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"cu_seqlens must hold ints, got {values!r}")
    return values


@dataclass(frozen=True)
class Documents:
    """The non-empty documents of one packed global sequence.

    bounds: cumulative lengths ``(0, b1, ..., S)``, strictly increasing (empty documents
        dropped); document i holds global tokens ``[bounds[i], bounds[i+1])``.
    """

    bounds: tuple[int, ...]

    @property
    def seq_len(self) -> int:
        return self.bounds[-1]

    @property
    def n_docs(self) -> int:
        return len(self.bounds) - 1

    def _doc_of(self, pos: int) -> int:
        """Index of the document holding global token ``pos``."""
        return bisect.bisect_right(self.bounds, pos) - 1

    def positions(self, segments: Segments, device=None) -> torch.Tensor:
        """RoPE positions (sum of lengths,) of the tokens in ``segments``: index within their
        document. ``segments``: ordered ``(global start, length)`` (a layout's)."""
        parts = []
        for start, n in segments:
            pos, end = start, start + n
            while pos < end:
                d = self._doc_of(pos)
                stop = min(end, self.bounds[d + 1])
                off = self.bounds[d]
                parts.append(torch.arange(pos - off, stop - off, device=device))
                pos = stop
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def blocks(self, q_segments: Segments, k_segments: Segments) -> DocBlocks:
        """The dense blocks of attention from the query set over the key set.

        Both sets are ordered global segments with increasing positions (see the module
        docstring). Returns, per document holding tokens of both, the local index ranges
        ``(q_start, q_end, k_start, k_end)``, in document order; empty when they share none.
        """
        q_docs, k_docs = self._spans(q_segments), self._spans(k_segments)
        return tuple((*q_docs[d], *k_docs[d]) for d in sorted(q_docs.keys() & k_docs.keys()))

    def _spans(self, segments: Segments) -> dict[int, tuple[int, int]]:
        """{document: (local start, local end)} for the documents a token set touches."""
        spans: dict[int, tuple[int, int]] = {}
        local = 0
        for start, n in segments:
            pos, end = start, start + n
            while pos < end:
                d = self._doc_of(pos)
                stop = min(end, self.bounds[d + 1])
                lo = spans[d][0] if d in spans else local
                spans[d] = (lo, local + stop - pos)
                local += stop - pos
                pos = stop
        return spans

    def full_blocks(self) -> DocBlocks:
        """Blocks of the full sequence over itself (the all-to-all methods' local attention)."""
        return tuple((a, b, a, b) for a, b in itertools.pairwise(self.bounds))


def documents(cu_seqlens, seq_len: int) -> Documents | None:
    """Validate ``cu_seqlens`` for a global sequence of ``seq_len`` tokens.

    Returns None when there is nothing to mask (``cu_seqlens`` None, or a single document:
    today's unpacked path, bit for bit), else the :class:`Documents`. Raises ValueError naming
    the rule: not starting at 0, not ending at ``seq_len``, decreasing. Zero-length documents
    (repeated values) are allowed and dropped, as flash-attn's varlen kernels skip them.

    Ranks cannot compare their ``cu_seqlens`` without a collective, so that is not checked:
    every rank of the CP group must pass the same global ``cu_seqlens`` (as it passes the same
    sequence length); ranks that disagree compute wrong attention without an error.
    """
    if cu_seqlens is None:
        return None
    values = _as_ints(cu_seqlens)
    if len(values) < 2:
        raise ValueError(f"cu_seqlens must hold at least [0, S], got {values!r}")
    if values[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {values[0]}")
    if values[-1] != seq_len:
        raise ValueError(f"cu_seqlens must end at the global sequence length {seq_len}, "
                         f"got {values[-1]}")
    for i, (a, b) in enumerate(itertools.pairwise(values)):
        if b < a:
            raise ValueError(f"cu_seqlens must be non-decreasing, got {a} then {b} at index "
                             f"{i + 1}")
    bounds = tuple(dict.fromkeys(values))  # drops the repeats of empty documents, keeps order
    return None if len(bounds) == 2 else Documents(bounds)


@dataclass(frozen=True)
class RingDocuments:
    """The documents seen through a ring: which global tokens each ring rank holds.

    layout/world: the ring's sequence layout over its ``world`` ranks (``ring`` and
    ``zigzag-ring``: the method's own; a hybrid's ring axis: zigzag over the ring ranks, each
    rank holding its whole zigzag pair after the Ulysses all-to-all).
    """

    docs: Documents
    layout: SeqLayout
    world: int

    def tokens(self, rank: int, part: tuple[int, int] | None = None) -> list[tuple[int, int]]:
        """Global segments of ring rank ``rank``'s tokens, or of its local tokens
        ``[part[0], part[0] + part[1])`` (a zigzag half)."""
        segs = self.layout.segments(self.docs.seq_len, rank, self.world)
        return segs if part is None else slice_segments(segs, *part)


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> list[int]:
    """cu_seqlens of packed documents marked by ``position_ids`` that restart at 0 in each
    document (transformers' ``DataCollatorWithFlattening`` convention).

    Args:
        position_ids: (S,) or (B, S) integers; every row must mark the same documents (one
            ``cu_seqlens`` serves the whole batch) and count up by 1 inside each document.
    Returns ``[0, l0, l0+l1, ..., S]``. Reads the values (a host sync on a device tensor): call
    it on the full batch before sharding, not inside a step. ValueError naming the rule.
    """
    pos = position_ids if position_ids.dim() == 2 else position_ids.unsqueeze(0)
    if pos.dim() != 2 or pos.dtype.is_floating_point or pos.is_complex():
        raise ValueError(f"position_ids must be (batch, seq) integers, got {pos.dtype} of shape "
                         f"{tuple(position_ids.shape)}")
    pos = pos.cpu()
    if not torch.equal(pos, pos[:1].expand_as(pos)):
        raise ValueError("position_ids must mark the same documents in every row of the batch: "
                         "pack the batch into one sequence (batch 1)")
    row = pos[0]
    starts = (row == 0).nonzero().flatten().tolist()
    if not starts or starts[0] != 0:
        raise ValueError("position_ids must start at 0 (documents restart at 0)")
    step_ok = (row[1:] == row[:-1] + 1) | (row[1:] == 0)
    if not bool(step_ok.all()):
        bad = int((~step_ok).nonzero()[0]) + 1
        raise ValueError(f"position_ids must count up by 1 inside a document and restart at 0, "
                         f"got {int(row[bad - 1])} then {int(row[bad])} at index {bad}")
    return [*starts, row.shape[0]]
