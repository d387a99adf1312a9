"""Faults a new user met on main at 257185c, each recorded truthfully now (issue 13).

1. a rank killed from outside is an ``error`` (not an ``oom``), re-run by ``--retry-failed``, and
   a max-context search that meets it reports no maximum;
3. a second sweep on a results directory in use is refused, and a crashed sweep does not leave
   it locked;
4. run files are written atomically and validated on read: a bad one is named, set aside and
   its cell re-run by a resume, never silently dropped;
5. ``--json`` under torchrun prints exactly one JSON object on stdout;
6. ``upipe-bench plot`` leaves unchanged inputs byte-identical;
7. validation slips are refused before anything runs, naming the flag or field and the rule;
8. progress on stderr (quiet with ``--json``), one line on Ctrl-C, SIGTERM or SIGHUP (the ranks
   ended first), help for every flag, and a dry run that says which cells resume.

(2, the Hugging Face example's exit, is tested in test_examples.py.)
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from experiments.cli import main, parser
from experiments.config import Cell, SearchSpec, Status, Sweep
from experiments.harness.launch import describe, disagreement, run_cell
from experiments.reporting.tables import write_tables
from experiments.runner.lock import ResultsInUse, results_lock
from experiments.runner.search import search_max_context
from experiments.runner.sweep_runner import SweepRunner
from experiments.store import BadResultFile, read_row, write_json

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
# A small model: the cost of a cell here is the ranks' start-up, not the step.
OVERRIDES = (("n_layers", "2"), ("dim", "64"), ("n_heads", "8"), ("n_kv_heads", "2"),
             ("head_dim", "8"), ("ffn_dim", "96"), ("vocab_size", "128"))
SMALL = {"model": "tiny", "nproc": 2, "stack": "alst", "warmup": 0, "iters": 1,
         "overrides": OVERRIDES}
MODEL_FLAGS = ["--model", "tiny", "--warmup", "0"] + [
    f for kv in OVERRIDES for f in ("--override", "=".join(kv))]
FLAGS = ["--nproc", "2", *MODEL_FLAGS]


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, **kw)


def _ranks(pid: int) -> list[int]:
    """The rank processes ``pid`` spawned (Linux /proc): its children started by
    multiprocessing's spawn, not its resource tracker."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if (int(stat.rsplit(")", 1)[1].split()[1]) == pid
                    and b"multiprocessing-fork" in cmdline and b"resource_tracker" not in cmdline):
                out.append(int(entry.name))
    return out


