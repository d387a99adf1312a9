"""The sweep runner and the CLI end to end on CPU: cells in their own launches, failures as
rows, resume, a real max-context search, tables and plots."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from session_ranks import SessionRanks

from experiments.cli import main
from experiments.config import Cell, SearchSpec, Sweep
from experiments.harness.launch import describe, run_cell
from experiments.runner.sweep_runner import SweepRunner
from experiments.store import read_json, write_json
from upipe.registry import available_methods

OVERRIDES = (("n_layers", "3"), ("dim", "64"), ("n_heads", "8"), ("n_kv_heads", "2"),
             ("head_dim", "8"), ("ffn_dim", "96"), ("vocab_size", "128"))
BASE = {"model": "tiny", "nproc": 2, "stack": "alst", "warmup": 1, "iters": 1,
        "overrides": OVERRIDES}


def needs(*methods: str):
    """Skip, naming them, while methods are not registered yet (upipe.available_methods())."""
    missing = sorted(set(methods) - set(available_methods()))
    return pytest.mark.skipif(bool(missing), reason=f"method(s) {missing} not registered")


def test_invalid_cell_is_a_row_without_a_launch():
    row = run_cell(Cell("upipe", options={"heads_per_stage": 3}, **BASE))
    assert row["status"] == "invalid" and "heads_per_stage" in row["error"]
    assert "wall_s" not in row


@needs("rfa-zigzag")
@pytest.mark.skipif(torch.cuda.is_available(), reason="rfa-zigzag may run where CUDA is present")
def test_unavailable_method_is_a_skipped_row_without_a_launch(tmp_path):
    """rfa-zigzag needs CUDA (and flash-attn): on CPU its cell and its max-context search are
    recorded as skipped, with the method's reason, and nothing is launched."""
    base = BASE | {"dtype": "bf16"}
    row = run_cell(Cell("rfa-zigzag", seq_len=512, **base))
    assert row["status"] == "skipped" and "CUDA" in row["error"]
    assert "wall_s" not in row  # no launch
    sweep = Sweep("skip", "unavailable", "cpu", base=base,
                  axes={"variant": [{"method": "rfa-zigzag"}], "seq_len": [512]},
                  search=SearchSpec(start=1024, block=256, limit=2048), timeout_s=60)
    paths = SweepRunner(sweep, tmp_path, progress=False)()
    mc = pd.read_csv(paths["max_context_csv"])
    assert list(mc.status) == ["skipped"] and mc.n_probes[0] == 0 and "CUDA" in mc.error[0]
    assert list(pd.read_csv(paths["rows_csv"]).status) == ["skipped"]  # the grid cell only


@pytest.mark.slow
@needs("usp", "fpdt")
def test_hybrid_and_fpdt_cells_run_end_to_end(dist_pool):
    """A 2 x 2 USP mesh through the launcher, as a sweep runs it, and FPDT on 4 ranks (on the
    session's ranks: the launch is the USP cell's; ``run_cell`` is what torchrun's ranks run).
    FPDT offloads its chunks to host itself: on the ``ac`` stack (no block offload) its host
    bytes are the only ones, and the tracker counts them."""
    two_layers = (("n_layers", "2"), *OVERRIDES[1:])  # the cost is per layer: keep it short
    base = BASE | {"nproc": 4, "seq_len": 512, "warmup": 0, "overrides": two_layers}
    usp = run_cell(Cell("usp", ring_degree=2, **base), timeout_s=300)
    assert usp["status"] == "ok", usp["error"]
    assert usp["ring_degree"] == 2 and usp["tokens_per_s_per_gpu"] > 0
    assert usp["kernel"] == "auto" and usp["kernel_ran"] == "sdpa"  # what auto ran on the CPU
    fpdt = SessionRanks(dist_pool).run(Cell("fpdt", options={"chunk_size": 256},
                                            **(base | {"stack": "ac"})))
    assert fpdt["status"] == "ok", fpdt["error"]
    assert fpdt["chunk_size"] == 256 and fpdt["peak_host_bytes"] > 0


def _process_groups() -> int:
    import torch.distributed as dist

    return len(dist.distributed_c10d._world.pg_map)


