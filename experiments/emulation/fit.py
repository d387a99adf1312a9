"""Paper-scale predictions from exact emulations at small sizes (the emulator's fast path).

Why this is exact at the target, not a curve fit: on one *lattice* of sequence lengths (every
tile, chunk and kernel padding divides evenly) every tensor the step allocates has a size that
is affine in the local sequence length L, and every loop runs a number of iterations affine in
L; middle blocks (all but the first and last) run identical code. So the live bytes at the
peak of each *phase* of the step (a block's forward or backward, its attention or MLP, the
loss, the optimizer) are affine in L and in the number of layers N, up to where another event
of the same phase takes over. The fit therefore works phase by phase:

- emulate the cell exactly (``fake_step.measure_fake``) at three lattice lengths
  S = kQ, (k+1)Q, (k+2)Q (the smallest k with two MLP shards per rank and, for chunked
  methods, the chunks of their loop's steady state, ``steady_chunks``) with N = 4 layers
  (blocks renamed by role: first, mid_first, mid, mid_last, last);
- per phase, require the three lengths to be collinear in bytes (to 64 KiB: the allocator's
  512-byte rounding of the few sizes that are not multiples of 512 everywhere); where a
  phase is not (its peak event changes between the samples: a constant term first, a term
  growing with S later), move the window one quantum longer, up to MAX_EXTENSIONS times;
- emulate N = 5 layers at the window's first two lengths, and require the extra middle block to
  lie exactly between its neighbours; phases that fail are
  listed in ``fit_nonaffine_phases`` (the prediction is then not trusted: ``exact=True``);
- predict every phase at (S, N) by its value at S with 4 and 5 layers, then the line in N, the
  peak as their maximum; host bytes likewise; communication bytes (sums, not peaks) by the
  window's lines; FLOPs as A(S) + N B(S) with A linear and B quadratic in S (attention); the
  work per window that the time model prices window by window from the 4-layer samples, the
  windows outside the blocks grown per layer by what the 5-layer ones add (``work_fit``).
- certify each peak at S (``certify``): a phase's peak is the largest of its moments' lines,
  so a moment the window does not show may overtake beyond it (FPDT's steps do, from 1M to
  3M tokens on Qwen3-32B). Where the samples around S do not pin its value, the fit samples
  S itself (memory only) and, between two samples, where the neighbouring lines cross, and
  keeps those samples for the predictions after. ``predict(certify=False)`` keeps to the
  window's lines (the CI guard's cheap check).

Lattice: Q = lcm(P x dim (the tiled MLP's shards of dim tokens), 2 x P x 128 (zigzag halves
and the flash kernels' 128-row blocks), the method's chunk size, a packed cell's doc_len). Off
the lattice (e.g. Qwen3-32B's dim 5120 over 16 ranks at multiples of 64K tokens) the MLP's
last shard is shorter than dim and a packed cell's last document holds the remainder, so the
lines through lattice samples are not the step's there (the chord between two of them was
found below the true peak): a certified prediction emulates S itself at its sample depths
(memory only) and takes the line in N from those; ``certify=False`` keeps to the window's
lines, approximate there.
tests/test_emulate.py checks predictions against exact emulations of the target.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

from experiments.config import Cell, Hardware
from experiments.config.options import declared, default
from experiments.emulation.certify import convex_at
from experiments.emulation.fake_step import Measurement, emulated_gpu, measure_fake
from experiments.timing.work_fit import predict_work
from upipe.registry import get_method

N_SAMPLE = (4, 5)  # layers in the sample runs: first, two (three) middle blocks, last
# lattice quanta the sample window may move while a phase is not collinear: DeepSpeed's FPDT
# (ds-fpdt, Llama3-8B, 8 ranks, 64K chunks) settles its forward peak from 7 chunks on (measured:
# the forward peak grows 336 MB from 6 to 7 chunks, then 470 MB per chunk), 4 quanta after a
# window starting at 3 chunks (it starts at its steady_chunks, 5, now: the margin is kept).
# UPipe on the long level with chunks at CPU size (tests/test_emulate.py: tiny, 512-token
# chunks, 1K quanta) needs 6: its recomputed forward's attention settles at 6K tokens and the
# step's root backward at 8K, where chunk scratch and head-stage tensors are of one size
MAX_EXTENSIONS = 6
MIN_TILES = 2  # per rank: with one, the tiled MLP calls the MLP directly (another code path)
ROLES = ("first", "mid_first", "mid", "mid_last", "last")


def sequence_chunk(cell: Cell) -> int | None:
    """The cell's sequence chunk (its method's default when unset), or None: not chunked."""
    if "chunk_size" not in declared(cell.method):
        return None
    return cell.option("chunk_size") or default(cell.method, "chunk_size")


def fit_refusal(cell: Cell) -> str | None:
    """Why the fit cannot predict ``cell`` (then only an exact emulation can), or None.

    A cell that keeps the attention in some blocks only (``keep_blocks``) runs two kinds of
    middle block, and which kind a sample's middle blocks are depends on its depth: the 4- and
    5-layer samples say nothing of the model's mix."""
    n_layers = cell.validate().n_layers
    if cell.keep_blocks is not None and cell.keep_blocks < n_layers:
        return (f"keep_blocks ({cell.keep_blocks} of {n_layers}) mixes blocks that keep the "
                "attention with blocks that recompute it; the fit's samples need every middle "
                "block alike")
    return None


