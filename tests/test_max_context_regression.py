"""CI's guard on the maximum supported context (results/baselines/max_context.csv).

The table is recomputed (every method emulated on Llama3-8B / 8 x 80 GiB and Qwen3-32B /
16 x 80 GiB, and UPipe's real CPU search on the tiny preset;
experiments/runner/max_context_guard.py) and each row compared with the committed one: a method
whose maximum context fell below its baseline fails the test with the old and new values. The
emulated searches run on idle cores from the session's start (tests/background.py), the real
one on the session's ranks when the test runs.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest
from session_ranks import SessionRanks

from experiments.reporting import results_index
from experiments.runner.max_context_guard import (
    PATH,
    UPDATE,
    compare,
    emulated_entries,
    entries,
    read,
    search_entry,
    table,
    write,
)


def _table(rows):
    return pd.DataFrame(rows, columns=["name", "max_seq_len", "status", "error"])


def test_compare_reports_drops_lost_rows_and_gains():
    old = _table([("a", 1024, "ok", ""), ("b", 2048, "ok", ""), ("c", None, "skipped", "why"),
                  ("d", 512, "ok", "")])
    new = _table([("a", 960, "ok", ""), ("b", 4096, "ok", ""), ("c", None, "skipped", "why")])
    bad, better = compare(old, new)
    assert bad == ["a: max context 1024 -> 960 (status ok)", "d: row missing (baseline 512)"]
    assert better == ["b: max context 2048 -> 4096"]
    new = _table([("a", None, "error", "boom"), ("b", 2048, "ok", ""), ("c", None, "skipped", ""),
                  ("d", 512, "ok", "")])
    bad, _ = compare(old, new)
    assert bad == ["a: max context 1024 -> None (status error: boom)"]
    # the same maxima from a fit that no longer confirms a phase affine: its lines were
    # continued from the window's last two points, so a drop may not show
    new = old.assign(fit_nonaffine_phases=["", "backward;loss", "", ""])
    bad, _ = compare(old.assign(fit_nonaffine_phases=["", "loss", None, ""]), new)
    assert bad == ["b: the fit no longer confirms ['backward'] affine (max context 2048, from "
                   "lines it could not check)"]


def test_baseline_covers_every_entry():
    table = read()
    assert list(table["name"]) == [e.name for e in entries()]
    emulated = table[table["mode"] == "emulated"]
    # every method that can be emulated here has a length; the rest say why they have none
    assert emulated.loc[emulated["status"] == "ok", "max_seq_len"].notna().all()
    assert (emulated.loc[emulated["status"] != "ok", "error"].str.len() > 0).all()
    # and every emulated length comes from a fit whose every phase was exactly affine, by the
    # window's lines (the guard's cheap check; the certified maxima are the paper tables')
    assert emulated["fit_nonaffine_phases"].isna().all()
    assert (emulated.loc[emulated["status"] == "ok", "fit_certified"] == False).all()  # noqa: E712


def test_update_writes_the_table_its_provenance_and_the_results_index(tmp_path):
    """``--update``'s write: the table as it was, its provenance and search times beside it,
    and the results index's row of the baselines naming that provenance (a rewritten table
    beside a stale index fails tests/test_results_index.py in CI)."""
    path = tmp_path / "results" / "baselines" / "max_context.csv"
    committed = read()
    write(committed.assign(search_s=1.5), path)
    pd.testing.assert_frame_equal(read(path), committed)
    meta = json.loads(path.with_suffix(".json").read_text())
    assert meta["search_s"] == dict.fromkeys(committed["name"], 1.5)
    assert results_index.stale(path.parents[1]) == []
    index = (path.parents[1] / "README.md").read_text()
    assert "[`baselines`](baselines/)" in index and meta["git_rev"][:8] in index


def _emulated_searches() -> dict:
    return {e.name: (search_entry, e) for e in emulated_entries()}


@pytest.mark.slow
@pytest.mark.background(jobs=_emulated_searches)
def test_max_context_has_not_regressed(dist_pool, background):
    measured = SessionRanks(dist_pool)
    rows = {e.name: search_entry(e, measured) for e in entries() if not e.emulated}
    bad, better = compare(read(), table(rows | background()))
    for line in better:
        print("improved (update the baseline to keep it):", line)
    assert not bad, ("maximum context regressed:\n  " + "\n  ".join(bad)
                     + f"\nIf the change is intended, update the baseline with `{UPDATE}` and "
                       f"commit {PATH.relative_to(PATH.parents[2])}.")