@pytest.mark.slow  # about 4 s on 2 cores (docs/testing.md)
@needs("usp", "ds-ulysses")
def test_cells_run_again_on_the_same_ranks_make_no_new_process_group(dist_pool):
    """A process that runs cell after cell (the session's ranks, a notebook) reuses its meshes
    (``experiments.harness.train.job_mesh``): a gloo group keeps a thread that wakes every 10 ms
    as long as it lives, and one set of groups per cell took half of the session ranks' CPU
    time. DeepSpeed's Ulysses is in the pair because DeepSpeed could make groups of its own."""
    ranks, pool = SessionRanks(dist_pool), dist_pool(2)
    base = BASE | {"seq_len": 256, "warmup": 0}
    cells = [Cell("usp", ring_degree=2, **base), Cell("ds-ulysses", **base)]
    for c in cells:  # each mesh shape's groups are made here, once
        assert ranks.run(c)["status"] == "ok"
    made = pool.run(_process_groups)
    for c in cells:
        assert ranks.run(c)["status"] == "ok"
    assert pool.run(_process_groups) == made


@pytest.mark.slow  # about 5 s on 2 cores (docs/testing.md)
def test_runtime_failure_and_timeout_become_rows():
    row = run_cell(Cell("ulysses", seq_len=256, lr=-1.0, **BASE), timeout_s=300)
    assert row["status"] == "error" and "Invalid learning rate" in row["error"]
    row = run_cell(Cell("ulysses", seq_len=256, **BASE), timeout_s=0.5)
    assert row["status"] == "timeout"


@pytest.fixture(scope="module")
def swept(tmp_path_factory, dist_pool):
    out = tmp_path_factory.mktemp("results")
    sweep = Sweep(
        # 3.8 MiB per rank: Ulysses fits 1024 tokens, not 2048; UPipe fits 2048 (measured
        # tracked peaks 2.80 / 4.07 and 3.61 MiB), so the search bisects once (1536) for Ulysses
        # and reaches the limit for UPipe.
        "mini", "test sweep", "cpu", base=BASE | {"budget_mib": 3.8},
        axes={"variant": [{"method": "ulysses"}, {"method": "upipe"},
                          {"method": "upipe", "heads_per_stage": 3}],  # invalid: a row
              "seq_len": [256, 512]},
        search=SearchSpec(start=1024, block=256, limit=2048),
        plots=("max_context", "memory_vs_seq", "throughput_vs_seq", "throughput_vs_ulysses"),
        timeout_s=300)
    runner = SweepRunner(sweep, out, progress=False)
    runner.executor = SessionRanks(dist_pool)  # the session's ranks: no start-up per cell
    paths = runner()
    return sweep, out, runner, paths


@pytest.mark.slow
def test_sweep_writes_rows_searches_and_plots(swept):
    sweep, out, runner, paths = swept
    rows = pd.read_csv(paths["rows_csv"])
    probes = rows[rows.iters == 0]  # the searches' probes are cells too
    assert len(rows) == 6 + len(probes) == 6 + 3 + 2, probes[["method", "seq_len", "status",
                                                             "error"]].to_string()
    assert set(probes.status) == {"ok", "oom"}
    grid = rows[rows.iters == 1]
    assert sorted(grid.status) == ["invalid"] * 2 + ["ok"] * 4
    assert (grid[grid.status == "ok"].tokens_per_s_per_gpu > 0).all()
    mc = pd.read_csv(paths["max_context_csv"]).sort_values(["method", "heads_per_stage"])
    assert list(mc.status) == ["ok", "invalid", "ok"]  # the invalid variant is not probed
    uly, up = mc.iloc[0], mc.iloc[2]
    assert (uly.method, uly.first_failing_seq_len, uly.n_probes) == ("ulysses", 2048, 3)
    assert uly.first_failing_seq_len - uly.max_seq_len == 512  # 2 ranks x 256-token blocks
    assert (up.method, up.max_seq_len, up.n_probes) == ("upipe", 2048, 2)
    assert pd.isna(up.first_failing_seq_len)  # the limit passed
    for name in sweep.plots:
        assert paths[name].exists() and paths[name].stat().st_size > 10_000
    env = json.loads((out / "mini" / "env.json").read_text())
    assert env["torch_version"] and env["git_rev"]


@pytest.mark.slow
def test_sweep_resumes_without_rerunning(swept):
    sweep, out, first, _ = swept
    before = pd.read_csv(out / "mini" / "rows.csv")
    again = SweepRunner(sweep, out, progress=False)
    again.run_id = "resumed"  # a later invocation
    again()
    assert set(again.counts) == {"cached"}
    after = pd.read_csv(out / "mini" / "rows.csv")
    pd.testing.assert_frame_equal(before, after)
    # env.json still describes the invocation that made the rows, not the resume
    assert json.loads((out / "mini" / "env.json").read_text())["run_id"] == first.run_id


