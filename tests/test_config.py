"""Typed configs, sweep declarations and the max-context search logic (no processes)."""

from __future__ import annotations

import dataclasses

import pytest

from experiments.config import (
    PRESETS,
    STACKS,
    Cell,
    format_size,
    parse_overrides,
    parse_size,
    resolve_model,
)
from experiments.maxctx import SearchSpec, search_max_context
from experiments.sweep import Sweep
from experiments.sweeps import SWEEPS, cpu_sweeps, get_sweep


@pytest.mark.parametrize("text, n", [("131072", 131072), ("128K", 131072), ("1M", 2**20),
                                     ("4k", 4096), (4096, 4096)])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["1.5M", "K", "-4", "12Q", ""])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="131072, 128K or 1M"):
        parse_size(text)


def test_format_size_round_trips():
    for n in (1000, 2048, 131072, 2**20, 5 * 2**20, 3 * 2**19):
        assert parse_size(format_size(n)) == n
    assert format_size(2**20) == "1M" and format_size(2**17) == "128K"


def test_presets_match_design_table():
    p = PRESETS["llama3-8b"]
    assert (p.n_layers, p.dim, p.n_heads, p.n_kv_heads, p.head_dim, p.ffn_dim, p.vocab_size) == (
        32, 4096, 32, 8, 128, 14336, 128256)
    assert 7.9e9 < p.n_params() < 8.1e9  # Llama 3 8B has 8.03B parameters
    assert 69e9 < PRESETS["llama3-70b"].n_params() < 71.5e9


def test_overrides_are_typed_and_checked():
    cfg = resolve_model("tiny", parse_overrides(["n_layers=2", "tie_embeddings=true",
                                                 "rope_theta=1e4"]))
    assert (cfg.n_layers, cfg.tie_embeddings, cfg.rope_theta) == (2, True, 1e4)
    with pytest.raises(ValueError, match="override key must be one of .*n_layers"):
        resolve_model("tiny", (("layers", "2"),))
    with pytest.raises(ValueError, match="model.n_layers must be int"):
        resolve_model("tiny", (("n_layers", "two"),))
    with pytest.raises(ValueError, match="model.n_heads .* multiple of model.n_kv_heads"):
        resolve_model("tiny", (("n_kv_heads", "3"),))
    with pytest.raises(ValueError, match="override must be key=value"):
        parse_overrides(["n_layers"])


@pytest.mark.parametrize("fields, msg", [
    ({"method": "nope"}, r"method must be one of \[.*'upipe'"),
    ({"model": "gpt5"}, r"model must be one of \[.*'tiny'"),
    ({"stack": "zero3"}, r"stack must be one of \['none', 'ac', 'offload', 'alst'\]"),
    ({"seq_len": 1001}, r"seq_len \(1001\) must be >= 2 and divisible by nproc \(4\)"),
    ({"nproc": 3, "seq_len": 3072}, r"n_heads \(16\) must be divisible by the CP degree \(3\)"),
    ({"heads_per_stage": 6}, r"heads_per_stage"),
    ({"method": "ulysses", "heads_per_stage": 4}, "applies to upipe only"),
    ({"dtype": "fp8"}, "dtype must be one of"),
    ({"budget_mib": 0}, "budget_mib must be positive"),
    ({"kernel": "cudnn"}, "kernel"),
])
def test_cell_validation_names_field_and_rule(fields, msg):
    cell = Cell(**({"method": "upipe"} | fields))
    with pytest.raises(ValueError, match=msg):
        cell.validate()


def test_cell_id_is_stable_and_distinct():
    a = Cell("upipe", heads_per_stage=8)
    assert a.cell_id() == Cell("upipe", heads_per_stage=8).cell_id()
    assert a.cell_id().startswith("upipe-U8-tiny-4K-p4-alst-fp32-")
    others = [dataclasses.replace(a, **kw) for kw in (
        {"heads_per_stage": 4}, {"budget_mib": 64.0}, {"overrides": (("n_layers", "2"),)},
        {"iters": 3})]
    assert len({c.cell_id() for c in [a, *others]}) == 5
    assert Cell.from_dict(a.to_dict()) == a


