"""The maximum-context baseline CI guards (``results/baselines/max_context.csv``).

Rows: every registered method x the paper's two settings, emulated on 80 GiB GPUs with the
paper's stack for the method (docs/design.md#the-comparison) -- Llama3-8B on 8 ranks, Qwen3-32B on
16 (the hybrids on the 8 (Ulysses) x 2 (ring) mesh, UPipe also on all 16 ranks as one Ulysses group;
on 8 ranks the hybrids run 4 x 2; both FPDTs on Llama3-8B only, ``_LEFT_OUT``) -- searched to a
64K-token granularity; beyond the paper,
UPipe on the ``long`` stack level with its chunked backward in both settings (the configuration
that reaches 8M tokens on one node: ``runner.plan_spec.LONG``); plus one real CPU
run: UPipe on the tiny preset, 2 gloo ranks, under a 51 MiB tracked budget (512-token
granularity, from 2K tokens: it fits 2K at 49.99 MiB, not 2.5K at 52.05 MiB). A method that cannot
run or be emulated here is a row with its status and no length. The emulated searches predict
by the fit's window lines (``fit_certified`` false): what a code change does to the step within
the window, cheap enough for every CI run, and blind to a peak that overtakes beyond it
(``emulation.certify``); the certified maxima are the emulated Tables 3 and 4's.

    python -m experiments.runner.max_context_guard            # recompute, compare with the table
    python -m experiments.runner.max_context_guard --update   # ... rewrite it and results/README.md

``tests/test_max_context_regression.py`` recomputes the table and fails when a method's
maximum context falls below its baseline (or a row that had a length no longer gets one).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pandas as pd

from experiments.config import (
    EMULATED_GRANULARITY,
    EMULATED_LIMIT,
    EMULATED_START,
    Cell,
    SearchSpec,
    paper_stack,
)
from experiments.provenance import provenance
from experiments.reporting import results_index
from experiments.runner.executor import Emulator, Launcher
from experiments.runner.plan_spec import LONG, LONG_CHUNK
from experiments.runner.search import run_search
from upipe.registry import available_methods, get_method

PATH = Path(__file__).resolve().parents[2] / "results" / "baselines" / "max_context.csv"
UPDATE = "python -m experiments.runner.max_context_guard --update"
# The real CPU search's probes take seconds each on 2 cores; 600 s is far above that
# and ends a stuck probe well inside CI's limit.
CPU_PROBE_TIMEOUT_S = 600.0


@dataclasses.dataclass(frozen=True)
class Entry:
    """One baseline row: a search (emulated or real) of one cell family."""

    name: str
    base: Cell
    spec: SearchSpec
    emulated: bool = True


# The chunked methods' searches on Qwen3-32B are the guard's longest, and each runs the same
# method code as its Llama3-8B row, which stays: DeepSpeed's FPDT was a third of the guard's
# emulation (64 s of 218), and ours was 54 s of 240 at 7cbed3c (search_s in
# results/baselines/max_context.json), its fit window at 1.97M-2.62M tokens. Qwen3-32B's own
# code paths (QK-norm, 16 ranks over 8 KV heads, the 8 x 2 mesh) stay guarded by the other
# methods' Qwen3-32B rows, and both FPDTs' Qwen3-32B maxima are certified in the emulated
# Table 4 (results/table4_qwen3_32b_h100x16-emulated/).
_LEFT_OUT = {("ds-fpdt", "qwen3-32b"), ("fpdt", "qwen3-32b")}


def entries() -> list[Entry]:
    """The baseline's rows, in a fixed order."""
    out = []
    settings = (("llama3-8b", 8, "8x80GB"), ("qwen3-32b", 16, "16x80GB"))
    for model, world, label in settings:
        spec = SearchSpec(start=EMULATED_START, block=EMULATED_GRANULARITY // world,
                          limit=EMULATED_LIMIT)
        for method in available_methods():
            if (method, model) in _LEFT_OUT:
                continue
            cls = get_method(method)
            variants = [{}]
            if cls.supports_mesh:  # hybrids on a (world/2 x 2) mesh: the paper's 8 x 2 on 16
                variants = [{"ring_degree": 2}] + ([{}] if method == "upipe" else [])
            for v in variants:
                cell = Cell(method=method, model=model, nproc=world, seq_len=spec.start,
                            stack=paper_stack(method), dtype="bf16", **v)
                mesh = f"-{world // 2}x2" if v else ""
                out.append(Entry(f"{method}{mesh}-{model}-{label}", cell, spec))
        long = Cell(method="upipe", model=model, nproc=world, seq_len=spec.start, stack=LONG,
                    options={"chunk_size": LONG_CHUNK}, dtype="bf16")
        out.append(Entry(f"upipe-{LONG}-{model}-{label}", long, spec))
    # 2 ranks and 2K tokens, not more: the guard runs in every CI run, and a probe is a real
    # step on 2 cores (about 5 s here; 4 ranks at 4K, the same 1K tokens a rank, took 15-20 s)
    tiny = Cell(method="upipe", model="tiny", nproc=2, seq_len=2048, dtype="fp32",
                budget_mib=51.0, warmup=1, iters=0)
    out.append(Entry("upipe-tiny-2xcpu-51MiB", tiny, SearchSpec(start=2048, block=256,
                                                               limit=2560), emulated=False))
    return out


