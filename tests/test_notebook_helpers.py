"""experiments.reporting.notebook, the notebooks' helpers, on a small results/ folder made here.

No notebook runs (tests/test_notebooks.py does that against the committed results/): each test
builds the few rows it needs, in the layout the runner writes (``<sweep>/sweep.json``,
``env.json``, ``rows.csv``, ``max_context.csv``), and checks the helper's answer.
"""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pandas as pd
import pytest

from experiments import store
from experiments.reporting import notebook as nb

K, M = 2**10, 2**20
ARTEFACT = "table9_toy_h100x8"
EMULATED_HW = {"gpu_mem_gib": 80.0, "host_mem_gib": 2048.0, "gpus_per_node": 8,
               "reserve_gib": 4.0, "device": "cuda"}


def _row(method: str, seq_len: int, status: str = "ok", **kw) -> dict:
    """One rows.csv row with the columns every row has; ``kw`` overrides or adds."""
    return {"method": method, "heads_per_stage": None, "ring_degree": 1, "chunk_size": None,
            "model": "tiny", "seq_len": seq_len, "nproc": 4, "stack": "alst",
            "status": status, "mode": "measured", "iters": 2, "workload": "step",
            "error": None if status == "ok" else f"{status} at {seq_len}", **kw}


def _sweep(results: Path, name: str, scale: str, rows: list[dict],
           maxctx: list[dict] | None = None, **decl) -> Path:
    """A sweep folder as the runner leaves it (tables already rebuilt)."""
    folder = results / name
    folder.mkdir(parents=True)
    spec = {"name": name, "scale": scale, "description": f"{name} (test)",
            "base": {}, "axes": {"variant": []}, "plots": [], "hardware": None} | decl
    (folder / "sweep.json").write_text(json.dumps(spec))
    env = {"argv": ["/repo/experiments/cli.py", "sweep", name, "--out", "results"],
           "git_rev": "abc123+dirty", "date_utc": "2026-11-22T17:16:34+00:00",
           "torch_version": "2.13.0+cpu", "cpu_model": "Test CPU", "gpu_name": None}
    (folder / "env.json").write_text(json.dumps(env))
    pd.DataFrame([{"sweep": name, **r} for r in rows]).to_csv(folder / "rows.csv", index=False)
    if maxctx is not None:
        pd.DataFrame([{"sweep": name, **r} for r in maxctx]).to_csv(
            folder / "max_context.csv", index=False)
    return folder


def _search(method: str, status: str, max_seq_len, first_failing, **kw) -> dict:
    return {"method": method, "heads_per_stage": None, "ring_degree": 1, "chunk_size": None,
            "model": "tiny", "nproc": 4, "stack": "alst", "dtype": "fp32", "budget_mib": 48,
            "status": status,
            "mode": "measured", "max_seq_len": max_seq_len,
            "first_failing_seq_len": first_failing, "granularity": K, "n_probes": 3,
            "error": None if status == "ok" else "needs a CUDA device", **kw}


