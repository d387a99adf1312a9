"""The paper's tables as data (experiments/reporting/paper_tables.py): well-formed, and the
numbers read from the paper pinned so that a transcription change is caught."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from experiments.reporting import paper_tables as pt
from upipe.registry import available_methods

CELL_KEYS = {"table", "model", "gpus", "method", "mesh", "seq_len", "status", "source"}
TABLES = {"table3": ("llama3-8b", 8, "Table 3"), "table4": ("qwen3-32b", 16, "Table 4")}
METHODS = set(available_methods())


def _check_common(row: dict) -> None:
    model, gpus, _ = TABLES[row["table"]]
    assert row["model"] == model and row["gpus"] == gpus
    assert row["method"] in METHODS, row
    u, _, r = row["mesh"].partition("x")
    assert u.isdigit() and r.isdigit() and int(u) * int(r) == gpus, row
    assert isinstance(row["seq_len"], int) and not isinstance(row["seq_len"], bool)
    assert row["seq_len"] > 0


@pytest.mark.parametrize("rows,value_key", [(pt.PAPER_THROUGHPUT, "tokens_per_s_per_gpu"),
                                            (pt.PAPER_MEMORY, "peak_memory_gib")])
def test_transcribed_cells_are_well_formed(rows, value_key):
    for row in rows:
        extra = {"memory_kind"} if value_key == "peak_memory_gib" else set()
        assert set(row) == CELL_KEYS | {value_key} | extra, row
        _check_common(row)
        assert row["source"] == f"arXiv 2602.21196v1 {TABLES[row['table']][2]}"
        assert row["status"] in ("ok", "oom")
        if row["status"] == "ok":
            assert isinstance(row[value_key], float) and row[value_key] > 0, row
        else:
            assert row[value_key] is None, row
        if extra:
            assert row["memory_kind"] in ("allocated", "reserved")


@pytest.mark.parametrize("rows", [pt.PAPER_THROUGHPUT, pt.PAPER_MEMORY, pt.UNREAD_CELLS])
def test_no_duplicate_cells(rows):
    keys = [(r["table"], r["method"], r["mesh"], r["seq_len"]) for r in rows]
    assert len(keys) == len(set(keys))


def test_unread_cells_are_well_formed_and_not_also_transcribed():
    assert pt.UNREAD_CELLS
    for row in pt.UNREAD_CELLS:
        assert set(row) == {"table", "model", "gpus", "method", "mesh", "seq_len", "script"}
        _check_common(row)
        assert row["seq_len"] in pt.SEQ_LEN_TOKENS.values()
    read = {(r["table"], r["method"], r["mesh"], r["seq_len"])
            for r in pt.PAPER_THROUGHPUT + pt.PAPER_MEMORY}
    unread = {(r["table"], r["method"], r["mesh"], r["seq_len"]) for r in pt.UNREAD_CELLS}
    assert not read & unread, "a transcribed cell is still listed as unread"


def test_seq_len_units_are_binary():
    k, m = 2**10, 2**20
    assert pt.SEQ_LEN_TOKENS == {"128K": 128 * k, "256K": 256 * k, "512K": 512 * k,
                                 "1M": m, "2M": 2 * m, "3M": 3 * m, "4M": 4 * m, "5M": 5 * m}


def test_spot_check_numbers_read_from_the_paper():
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