def _first_quantum(cell: Cell, q: int, dim: int) -> int:
    """The smallest k such that k * q holds MIN_TILES MLP shards per rank and, for a chunked
    method, its chunk loop's steady state (``steady_chunks``): the fit's three lengths are k,
    k + 1 and k + 2 quanta."""
    k = math.ceil(MIN_TILES * cell.nproc * dim / q)
    chunk = sequence_chunk(cell)
    if chunk is None:
        return k
    return max(k, math.ceil(get_method(cell.method).steady_chunks * chunk / q))


def exact_is_cheaper(cell: Cell, n_layers: int, dim: int) -> bool:
    """Whether one exact step of ``cell`` costs no more than one of the fit's samples (so at
    most a fifth of the fit): a model shallower than the samples, or one no deeper than the
    5-layer samples and no longer than the longest of the window's first three lengths
    (``_window``). A step's
    ops grow with its layers and, through the tiled MLP's shards, chunks and loss chunks, with
    its length; the fit runs at least five such steps."""
    if n_layers < N_SAMPLE[0]:
        return True
    if n_layers > N_SAMPLE[1]:
        return False
    q = lattice(cell, dim)
    return cell.seq_len <= (_first_quantum(cell, q, dim) + 2) * q


def lattice(cell: Cell, dim: int) -> int:
    """The global-token quantum Q on which every allocation of the step is affine in S.

    A packed cell's documents (``doc_len``) divide Q: at every sample length they are all
    ``doc_len`` long, so each document's attention block is the same and their count is linear
    in S (off the lattice the last one holds the remainder).
    """
    q = math.lcm(cell.nproc * dim, 2 * cell.nproc * 128)
    chunk = sequence_chunk(cell)
    q = math.lcm(q, chunk) if chunk else q
    return math.lcm(q, cell.doc_len) if cell.doc_len else q


def _role(i: int, n: int) -> str:
    if i == 0:
        return "first"
    if i == n - 1:
        return "last"
    return "mid_first" if i == 1 else "mid_last" if i == n - 2 else "mid"


def canonical(key: tuple[str, ...], n_layers: int) -> tuple[str, ...]:
    """A phase key with block indices replaced by roles (``layers.7:bwd`` -> ``mid:bwd``)."""
    out = []
    for name in key:
        if name.startswith("layers."):
            idx, _, rest = name[len("layers."):].partition(":")
            name = f"{_role(int(idx), n_layers)}:{rest}"
        out.append(name)
    return tuple(out)


# How far a sample may sit off the line through the others and still count as collinear: the
# allocator's 512-byte rounding of the few tensors whose size is not a multiple of 512 at every
# length (the loss's last, partial chunk, per-chunk index tensors) moves a phase peak by a few
# KiB without a change of regime; a change of regime moves it by far more.
TOLERANCE_BYTES = 64 * 2**10


