"""Maximum-context search: the longest sequence a (method, model, world, stack, budget) trains.

Grow the length geometrically from ``start`` until a probe fails, then bisect between the
last passing and the first failing length down to ``granularity`` (the CP degree times a block,
so every probed length shards evenly). A probe is one cell run with ``iters=0``: the warm-up and
memory steps only. It passes when its status is ``ok``: on GPU the step did not OOM (against
the device, or a ``budget_mib`` fraction of it); on CPU the tracked per-rank peak stayed within
``budget_mib`` (deterministic, so the search is reproducible). A probe that errors or times out
ends the search with that status: no length is reported for a method that does not run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from experiments.config import Cell

PASS, FAIL = "ok", "oom"
# Emulated searches (``max-context --emulate``, the emulated sweeps): 64K global tokens between
# the last passing and the first failing length, the resolution of the paper's max-context
# figures, starting from 1M tokens.
EMULATED_GRANULARITY = 2**16
EMULATED_START = 2**20


@dataclass(frozen=True)
class SearchSpec:
    """How to search: first length, bisection block, upper limit (all global tokens)."""

    start: int
    """first probed length"""
    block: int = 1024
    """bisection stops at nproc * block tokens between passing and failing"""
    limit: int = 2**24
    """largest length probed; reaching it passing reports first_failing_seq_len None"""
    growth: int = 2
    """factor between grow-phase probes"""

    def validate(self, nproc: int) -> None:
        for name in ("start", "block", "limit"):
            if getattr(self, name) <= 0:
                raise ValueError(f"search.{name} must be positive, got {getattr(self, name)}")
        if self.growth < 2:
            raise ValueError(f"search.growth must be >= 2, got {self.growth}")
        if self.start % (nproc * self.block):
            raise ValueError(f"search.start ({self.start}) must be a multiple of nproc * block "
                             f"({nproc} * {self.block})")


def search_max_context(base: Cell, spec: SearchSpec,
                       run: Callable[[Cell], dict]) -> dict:
    """Run the search; ``run(cell) -> row`` runs one probe. Returns the summary with the probes.

    Returns a dict with ``status`` (ok, or the failing probe's error status), ``max_seq_len``
    (None when even the smallest probe fails), ``first_failing_seq_len`` (None when ``limit``
    passes) and ``probes`` (their rows, in order).
    """
    spec.validate(base.nproc)
    gran = base.nproc * spec.block
    probes: list[dict] = []

    def probe(seq_len: int) -> str:
        row = run(dataclasses.replace(base, seq_len=seq_len, iters=0))
        probes.append(row)
        return row["status"]

    def result(status: str, ok: int | None, bad: int | None, error: str = "") -> dict:
        return {"status": status, "max_seq_len": ok, "first_failing_seq_len": bad,
                "granularity": gran, "n_probes": len(probes), "error": error, "probes": probes}

    ok, bad = None, None
    length = spec.start
    while True:  # grow (or, if the start fails, shrink) to bracket the limit
        status = probe(length)
        if status not in (PASS, FAIL):
            return result(status, ok, bad, probes[-1].get("error", ""))
        if status == PASS:
            ok = length
            if bad is not None or length >= spec.limit:
                break
            length = min(length * spec.growth, max(gran, spec.limit // gran * gran))
        else:
            bad = length
            if ok is not None or length <= gran:
                break
            length = max(gran, (length // spec.growth) // gran * gran)
    while ok is not None and bad is not None and bad - ok > gran:  # bisect
        mid = (ok + bad) // 2 // gran * gran
        status = probe(mid)
        if status not in (PASS, FAIL):
            return result(status, ok, bad, probes[-1].get("error", ""))
        ok, bad = (mid, bad) if status == PASS else (ok, mid)
    return result("ok", ok, bad)


# Memory columns of a probe that a search summary carries from its longest passing probe.
PEAK_KEYS = ("peak_device_bytes", "peak_host_bytes", "peak_model_bytes", "peak_attention_bytes",
             "peak_other_bytes")
EMULATED_KEYS = ("peak_phase", "device_budget_bytes", "host_budget_bytes", "emulation")
IDENTITY = ("method", "heads_per_stage", "ring_degree", "chunk_size", "model", "nproc", "stack",
            "dtype", "budget_mib")


def summarize(base: Cell, res: dict, hardware=None) -> dict:
    """One flat record of a search: the cell's identity, the result without its probes, the
    memory columns (``PEAK_KEYS``) of the longest passing probe (None when none passed), the
    mode (``measured``, or ``emulated`` when ``hardware``, an ``experiments.emulate.Hardware``,
    is given), and when emulated the probe's ``EMULATED_KEYS`` and the hardware as ``hw_*``
    columns."""
    passing = [p for p in res["probes"] if p.get("status") == PASS]
    best = max(passing, key=lambda p: p["seq_len"]) if passing else {}
    out = {k: getattr(base, k) for k in IDENTITY}
    out |= {k: v for k, v in res.items() if k != "probes"}
    out |= {k: best.get(k) for k in PEAK_KEYS}
    out["mode"] = "measured" if hardware is None else "emulated"
    if hardware is not None:
        out |= {k: best.get(k) for k in EMULATED_KEYS}
        out |= {f"hw_{k}": v for k, v in dataclasses.asdict(hardware).items()}
    return out