@pytest.fixture
def results(tmp_path: Path) -> Path:
    """results/ with an artefact at the cpu and emulated scales (not the paper's), an
    attention-layer sweep, the CI baseline and a folder that is not a sweep."""
    results = tmp_path / "repo" / "results"
    results.mkdir(parents=True)
    (results / "README.md").write_text("# results\n")
    cpu_rows = [
        _row("ulysses", 2 * K, peak_device_bytes=40 * M, tokens_per_s_per_gpu=100.0),
        _row("ulysses", 2 * K, peak_device_bytes=40 * M, tokens_per_s_per_gpu=120.0),
        _row("ulysses", 8 * K, "oom", peak_device_bytes=60 * M),
        _row("upipe", 2 * K, heads_per_stage=8, peak_device_bytes=30 * M,
             tokens_per_s_per_gpu=55.0),
        _row("upipe", 8 * K, heads_per_stage=8, peak_device_bytes=45 * M,
             tokens_per_s_per_gpu=40.0),
        _row("usp", 2 * K, ring_degree=2, peak_device_bytes=38 * M, tokens_per_s_per_gpu=90.0),
        _row("torch-cp", 2 * K, "skipped", stack="native"),
        # max-context probes (iters 0) under the 48 MiB budget
        _row("ulysses", 6 * K, iters=0, budget_mib=48, peak_device_bytes=47 * M),
        _row("ulysses", 7 * K, "oom", iters=0, budget_mib=48, peak_device_bytes=49 * M),
        _row("upipe", 12 * K, "oom", heads_per_stage=8, iters=0, budget_mib=48),
    ]
    cpu_searches = [_search("ulysses", "ok", 6 * K, 7 * K),
                    _search("upipe", "ok", 8 * K, 12 * K, heads_per_stage=8),
                    _search("torch-cp", "skipped", None, None, stack="native")]
    _sweep(results, f"{ARTEFACT}-cpu", "cpu", cpu_rows, cpu_searches,
           plots=["memory_vs_seq", "max_context"])
    emulated_rows = [
        _row("ulysses", M, mode="emulated", nproc=8, peak_device_bytes=40 * 2**30),
        _row("upipe", M, mode="emulated", nproc=8, heads_per_stage=16,
             peak_device_bytes=30 * 2**30),
    ]
    _sweep(results, f"{ARTEFACT}-emulated", "emulated", emulated_rows,
           hardware=EMULATED_HW, axes={"stack": ["none", "alst"]})
    bench_rows = [_row("ulysses", 16 * K, workload="attention", peak_attention_bytes=200 * M,
                       tokens_per_s_per_gpu=10.0),
                  _row("ulysses", 16 * K, workload="attention", peak_attention_bytes=200 * M,
                       tokens_per_s_per_gpu=20.0, rep=0),
                  _row("upipe", 16 * K, workload="attention", heads_per_stage=4,
                       peak_attention_bytes=100 * M, tokens_per_s_per_gpu=12.0)]
    _sweep(results, "bench_toy", "cpu", bench_rows, base={"workload": "attention"})
    baselines = results / "baselines"
    baselines.mkdir()
    pd.DataFrame([
        {"name": "ulysses-tiny-4xcpu", "mode": "measured", "method": "ulysses",
         "model": "tiny", "nproc": 4, "ring_degree": 1, "stack": "alst", "dtype": "fp32",
         "budget_mib": 48, "status": "ok", "max_seq_len": 6 * K,
         "first_failing_seq_len": 7 * K, "error": None},
        {"name": "upipe-tiny-4xcpu", "mode": "measured", "method": "upipe", "model": "tiny",
         "nproc": 4, "ring_degree": 1, "stack": "alst", "dtype": "fp32", "budget_mib": 48,
         "status": "ok", "max_seq_len": 9 * K, "first_failing_seq_len": 10 * K, "error": None},
        {"name": "ring-tiny-4xcpu", "mode": "measured", "method": "ring", "model": "tiny",
         "nproc": 4, "ring_degree": 1, "stack": "alst", "dtype": "fp32", "budget_mib": 48,
         "status": "skipped",
         "max_seq_len": None, "first_failing_seq_len": None, "error": "not searched"},
    ]).to_csv(baselines / "max_context.csv", index=False)
    (baselines / "max_context.json").write_text(json.dumps(
        {"command": "python -m experiments.runner.max_context_guard --update",
         "git_rev": "def456", "date_utc": "2026-11-22T19:32:20+00:00"}))
    check = results / "gpu_check"  # no sweep.json, no mode column
    check.mkdir()
    pd.DataFrame([{"method": "upipe", "status": "ok"}]).to_csv(check / "rows.csv", index=False)
    (check / "env.json").write_text(json.dumps({"command": "python -m x.gpu_check"}))
    return results