def _line(xs, ys, tol: int = TOLERANCE_BYTES) -> tuple[Fraction, Fraction] | None:
    """(slope, intercept) through the first two points if the others are within ``tol`` bytes
    of that line, else None."""
    slope = Fraction(ys[1] - ys[0], xs[1] - xs[0])
    for x, y in zip(xs[2:], ys[2:], strict=True):
        if abs(Fraction(y - ys[0]) - slope * (x - xs[0])) > tol:
            return None
    return slope, ys[0] - slope * xs[0]


def _quadratic(xs, ys) -> tuple[Fraction, Fraction, Fraction]:
    """(a, b, c) of a + b x + c x^2 through three points."""
    (x0, x1, x2), (y0, y1, y2) = xs, ys
    d01, d12 = Fraction(y1 - y0, x1 - x0), Fraction(y2 - y1, x2 - x1)
    c = (d12 - d01) / (x2 - x0)
    b = d01 - c * (x0 + x1)
    return y0 - b * x0 - c * x0 * x0, b, c


@dataclass
class Fit:
    """Exact emulations of a cell's family at N = 4 and 5 layers and lattice lengths, and
    predictions from them. The window's samples come first; a prediction that they do not
    certify (``certify.convex_at``) adds memory-only samples through ``sample``, kept for the
    predictions after it."""

    seq_lens: tuple[int, ...]  # the window: three lattice lengths, every 4-layer series collinear
    samples: dict[int, dict[int, Measurement]]  # depth -> length -> exact emulation
    quantum: int  # the lattice (``lattice``)
    shortest: int  # the shortest length the fit samples (``_first_quantum``)
    sample: Callable[[int, int], Measurement] | None = None  # (depth, length) -> emulation
    nonaffine: list[str] = field(default_factory=list)
    time_approximate: list[str] = field(default_factory=list)  # work_fit's approximate keys

    def __post_init__(self):
        self._phase_cache: dict[tuple[int, int], dict] = {}
        self._uncertified: list[str] = []  # the last prediction's series left uncertified
        # (depth, length) -> exact emulation at a length off the lattice (``_off_lattice``),
        # kept apart: the convexity that certifies the lattice's samples does not hold there
        self._off: dict[tuple[int, int], Measurement] = {}
        # counted only when every window sample is: a memory-only fit may take a counted
        # 4-layer window from the cache (``_cached``) beside 5-layer samples of its own
        self.counted = all(self.samples[n][x].flops is not None
                           for n in N_SAMPLE for x in self._window_lens(n))
        for m in self.samples[N_SAMPLE[1]].values():
            self.nonaffine += _check_mid(m, N_SAMPLE[1])

    def _phases_of(self, n: int, x: int) -> dict:
        if (n, x) not in self._phase_cache:
            self._phase_cache[(n, x)] = _phases(self.samples[n][x], n)
        return self._phase_cache[(n, x)]

    def _window_lens(self, n: int) -> tuple[int, ...]:
        """The window's lengths sampled at depth ``n`` (5 layers: its first two)."""
        return self.seq_lens if n == N_SAMPLE[0] else self.seq_lens[:2]

    def _window(self, n: int) -> list[Measurement]:
        """The samples of depth ``n`` at the window's lengths, those that count FLOPs and bytes
        sent when the fit does."""
        return [self.samples[n][x] for x in self._window_lens(n)]

    def _certified(self, get, n: int, seq_len: int, label: str) -> Fraction:
        """``get(measurement, phases)`` with ``n`` layers at ``seq_len``, certified by the
        samples around it (``convex_at``), sampling where they do not; what stays uncertified
        is recorded for this prediction's summary. Off the lattice, ``seq_len`` itself is
        sampled (``_off_lattice``)."""
        off = self._off_lattice(n, seq_len)
        if off is not None:
            return Fraction(get(off, _phases(off, n)))
        while True:
            xs = sorted(self.samples[n])
            ys = [get(self.samples[n][x], self._phases_of(n, x)) for x in xs]
            p = convex_at(xs, ys, seq_len, self.quantum, self.shortest, TOLERANCE_BYTES)
            if p.exact or p.sample is None or self.sample is None:
                break
            self.samples[n][p.sample] = self.sample(n, p.sample)
            if n == N_SAMPLE[1]:
                self.nonaffine += _check_mid(self.samples[n][p.sample], n)
        if not p.exact:
            why = "no sampler" if self.sample is None else "changes within one quantum"
            self._uncertified.append(f"{label} ({why} of {seq_len})")
        return p.value

    def _off_lattice(self, n: int, seq_len: int) -> Measurement | None:
        """The exact emulation at ``seq_len`` with ``n`` layers when ``seq_len`` is off the
        lattice (memory only, sampled once), else None. There the lines through lattice samples
        are not the step's: the MLP's last shard is shorter than dim, a packed cell's last
        document holds the remainder, and the chord between two lattice samples can sit below
        the true peak (measured: 164-328 KiB low for UPipe with doc_len 3072 on the tiny model,
        and a search accepted a length that was out of memory), so no convexity certifies it.
        Below the shortest sampled length too, on the lattice or not: there the line through
        the two shortest samples is no bound (a different code path, e.g. one MLP tile;
        measured 522,240 B above the exact peak for the tiny model's UPipe at 1K tokens, where
        rows had said certified). None without a sampler."""
        if self.sample is None or (seq_len % self.quantum == 0 and seq_len >= self.shortest):
            return None
        if (n, seq_len) not in self._off:
            self._off[n, seq_len] = m = self.sample(n, seq_len)
            if n == N_SAMPLE[1]:
                self.nonaffine += _check_mid(m, n)
        return self._off[n, seq_len]

    def _bilinear(self, get, seq_len: int, n_layers: int, label: str, certify: bool) -> int:
        """``get(measurement, phases)`` at (seq_len, n_layers): certified at each sample depth
        (``_certified``), or the window's line there (``certify=False``), then a line in N."""
        if not certify:
            return self._window_bilinear(
                lambda n, x: get(self.samples[n][x], self._phases_of(n, x)), seq_len, n_layers,
                label)
        at_n = [self._certified(get, n, seq_len, label) for n in N_SAMPLE]
        return int(round(at_n[0] + (n_layers - N_SAMPLE[0]) * (at_n[1] - at_n[0])))

    def _window_bilinear(self, get, seq_len: int, n_layers: int, label: str) -> int:
        """A line in S through the window's samples at each depth (``get(depth, length)``),
        then a line in N: exact for a sum the step adds up rather than a peak (bytes sent). A
        series that is not collinear is recorded in ``nonaffine`` and continued from its last
        two points."""
        at_n = []
        for n in N_SAMPLE:
            xs = self._window_lens(n)
            ys = [get(n, x) for x in xs]
            line = _line(xs, ys)
            if line is None:
                self.nonaffine.append(label)
                line = _line(xs[-2:], ys[-2:])
            at_n.append(line[0] * seq_len + line[1])
        return int(round(at_n[0] + (n_layers - N_SAMPLE[0]) * (at_n[1] - at_n[0])))

    def _flops(self, seq_len: int, n_layers: int) -> int:
        """FLOPs F(S, N) = A(S) + N B(S): A linear (the loss head; embedding lookups, FSDP and
        the optimizer count none), B quadratic (a block: attention is quadratic in S). The
        window's 3 + 2 samples determine the 5 coefficients exactly."""
        f4 = [m.flops for m in self._window(N_SAMPLE[0])]
        f5 = [m.flops for m in self._window(N_SAMPLE[1])[:2]]
        a4, b4, c4 = _quadratic(self.seq_lens, f4)  # A + 4B
        per_layer = [y5 - y4 for y4, y5 in zip(f4[:2], f5, strict=True)]  # B at the first two
        (x0, x1), c = self.seq_lens[:2], c4 / N_SAMPLE[0]
        b = Fraction(per_layer[1] - per_layer[0], x1 - x0) - c * (x0 + x1)
        a = per_layer[0] - b * x0 - c * x0 * x0
        at_4 = a4 + b4 * seq_len + c4 * seq_len * seq_len
        return int(round(at_4 + (n_layers - N_SAMPLE[0]) * (a + b * seq_len + c * seq_len**2)))

    def predict(self, seq_len: int, n_layers: int, certify: bool = True) -> Measurement:
        """The step at (seq_len, n_layers). ``certify``: every peak certified by samples around
        ``seq_len`` (``_certified``, sampling where needed: the default); False: the window's
        lines, as cheap as the window and blind to a moment overtaking beyond it (``certify``),
        for a check that compares like with like (the CI guard)."""
        self._uncertified = []
        every = [self._phases_of(n, x) for n in N_SAMPLE for x in self._window_lens(n)]
        keys = sorted(set.intersection(*(set(ph) for ph in every)))
        peaks = {k: self._bilinear(lambda m, ph, k=k: ph.get(k, (0, {}))[0], seq_len,
                                   n_layers, " > ".join(k), certify) for k in keys}
        top = max(peaks, key=peaks.get)
        cats = sorted(set().union(*(ph[top][1] for ph in every)))
        breakdown = {c: self._bilinear(lambda m, ph, c=c: ph.get(top, (0, {}))[1].get(c, 0),
                                       seq_len, n_layers, f"{' > '.join(top)} [{c}]", certify)
                     for c in cats}
        host = self._bilinear(lambda m, ph: m.peak_host_bytes, seq_len, n_layers, "host",
                              certify)
        comm, flops = None, None
        if self.counted:
            window = [m for n in N_SAMPLE for m in self._window(n)]
            ops = sorted(set().union(*(m.comm_bytes for m in window)))
            comm = {op: self._window_bilinear(
                lambda n, x, op=op: self.samples[n][x].comm_bytes.get(op, 0), seq_len,
                n_layers, f"comm {op}") for op in ops}
            flops = self._flops(seq_len, n_layers)
        work = None
        if self.counted and self._window(N_SAMPLE[0])[0].work is not None:
            deeper = [m.work for m in self._window(N_SAMPLE[1])]  # both or neither recorded
            work, self.time_approximate = predict_work(
                [m.work for m in self._window(N_SAMPLE[0])], self.seq_lens, N_SAMPLE[0],
                seq_len, n_layers, None if None in deeper else deeper)
        self.nonaffine = sorted(set(self.nonaffine))
        return Measurement(peaks[top], host, breakdown, {top: peaks[top]}, {top: breakdown},
                           flops, comm, work)

    def summary(self, certify: bool = True) -> dict:
        """The fit's provenance for a row: its window, depths, what it could not certify,
        whether the prediction was certified (``predict`` asked to certify, and nothing named
        uncertified or not affine) and the lengths of its samples
        besides the window's (before it, and those sampled to certify predictions so far)."""
        checked = sorted(({x for n in N_SAMPLE for x in self.samples[n]}
                          | {x for _, x in self._off}) - set(self.seq_lens))
        flagged = sorted(set(self.nonaffine + self._uncertified))
        # certified: asked for, and every series the prediction took certified and affine (a
        # row said certified while naming what was not)
        return {"emulation": "fit", "fit_seq_lens": list(self.seq_lens),
                "fit_layers": list(N_SAMPLE), "fit_nonaffine_phases": flagged,
                "fit_time_approximate": list(self.time_approximate),
                "fit_certified": certify and not flagged, "fit_checked_lens": checked}


