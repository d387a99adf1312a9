"""A convex series' value between and beyond its samples, certified or not (the fit's far check).

Why convex: one phase of a step peaks at the largest of its moments (the live bytes after one
allocation), and on the fit's lattice each moment's bytes are affine in the sequence length S
(``fit``). The phase's peak is then the maximum of lines, a convex piecewise-linear function of
S; so is the host peak. A window of collinear samples shows one of those lines, but a moment
with a steeper line may overtake it further on (FPDT's step did: at 6M tokens a Qwen3-32B
block's backward peaked 3 GiB above the line through its 330K-980K window). For a convex f
known at lattice lengths x_0 < ... < x_m:

- between two samples x_i < S < x_{i+1}, f lies under their chord and over the lines through
  the neighbouring pairs, (x_{i-1}, x_i) and (x_{i+1}, x_{i+2}) (a secant of a convex function
  is below it outside the secant's interval): where a neighbour line meets the chord at S, f(S)
  is the chord's value, exactly;
- beyond the last sample nothing bounds f from above: only a sample at or past S tells;
- below the first sample the line through the first two is a lower bound.

``convex_at`` returns the value and, where the samples do not certify it, the lattice length
whose sample would (the lines' crossing, which settles a single change of moment in one
sample). Written by hand: it is arithmetic on a handful of exact integers.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass
from fractions import Fraction


@dataclass(frozen=True)
class Point:
    """A series at one length: ``value`` there, whether the samples certify it (``exact``), and
    the lattice length to sample next when they do not (None: no sample would help)."""

    value: Fraction
    exact: bool
    sample: int | None


def _through(x0: int, y0: int, x1: int, y1: int, s: int) -> Fraction:
    """The line through (x0, y0) and (x1, y1) at s."""
    return y0 + Fraction(y1 - y0, x1 - x0) * (s - x0)


def convex_at(xs: list[int], ys: list[int], s: int, quantum: int, shortest: int,
              tol: int) -> Point:
    """The convex piecewise-linear series sampled at the lattice lengths ``xs`` (ascending,
    at least two; values ``ys``) at length ``s``, certified to ``tol`` bytes (the allocator's
    rounding, ``fit.TOLERANCE_BYTES``) or with the length to sample: at ``s`` rounded up to the
    lattice (``quantum``) beyond the samples, inside the bracketing pair where a change of
    moment lies between them (at the neighbour lines' crossing), one quantum beside a pair one
    quantum apart whose neighbour there is missing, at ``s`` rounded down below the first
    sample while that is not below ``shortest`` (the fit's shortest length)."""
    if s in xs:
        return Point(Fraction(ys[xs.index(s)]), True, None)
    if s > xs[-1]:
        return Point(_through(xs[-2], ys[-2], xs[-1], ys[-1], s), False,
                     quantum * math.ceil(s / quantum))
    if s < xs[0]:
        below = quantum * (s // quantum)
        return Point(_through(xs[0], ys[0], xs[1], ys[1], s), False,
                     below if below >= shortest else None)
    i = bisect_left(xs, s) - 1  # xs[i] < s < xs[i + 1]
    chord = _through(xs[i], ys[i], xs[i + 1], ys[i + 1], s)
    left = (xs[i - 1], ys[i - 1], xs[i], ys[i]) if i >= 1 else None
    right = (xs[i + 1], ys[i + 1], xs[i + 2], ys[i + 2]) if i + 2 < len(xs) else None
    lower = [_through(*pair, s) for pair in (left, right) if pair is not None]
    # a neighbour line above the chord by more than the rounding: not a convex series (a peak's
    # breakdown by category need not be); only a sample between tells then, too
    if lower and abs(chord - max(lower)) <= tol:
        return Point(chord, True, None)
    inside = range(xs[i] // quantum + 1, -(-xs[i + 1] // quantum))  # lattice points strictly in
    if not inside:
        # s is off the lattice, its pair one quantum apart: a neighbour one quantum away on
        # either side is the series' own line there, where a far one is a long secant
        if i == 0 or xs[i] - xs[i - 1] > quantum:
            if xs[i] - quantum >= shortest and (i == 0 or xs[i] - quantum > xs[i - 1]):
                return Point(chord, False, xs[i] - quantum)
        if i + 2 >= len(xs) or xs[i + 2] - xs[i + 1] > quantum:
            return Point(chord, False, xs[i + 1] + quantum)
        return Point(chord, False, None)  # a change of moment within that one quantum
    target = Fraction(s)
    if left is not None and right is not None:
        (a0, b0), (a1, b1) = _slope_intercept(*left), _slope_intercept(*right)
        if a1 != a0:  # where the two moments' lines cross: the change of moment
            target = (b0 - b1) / (a1 - a0)
    k = min(max(round(target / quantum), inside.start), inside.stop - 1)
    return Point(chord, False, k * quantum)


def _slope_intercept(x0: int, y0: int, x1: int, y1: int) -> tuple[Fraction, Fraction]:
    slope = Fraction(y1 - y0, x1 - x0)
    return slope, y0 - slope * x0
