"""The paper's tables and figures as data (experiments/reporting/paper_tables.py): well-formed,
consistent with themselves (each row runs to 5M or stops at its first OOM, the max-context
sentences and the stated limits agree with the cells), and spot values pinned so that a
transcription change is caught."""

from __future__ import annotations

import ast
from itertools import groupby
from pathlib import Path

import pytest

from experiments.reporting import paper_tables as pt
from experiments.reporting.ablation_plots import ladder_rung
from upipe.registry import available_methods

CELL_KEYS = {"table", "model", "gpus", "method", "mesh", "paper_method", "seq_len",
             "tokens_per_s_per_gpu", "status", "source"}
TABLES = {"table3": ("llama3-8b", 8, "Table 3"), "table4": ("qwen3-32b", 16, "Table 4")}
METHODS = set(available_methods())
LENGTHS = list(pt.SEQ_LEN_TOKENS.values())


def _key(c: dict) -> tuple:
    return c["table"], c["method"], c["mesh"]


def _rows() -> dict[tuple, list[dict]]:
    """(table, method, mesh) -> its cells in the table's column order."""
    return {k: list(g) for k, g in groupby(pt.PAPER_THROUGHPUT, key=_key)}


def _check_common(row: dict) -> None:
    model, gpus, _ = TABLES[row["table"]]
    assert row["model"] == model and row["gpus"] == gpus
    assert row["method"] in METHODS, row
    u, _, r = row["mesh"].partition("x")
    assert u.isdigit() and r.isdigit() and int(u) * int(r) == gpus, row
    assert isinstance(row["seq_len"], int) and not isinstance(row["seq_len"], bool)
    assert row["seq_len"] in LENGTHS


def test_transcribed_cells_are_well_formed():
    for row in pt.PAPER_THROUGHPUT:
        assert set(row) == CELL_KEYS, row
        _check_common(row)
        assert row["source"] == f"UPipe project page, {TABLES[row['table']][2]}"
        assert row["status"] in ("ok", "oom")
        value = row["tokens_per_s_per_gpu"]
        assert (isinstance(value, float) and value > 0) if row["status"] == "ok" else value is None


def test_no_duplicate_cells():
    keys = [(*_key(r), r["seq_len"]) for r in pt.PAPER_THROUGHPUT]
    assert len(keys) == len(set(keys))


def test_each_row_runs_to_5m_or_stops_at_its_first_oom():
    rows = _rows()
    assert len(rows) == 10 and len(pt.PAPER_THROUGHPUT) == 67  # 35 cells + 32 cells
    for key, cells in rows.items():
        assert [c["seq_len"] for c in cells] == LENGTHS[:len(cells)], key  # from 128K, no gaps
        statuses = [c["status"] for c in cells]
        assert "oom" not in statuses[:-1], key  # nothing after an OOM
        assert len(cells) == len(LENGTHS) or statuses[-1] == "oom", key
        assert len({c["paper_method"] for c in cells}) == 1


def test_max_context_sentences_agree_with_the_last_ok_cell():
    rows = _rows()
    stated = {_key(m): m["max_context"] for m in pt.PAPER_MAX_CONTEXT}
    assert set(stated) == set(rows)
    for key, cells in rows.items():
        assert stated[key] == max(c["seq_len"] for c in cells if c["status"] == "ok"), key
    # Table 3: "UPipe 5M (+25% over FPDT)", the abstract's "over 25%" on prior methods
    t3 = {m: n for (t, m, _), n in stated.items() if t == "table3"}
    assert t3["upipe"] == 1.25 * t3["ds-fpdt"] == pt.SEQ_LEN_TOKENS["5M"]
    assert t3["upipe"] / max(n for m, n in t3.items() if m != "upipe") - 1 == pytest.approx(
        next(c["value"] for c in pt.PAPER_CLAIMS if c["claim"] ==
             "max_context_gain_over_prior_pct") / 100)


def test_stated_limits_agree_with_the_tables():
    value = {(c["table"], c["method"], c["mesh"], c["seq_len"]): c["tokens_per_s_per_gpu"]
             for c in pt.PAPER_THROUGHPUT}
    ulysses = {"table3": ("usp-ulysses", "8x1", "upipe", "8x1"),
               "table4": ("usp", "8x2", "upipe", "8x2")}
    for lim in pt.PAPER_LIMITS:
        u, um, p, pm = ulysses[lim["table"]]
        n = lim["seq_len"]
        pct = 100 * (value[(lim["table"], p, pm, n)] / value[(lim["table"], u, um, n)] - 1)
        assert pct == pytest.approx(lim["upipe_vs_ulysses_pct"], abs=0.05), lim  # 1 decimal


def test_outcomes_are_the_tables_cells():
    assert [(*_key(o), o["seq_len"], o["status"]) for o in pt.PAPER_OUTCOMES] == \
        [(*_key(c), c["seq_len"], c["status"]) for c in pt.PAPER_THROUGHPUT]
    peaks = [o for o in pt.PAPER_OUTCOMES if o["peak_memory_gib"] is not None]
    assert [(o["method"], o["seq_len"], o["peak_memory_gib"], o["status"]) for o in peaks] == \
        [("zigzag-ring", pt.SEQ_LEN_TOKENS["3M"], 73.5, "ok")]