def search_entry(entry: Entry, measured=None) -> dict:
    """Run one entry's search (emulated: in a worker process); its baseline row. ``measured``
    runs the real search's probes (default: a ``Launcher``, fresh ranks per probe)."""
    t0 = time.monotonic()
    if entry.emulated:
        # memory only (no FLOP or byte counters: two dispatch layers fewer per op), by the fit's
        # window lines: certifying every probe samples at millions of tokens (the first try
        # took CI's guard from 79 s to over 600), so the guard compares the code's window
        # with the window it had; Tables 3 and 4 carry the certified maxima
        executor = Emulator(count=False, certify=False)
    else:
        executor = measured or Launcher(CPU_PROBE_TIMEOUT_S)
    res = run_search(executor, entry.base, entry.spec)
    best = next((p for p in reversed(res["probes"])
                 if p.get("seq_len") == res["max_seq_len"]), {})
    c = entry.base
    return {
        "name": entry.name, "mode": "emulated" if entry.emulated else "measured",
        "method": c.method, "model": c.model, "nproc": c.nproc, "ring_degree": c.ring_degree,
        "stack": c.stack, "dtype": c.dtype, "budget_mib": c.budget_mib,
        "granularity": c.nproc * entry.spec.block, "status": res["status"],
        "max_seq_len": res["max_seq_len"], "first_failing_seq_len": res["first_failing_seq_len"],
        "peak_device_bytes_at_max": best.get("peak_device_bytes"),
        # phases the fit could not confirm affine (empty when the prediction is exact)
        "fit_nonaffine_phases": ";".join(best.get("fit_nonaffine_phases") or []),
        # False: the window's lines, blind to a peak overtaking beyond the window
        "fit_certified": best.get("fit_certified"),
        "error": (res.get("error") or "").splitlines()[0][:200] if res.get("error") else "",
        "search_s": round(time.monotonic() - t0, 1),
    }


def compute(workers: int = 2, measured=None) -> pd.DataFrame:
    """Every entry's row, in ``entries()`` order. The real CPU search runs first and alone (its
    probes are 2-rank runs that need the cores, and the tracker's wait for gloo to release
    buffers must not be starved); the emulated ones then share ``workers`` processes
    (CPU-bound and independent), slowest first so the pool ends together.

    ``measured``: the executor of the real search's probes (``unavailable(cell)``,
    ``run(cell) -> row``), by default a ``Launcher`` (2 fresh ranks per probe). The test passes
    ranks it has already started: the tracked peak is the same in any process, and a launch
    costs ~8 s of imports per probe on 2 cores."""
    rows = {e.name: search_entry(e, measured) for e in entries() if not e.emulated}
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        rows |= {r["name"]: r for r in pool.map(search_entry, emulated_entries())}
    return table(rows)


def emulated_entries() -> list[Entry]:
    """The emulated entries, slowest first (``_expected_cost``)."""
    return sorted((e for e in entries() if e.emulated), key=_expected_cost, reverse=True)