def _phases(m: Measurement, n_layers: int) -> dict[tuple[str, ...], tuple[int, dict]]:
    """Phase peaks by canonical key, with their breakdowns; the N = 5 run's "mid" block is
    checked by ``_check_mid`` and left out here."""
    out: dict[tuple[str, ...], tuple[int, dict]] = {}
    for key, peak in m.phase_peaks.items():
        ck = canonical(key, n_layers)
        if any(name.startswith("mid:") for name in ck):
            continue
        out[ck] = (peak, m.phase_breakdowns.get(key, {}))
    return out


def _check_mid(m: Measurement, n_layers: int) -> list[str]:
    """Phases of the middle block of a 5-layer run that are not exactly halfway between the
    blocks before and after it (the affine-in-depth assumption)."""
    bad = []
    for key, peak in m.phase_peaks.items():
        ck = canonical(key, n_layers)
        if not any(name.startswith("mid:") for name in ck):
            continue
        before = tuple(n.replace("mid:", "mid_first:") for n in ck)
        after = tuple(n.replace("mid:", "mid_last:") for n in ck)
        lo = max((v for k, v in m.phase_peaks.items() if canonical(k, n_layers) == before),
                 default=None)
        hi = max((v for k, v in m.phase_peaks.items() if canonical(k, n_layers) == after),
                 default=None)
        if lo is None or hi is None or 2 * peak != lo + hi:
            bad.append(" > ".join(ck) + " (depth)")
    return bad