def _wait_for(predicate, timeout_s: float = 120.0, what: str = "a condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# -- 1. a rank killed from outside -------------------------------------------------------------


@pytest.mark.slow  # about 1 s on 2 cores (docs/testing.md)
def test_a_rank_killed_from_outside_is_an_error_not_an_oom():
    """SIGKILL from outside (a user, a scheduler; the launcher cannot tell the kernel's OOM
    killer apart) is not a measured OOM: the row is an error naming the signal."""
    box = {}
    others = {p.pid for p in multiprocessing.active_children()}  # e.g. the session's dist_pool
    worker = threading.Thread(target=lambda: box.update(row=run_cell(
        Cell("ulysses", seq_len=256, **SMALL), timeout_s=300)))
    worker.start()
    ranks = _wait_for(lambda: [p for p in multiprocessing.active_children()
                               if p.pid not in others], what="the cell's ranks")
    os.kill(ranks[-1].pid, signal.SIGKILL)
    worker.join(300)
    row = box["row"]
    assert row["status"] == Status.ERROR, row
    assert "killed by SIGKILL" in row["error"] and "not a measured OOM" in row["error"]
    # a row that rank 0 never wrote still says what code and machine it came from
    assert row["git_rev"] and row["torch_version"] == torch.__version__ and row["date_utc"]


def _row(cell: Cell, status: str) -> dict:
    return describe(cell, None) | {"status": status, "error": "", "mode": "measured"}


def _stored(tmp_path: Path, cell: Cell, status: str) -> SweepRunner:
    sweep = Sweep("s", "faults", "cpu", base=dict(SMALL), axes={"seq_len": [cell.seq_len]})
    runner = SweepRunner(sweep, tmp_path, progress=False)
    write_json(runner._row_path(cell), _row(cell, status))
    return runner


@pytest.mark.parametrize("status, plain, retry", [
    ("error", "resume", "retry"), ("timeout", "resume", "retry"),
    ("oom", "resume", "resume"), ("ok", "resume", "resume")])
def test_retry_failed_reruns_errors_and_timeouts_only(tmp_path, status, plain, retry):
    cell = Cell("ulysses", seq_len=256, **SMALL)
    runner = _stored(tmp_path, cell, status)
    assert runner.action(cell) == plain
    runner.retry_failed = True
    assert runner.action(cell) == retry


@pytest.mark.slow
def test_max_context_search_that_meets_a_killed_rank_reports_no_maximum():
    """The issue's reproduction: ``kill -9`` one rank during the second probe of a real search.
    Before, the kill read as an OOM and the search reported the first probe's length.

    The kill lands in the second probe by the search's own account, not by counting processes:
    the first probe's progress line is printed after all its ranks have ended, so every rank
    seen after it is the second probe's. (Sampling the first probe's ranks while some had not
    started yet once took one of them for the second's, and killed the first probe.)
    """
    cmd = [sys.executable, "-m", "experiments.cli", "max-context", "--method", "upipe",
           "--budget-mib", "400", "--start", "512", "--block", "256", "--limit", "4K", *FLAGS]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    _wait_for(lambda: any("probe 512 tokens: ok" in line for line in lines),
              what="the first probe's result")
    second = _wait_for(lambda: _ranks(proc.pid), what="the second probe's ranks")
    time.sleep(1.0)  # inside the probe, not at its start-up only
    os.kill(max(second), signal.SIGKILL)
    out = proc.stdout.read()
    proc.wait(timeout=300)
    reader.join(60)
    err = "".join(lines)
    assert proc.returncode == 1, err
    probes = [line.split(":")[1].split(",")[0].strip() for line in lines if "  probe " in line]
    assert probes == ["ok", "error"], err
    summary, error = out.split("\n", 1)
    assert summary.startswith("max_seq_len None  first_failing_seq_len None  (2 probes, error")
    assert "killed by SIGKILL" in error, out


def test_search_meeting_an_error_row_claims_no_maximum():
    rows = {512: "ok", 1024: "ok", 2048: "error"}
    res = search_max_context(Cell("ulysses", **(SMALL | {"seq_len": 512})),
                             SearchSpec(start=512, block=256, limit=4096),
                             lambda c: {"status": rows[c.seq_len], "error": "rank 1 was killed"})
    assert (res["status"], res["max_seq_len"], res["first_failing_seq_len"]) == (
        "error", None, None)
    assert "so far 1024 passed" in res["error"]


# -- 3. one sweep per results directory --------------------------------------------------------


_HOLD = "import sys, time; from experiments.runner.lock import results_lock\n" \
        "with results_lock(sys.argv[1]):\n    print('held', flush=True); time.sleep(600)"


@pytest.mark.slow  # about 3 s on 2 cores (docs/testing.md)
def test_a_second_sweep_on_a_directory_in_use_is_refused(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path / "bench_attention")],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        r = _cli("sweep", "bench_attention", "--out", str(tmp_path), "--no-progress")
        assert r.returncode == 2, r.stderr
        assert "is in use by another sweep" in r.stderr and f"pid {holder.pid}" in r.stderr
        assert not (tmp_path / "bench_attention" / "runs").exists()  # nothing ran
    finally:
        holder.kill()  # a crash: the kernel drops the lock with the process
        holder.wait()
    with results_lock(tmp_path / "bench_attention"):  # free again, not stuck
        with pytest.raises(ResultsInUse, match="in use by another sweep"):
            with results_lock(tmp_path / "bench_attention"):
                pass


# -- 4. run files atomic and validated ---------------------------------------------------------


@pytest.mark.parametrize("content, why", [
    ('{"cell_id": "x", "method": "ulysses", "stat', "not valid JSON"),
    ("[]", "must be a JSON object, got list"),
    ('{"status": "ok", "method": "ulysses"}', "missing cell_id, model, seq_len"),
    (json.dumps(_row(Cell("ulysses"), "fine")), "status must be one of"),
])
def test_a_bad_run_file_is_named_not_dropped(tmp_path, content, why):
    sweep_dir = tmp_path / "s"
    bad = sweep_dir / "runs" / "some-cell" / "row.json"
    bad.parent.mkdir(parents=True)
    bad.write_text(content)
    with pytest.raises(BadResultFile, match=why) as e:
        write_tables(sweep_dir)
    assert str(bad) in str(e.value)
    (sweep_dir / "sweep.json").write_text(json.dumps({"plots": []}))
    assert main(["plot", str(sweep_dir)]) == 2  # the CLI names it too, without a traceback