def table(rows: dict[str, dict]) -> pd.DataFrame:
    """``search_entry``'s rows by name -> the baseline table, in ``entries()`` order."""
    return pd.DataFrame([rows[e.name] for e in entries()])


def _expected_cost(entry: Entry) -> int:
    """A rough order of the emulated searches' cost (chunked and hybrid methods fit longer). The
    chunked methods' searches are the longest (search_s in results/baselines/max_context.json:
    ds-fpdt and fpdt on Llama3-8B 29 and 19 s, `long` on Qwen3-32B 14 s), so they start
    first."""
    c = entry.base
    return (2 * (c.method in ("fpdt", "ds-fpdt")) + (c.ring_degree > 1) + (c.model == "qwen3-32b")
            + (c.stack == LONG))


def read(path: Path = PATH) -> pd.DataFrame:
    return pd.read_csv(path, dtype={"max_seq_len": "Int64", "first_failing_seq_len": "Int64"})


def compare(old: pd.DataFrame, new: pd.DataFrame) -> tuple[list[str], list[str]]:
    """(regressions, improvements) as lines naming the row and the old and new lengths.

    A regression: a row whose maximum context is below its baseline, a row that had a length
    and no longer gets one, a baseline row that disappeared, or a row whose fit no longer
    confirms a phase affine that its baseline's did (its maximum then rests on lines continued
    from the window's last two points, which the guard cannot trust to show a drop).
    """
    new_by = {r["name"]: r for r in new.to_dict("records")}
    bad, better = [], []
    for r in old.to_dict("records"):
        was = None if pd.isna(r["max_seq_len"]) else int(r["max_seq_len"])
        cur = new_by.get(r["name"])
        if cur is None:
            bad.append(f"{r['name']}: row missing (baseline {was})")
            continue
        now = None if pd.isna(cur["max_seq_len"]) else int(cur["max_seq_len"])
        if was is not None and (now is None or now < was):
            bad.append(f"{r['name']}: max context {was} -> {now} "
                       f"(status {cur['status']}{': ' + cur['error'] if cur['error'] else ''})")
            continue
        phases = set(_phase_list(cur.get("fit_nonaffine_phases"))) - set(
            _phase_list(r.get("fit_nonaffine_phases")))
        if phases:
            bad.append(f"{r['name']}: the fit no longer confirms {sorted(phases)} affine (max "
                       f"context {now}, from lines it could not check)")
        elif now is not None and (was is None or now > was):
            better.append(f"{r['name']}: max context {was} -> {now}")
    return bad, better


def _phase_list(value) -> list[str]:
    """A row's ``fit_nonaffine_phases`` (";"-joined; empty, None or NaN: none)."""
    return [p for p in value.split(";") if p] if isinstance(value, str) else []


def write(table: pd.DataFrame, path: Path = PATH) -> None:
    """Write the table (``path``), its provenance and search times (``.json`` beside it), and
    the results index of the results root above it (``results/README.md``), whose row for the
    baselines names that provenance: a rewritten table with a stale index fails
    tests/test_results_index.py."""
    path.parent.mkdir(parents=True, exist_ok=True)
    table.drop(columns=["search_s"]).to_csv(path, index=False)
    meta = provenance() | {"command": UPDATE, "search_s": dict(zip(table["name"],
                                                                    table["search_s"],
                                                                    strict=True))}
    path.with_suffix(".json").write_text(json.dumps(meta, indent=1, default=str) + "\n")
    results_index.write(path.parents[1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--update", action="store_true", help="rewrite the committed table")
    p.add_argument("--workers", type=int, default=2)
    a = p.parse_args(argv)
    t0 = time.monotonic()
    table = compute(a.workers)
    print(table.drop(columns=["error"]).to_string(index=False))
    print(f"({time.monotonic() - t0:.0f} s)")
    if a.update:
        write(table)
        print(f"wrote {PATH}")
        return 0
    bad, better = compare(read(), table)
    for line in better:
        print("improved:", line)
    for line in bad:
        print("REGRESSED:", line, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
