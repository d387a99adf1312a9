"""The step's work per window at paper scale, from the fit's exact samples (``fit``).

Every work amount of ``op_costs`` (FLOPs, bytes, launches, calls) of one window is a
polynomial of degree at most two in the sequence length S on the fit's lattice: attention FLOPs
grow with S^2 (Ulysses-style: the full sequence per call) or with the number of chunk pairs
(FPDT), everything else with S. So three samples at S0 < S1 < S2 (4 layers) give each amount
exactly at any S by the quadratic through them, window by window, the windows named by their
block's role (``fit.canonical``: first, mid_first, mid_last, last; None outside the blocks).

Keys that carry a size (a matmul's (m, n, k), an attention call's key length) are paired across
the samples, and each dimension matched either by itself (the same in every sample: a chunk, a
model dimension) or by its fraction of S (a shard of the sequence: L = S / P); the predicted
size is then that fraction of the target S, so the profile's rate is read at the target's own
shapes. A family of keys that matches neither way is predicted by its total at the last
sample's sizes and listed as approximate.

The target's windows: forward (root, then blocks 0..N-1), backward (root, then blocks N-1..0),
optimizer; middle blocks beyond the samples' two are copies of the last middle block, and the
windows outside the blocks grow per layer by the difference between samples one layer apart.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from fractions import Fraction

from experiments.timing.op_costs import Window

SIZED = {"matmul": 2, "attention": 5}  # key kind -> index of its size


def size_index(key: tuple) -> int | None:
    """The index of a work key's size (``SIZED``), None for a key without one; a ``cover`` key
    (``op_costs``) carries its kernel's key after ``("cover", n)``."""
    if key[0] == "cover":
        inner = size_index(key[2:])
        return None if inner is None else inner + 2
    return SIZED.get(key[0])


def _role(block: int | None, n_layers: int) -> str | None:
    if block is None:
        return None
    if block == 0:
        return "first"
    if block == n_layers - 1:
        return "last"
    return "mid_first" if block == 1 else "mid_last" if block == n_layers - 2 else "mid"


def quadratic_at(xs, ys, x) -> Fraction:
    """The quadratic through three points, at x (exact in rationals)."""
    (x0, x1, x2), (y0, y1, y2) = xs, (Fraction(y) for y in ys)
    d01, d12 = (y1 - y0) / (x1 - x0), (y2 - y1) / (x2 - x1)
    c = (d12 - d01) / (x2 - x0)  # Newton's form: y0 + d01 (x - x0) + c (x - x0)(x - x1)
    return y0 + d01 * (x - x0) + c * (x - x0) * (x - x1)


def _by_role(work: list[tuple[Window, Counter]], n_layers: int) -> dict:
    out: dict[tuple[str, str | None], Counter] = {}
    for (stage, block), c in work:
        out[(stage, _role(block, n_layers))] = c
    return out


def _predict_window(samples: list[Counter], seq_lens, seq_len: int,
                    approximate: list[str], label: str) -> Counter:
    out: Counter = Counter()
    plain = {k for c in samples for k in c if size_index(k) is None}
    for k in plain:
        v = quadratic_at(seq_lens, [c.get(k, 0) for c in samples], seq_len)
        if v > 0:
            out[k] = float(v)
    families: dict[tuple, list[dict[tuple, float]]] = defaultdict(
        lambda: [defaultdict(float) for _ in samples])
    for i, c in enumerate(samples):
        for k, v in c.items():
            at = size_index(k)
            if at is not None:
                families[k[:at] + k[at + 1:]][i][k[at]] += v
    for fam, per_sample in families.items():
        at = size_index(fam)  # a family is its keys less the size: its kinds stand where they did
        for size, ys in _matched(per_sample, seq_lens, seq_len, approximate, f"{label} {fam}"):
            v = quadratic_at(seq_lens, ys, seq_len)
            if v > 0:
                out[fam[:at] + (size,) + fam[at:]] += float(v)
    return out


def _follows(a: tuple, b: tuple, s_a: int, s_b: int) -> tuple | None:
    """Per dimension of size tuple ``a`` (at length ``s_a``) -> ``b`` (at ``s_b``): "abs" if it
    is unchanged, "frac" if it grew with the sequence; None if some dimension does neither."""
    rule = []
    for x, y in zip(a, b, strict=True):
        if x == y:
            rule.append("abs")
        elif x * s_b == y * s_a:
            rule.append("frac")
        else:
            return None
    return tuple(rule)