_CACHE: dict[tuple, Fit] = {}
_WINDOWS: dict[tuple, tuple[list[int], list[Measurement]]] = {}


def _cached(cache: dict, cell: Cell, hw: Hardware, count: bool, make):
    """``cache``'s entry for ``cell``'s family, made by ``make()`` once per process. The family
    is every field but those that change nothing in one step's allocations: the length (the
    fit's variable), the step counts, the budget (it decides the status, after) and labels; the
    node size decides which links collectives use, and the emulated GPU (its compute capability
    and priced kernels) which kernel ``"auto"`` runs. A counted entry serves an uncounted one."""
    family = dataclasses.replace(cell, seq_len=0, warmup=0, iters=0, budget_mib=None, extra={})
    cap = emulated_gpu(hw) if hw.device == "cuda" else None
    key = (family, hw.device, hw.gpus_per_node, cap, count)
    if not count and (family, hw.device, hw.gpus_per_node, cap, True) in cache:
        return cache[(family, hw.device, hw.gpus_per_node, cap, True)]
    if key not in cache:
        cache[key] = make()
    return cache[key]


def _sampler(cell: Cell, hw: Hardware, count: bool, n_layers: int):
    """``S -> measure_fake`` of ``cell`` at length S with ``n_layers`` layers, with the work
    the time model prices when ``count`` (``work_fit``: the 4-layer samples' per window, and
    what the 5-layer ones add outside the blocks)."""
    cfg = dataclasses.replace(cell.validate(), n_layers=n_layers)
    return lambda s: measure_fake(dataclasses.replace(cell, seq_len=s), cfg, hw, count)


