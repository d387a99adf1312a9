"""The ladder to 8M tokens (``experiments.runner.long_ladder``) and its tables in
docs/results.md (``experiments.reporting.ladder_table``): the last rung is the level the library
ships, a run keeps the records it has, and the committed tables are the records rendered."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pandas as pd
import pytest

from experiments.config import STACKS
from experiments.reporting import ladder_table, results_index
from experiments.runner import long_ladder
from experiments.runner.plan_spec import LONG, LONG_CHUNK

ROOT = Path(__file__).resolve().parents[1]


def test_the_last_rung_is_the_long_level_with_its_chunks_and_the_first_is_alst():
    last = long_ladder.rung_cell(len(long_ladder.RUNGS) - 1, "llama3-8b", 8, 2**23)
    assert STACKS[last.stack] == STACKS[LONG] and last.options == {"chunk_size": LONG_CHUNK}
    first = long_ladder.rung_cell(0, "llama3-8b", 8, 2**23)
    assert STACKS[first.stack] == STACKS["alst"] and first.options == {}
    # each rung keeps every mechanism of the rung before it
    fields = [f for _, f, _ in long_ladder.RUNGS]
    assert all(a.items() <= b.items() for a, b in itertools.pairwise(fields))


def _record(i: int, model="llama3-8b", gpus=8, seq_len=2**23, **kw) -> dict:
    label, fields, options = long_ladder.RUNGS[i]
    cell = long_ladder.rung_cell(i, model, gpus, seq_len)
    return {"rung": i, "label": label, "model": model, "nproc": gpus, "seq_len": seq_len,
            "kernel": "fa3", "device": "emulated cuda (79.65 GiB)",
            "stack_fields": json.dumps(fields, sort_keys=True),
            "options": json.dumps(options, sort_keys=True), "cell_id": cell.cell_id(),
            "status": "oom", "error": "", "peak_device_bytes": 80 * 2**30,
            "peak_phase": "backward > attention:bwd", "peak_model_bytes": 15 * 2**30,
            "peak_attention_bytes": 40 * 2**30, "peak_other_bytes": 25 * 2**30,
            "peak_host_bytes": 240 * 2**30, "device_budget_bytes": int(73.35 * 2**30),
            "host_budget_bytes": 256 * 2**30, "fit_certified": True,
            "fit_nonaffine_phases": "", "search_status": "ok", "max_seq_len": 5898240,
            "first_failing_seq_len": 5963776,
            "failing_error": "device peak 73.86 GiB > budget 73.35 GiB",
            "failing_is_lower_bound": False, "search_error": "", "emulation_s": 1.0} | kw


def test_a_run_keeps_the_records_it_has_and_runs_the_rest(tmp_path, monkeypatch):
    ran, stop_at = [], [2]

    def fake_run(i, model, gpus, seq_len, hw=None):
        if i in stop_at:
            raise KeyboardInterrupt  # the run is interrupted at rung 2
        ran.append(i)
        return _record(i, model, gpus, seq_len, status="ok")

    monkeypatch.setattr(long_ladder, "run_rung", fake_run)
    out = long_ladder.folder("llama3-8b", 8, tmp_path)
    out.mkdir(parents=True)
    kept, later = _record(0, peak_device_bytes=123), _record(3, peak_device_bytes=456)
    # a record of rung 1 whose mechanisms have changed since: run again
    stale = _record(1) | {"stack_fields": json.dumps({"offload_first": False})}
    pd.DataFrame([kept, stale, later]).to_csv(out / long_ladder.FILE, index=False)
    with pytest.raises(KeyboardInterrupt):
        long_ladder.run_ladder("llama3-8b", 8, 2**23, tmp_path, progress=lambda _: None)
    # what the interrupted run measured is written, and no standing record is lost
    got = pd.read_csv(out / long_ladder.FILE)
    assert list(got["rung"]) == [0, 1, 3] and list(got["status"]) == ["oom", "ok", "oom"]
    stop_at.clear()
    path = long_ladder.run_ladder("llama3-8b", 8, 2**23, tmp_path, progress=lambda _: None)
    assert ran == [1, 2, 4]
    got = pd.read_csv(path)
    assert list(got["rung"]) == list(range(len(long_ladder.RUNGS)))
    assert list(got["peak_device_bytes"][[0, 3]]) == [123, 456]
    assert "git_rev" in json.loads((out / "env.json").read_text())


def test_retry_failed_runs_again_the_rungs_that_failed_and_keeps_the_rest(tmp_path, monkeypatch):
    """A rung whose step or search ended in an error or a timeout is kept by a plain run (as a
    sweep keeps its rows) and run again with ``retry_failed``; an OOM is an outcome, kept."""
    ran = []

    def fake_run(i, model, gpus, seq_len, hw=None):
        ran.append(i)
        return _record(i, model, gpus, seq_len, status="ok")

    monkeypatch.setattr(long_ladder, "run_rung", fake_run)
    out = long_ladder.folder("llama3-8b", 8, tmp_path)
    out.mkdir(parents=True)
    records = [_record(i) for i in range(len(long_ladder.RUNGS))]
    records[1] |= {"status": "error", "error": "a rank died"}
    records[2] |= {"search_status": "timeout"}
    pd.DataFrame(records).to_csv(out / long_ladder.FILE, index=False)
    long_ladder.run_ladder("llama3-8b", 8, 2**23, tmp_path, progress=lambda _: None)
    assert ran == []
    long_ladder.run_ladder("llama3-8b", 8, 2**23, tmp_path, progress=lambda _: None,
                           retry_failed=True)
    assert ran == [1, 2]
    got = pd.read_csv(out / long_ladder.FILE)
    assert list(got["status"][:3]) == ["oom", "ok", "ok"]


def test_the_table_renders_each_rung_and_marks_what_is_not_certified():
    rows = pd.DataFrame([
        _record(0),
        _record(3, status="ok", peak_device_bytes=72 * 2**30, fit_certified=False),
        _record(4, max_seq_len=float("nan"), search_status="error",
                search_error="fit refused"),
    ])
    lines = ladder_table.table(rows)
    assert lines[0].startswith("**Llama3-8B on 8 GPUs** (emulated cuda (79.65 GiB); "
                               "device budget 73.35 GiB per rank")
    assert lines[2].startswith("| rung | device peak at 8M (GiB) |")
    assert lines[4] == ("| ALST (the paper's stack) | 80.00 (oom) | backward > attention:bwd | "
                        "15.00 / 40.00 / 25.00 | 240.0 | 5760K (device peak 73.86 GiB) |")
    assert lines[5].startswith("| + chunked attention backward (64K) | 72.00 (ok) ‡ |")
    assert lines[6].endswith("| — (error: fit refused) |")
    assert lines[-1].startswith("‡ the step's fit is not certified")


def test_the_committed_tables_are_up_to_date():
    assert not ladder_table.stale(ROOT / "results", ROOT / "docs" / "results.md"), (
        f"docs/results.md's ladder tables are stale: run `{ladder_table.COMMAND}` and commit "
        "docs/results.md")


def test_without_records_the_section_says_so(tmp_path):
    assert "No ladder records" in ladder_table.render(tmp_path)


def test_the_ladder_registers_its_rungs_without_changing_a_shipped_level():
    before = {k: dataclasses.asdict(v) for k, v in STACKS.items() if not k.startswith("ladder-")}
    long_ladder.rung_cell(2, "qwen3-32b", 16, 2**22)
    after = {k: dataclasses.asdict(v) for k, v in STACKS.items() if not k.startswith("ladder-")}
    assert before == after


def test_the_results_index_lists_a_ladder_with_its_command(tmp_path):
    d = long_ladder.folder("qwen3-32b", 16, tmp_path)
    d.mkdir(parents=True)
    pd.DataFrame([_record(0, "qwen3-32b", 16, 6 * 2**20)]).to_csv(d / "ladder.csv", index=False)
    (line,) = results_index.other_lines(tmp_path)
    assert line.startswith("| [`long_ladder_qwen3_32b_h100x16-emulated`]")
    assert "| emulated cuda (79.65 GiB) · host: " in line and "[1 rungs](" in line
    assert line.endswith("| `python -m experiments.runner.long_ladder --model qwen3-32b "
                         "--gpus 16 --seq-len 6M` |")


@pytest.mark.parametrize("argv, says", [(["--model", "gpt9"], "model must be one of"),
                                        (["--gpus", "3"], "divisible by nproc (3)"),
                                        (["--seq-len", "1001"], "seq_len (1001)")])
def test_bad_input_is_refused_before_anything_runs_or_is_written(tmp_path, capsys, argv, says):
    assert long_ladder.main([*argv, "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("long_ladder: ") and says in err, err
    assert not any(tmp_path.iterdir())