def test_every_declared_sweep_expands_to_valid_cells():
    """The dry run of run_all.sh: every cell of every sweep validates."""
    for sweep in SWEEPS.values():
        assert sweep.cells(), sweep.name
        assert sweep.validate() == [], sweep.name
    names = {s.name for s in cpu_sweeps()}
    for paper in (s for s in SWEEPS.values() if s.scale == "paper"):
        assert paper.name + "-cpu" in names  # every artefact has a CPU counterpart
    with pytest.raises(ValueError, match="sweep must be one of"):
        get_sweep("table9")


def test_sweep_expansion_and_searches():
    sweep = Sweep("t", "test", "cpu", base={"model": "tiny", "nproc": 4},
                  axes={"variant": [{"method": "ulysses"},
                                    {"method": "upipe", "heads_per_stage": 8}],
                        "seq_len": ["8K", "2K"]},
                  search=SearchSpec(start=4096, block=512), repeats=2)
    cells = sweep.cells()
    assert len(cells) == 8 and [c.seq_len for c in cells][:4] == [2048] * 4  # short first
    assert {c.extra["rep"] for c in cells} == {0, 1}
    assert len({c.cell_id() for c in cells}) == 8
    searches = sweep.search_cells()
    assert [(c.method, c.heads_per_stage, c.seq_len) for c in searches] == [
        ("ulysses", None, 4096), ("upipe", 8, 4096)]
    bad = Sweep("b", "bad", "cpu", base={"nproc": 4},
                axes={"variant": [{"method": "upipe", "heads_per_stage": 6}]})
    assert len(bad.validate()) == 1
    with pytest.raises(ValueError, match="sweep.plots"):
        Sweep("p", "bad", "cpu", base={}, plots=("pie",))


def test_stack_levels_build_on_each_other():
    assert [s.checkpoint for s in STACKS.values()] == [False, True, True, True]
    assert [s.offload for s in STACKS.values()] == [False, False, True, True]
    assert STACKS["alst"].tiled and STACKS["alst"].chunked_loss


# -- max-context search logic, against a deterministic fake probe ------------------------------


def _fake_run(limit_tokens: int, calls: list, fail_status: str = "oom", error_at=None):
    def run(cell):
        calls.append(cell.seq_len)
        if error_at is not None and cell.seq_len >= error_at:
            return {"status": "error", "error": "boom"}
        return {"status": "ok" if cell.seq_len <= limit_tokens else fail_status}
    return run


@pytest.mark.parametrize("true_max", [5000, 4096, 12288, 20000, 2047, 70000])
def test_search_brackets_to_granularity(true_max):
    calls = []
    spec = SearchSpec(start=4096, block=256, limit=2**16)
    res = search_max_context(Cell("ulysses", nproc=4), spec, _fake_run(true_max, calls))
    gran = 4 * 256
    assert res["status"] == "ok" and res["granularity"] == gran
    assert all(n % gran == 0 for n in calls)
    if true_max >= 2**16:
        assert res["max_seq_len"] == 2**16 and res["first_failing_seq_len"] is None
        return
    if true_max < gran:
        assert res["max_seq_len"] is None and res["first_failing_seq_len"] == gran
        return
    assert res["max_seq_len"] == true_max // gran * gran
    assert res["first_failing_seq_len"] == res["max_seq_len"] + gran
    assert res["n_probes"] == len(calls) <= 12


def test_search_stops_on_errors():
    calls = []
    res = search_max_context(Cell("ulysses", nproc=4), SearchSpec(start=4096, block=256),
                             _fake_run(10**6, calls, error_at=16384))
    assert res["status"] == "error" and res["max_seq_len"] == 8192 and res["error"] == "boom"
    with pytest.raises(ValueError, match="search.start"):
        SearchSpec(start=1000, block=256).validate(4)