def _memory_sampler(cell: Cell, hw: Hardware):
    """``(N, S) -> measure_fake`` of ``cell``, memory only: the samples a prediction adds to
    certify its peaks (``Fit._certified``); bytes sent and FLOPs come from the window."""
    return lambda n, s: _sampler(cell, hw, False, n)(s)


def _window(cell: Cell, hw: Hardware, count: bool) -> tuple[list[int], list[Measurement]]:
    """The 4-layer samples, in length order, whose last three lengths are the fit's window:
    three lattice lengths from the first quantum on, moved one quantum longer while a phase
    is not collinear over them (up to MAX_EXTENSIONS times)."""

    def make():
        dim = cell.validate().dim
        q = lattice(cell, dim)
        k = _first_quantum(cell, q, dim)
        run = _sampler(cell, hw, count, N_SAMPLE[0])
        lengths = [k * q, (k + 1) * q, (k + 2) * q]
        at_4 = [run(s) for s in lengths]
        # A phase whose peak event changes between the samples (constant terms first, terms
        # growing with S later) is not collinear yet: move the window to longer lengths.
        for _ in range(MAX_EXTENSIONS):
            if not _noncollinear(lengths[-3:], at_4[-3:]):
                break
            lengths.append(lengths[-1] + q)
            at_4.append(run(lengths[-1]))
        return lengths, at_4

    return _cached(_WINDOWS, cell, hw, count, make)


