"""The fit's far check (experiments/emulation/certify.py, ``fit.Fit._certified``): a phase's peak
is the largest of its moments, lines in the length; a window of collinear samples shows one of
them, and a steeper one may overtake it further on. Synthetic series here, so every answer is
known; tests/test_emulate.py checks the fit against exact emulations."""

from __future__ import annotations

from fractions import Fraction

import pytest

from experiments.emulation.certify import convex_at
from experiments.emulation.fake_step import Measurement
from experiments.emulation.fit import Fit

Q = 1024  # lattice quantum of the synthetic series
TOL = 0


def kinked(s: int) -> int:
    """Two moments: flat-ish early (a constant scratch), steeper from 9Q on."""
    return max(1_000_000 + 10 * s, 100 * s + 1_000_000 - 90 * 9 * Q)


def _fill(xs):
    return list(xs), [kinked(x) for x in xs]


def test_between_collinear_samples_the_chord_is_certified():
    xs, ys = _fill([2 * Q, 3 * Q, 4 * Q, 5 * Q])
    p = convex_at(xs, ys, 3 * Q + 100, Q, 2 * Q, TOL)
    assert p.exact and p.sample is None and p.value == kinked(3 * Q + 100)


def test_beyond_the_samples_nothing_is_certified_and_the_target_is_sampled():
    xs, ys = _fill([2 * Q, 3 * Q, 4 * Q])
    p = convex_at(xs, ys, 20 * Q + 5, Q, 2 * Q, TOL)
    # the window's line: what the fit said before it had a far check, 1.4M bytes low here
    assert not p.exact and p.sample == 21 * Q
    assert kinked(20 * Q + 5) - p.value == 90 * (20 * Q + 5) - 90 * 9 * Q


def test_a_change_of_moment_between_two_samples_is_sampled_where_the_lines_cross():
    xs, ys = _fill([2 * Q, 3 * Q, 4 * Q, 19 * Q, 20 * Q, 21 * Q])
    p = convex_at(xs, ys, 15 * Q, Q, 2 * Q, TOL)
    assert not p.exact and p.sample == 9 * Q  # the lines 10 s + c and 100 s + c' cross at 9Q
    xs, ys = _fill(sorted(xs + [9 * Q]))
    for s in (5 * Q + 7, 9 * Q, 15 * Q + 3):
        p = convex_at(xs, ys, s, Q, 2 * Q, TOL)
        assert p.exact and p.value == kinked(s)


def test_off_the_lattice_within_one_quantum_of_the_change_it_stays_uncertified():
    def f(s):  # the change at 9.5 Q: between two lattice lengths
        return max(10 * s, 100 * s - 90 * 9 * Q - 45 * Q)

    xs = [2 * Q, 3 * Q, 9 * Q, 10 * Q, 11 * Q]
    # the neighbour on the left is a long secant: first the lattice length beside the pair
    assert convex_at(xs, [f(x) for x in xs], 9 * Q + 512, Q, 2 * Q, TOL).sample == 8 * Q
    xs = [2 * Q, 3 * Q, 8 * Q, 9 * Q, 10 * Q, 11 * Q]
    p = convex_at(xs, [f(x) for x in xs], 9 * Q + 512, Q, 2 * Q, TOL)
    assert not p.exact and p.sample is None
    assert p.value >= f(9 * Q + 512)  # the chord: above a convex series


def test_below_the_samples_it_samples_down_to_the_shortest_length_only():
    xs, ys = _fill([6 * Q, 7 * Q])
    assert convex_at(xs, ys, 3 * Q + 1, Q, 2 * Q, TOL).sample == 3 * Q
    p = convex_at(xs, ys, Q, Q, 2 * Q, TOL)
    assert not p.exact and p.sample is None


def _measurement(s: int, n: int) -> Measurement:
    """A synthetic step of ``n`` layers at ``s``: the block backward's peak ``kinked`` plus
    1000 bytes a layer, and a host peak linear in s."""
    peak = kinked(s) + 1000 * n
    key = ("backward",)
    return Measurement(peak, 3 * s, {"attention": peak}, {key: peak}, {key: {"attention": peak}},
                       None, None, block_state_bytes=1000)