def test_resume_sets_a_bad_run_file_aside_and_reruns_its_cell(tmp_path, capsys):
    cell = Cell("ulysses", seq_len=256, **SMALL)
    runner = _stored(tmp_path, cell, "ok")
    path = runner._row_path(cell)
    truncated = path.read_text()[:40]
    path.write_text(truncated)
    assert runner.action(cell) == "re-run"
    ran = []

    class Quick:  # the executor: records the cell instead of launching ranks
        def unavailable(self, c):
            return None

        def run(self, c):
            ran.append(c)
            return _row(c, "ok")

    runner.executor = Quick()
    row = runner.run(cell)
    assert ran == [cell] and row["status"] == "ok"
    assert read_row(path)["status"] == "ok"  # the new row, valid
    assert path.with_name("row.json.bad").read_text() == truncated  # kept for inspection
    assert f"{path}: not valid JSON" in capsys.readouterr().err


def test_json_writes_are_atomic(tmp_path, monkeypatch):
    """A writer killed mid-write leaves the old file whole (a temporary file is renamed)."""
    path = tmp_path / "row.json"
    write_json(path, {"a": 1})

    def crash(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        write_json(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["row.json"]  # no temporary left


# -- 5. JSON under torchrun --------------------------------------------------------------------


@pytest.mark.slow
def test_json_under_torchrun_is_the_only_thing_on_stdout():
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "experiments.cli", "run", "--method", "ulysses", "--seq-len", "256", "--json",
         *MODEL_FLAGS],  # the world is torchrun's
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)  # the whole of stdout is one JSON object
    assert row["status"] == "ok" and row["launcher"] == "torchrun"


# -- 6. plot runs nothing and changes nothing ---------------------------------------------------


def _digests(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("sweep", ["table3_llama3_8b_h100x8-cpu",
                                   "memory_ladder_llama3_8b_h100x8-emulated"])
def test_plot_leaves_unchanged_inputs_byte_identical(tmp_path, sweep, capsys):
    d = tmp_path / sweep
    shutil.copytree(RESULTS / sweep, d)
    before = _digests(d)
    assert main(["plot", str(d)]) == 0
    assert _digests(d) == before


# -- 7. validation slips -----------------------------------------------------------------------


@pytest.mark.parametrize("argv, says", [
    (["run", "--method", "upipe", "--heads-per-stage", "0"],
     "heads_per_stage (0) must be a positive multiple of the CP degree (4)"),
    (["run", "--method", "upipe", "--override", "n_layers=-1"],
     "model.n_layers must be positive, got -1"),
    (["emulate", "--method", "upipe", "--model", "llama3-8b", "--gpus-per-node", "3"],
     "--gpus-per-node (3) must divide the world size (8)"),
    (["max-context", "--emulate", "--method", "upipe", "--model", "llama3-8b", "--start", "8M",
      "--limit", "1M"], "--start (8388608) must not exceed --limit (1048576)"),
    (["plan", "--model", "llama3-8b", "--gpus", "8", "--seq-len", "1M", "--ring-degrees", "3"],
     "--ring-degrees must be divisors of the CP degree (8), got [3]"),
    (["plan", "--model", "llama3-8b", "--gpus", "8", "--seq-len", "1M", "--ring-degrees", "1,x"],
     "--ring-degrees must be integers separated by commas, got '1,x'"),
    # an empty list read as "not given", and planned everything
    (["plan", "--model", "tiny", "--gpus", "4", "--seq-len", "16K", "--methods", ""],
     "--methods must name at least one, separated by commas, got ''"),
    (["plan", "--model", "tiny", "--gpus", "4", "--seq-len", "16K", "--stacks", ","],
     "--stacks must name at least one"),
    # a real search's flags were ignored by an emulated one
    (["max-context", "--emulate", "--method", "upipe", "--model", "llama3-8b", "--iters", "5",
      "--timeout", "1"], "--iters, --timeout apply to a real search only"),
    (["max-context", "--emulate", "--method", "upipe", "--model", "llama3-8b", "--start", "4K"],
     "--start (4096) must be a multiple of the granularity, nproc * block (8 * 8192 = 65536)"),
    # a sweep whose folder names 16 GPUs ran on 8 under that name, before
    (["sweep", "table4_qwen3_32b_h100x16", "--nproc", "8", "--dry-run"],
     "--nproc 8: these sweeps run on the GPUs they name, not 8: table4_qwen3_32b_h100x16 (16)"),
    (["sweep", "two_node_llama3_8b_h100x16-emulated", "--nproc", "8", "--dry-run"],
     "two_node_llama3_8b_h100x16-emulated (16)"),
    # a finished GPU run is what --reprice prices: a traceback, before
    (["validate-time", "--device", "cuda", "--reprice", "--out", "/nonexistent-upipe-results"],
     "holds no finished GPU run to price again (no rows.csv or env.json)"),
])
def test_bad_values_are_refused_naming_the_rule(capsys, argv, says):
    assert main(argv) == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [
    (["run", "--method", "upipe", "--timeout", "0"], "--timeout"),
    (["run", "--method", "upipe", "--timeout", "-5"], "--timeout"),
    (["sweep", "bench_attention", "--nproc", "0"], "--nproc"),
    (["sweep", "bench_attention", "--timeout", "-1"], "--timeout"),
    (["run", "--method", "upipe", "--nproc", "0"], "--nproc"),
    (["run", "--method", "upipe", "--iters", "-1"], "--iters"),
    (["run", "--method", "upipe", "--kernel", "cudnn-v9"], "--kernel"),
    (["emulate", "--method", "upipe", "--workload", "attention"], "--workload"),  # step only
])
def test_bad_flags_are_refused_before_anything_runs(capsys, argv, flag):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and flag in capsys.readouterr().err