@pytest.fixture
def tables(results: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    return nb.load_tables(nb.sweep_dirs(results, ARTEFACT))


# -- files -----------------------------------------------------------------------------------


def test_find_results_from_the_root_or_below_it(results: Path, monkeypatch):
    root = results.parent
    (root / "notebooks").mkdir()
    assert nb.find_results(root) == results
    assert nb.find_results(root / "notebooks") == results
    monkeypatch.chdir(root / "notebooks")
    assert nb.find_results() == results
    with pytest.raises(FileNotFoundError, match="no results/"):
        nb.find_results(results.parent.parent / "elsewhere")


def test_read_csv_keeps_the_stack_none_as_text(tmp_path: Path):
    path = tmp_path / "t.csv"
    path.write_text("stack,status,error\nnone,ok,\nalst,oom,NA\n")
    df = nb.read_csv(path)
    assert df["stack"].tolist() == ["none", "alst"]
    assert df["error"].isna().tolist() == [True, False]  # only an empty cell is missing
    assert df["error"].iloc[1] == "NA"


def test_read_json_absent_is_empty_malformed_names_the_file(tmp_path: Path):
    assert nb.read_json(tmp_path / "absent.json") == {}
    (tmp_path / "cut.json").write_text('{"name": "x"')
    with pytest.raises(store.BadResultFile, match="cut.json"):
        nb.read_json(tmp_path / "cut.json")


def test_tokens_and_memory_unit():
    assert [nb.tokens(n) for n in (131072, 2**20, 6144.0)] == ["128K", "1M", "6K"]
    assert nb.tokens(float("nan")) == nb.tokens(None) == ""
    assert nb.memory_unit(pd.Series([40 * M, 80 * 2**30])) == (2**30, "GiB")
    assert nb.memory_unit(pd.Series([40 * M, None])) == (M, "MiB")


# -- sweeps and provenance ---------------------------------------------------------------------


def test_sweep_dirs_an_artefact_in_scale_order_and_by_workload(results: Path):
    scales = nb.sweep_dirs(results, ARTEFACT)
    assert list(scales) == ["cpu", "emulated"]  # the paper scale has not run
    assert scales["cpu"] == results / f"{ARTEFACT}-cpu"
    assert nb.not_run(results, ARTEFACT) == [ARTEFACT]
    # every sweep by name: the attention-layer sweep only when asked for
    assert list(nb.sweep_dirs(results)) == [f"{ARTEFACT}-cpu", f"{ARTEFACT}-emulated"]
    assert list(nb.sweep_dirs(results, workload="attention")) == ["bench_toy"]
    assert len(nb.sweep_dirs(results, workload=None)) == 3


def test_provenance_of_a_sweep(results: Path):
    cpu = nb.provenance(results / f"{ARTEFACT}-cpu")
    assert cpu["command"] == f"upipe-bench sweep {ARTEFACT}-cpu --out results"
    # the rows carry no revision: env.json's, marked as the results index marks it
    assert (cpu["scale"], cpu["git_rev"], cpu["ran on"]) == ("cpu", "abc123+dirty †",
                                                              "Test CPU")
    assert cpu["emulated hardware"] is None
    emulated = nb.provenance(results / f"{ARTEFACT}-emulated")
    assert emulated["emulated hardware"] == "8x 80 GiB cuda per node, 4 GiB reserve"
    table = nb.provenance_table(nb.sweep_dirs(results, ARTEFACT))
    assert list(table.columns) == [f"{ARTEFACT}-cpu", f"{ARTEFACT}-emulated"]
    assert table.loc["scale"].tolist() == ["cpu", "emulated"]


def test_provenance_counts_the_revisions_of_the_rows(results: Path):
    """A sweep resumed at several revisions: its rows' revisions with their counts, as the
    results index prints them, not env.json's (the last invocation's) alone."""
    folder = results / f"{ARTEFACT}-cpu"
    revs = ["610a52f3" + "0" * 32] * 2 + ["b32103be" + "0" * 32 + "+dirty"]
    rows = [_row("ulysses", 2 * K, git_rev=rev) for rev in revs]
    pd.DataFrame([{"sweep": folder.name, **r} for r in rows]).to_csv(folder / "rows.csv",
                                                                     index=False)
    assert nb.provenance(folder)["git_rev"] == "610a52f3 (2), b32103be+dirty (1)"
    assert nb.inventory(results).loc[f"{ARTEFACT}-cpu/rows.csv", "git_rev"] == (
        "610a52f3 (2), b32103be+dirty (1)")


def test_provenance_command_of_a_script_and_a_recorded_command(results: Path):
    folder = results / f"{ARTEFACT}-cpu"
    (folder / "env.json").write_text(json.dumps({"argv": ["scripts/migrate.py", "--all"]}))
    assert nb.provenance(folder)["command"] == "python scripts/migrate.py --all"
    (folder / "env.json").write_text(json.dumps({"command": "make it", "argv": ["x.py"]}))
    assert nb.provenance(folder)["command"] == "make it"


def test_inventory_lists_every_table_with_its_provenance(results: Path):
    inv = nb.inventory(results)
    assert set(inv.index) == {f"{ARTEFACT}-cpu/rows.csv", f"{ARTEFACT}-cpu/max_context.csv",
                              f"{ARTEFACT}-emulated/rows.csv", "bench_toy/rows.csv",
                              "baselines/max_context.csv", "gpu_check/rows.csv"}
    cpu = inv.loc[f"{ARTEFACT}-cpu/rows.csv"]
    assert (cpu["scale"], cpu["rows"], cpu["mode"]) == ("cpu", 10, "measured")
    assert cpu["status"] == "ok 6, oom 3, skipped 1"
    baseline = inv.loc["baselines/max_context.csv"]
    assert baseline["command"] == "python -m experiments.runner.max_context_guard --update"
    assert (baseline["git_rev"], baseline["scale"]) == ("def456 †", "")
    assert inv.loc["gpu_check/rows.csv", "mode"] == ""  # no mode column: none invented


# -- loading ---------------------------------------------------------------------------------


def test_load_labels_variants_and_adds_the_sweep_columns(results: Path):
    rows = nb.load(nb.sweep_dirs(results, ARTEFACT))
    assert len(rows) == 12
    cpu = rows[rows["scale"] == "cpu"]
    assert set(cpu["sweep"]) == {f"{ARTEFACT}-cpu"} and set(cpu["artefact"]) == {ARTEFACT}
    assert set(cpu["variant"]) == {"ulysses", "upipe U=8", "usp 2x2", "torch-cp"}
    assert rows.groupby("scale")["ladder"].first().to_dict() == {"cpu": False, "emulated": True}
    # the columns the notebooks read exist even where no table has them
    assert {"peak_host_bytes", "attention_peak_bytes", "model_n_heads"} <= set(rows.columns)
    assert rows["peak_host_bytes"].isna().all()
    relative = nb.load(nb.sweep_dirs(results, ARTEFACT), relative=True)
    assert set(relative["variant"]) == {"ulysses", "upipe U=2C", "usp ring=2", "torch-cp"}


def test_relative_variant_reads_the_same_at_every_scale():
    assert nb.relative_variant("upipe", 4, 1, 4) == nb.relative_variant("upipe", 8, 1, 8)
    assert nb.relative_variant("upipe", 8, 1, 8) == "upipe U=C"
    assert nb.relative_variant("upipe", 8, 2, 8) == "upipe ring=2 U=2C"
    assert nb.relative_variant("fpdt", math.nan, 1, 8) == "fpdt"


def test_load_tables_share_one_variant_order_ulysses_first(tables):
    rows, maxctx = tables
    order = list(rows["variant"].cat.categories)
    assert order == list(maxctx["variant"].cat.categories)
    assert order[0] == "ulysses"
    assert order.index("upipe U=8") < order.index("upipe U=16") < order.index("usp 2x2")
    assert len(maxctx) == 3 and set(maxctx["scale"]) == {"cpu"}  # only cpu searched


def test_load_of_sweeps_without_the_table_is_empty_with_its_columns(results: Path):
    maxctx = nb.load([results / f"{ARTEFACT}-emulated"], "max_context.csv")
    assert maxctx.empty and {"max_seq_len", "first_failing_seq_len", "variant"} <= set(maxctx)


@pytest.mark.parametrize("cut, why", [
    (lambda text: text[:-5], "does not end with a newline"),  # mid-line
    (lambda text: text[:text.rstrip("\n").rfind(",")] + "\n", "record 11 .* fields"),
    # whole lines: only the rows the sweep folder holds (runs/, one row.json each) tell
    (lambda text: text[:text.rstrip("\n").rfind("\n") + 1], "9 rows, but .*runs has 10"),
])
def test_load_tables_refuses_a_table_cut_short_naming_it(results: Path, cut, why):
    folder = results / f"{ARTEFACT}-cpu"
    for i in range(10):  # the table's 10 rows, each from a run
        (folder / "runs" / f"cell-{i}").mkdir(parents=True)
        (folder / "runs" / f"cell-{i}" / "row.json").write_text("{}")
    assert len(nb.load_tables(nb.sweep_dirs(results, ARTEFACT))[0]) == 10 + 2  # and emulated
    table = folder / "rows.csv"
    table.write_text(cut(table.read_text()))
    with pytest.raises(store.BadResultFile, match=why) as e:
        nb.load_tables(nb.sweep_dirs(results, ARTEFACT))
    assert e.value.path == table


# -- filtering and tables --------------------------------------------------------------------


def test_not_ok_lists_every_failed_row_with_its_error(tables):
    rows, _ = tables
    failed = nb.not_ok(rows)
    assert len(failed) == 4 and "ok" not in set(failed["status"])
    assert list(failed.columns)[-1] == "error" and failed["error"].notna().all()
    assert nb.status_counts(rows).loc[("cpu", "measured")].to_dict() == {
        "ok": 6, "oom": 3, "skipped": 1}


def test_not_ok_by_error_groups_one_error_at_several_lengths(tables):
    rows, _ = tables
    rows = rows.assign(error=rows["error"].where(rows["status"] != "oom",
                                                 "device peak 1.5 GiB > budget 1.0 GiB"))
    grouped = nb.not_ok_by_error(rows)
    ulysses = grouped.loc[(f"{ARTEFACT}-cpu", "ulysses", "oom", "device peak X > budget X")]
    assert ulysses["rows"] == 2 and ulysses["lengths"] == "7K, 8K"


def test_vs_ulysses_is_over_the_median_of_ulysses_ok_rows(tables):
    rows, _ = tables
    grid = rows[(rows["scale"] == "cpu") & (rows["iters"] > 0)]
    ratio = nb.vs_ulysses(grid, "tokens_per_s_per_gpu", ["seq_len"])
    upipe = grid["variant"] == "upipe U=8"
    # 2K: Ulysses' median is 110; 8K: Ulysses ran out of memory, no reference
    assert ratio[upipe & (grid["seq_len"] == 2 * K)].item() == pytest.approx(0.5)
    assert math.isnan(ratio[upipe & (grid["seq_len"] == 8 * K)].item())


def test_vs_ulysses_within_each_cell_ulysses_is_one():
    """Two models and two stacks at one length (time_validation_cpu's shape): each row over
    the Ulysses of its own model and stack, so Ulysses is exactly 1.0; a packed row has no
    packed Ulysses, so no ratio (it is never over an unpacked one)."""
    rows = pd.DataFrame([
        _row("ulysses", 4 * K, model="tiny", tokens_per_s_per_gpu=100.0),
        _row("ulysses", 4 * K, model="tiny-wide", tokens_per_s_per_gpu=40.0),
        _row("ulysses", 4 * K, model="tiny", stack="none", tokens_per_s_per_gpu=250.0),
        _row("upipe", 4 * K, model="tiny-wide", tokens_per_s_per_gpu=20.0),
        _row("upipe", 4 * K, model="tiny", doc_len=2 * K, tokens_per_s_per_gpu=134.0),
        _row("torch-cp", 4 * K, model="tiny", stack="native", tokens_per_s_per_gpu=50.0),
    ]).reindex(columns=nb.ROW_COLUMNS)
    ratio = nb.vs_ulysses(rows, "tokens_per_s_per_gpu", nb.CELL_KEYS)
    assert ratio.tolist()[:4] == [1.0, 1.0, 1.0, 0.5]
    assert math.isnan(ratio[4])  # packed: no Ulysses with its document length
    assert math.isnan(ratio[5])  # torch-cp's own stack, and Ulysses ran on two: no one match
    packed_ulysses = rows.iloc[[0]].assign(doc_len=2 * K, tokens_per_s_per_gpu=67.0)
    with_it = pd.concat([rows, packed_ulysses], ignore_index=True)
    assert nb.vs_ulysses(with_it, "tokens_per_s_per_gpu", nb.CELL_KEYS)[4] == 2.0


def test_ratio_reference_of_a_paper_table_is_the_papers_ulysses():
    """A Table 4 sweep divides by USP 8x2 (the paper's Ulysses there), named so; a sweep at
    the CPU scale by upipe's Ulysses."""
    paper = pd.DataFrame([
        _row(m, 128 * K, model="qwen3-32b", nproc=16, ring_degree=r, kernel="fa3")
        for m, r in (("ulysses", 1), ("usp", 2), ("upipe", 2))])
    mask, name = nb.ratio_reference(paper)
    assert mask.tolist() == [False, True, False] and name.startswith("usp 8x2")
    mask, name = nb.ratio_reference(paper.assign(model="tiny"))
    assert mask.tolist() == [True, False, False] and name == "Ulysses"


def test_max_context_vs_ulysses_prints_a_dash_without_ulysses(tables):
    _, maxctx = tables
    found = nb.max_context_vs_ulysses(maxctx).set_index("variant")
    assert found.loc["upipe U=8", "text"] == "8K (1.33x)"
    alone = nb.max_context_vs_ulysses(maxctx[maxctx["method"] != "ulysses"])
    assert alone["text"].tolist() == ["8K (-)"]


def test_vs_no_stack_keeps_only_variants_with_a_none_row():
    """A selective-recomputation sweep varies the stack but has no ``none`` row: nothing to
    anchor the ratio, so none of its rows (no empty panel row)."""
    rows = pd.DataFrame([
        _row("ulysses", 4 * K, stack=st, peak_device_bytes=p * M) | {"sweep": "ladder"}
        for st, p in (("none", 80), ("alst", 20))] + [
        _row("ulysses", 4 * K, stack="alst-attn", peak_device_bytes=10 * M) | {"sweep": "sel"}
    ]).assign(ladder=True, variant="ulysses")
    got = nb.vs_no_stack(rows)
    assert got["sweep"].tolist() == ["ladder", "ladder"]
    assert got["vs_none"].tolist() == [1.0, 0.25]


def test_by_length_prints_the_median_or_the_status(tables):
    rows, _ = tables
    grid = rows[(rows["scale"] == "cpu") & (rows["iters"] > 0)]
    table = nb.by_length(grid, "tokens_per_s_per_gpu", "{:.0f}".format)
    assert list(table.columns) == ["2K", "8K"]
    assert table.loc[("ulysses", "alst")].tolist() == ["110", "OOM"]
    assert table.loc[("torch-cp", "native"), "2K"] == "SKIPPED"
    peak = nb.by_length(grid.assign(x=float("nan")), "x", str)
    assert peak.loc[("upipe U=8", "alst"), "2K"] == "-"  # ran ok, no value


def test_searches_and_their_check_against_the_probes(tables):
    rows, maxctx = tables
    table = nb.searches(maxctx).set_index("variant")
    assert table.loc["ulysses", "max_context"] == "6K"
    assert table.loc["torch-cp", "max_context"] == "skipped"
    assert table.loc["upipe U=8", "vs_ulysses"] == pytest.approx(8 / 6, abs=0.01)
    check = nb.check_searches(rows, maxctx).set_index("variant")
    assert check.loc["ulysses", "agrees"]  # 6K the longest ok probe, 7K the shortest oom
    # UPipe's search says 8K fits, but no ok row at 8K ran under the budget
    assert not check.loc["upipe U=8", "agrees"]
    assert "torch-cp" not in check.index


def test_ladder_ratios_to_no_stack_and_to_ulysses():
    rows = pd.DataFrame([
        _row("ulysses", 4 * K, stack="none", peak_device_bytes=100, peak_host_bytes=0),
        _row("ulysses", 4 * K, stack="ac", peak_device_bytes=50, peak_host_bytes=0),
        _row("upipe", 4 * K, "oom", stack="none", peak_device_bytes=80, peak_host_bytes=0),
        _row("upipe", 4 * K, stack="ac", peak_device_bytes=20, peak_host_bytes=10)])
    rows = rows.assign(variant=rows["method"], peak_model_bytes=1, peak_attention_bytes=2,
                       peak_other_bytes=3)
    table = nb.ladder(rows)
    assert table.loc[("ulysses", "ac"), "vs none"] == 0.5
    assert table.loc[("upipe", "ac"), "vs none"] == 0.25
    assert table.loc[("upipe", "ac"), "vs ulysses"] == 0.4
    assert table.loc[("upipe", "none"), "status"] == "oom"
    assert table.loc[("upipe", "ac"), "host (offloaded)"] == 10


def test_per_u_in_units_of_the_ulysses_degree():
    rows = pd.DataFrame([
        _row("ulysses", 4 * K, peak_device_bytes=100, tokens_per_s_per_gpu=10.0),
        _row("upipe", 4 * K, heads_per_stage=4, peak_device_bytes=60, tokens_per_s_per_gpu=8.0),
        _row("upipe", 4 * K, heads_per_stage=8, peak_device_bytes=80, tokens_per_s_per_gpu=9.0)])
    rows = rows.assign(variant=[nb.plot_labels.variant_label(m, u) for m, u in
                                zip(rows["method"], rows["heads_per_stage"], strict=True)],
                       model_n_heads=16, peak_attention_bytes=1, attention_peak_bytes=2)
    table = nb.per_u(rows)
    assert table.loc["upipe U=8", "U/C"] == 2 and table.loc["upipe U=8", "stages"] == 2
    assert table.loc["ulysses", "stages"] == 1  # Ulysses: all heads in one stage
    assert table.loc["upipe U=4", "peak vs ulysses"] == pytest.approx(0.6)
    assert table.loc["upipe U=4", "tokens_per_s_per_gpu vs ulysses"] == pytest.approx(0.8)


def test_baseline_vs_sweeps(results: Path):
    """Beside each baseline row: the sweeps' search of the same cell, none of another's."""
    baseline = nb.read_csv(results / "baselines" / "max_context.csv")
    maxctx = pd.DataFrame([
        _search("ulysses", "ok", 6 * K, 7 * K),
        _search("upipe", "ok", 8 * K, 12 * K),
        # other cells: another U, a full RoPE table, another budget, another mode, documents
        _search("upipe", "ok", 10 * K, 11 * K, heads_per_stage=2),
        _search("ulysses", "ok", 8 * K, 9 * K, global_rope_table=True),
        _search("ulysses", "ok", 7 * K, 8 * K, budget_mib=64),
        _search("ulysses", "ok", 9 * K, 10 * K, budget_mib=None, mode="emulated"),
        _search("ulysses", "ok", 10 * K, 11 * K, doc_len=K)])
    table = nb.baseline_vs_sweeps(baseline, maxctx).set_index("name")
    assert table.loc["ulysses-tiny-4xcpu", "sweep_max_context"] == "6K"
    assert table.loc["ulysses-tiny-4xcpu", "agrees"] is True
    upipe = table.loc["upipe-tiny-4xcpu"]
    assert (upipe["max_context"], upipe["sweep_max_context"]) == ("9K", "8K")
    assert upipe["agrees"] is False
    assert table.loc["ring-tiny-4xcpu", "max_context"] == "skipped"
    alone = nb.baseline_vs_sweeps(baseline, maxctx.iloc[2:])  # no search of the same cells
    assert alone["agrees"].isna().all() and (alone["sweep_max_context"] == "").all()


def test_attention_layer_table_medians_per_variant_and_length(results: Path):
    bench, _ = nb.load_tables(nb.sweep_dirs(results, workload="attention"))
    table = nb.attention_layer_table(bench)
    assert table.loc[("bench_toy", 4, "ulysses"), ("tokens_per_s_per_gpu", "16K")] == 15.0
    assert table.loc[("bench_toy", 4, "upipe U=4"), ("attention_mib", "16K")] == 100.0
    assert list(table.index) == [("bench_toy", 4, "ulysses"), ("bench_toy", 4, "upipe U=4")]


def test_attention_layer_table_keeps_sweeps_of_other_ranks_apart_lengths_in_order(
        results: Path):
    """Two attention sweeps on 4 and 2 ranks are not one table: the sweep and its ranks index
    the rows; lengths read 2K 4K 16K, not as strings sort (16K 2K 4K)."""
    _sweep(results, "overlap_toy", "cpu",
           [_row("ulysses", n, nproc=2, workload="attention", tokens_per_s_per_gpu=1.0,
                 peak_attention_bytes=M) for n in (2 * K, 4 * K)],
           base={"workload": "attention"})
    bench, _ = nb.load_tables(nb.sweep_dirs(results, workload="attention"))
    table = nb.attention_layer_table(bench)
    assert list(table.index) == [("bench_toy", 4, "ulysses"), ("bench_toy", 4, "upipe U=4"),
                                 ("overlap_toy", 2, "ulysses")]
    assert list(table["tokens_per_s_per_gpu"].columns) == ["2K", "4K", "16K"]


# -- figures and the module's imports ----------------------------------------------------------


def test_figures_draw_each_declared_plot_of_each_sweep(results: Path, tables):
    rows, maxctx = tables
    drawn = nb.figures(nb.sweep_dirs(results, ARTEFACT), rows, maxctx)
    assert [title for title, _ in drawn] == [f"{ARTEFACT}-cpu: memory_vs_seq",
                                             f"{ARTEFACT}-cpu: max_context"]
    for _, png in drawn:
        assert png._repr_png_().startswith(b"\x89PNG\r\n\x1a\n")
        assert repr(png).startswith("<PNG image")
    assert nb.figure("max_context", rows, maxctx.iloc[:0]) is None  # no search: nothing drawn


def test_reads_results_only():
    """docs/design.md#layout-and-dependency-direction: reporting imports no harness, time model,
    emulation, runner, GPU check or CLI code."""
    tree = ast.parse(Path(nb.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    forbidden = ("experiments.harness", "experiments.timing", "experiments.emulation",
                 "experiments.runner", "experiments.gpu", "experiments.cli", "torch", "upipe",
                 "baselines")
    assert not [m for m in imported if m and m.startswith(forbidden)]