def test_the_fit_samples_far_out_and_predicts_the_change_of_moment_exactly():
    asked = []

    def sample(n, s):
        asked.append((n, s))
        return _measurement(s, n)

    window = (2 * Q, 3 * Q, 4 * Q)
    fit = Fit(window, {4: {s: _measurement(s, 4) for s in window},
                       5: {s: _measurement(s, 5) for s in window[:2]}}, Q, 2 * Q, sample)
    s = 30 * Q  # on the lattice (off it, the length itself is sampled: the test below)
    m = fit.predict(s, 32)
    assert m.peak_device_bytes == kinked(s) + 32 * 1000
    assert m.breakdown == {"attention": kinked(s) + 32 * 1000}
    assert m.peak_host_bytes == 3 * s
    assert fit.summary()["fit_nonaffine_phases"] == []
    assert (4, 30 * Q) in asked and (5, 30 * Q) in asked  # the target, beyond the window
    assert fit.summary()["fit_checked_lens"] == sorted({x for _, x in asked})
    # a shorter length between the window and the far samples is certified with what is there
    # or a sample where the lines cross, and its answer is exact too
    before = len(asked)
    assert fit.predict(12 * Q, 32).peak_device_bytes == kinked(12 * Q) + 32 * 1000
    assert len(asked) - before <= 4


def test_without_a_sampler_an_uncertified_prediction_is_named():
    window = (2 * Q, 3 * Q, 4 * Q)
    fit = Fit(window, {4: {s: _measurement(s, 4) for s in window},
                       5: {s: _measurement(s, 5) for s in window[:2]}}, Q, 2 * Q)
    fit.predict(30 * Q, 32)
    assert "backward (no sampler of 30720)" in fit.summary()["fit_nonaffine_phases"]
    # the row says so: a certifying prediction that could not certify is not certified
    assert fit.summary()["fit_certified"] is False
    fit.predict(3 * Q, 32)  # inside the window: certified, and the flag was that prediction's
    assert fit.summary()["fit_nonaffine_phases"] == []
    assert fit.summary()["fit_certified"] is True
    assert fit.summary(certify=False)["fit_certified"] is False


def test_below_the_shortest_sample_the_length_itself_is_sampled():
    """Below the fit's shortest length the line through its two shortest samples is no bound
    (another code path: measured 522,240 B above the exact peak for the tiny model's UPipe at
    1K tokens), yet rows had said certified and named nothing. The length is sampled now (as
    off the lattice); without a sampler the prediction is named uncertified."""
    def shallow(s, n):  # a step whose short lengths run another path: 5000 B more below 2Q
        m = _measurement(s, n)
        extra = 5000 if s < 2 * Q else 0
        key = ("backward",)
        peak = m.peak_device_bytes + extra
        return Measurement(peak, m.peak_host_bytes, {"attention": peak}, {key: peak},
                           {key: {"attention": peak}}, None, None, block_state_bytes=1000)

    asked = []

    def sample(n, x):
        asked.append((n, x))
        return shallow(x, n)

    window = (2 * Q, 3 * Q, 4 * Q)
    samples = {4: {x: shallow(x, 4) for x in window}, 5: {x: shallow(x, 5) for x in window[:2]}}
    fit = Fit(window, samples, Q, 2 * Q, sample)
    assert fit.predict(Q, 8).peak_device_bytes == shallow(Q, 8).peak_device_bytes
    assert {(4, Q), (5, Q)} <= set(asked) and not fit.summary()["fit_nonaffine_phases"]
    blind = Fit(window, samples, Q, 2 * Q)
    blind.predict(Q, 8)
    assert "backward (no sampler of 1024)" in blind.summary()["fit_nonaffine_phases"]


@pytest.mark.parametrize("s", [2 * Q, 3 * Q + 1, 4 * Q])
def test_inside_the_window_at_most_the_third_five_layer_sample_is_added(s):
    window = (2 * Q, 3 * Q, 4 * Q)
    asked = []

    def sample(n, x):
        asked.append((n, x))
        return _measurement(x, n)

    fit = Fit(window, {4: {x: _measurement(x, 4) for x in window},
                       5: {x: _measurement(x, 5) for x in window[:2]}}, Q, 2 * Q, sample)
    assert fit.predict(s, 8).peak_device_bytes == kinked(s) + 8000
    assert Fraction(fit.predict(s, 8).peak_host_bytes) == 3 * s
    # on the lattice at most the third 5-layer sample; off it, the length itself
    assert set(asked) <= ({(5, 4 * Q)} if s % Q == 0 else {(4, s), (5, s)})
    assert not fit.summary()["fit_nonaffine_phases"]