def _matched(per_sample: list[dict[tuple, float]], seq_lens, seq_len: int,
             approximate: list[str], label: str) -> list[tuple[tuple, list[float]]]:
    """The sized keys of one family paired across the samples, each with its size at the
    target: each size of the first sample is paired with the size of every later sample whose
    dimensions are either the same or the same fraction of S (by one rule for all samples).
    When some size finds no partner (or one is left over), the family's total is kept at the
    size that carries the most of the last sample's amount and the family is listed in
    ``approximate``."""
    first, rest = per_sample[0], [dict(d) for d in per_sample[1:]]
    out = []
    for t0, v0 in first.items():
        chain, rule = [t0], None
        for i, d in enumerate(rest, start=1):
            partner = next((t for t in d if (r := _follows(t0, t, seq_lens[0], seq_lens[i]))
                            is not None and (rule is None or r == rule)), None)
            if partner is None:
                break
            rule = rule or _follows(t0, partner, seq_lens[0], seq_lens[i])
            chain.append(partner)
        if len(chain) < len(per_sample):
            break
        ys = [v0] + [d.pop(t) for d, t in zip(rest, chain[1:], strict=True)]
        target = tuple(x if r == "abs" else round(Fraction(x, seq_lens[0]) * seq_len)
                       for x, r in zip(t0, rule or ("abs",) * len(t0), strict=True))
        out.append((target, ys))
    else:
        if not any(rest):
            return out
    approximate.append(label)
    last = per_sample[-1]
    return [(max(last, key=last.get), [sum(d.values()) for d in per_sample])]


def _per_layer(shallow: list[Counter], deep: list[Counter], seq_lens, seq_len: int,
               approximate: list[str], label: str) -> Counter:
    """What one more layer adds to a window outside the blocks at ``seq_len``: the difference
    between the samples one layer apart at the first two lengths, a line in S (FSDP2's
    per-unit copies and the optimizer's per-parameter kernels do not grow with S at all). A
    sized key whose amount changes with the depth is left out and its window listed in
    ``approximate`` (none does: the loss head's matmuls are the same at every depth)."""
    out: Counter = Counter()
    for k in set().union(*shallow, *deep):
        diffs = [d.get(k, 0) - s.get(k, 0) for s, d in zip(shallow, deep, strict=True)]
        if not any(diffs):
            continue
        if size_index(k) is not None:
            approximate.append(label)
            continue
        (x0, x1), (y0, y1) = seq_lens[:2], (Fraction(d) for d in diffs)
        out[k] = float(y0 + (y1 - y0) / (x1 - x0) * (seq_len - x0))
    return out


def predict_work(samples: list[list[tuple[Window, Counter]]], seq_lens: tuple[int, ...],
                 n_sample_layers: int, seq_len: int, n_layers: int,
                 deeper: list[list[tuple[Window, Counter]]] | None = None,
                 ) -> tuple[list[tuple[Window, Counter]], list[str]]:
    """The target's windows in execution order with their predicted work, and the key families
    predicted only approximately. ``samples``: the work of the three ``n_sample_layers``-layer
    samples at ``seq_lens``; ``deeper``: of the samples one layer deeper at the first two,
    whose difference the windows outside the blocks (the root's forward and backward, the
    optimizer) grow by per layer (FSDP2's per-unit copy-in and copy-out run in the root
    unit's windows, AdamW runs over every layer's shards). Without them those windows keep
    their ``n_sample_layers``-layer work."""
    if n_layers < n_sample_layers:
        raise ValueError(f"the work fit predicts models of at least {n_sample_layers} layers, "
                         f"got {n_layers}: emulate exactly")
    roles = [_by_role(w, n_sample_layers) for w in samples]
    approximate: list[str] = []
    predicted = {}
    for key in sorted(set().union(*roles), key=str):
        predicted[key] = _predict_window([r.get(key, Counter()) for r in roles], seq_lens,
                                         seq_len, approximate, f"{key[0]}:{key[1]}")
    if deeper and n_layers > n_sample_layers:
        deep = [_by_role(w, n_sample_layers + 1) for w in deeper]
        for key in sorted({k for r in roles + deep for k in r if k[1] is None}, key=str):
            extra = _per_layer([r.get(key, Counter()) for r in roles[:2]],
                               [r.get(key, Counter()) for r in deep], seq_lens, seq_len,
                               approximate, f"{key[0]}:{key[1]} per layer")
            work = predicted.setdefault(key, Counter())
            for k, v in extra.items():
                work[k] = work.get(k, 0.0) + (n_layers - n_sample_layers) * v
                if work[k] <= 0:
                    del work[k]
    blocks = list(range(n_layers))
    out = []
    for stage, order in (("forward", blocks), ("backward", blocks[::-1]), ("optimizer", [])):
        for block in [None, *order]:
            role = _role(block, n_layers)
            role = "mid_last" if role == "mid" else role
            work = predicted.get((stage, role))
            if work:
                out.append(((stage, block), work))
    return out, sorted(set(approximate))