@pytest.mark.parametrize("verb", [["sweep", "upipe_overlap-cpu"], ["plot", "upipe_overlap-cpu"],
                                  ["validate-time"]])
def test_an_out_that_is_a_file_is_refused_before_any_work(tmp_path, capsys, verb):
    """A traceback after the work (a sweep's first write), before; --dry-run said every cell
    would run."""
    afile = tmp_path / "afile"
    afile.write_text("")
    for out in (afile, afile / "below"):
        with pytest.raises(SystemExit) as e:
            main([*verb, "--out", str(out)])
        assert e.value.code == 2 and f"{afile} is a file, not a directory" in (
            capsys.readouterr().err)


def test_an_out_this_user_cannot_write_is_refused_before_any_work(tmp_path, capsys,
                                                                   monkeypatch):
    """A permission-denied results root gave a FileNotFoundError/PermissionError traceback from
    the sweep's lock (rc 1). os.access is stood in for: this suite may run as root, whom no
    permission bit stops."""
    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == locked
                        else real(p, mode))
    for out in (locked, locked / "below"):
        with pytest.raises(SystemExit) as e:
            main(["sweep", "upipe_overlap-cpu", "--dry-run", "--out", str(out)])
        assert e.value.code == 2 and f"{locked} is not writable by this user" in (
            capsys.readouterr().err)


def test_a_length_whose_inputs_cannot_exist_here_is_not_launched():
    seq = 2**40  # 16 TiB of tokens and labels per rank
    row = run_cell(Cell("ulysses", **(SMALL | {"seq_len": seq})))
    assert row["status"] == Status.INVALID and "wall_s" not in row  # nothing launched
    assert f"seq_len ({seq}) needs at least" in row["error"] and "memory" in row["error"]


def _cells_that_disagree() -> tuple[str | None, str | None]:
    rank = dist.get_rank()
    agree = Cell("ulysses", **(SMALL | {"seq_len": 256}))
    differ = Cell("ulysses", **(SMALL | {"seq_len": 256 * (rank + 1), "iters": 1 + rank}))
    return disagreement(agree), disagreement(differ)


@pytest.mark.slow  # about 1-2 s on 2 cores (docs/testing.md)
def test_ranks_given_different_cells_are_told_which_fields_differ(dist_pool):
    """Under torchrun every rank parses its own command line: a length that differs between
    ranks is named on every rank before the cell's first collective (it used to abort inside
    gloo with "Received data size doesn't match")."""
    for same, differ in dist_pool(2).run(_cells_that_disagree):
        assert same is None
        assert differ.startswith("the ranks were given different cells")
        assert "iters: [1, 2]; seq_len: [256, 512]" in differ