def test_resume_writes_a_missing_cell_json_again(tmp_path, capsys):
    """A stored row whose cell.json was deleted is resumed (not run), and its cell.json is
    written again from the sweep's declaration, which readers of the run need (the time
    validation predicts each row from it). A row stored by hand: nothing is launched."""
    sweep = Sweep("resume", "cell.json", "cpu", base=BASE | {"method": "ulysses"},
                  axes={"seq_len": [256]})
    (cell,) = sweep.cells()
    runner = SweepRunner(sweep, tmp_path, progress=False)
    row_path = runner._row_path(cell)
    write_json(row_path, describe(cell, None) | {"status": "ok", "error": "", "mode": "measured"})
    assert runner.run(cell)["status"] == "ok" and runner.resumed
    cell_path = row_path.with_name("cell.json")
    assert cell_path.is_file() and Cell.from_dict(read_json(cell_path)) == cell
    assert f"warning: {cell_path} was missing" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_run_and_max_context_print_one_json_object(capfd):
    flags = ["--model", "tiny", "--nproc", "2", "--stack", "alst", "--warmup", "0"]
    for o in OVERRIDES:
        flags += ["--override", "=".join(o)]
    assert main(["run", "--method", "upipe", "--seq-len", "512", "--iters", "1", "--json",
                 *flags]) == 0
    out, err = capfd.readouterr()
    row = json.loads(out)  # the whole of stdout is one JSON object
    assert "step 1/" not in err  # --json: no progress either
    for key in ("status", "method", "seq_len", "peak_device_bytes", "peak_host_bytes",
                "tokens_per_s_per_gpu"):
        assert key in row
    assert row["status"] == "ok" and row["seq_len"] == 512
    assert main(["max-context", "--method", "ulysses", "--budget-mib", "5", "--start", "512",
                 "--block", "256", "--limit", "1K", "--json", *flags]) == 0
    res = json.loads(capfd.readouterr().out)
    assert {"max_seq_len", "first_failing_seq_len"} <= set(res)


@pytest.mark.parametrize("argv, says", [
    (["run", "--method", "nope"], ["method must be one of", "upipe"]),
    (["run", "--method", "upipe", "--model", "gpt9"], ["tiny"]),
    (["run", "--method", "upipe", "--override", "layers=2"], ["n_layers"]),
    (["sweep", "table9"], ["table3_llama3_8b_h100x8-cpu"]),
])
def test_cli_rejects_bad_input_listing_choices(capsys, argv, says):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert all(text in err for text in says), err


def test_a_paper_sweep_without_cuda_is_refused_before_any_cell(tmp_path, capsys, monkeypatch):
    """A paper-scale sweep launched on CPU ranks ran GPU-sized cells (Llama3-8B at 1M tokens)
    until the kernel killed each one; without CUDA it is refused up front, naming its emulated
    twin and its CPU counterpart, and nothing is written (its dry run still answers: above)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    name = "selective_recompute_llama3_8b_h100x8"
    assert main(["sweep", name, "--out", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "paper scale" in err and f"{name}-emulated" in err and f"{name}-cpu" in err, err
    assert not any(tmp_path.iterdir())


def test_cli_rejects_a_length_that_is_not_a_size(capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "--method", "upipe", "--seq-len", "1.5M"])
    assert e.value.code == 2 and "128K" in capsys.readouterr().err


def test_cli_list_and_dry_run(capsys):
    assert main(["list", "--json"]) == 0
    cat = json.loads(capsys.readouterr().out)
    assert {"upipe", "ulysses"} <= set(cat["methods"]) and "llama3-8b" in cat["presets"]
    assert cat["methods"]["ulysses"]["available"] and cat["methods"]["ulysses"]["reason"] is None
    assert cat["methods"]["upipe"]["options"] == ["heads_per_stage", "chunk_size", "overlap",
                                                  "ring_degree"]
    if "rfa-zigzag" in cat["methods"] and cat["methods"]["rfa-zigzag"]["device"] == "cpu":
        assert not cat["methods"]["rfa-zigzag"]["available"]
        assert "CUDA" in cat["methods"]["rfa-zigzag"]["reason"]
    assert cat["methods"]["torch-cp"]["available"]  # torch's ring runs on CPU too
    code = main(["sweep", "--dry-run", "table3_llama3_8b_h100x8", "table3_llama3_8b_h100x8-cpu"])
    out = capsys.readouterr().out
    # 9 variants (the paper's Ulysses and upipe's, UPipe with and without overlap) x 8 lengths,
    # each searched; the CPU one: 8 x 3, one packed UPipe cell and two searches
    assert "72 cells, 9 max-context searches" in out, out
    assert "25 cells, 2 max-context searches" in out
    if {"torch-cp", "fpdt"} <= set(cat["methods"]):  # else INVALID until they are registered
        assert code == 0 and "INVALID" not in out, out