def test_spot_check_cells():
    value = {(c["table"], c["method"], c["seq_len"]): c["tokens_per_s_per_gpu"]
             for c in pt.PAPER_THROUGHPUT}
    n = pt.SEQ_LEN_TOKENS
    assert value[("table3", "upipe", n["5M"])] == 98.25
    assert value[("table3", "torch-cp", n["128K"])] == 1373.87
    assert value[("table3", "ds-fpdt", n["5M"])] is None
    assert value[("table4", "usp", n["128K"])] == 545.29
    assert value[("table4", "ds-fpdt", n["4M"])] == 27.66
    assert value[("table4", "upipe", n["5M"])] is None
    meshes = {(c["table"], c["method"]): c["mesh"] for c in pt.PAPER_THROUGHPUT}
    assert meshes == {
        ("table3", "torch-cp"): "1x8", ("table3", "zigzag-ring"): "1x8",
        ("table3", "usp-ulysses"): "8x1", ("table3", "ds-fpdt"): "8x1",
        ("table3", "upipe"): "8x1",
        ("table4", "torch-cp"): "1x16", ("table4", "zigzag-ring"): "1x16",
        ("table4", "usp"): "8x2", ("table4", "ds-fpdt"): "16x1", ("table4", "upipe"): "8x2"}


def test_seq_len_units_are_binary():
    k, m = 2**10, 2**20
    assert pt.SEQ_LEN_TOKENS == {"128K": 128 * k, "256K": 256 * k, "512K": 512 * k,
                                 "1M": m, "2M": 2 * m, "3M": 3 * m, "4M": 4 * m, "5M": 5 * m}


def test_memory_wall_figure():
    wall = {r["rung"]: r for r in pt.PAPER_LADDER_3M}
    assert list(wall) == ["fsdp", "ulysses", "ac", "offload", "alst", "upipe"]
    for r in pt.PAPER_LADDER_3M:
        assert r["label"] == ladder_rung(r["method"], r["stack"], r["nproc"])  # our plots' name
        assert r["method"] in METHODS and r["source"].startswith("UPipe project page")
        parts = [r[f"{p}_gib"] for p in ("model", "attention", "other")]
        if r["status"] == "ok":
            assert all(isinstance(p, float) for p in parts) and r["oom_gib"] is None
        else:
            assert r["status"] == "oom" and r["oom_gib"] > 0 and None in parts
    alst, upipe = wall["alst"], wall["upipe"]
    assert (alst["model_gib"], alst["attention_gib"], alst["other_gib"]) == (15.0, 33.0, 16.6)
    assert (upipe["model_gib"], upipe["attention_gib"], upipe["other_gib"]) == (15.0, 19.5, 16.6)
    assert wall["fsdp"]["oom_gib"] == 8 * wall["ulysses"]["oom_gib"] == 7680.0


def test_two_node_figure_is_marked_approximate():
    rows = pt.PAPER_TWO_NODE
    assert [r["seq_len"] // 2**10 for r in rows] == [512, 2048, 4096, 6144, 8192]
    for r in rows:
        assert r["approximate"] is True and "approximate" in r["source"]
        assert r["gpus"] == 16 and r["mesh"] == "8x2"
        if r["usp_status"] == "ok":
            assert r["upipe_peak_gib"] < r["usp_peak_gib"] and r["upipe_vs_usp_tokens_per_s"]
    assert (rows[-1]["usp_status"], rows[-1]["usp_peak_gib"], rows[-1]["upipe_peak_gib"]) == \
        ("oom", None, 69.5)


def test_spot_check_numbers_read_from_the_abstract():
    claims = {c["claim"]: c for c in pt.PAPER_CLAIMS}
    # Abstract: "5M tokens when training Llama3-8B on a single 8xH100 node" (5M = 5 * 2**20)
    ctx = claims["max_context_tokens"]
    assert (ctx["method"], ctx["model"], ctx["gpus"], ctx["value"]) == \
        ("upipe", "llama3-8b", 8, 5242880)
    # Abstract: "by as much as 87.5% for 32B Transformers"
    assert claims["attention_intermediate_memory_reduction_pct"]["value"] == 87.5
    # Abstract: "improving upon prior methods by over 25%"
    assert claims["max_context_gain_over_prior_pct"]["value"] == 25.0
    for c in pt.PAPER_CLAIMS:
        assert c["source"] == "arXiv 2602.21196v1 Abstract" and c["method"] in METHODS


def test_scripts_name_every_row():
    assert set(pt.PAPER_SCRIPTS) == {(t, m) for t, m, _ in _rows()}


def test_setup_facts_are_short_sentences():
    for key in ("attention_kernel", "sharding", "activation_checkpointing",
                "activation_offloading", "batch_size", "steps_measured", "precision",
                "torch_cp_rotation", "fpdt_chunk_size"):
        assert isinstance(pt.PAPER_SETUP[key], str) and pt.PAPER_SETUP[key].endswith(".")


def test_module_imports_nothing_from_the_project():
    tree = ast.parse(Path(pt.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert all(n.split(".")[0] not in ("upipe", "baselines", "experiments") for n in names)