def fitted(cell: Cell, hw: Hardware, count: bool = True) -> Fit:
    """The fit for ``cell``'s family (``_cached``), computed once per process; ValueError for
    a cell it cannot predict (``fit_refusal``)."""
    reason = fit_refusal(cell)
    if reason is not None:
        raise ValueError(f"cannot fit {cell.cell_id()}: {reason}")

    def make():
        lengths, at_4 = _window(cell, hw, count)
        # the window is in one regime throughout: its two shortest lengths are the cheapest
        run = _sampler(cell, hw, count, N_SAMPLE[1])
        at_5 = {s: run(s) for s in lengths[-3:-1]}
        dim = cell.validate().dim
        q = lattice(cell, dim)
        # every 4-layer sample, the window's and those before it: they certify predictions
        # between them (``certify``)
        return Fit(tuple(lengths[-3:]), {N_SAMPLE[0]: dict(zip(lengths, at_4, strict=True)),
                                         N_SAMPLE[1]: at_5},
                   q, _first_quantum(cell, q, dim) * q, _memory_sampler(cell, hw))

    return _cached(_CACHE, cell, hw, count, make)


def depth_lower_bound(cell: Cell, hw: Hardware, count: bool = True) -> Measurement | None:
    """A lower bound on ``cell``'s step (its model's N layers, its length) from the fit's 4-layer
    samples alone; None when a series of the window is not collinear (the samples then predict
    nothing).

    Each phase's peak (and its breakdown, and the host peak) with 4 layers at ``cell.seq_len``
    is its line through the window, exact as the fit's predictions are. The model's own device
    peak is at least the highest of those phases plus, for each of its N - 4 further blocks, the
    block's parameter and optimizer-state shards (``Measurement.block_state_bytes``, counted as
    "model"): every block adds them to every moment of the step, besides whatever else it keeps
    (its checkpoint, its gradients), so more layers never keep less; its host peak is at least
    the 4-layer one. It costs the window's samples, which the fit reuses, not the 5-layer ones.
    None, too, for a cell the fit cannot predict (``fit_refusal``).
    """
    if fit_refusal(cell) is not None:
        return None
    lengths, at_4 = _window(cell, hw, count)
    xs, ms = lengths[-3:], at_4[-3:]
    if _noncollinear(xs, ms):
        return None

    def at(ys: list[int]) -> int:  # the series' line at the target length
        slope, intercept = _line(xs, ys)
        return int(round(slope * cell.seq_len + intercept))

    phases = [_phases(m, N_SAMPLE[0]) for m in ms]
    peaks = {k: at([ph[k][0] for ph in phases])
             for k in set.intersection(*(set(ph) for ph in phases))}
    top = max(peaks, key=peaks.get)
    breakdown = {c: at([ph[top][1].get(c, 0) for ph in phases])
                 for c in set().union(*(ph[top][1] for ph in phases))}
    extra = (cell.validate().n_layers - N_SAMPLE[0]) * ms[-1].block_state_bytes
    breakdown["model"] = breakdown.get("model", 0) + extra
    return Measurement(peaks[top] + extra, at([m.peak_host_bytes for m in ms]), breakdown,
                       {top: peaks[top] + extra}, {top: breakdown}, None, None)


def _noncollinear(xs, ms: list[Measurement]) -> list[str]:
    """The 4-layer series (phase peaks and their categories, host and communication bytes)
    that are not collinear (``_line``) over ``xs``."""
    phases = [_phases(m, N_SAMPLE[0]) for m in ms]
    series: dict[str, list[int]] = {"host": [m.peak_host_bytes for m in ms]}
    for key in set.intersection(*(set(ph) for ph in phases)):
        series[" > ".join(key)] = [ph[key][0] for ph in phases]
        for c in set().union(*(ph[key][1] for ph in phases)):
            series[f"{' > '.join(key)} [{c}]"] = [ph[key][1].get(c, 0) for ph in phases]
    for op in set().union(*(m.comm_bytes or {} for m in ms)):
        series[f"comm {op}"] = [m.comm_bytes.get(op, 0) for m in ms]
    return sorted(k for k, ys in series.items() if _line(xs, ys) is None)