def test_the_library_refuses_zero_heads_per_stage():
    from upipe.untied import UPipeAttention

    with pytest.raises(ValueError, match=r"heads_per_stage \(0\) must be a positive multiple"):
        UPipeAttention.check_config(8, 2, cp=2, heads_per_stage=0)


# -- 8. progress, Ctrl-C, help, dry run --------------------------------------------------------


@pytest.mark.slow
def test_progress_on_stderr(capfd):
    assert main(["run", "--method", "ulysses", "--seq-len", "256", "--iters", "2", *FLAGS]) == 0
    out, err = capfd.readouterr()
    assert "step 1/3 (warm-up and memory, tracked)" in err and "step 3/3 (timed)" in err
    assert "status" in out and "step 1/" not in out
    # --json prints none: test_runner.py::test_cli_run_and_max_context_print_one_json_object


# (signal, exit code, last line, command): a cell's ranks (enough timed steps that the run is
# still going when the signal comes: a 3-step run of this cell can end within the second the
# test waits), and calibrate's ranks (its full CPU grid runs for minutes), which the two
# launchers start and end alike (experiments/harness/ranks.py)
RUN = ["run", "--method", "ulysses", "--seq-len", "256", "--iters", "1000", *FLAGS]
SIGNALS = [(signal.SIGINT, 130, "interrupted", RUN),
           (signal.SIGTERM, 143, "terminated (SIGTERM)", RUN),
           (signal.SIGHUP, 129, "terminated (SIGHUP)", ["calibrate", "--device", "cpu"])]


@pytest.mark.slow
@pytest.mark.parametrize("sig, code, says, argv", SIGNALS,
                         ids=[f"{s.name}-{a[0]}" for s, _, _, a in SIGNALS])
def test_a_signal_prints_one_line_and_ends_the_ranks(sig, code, says, argv):
    """Ctrl-C, and SIGTERM / SIGHUP (which used to end the CLI at once, exit 143, while its ranks
    ran on to the end of the cell), end the ranks first, then the command, with one line."""
    # with SIGINT's default action restored: a test run started as a background job of a
    # non-interactive shell (``pytest ... &``) ignores SIGINT, and an ignored signal stays
    # ignored across exec, so the CLI would never see the Ctrl-C this test sends
    proc = subprocess.Popen([sys.executable, "-m", "experiments.cli", *argv], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    ranks = _wait_for(lambda: _ranks(proc.pid), what="the ranks")
    time.sleep(1.0)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == f"upipe-bench {argv[0]}: {says}"
    assert not any(_alive(pid) for pid in ranks)


@pytest.mark.slow
def test_sigterm_ends_a_sweeps_ranks_before_its_lock(tmp_path):
    """A sweep ended by SIGTERM: its cell's ranks are gone when the command has exited (the
    lock, freed at exit, is then free with nothing left loading the machine)."""
    proc = subprocess.Popen([sys.executable, "-m", "experiments.cli", "sweep", "upipe_overlap-cpu",
                             "--out", str(tmp_path), "--no-progress"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: _ranks(proc.pid), what="the first cell's ranks")
    time.sleep(1.0)
    ranks = _ranks(proc.pid)  # the cell running now (the first may have ended in that second)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1] == "upipe-bench sweep: terminated (SIGTERM)"
    assert ranks and not any(_alive(pid) for pid in ranks)
    with results_lock(tmp_path / "upipe_overlap-cpu"):  # free
        pass


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() and "Z" not in _state(pid)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_every_flag_has_help_and_kernel_lists_its_choices():
    p = parser()
    subparsers = next(a for a in p._actions if a.choices and isinstance(a.choices, dict))
    missing = [f"{name} {'/'.join(action.option_strings) or action.dest}"
               for name, sub in subparsers.choices.items() for action in sub._actions
               if action.help in (None, "") and action.dest != "help"]
    assert not missing, f"flags without a help text: {missing}"
    assert "{auto,sdpa,math,flash-attn,fa3,cudnn}" in subparsers.choices["run"].format_help()


def test_dry_run_says_which_cells_resume(tmp_path, capsys):
    assert main(["sweep", "bench_attention", "--dry-run", "--out", str(RESULTS)]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert lines and all(line.split()[0] == "resume" for line in lines), lines
    assert main(["sweep", "bench_attention", "--dry-run", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert lines and all(line.split()[0] == "run" for line in lines), lines
