"""Typed configs, sweep declarations and the max-context search logic (no processes)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import pickle
from pathlib import Path

import pytest

from experiments.config import (
    PRESETS,
    STACKS,
    Cell,
    SearchSpec,
    Sweep,
    format_size,
    paper_stack,
    parse_overrides,
    parse_size,
    resolve_model,
)
from experiments.config.options import every_option
from experiments.runner.search import search_max_context
from experiments.sweeps import SWEEPS, cpu_sweeps, get_sweep
from upipe.registry import available_methods, get_method


def needs(*methods: str):
    """Skip, naming them, while methods are not registered yet (upipe.available_methods())."""
    missing = sorted(set(methods) - set(available_methods()))
    return pytest.mark.skipif(bool(missing), reason=f"method(s) {missing} not registered")


SWEEP_METHODS = sorted({c.method for s in SWEEPS.values() for c in s.cells()})


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
    ({"stack": "zero3"},
     r"stack must be one of \['none', 'ac', 'offload', 'alst', 'native', 'torchtitan', "
     r"'megatron-ds', 'long', 'alst-attn', 'alst-attn-host', 'long-attn-host', 'alst-block'\]"),
    ({"seq_len": 1001}, r"seq_len \(1001\) must be >= 2 and divisible by nproc \(4\)"),
    # a document's last token has no target: one of 1 token has none
    ({"doc_len": 1}, r"doc_len must be between 2 and seq_len \(4096\) tokens, got 1"),
    ({"nproc": 3, "seq_len": 3072}, r"n_heads \(16\) must be divisible by the CP degree \(3\)"),
    ({"heads_per_stage": 6}, r"heads_per_stage"),
    ({"method": "ulysses", "heads_per_stage": 4}, "applies to upipe only"),
    ({"dtype": "fp8"}, "dtype must be one of"),
    ({"budget_mib": 0}, "budget_mib must be a positive, finite number of MiB, got 0"),
    ({"budget_mib": float("nan")}, "budget_mib must be a positive, finite number of MiB, got nan"),
    ({"budget_mib": float("inf")}, "budget_mib must be a positive, finite number of MiB, got inf"),
    ({"kernel": "cudnn-v9"}, "kernel"),
    ({"global_rope_table": "yes"}, "global_rope_table must be true or false, got 'yes'"),
    ({"global_rope_table": True, "workload": "attention"},
     "global_rope_table needs the 'step' workload"),
])
def test_cell_validation_names_field_and_rule(fields, msg):
    cell = Cell.from_dict({"method": "upipe"} | fields)
    with pytest.raises(ValueError, match=msg):
        cell.validate()


@pytest.mark.parametrize("fields, msg", [
    # the hybrid mesh: only methods that run on one, and it must tile the ranks
    ({"method": "ulysses", "ring_degree": 2}, r"ring_degree > 1 applies to hybrid methods"),
    ({"method": "usp", "ring_degree": 3}, r"ring_degree \(3\) must divide the CP degree \(4\)"),
    ({"method": "usp", "ring_degree": 0}, r"ring_degree must be >= 1"),
    # hybrids check heads against the Ulysses degree nproc / ring_degree (12 / 2 = 6)
    ({"method": "usp", "nproc": 12, "ring_degree": 2, "seq_len": 3072},
     r"n_heads \(16\) must be divisible by the CP degree \(6\)"),
    ({"method": "upipe", "nproc": 8, "ring_degree": 2, "heads_per_stage": 2}, r"heads_per_stage"),
    # chunk_size: FPDT's and UPipe's (its chunked backward) only, positive
    ({"method": "ulysses", "chunk_size": 1024}, r"chunk_size applies to .*only, not 'ulysses'"),
    ({"method": "upipe", "chunk_size": 0}, r"chunk_size must be a positive number of tokens"),
    ({"method": "upipe", "nproc": 8, "ring_degree": 2, "chunk_size": 1024},
     r"chunk_size .* needs the plain Ulysses mesh \(ring_degree 1\)"),
    # overlap: UPipe's only, a bool
    ({"method": "ulysses", "overlap": True}, r"overlap applies to upipe only, not 'ulysses' "
                                             r"\(its options: none\)"),
    ({"method": "upipe", "overlap": "yes"}, r"overlap of 'upipe' must be true or false, got "
                                            "'yes'"),
    # each option of its kind: a bool is no number of heads, text no number of tokens
    ({"method": "upipe", "heads_per_stage": True}, r"heads_per_stage of 'upipe' must be an "
                                                    "integer, got True"),
    ({"method": "fpdt", "chunk_size": "64K"}, r"chunk_size of 'fpdt' must be an integer"),
    # an option no method declares: named, with the method's own
    ({"method": "upipe", "heads_per_stag": 8}, r"heads_per_stag is no option of any registered "
                                               r"method, not 'upipe' \(its options: "
                                               r"heads_per_stage, chunk_size, overlap\)"),
    # zigzag: two chunks per rank
    ({"method": "zigzag-ring", "seq_len": 4100},
     r"seq_len \(4100\) must be divisible by 2 x the CP degree \(8\)"),
    ({"method": "usp", "ring_degree": 2, "seq_len": 4100}, r"2 x the CP degree \(8\)"),
])
def test_cell_validation_of_method_options(fields, msg):
    missing = sorted({fields["method"]} - set(available_methods()))
    if missing:
        pytest.skip(f"method(s) {missing} not registered")
    with pytest.raises(ValueError, match=msg):
        Cell.from_dict(fields).validate()


@needs("fpdt")
def test_chunk_size_must_split_over_the_ranks():
    with pytest.raises(ValueError, match=r"chunk_size \(1022\) must be divisible by the CP "
                                         r"degree \(4\)"):
        Cell("fpdt", options={"chunk_size": 1022}).validate()
    Cell("fpdt", options={"chunk_size": 1024}, seq_len=3072).validate()


@needs("usp", "zigzag-ring", "ring")
def test_method_rules_come_from_the_method():
    """Ring methods have no head rule; hybrids check heads over the Ulysses degree only."""
    Cell("ring", nproc=3, seq_len=3072).validate()  # 16 heads over 3 ranks: fine for a ring
    Cell("zigzag-ring", nproc=3, seq_len=3072).validate()
    Cell("usp", nproc=6, ring_degree=3, seq_len=3072).validate()  # Ulysses over 2 ranks
    # U % 4 over 4 ranks
    Cell("upipe", nproc=8, ring_degree=2, options={"heads_per_stage": 4}).validate()
    with pytest.raises(ValueError, match=r"n_heads \(16\) must be divisible"):
        Cell("ulysses", nproc=6, seq_len=3072).validate()


def test_options_are_one_read_only_mapping_and_unset_is_none():
    assert dict(Cell("upipe").options) == {}
    cell = Cell("upipe", options={"heads_per_stage": 8, "overlap": None})
    assert dict(cell.options) == {"heads_per_stage": 8}  # None: the method's default, dropped
    assert cell == Cell("upipe", options={"heads_per_stage": 8})
    assert cell.option("heads_per_stage") == 8 and cell.option("chunk_size") is None
    with pytest.raises(TypeError):
        cell.options["heads_per_stage"] = 4  # type: ignore[index]
    assert pickle.loads(pickle.dumps(cell)) == cell  # cells travel to rank processes
    with pytest.raises(ValueError, match="options must be a mapping"):
        Cell("upipe", options=[("heads_per_stage", 8)])  # type: ignore[arg-type]


def test_the_dict_form_is_flat_and_round_trips():
    """A cell's dict (cell.json, a row's identity, a sweep's declaration) writes the options
    beside the fields: the three that were fields once always (null when unset), in their
    committed places; from_dict reads both that and an ``options`` key."""
    cell = Cell("upipe", options={"heads_per_stage": 8, "overlap": True}, extra={"rep": 1})
    d = cell.to_dict()
    assert "options" not in d and (d["heads_per_stage"], d["overlap"], d["chunk_size"]) == (
        8, True, None)
    keys = list(d)
    assert keys.index("stack") < keys.index("heads_per_stage") < keys.index("ring_degree")
    assert keys[-1] == "extra"
    assert Cell.from_dict(d) == cell and Cell.from_dict(d).extra == {"rep": 1}
    assert Cell.from_dict({"method": "upipe", "options": {"heads_per_stage": 8},
                           "overlap": True}) == Cell("upipe", options={"heads_per_stage": 8,
                                                                       "overlap": True})
    plain = Cell("ulysses").to_dict()
    assert (plain["heads_per_stage"], plain["chunk_size"], plain["overlap"]) == (None,) * 3


def test_no_option_is_named_as_a_cell_field_and_each_name_has_one_kind():
    """A flat dict tells fields from options by name, and one flag serves every method that
    declares a name: so names must not clash and a name means one kind of value."""
    fields_ = {f.name for f in dataclasses.fields(Cell)}
    for name, by in every_option().items():
        assert name not in fields_, name
        assert len({(o.kind, o.tokens) for o in by.values()}) == 1, (name, by)
        for method in by:  # a declaration names a keyword its constructor takes
            assert name in inspect.signature(get_method(method)).parameters, (method, name)


def test_cell_ids_of_committed_results_do_not_change():
    """Fields added later (ring_degree, chunk_size) stay out of the id at their defaults, so
    results/ written before them still resume (an id from results/table3_llama3_8b_h100x8-cpu)."""
    old = Cell("ulysses", "tiny", seq_len=2048, nproc=4, stack="alst", dtype="fp32", warmup=1,
               iters=2)
    assert old.cell_id() == "ulysses-tiny-2K-p4-alst-fp32-473210fc"
    usp = Cell("usp", ring_degree=2)
    fpdt = Cell("fpdt", options={"chunk_size": 1024})
    assert usp.cell_id().startswith("usp-R2-tiny-4K-p4-alst-fp32-")
    assert fpdt.cell_id().startswith("fpdt-c1K-tiny-4K-p4-alst-fp32-")
    assert fpdt.cell_id() != Cell("fpdt", options={"chunk_size": 2048}).cell_id()
    assert Cell.from_dict(usp.to_dict()) == usp


def test_cell_id_is_stable_and_distinct():
    a = Cell("upipe", options={"heads_per_stage": 8})
    assert a.cell_id() == Cell("upipe", options={"heads_per_stage": 8}).cell_id()
    assert a.cell_id().startswith("upipe-U8-tiny-4K-p4-alst-fp32-")
    others = [dataclasses.replace(a, **kw) for kw in (
        {"options": {"heads_per_stage": 4}}, {"budget_mib": 64.0},
        {"overrides": (("n_layers", "2"),)}, {"iters": 3}, {"global_rope_table": True})]
    assert len({c.cell_id() for c in [a, *others]}) == 6
    assert others[-1].cell_id().startswith("upipe-U8-tiny-4K-p4-alst-rope-fp32-")
    assert Cell.from_dict(a.to_dict()) == a


def test_every_committed_cell_keeps_its_id_and_its_dict():
    """Every cell.json under results/ read back gives its folder's name as its id and the same
    dict (less the fields added after it was written): the options' move into one mapping left
    every committed cell, its row and a resumed sweep as they were."""
    paths = sorted(Path(__file__).parents[1].glob("results/*/runs/*/cell.json"))
    assert len(paths) > 100
    for path in paths:
        d = json.loads(path.read_text())
        cell = Cell.from_dict(d)
        assert cell.cell_id() == path.parent.name, path
        again = cell.to_dict()
        assert {k: again[k] for k in d} == d and [k for k in again if k in d] == list(d), path
        assert set(again) - set(d) <= {"dp", "doc_len", "overlap", "keep_blocks",
                                       "global_rope_table"}, path


@needs(*SWEEP_METHODS)
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


def test_paper_tables_compare_the_papers_methods():
    """docs/design.md#the-comparison: every method of the comparison, each on its stack, searched
    for its max context; Table 4 adds the two-node hybrids (8 x 2)."""
    def variants(name):
        return {(c.method, c.stack, c.ring_degree, c.option("chunk_size"))
                for c in get_sweep(name).cells()}

    t3 = variants("table3_llama3_8b_h100x8")
    assert {("torch-cp", "torchtitan", 1, None), ("zigzag-ring", "alst", 1, None),
            ("ulysses", "alst", 1, None), ("usp-ulysses", "alst", 1, None),
            ("fpdt", "alst", 1, 65536), ("upipe", "alst", 1, None)} <= t3
    t4 = variants("table4_qwen3_32b_h100x16")
    # the paper's Ulysses at 8 x 1 (usp-ulysses) is Table 3's; Table 4's is USP 8 x 2
    t3_in_t4 = t3 - {("usp-ulysses", "alst", 1, None)}
    assert t3_in_t4 | {("usp", "alst", 2, None), ("upipe", "alst", 2, None)} <= t4
    for name in ("table3_llama3_8b_h100x8", "table4_qwen3_32b_h100x16"):
        sweep = get_sweep(name)
        assert {c.method for c in sweep.search_cells()} == {c.method for c in sweep.cells()}
    cpu = variants("table3_llama3_8b_h100x8-cpu") | variants("table4_qwen3_32b_h100x16-cpu")
    assert {("fpdt", "alst", 1, 1024), ("usp", "alst", 2, None), ("upipe", "alst", 2, None),
            ("torch-cp", "torchtitan", 1, None), ("zigzag-ring", "alst", 1, None)} <= cpu


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
    assert [(c.method, c.option("heads_per_stage"), c.seq_len) for c in searches] == [
        ("ulysses", None, 4096), ("upipe", 8, 4096)]
    sized = Sweep("s", "sizes", "cpu", base={"nproc": 4, "seq_len": "8K"},
                  axes={"variant": [{"method": "fpdt", "chunk_size": "1K"}]})
    assert (sized.cells()[0].seq_len, sized.cells()[0].option("chunk_size")) == (8192, 1024)
    bad = Sweep("b", "bad", "cpu", base={"nproc": 4},
                axes={"variant": [{"method": "upipe", "heads_per_stage": 6}]})
    assert len(bad.validate()) == 1
    with pytest.raises(ValueError, match="sweep.plots"):
        Sweep("p", "bad", "cpu", base={}, plots=("pie",))


def test_stack_levels_build_on_each_other():
    ladder = [STACKS[k] for k in ("none", "ac", "offload", "alst")]
    assert [s.checkpoint for s in ladder] == [False, True, True, True]
    assert [s.offload for s in ladder] == [False, False, True, True]
    assert STACKS["alst"].tiled and STACKS["alst"].chunked_loss
    # PyTorch-native CP as the paper runs it: checkpointing and chunked loss only
    assert STACKS["native"] == dataclasses.replace(STACKS["ac"], chunked_loss=True)


def test_megatron_ds_stack_is_the_papers_fpdt_configuration():
    """Megatron-DeepSpeed as the paper ran FPDT (sources: experiments/config/stack.py): every
    block input offloaded, reentrant checkpointing, the MLP as FPDT_FFN and the norms fused
    (megatron_fpdt), chunked loss; the new fields default off, so the other levels are what
    they were."""
    mds = STACKS["megatron-ds"]
    assert mds == dataclasses.replace(STACKS["offload"], chunked_loss=True, offload_all=True,
                                      reentrant=True, megatron_fpdt=True)
    assert not mds.tiled
    assert not any(STACKS[k].offload_all or STACKS[k].reentrant or STACKS[k].megatron_fpdt
                   for k in ("none", "ac", "offload", "alst", "native", "torchtitan"))
    assert paper_stack("ds-fpdt") == "megatron-ds"
    assert (paper_stack("torch-cp"), paper_stack("fpdt"), paper_stack("upipe")) == (
        "torchtitan", "alst", "alst")


def test_torchtitan_stack_offloads_every_block_input_but_the_first():
    """The paper's TorchTitan checkpoint wrapper offloads every block's input but layer 0's
    (experiments/config/stack.py); nothing else differs from native + offload."""
    from experiments.harness.model import Transformer

    tt = STACKS["torchtitan"]
    assert tt == dataclasses.replace(STACKS["native"], offload=True, offload_last=True)
    assert not any(STACKS[k].offload_last for k in STACKS if k != "torchtitan")
    cfg = resolve_model("tiny", ())
    model = Transformer(cfg, "ulysses", tt)
    assert [b.offload for b in model.layers] == [False] + [True] * (cfg.n_layers - 1)


def test_megatron_ds_model_offloads_every_block_and_checkpoints_reentrantly():
    from experiments.harness.model import Transformer

    cfg = resolve_model("tiny", ())
    model = Transformer(cfg, "ulysses", STACKS["megatron-ds"])
    assert all(b.offload and b.reentrant for b in model.layers)
    alst = Transformer(cfg, "ulysses", STACKS["alst"])
    assert [b.offload for b in alst.layers] == [False, True, True, False]
    assert not any(b.reentrant for b in alst.layers)


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


@pytest.mark.parametrize("true_max", [3000, 10**6])
def test_a_limit_off_the_granularity_ends_the_search(true_max):
    """limit 5000 on a 1024 lattice: the grow phase probed 4096 forever (it stopped only at a
    length >= the limit, which the lattice never reaches)."""
    calls = []
    spec = SearchSpec(start=2048, block=256, limit=5000)
    res = search_max_context(Cell("ulysses", nproc=4), spec, _fake_run(true_max, calls))
    assert len(calls) <= 4 and max(calls) == 4096
    assert res["max_seq_len"] == (4096 if true_max > 4096 else 2048)
    assert res["first_failing_seq_len"] == (None if true_max > 4096 else 3072)


def test_nothing_fits_is_said_and_a_shrinking_search_stops_at_the_methods_shortest_length():
    """A search whose shortest probe runs out of memory says so (it was status ok, no word);
    ds-fpdt's shortest length is one whole chunk: the search shrank to 1024 tokens, which it
    refuses, and ended invalid with a retry hint."""
    calls = []
    res = search_max_context(Cell("ulysses", nproc=4), SearchSpec(start=4096, block=256),
                             _fake_run(10, calls))
    assert res["max_seq_len"] is None and "nothing fits" in res["error"]
    fpdt = Cell("ds-fpdt", model="tiny", nproc=2, options={"chunk_size": 2048})
    calls = []
    res = search_max_context(fpdt, SearchSpec(start=4096, block=512), _fake_run(10, calls))
    assert calls == [4096, 2048] and res["status"] == "ok" and res["max_seq_len"] is None
    assert "nothing fits: the shortest length probed, 2048 tokens" in res["error"]


def test_a_granularity_the_method_cannot_take_is_refused_before_any_probe():
    """ds-fpdt with 1K chunks on a 512-token lattice: the bisection reached 8704 tokens after
    seven probes and ended invalid; zigzag needs lengths divisible by 2 x CP."""
    from experiments.runner.search import run_search

    class Executor:
        def unavailable(self, cell):
            return None

        def run(self, cell):
            raise AssertionError("no probe may run")

    for cell, spec, says in (
            (Cell("ds-fpdt", model="tiny", nproc=2, options={"chunk_size": 1024}),
             SearchSpec(start=2048, block=256, limit=16384), "whole chunks"),
            (Cell("zigzag-ring", model="tiny", nproc=2), SearchSpec(start=2040, block=255),
             "zigzag")):
        res = run_search(Executor(), dataclasses.replace(cell, seq_len=spec.start), spec)
        assert res["status"] == "invalid" and res["n_probes"] == 0, res
        assert "granularity" in res["error"] and says in res["error"], res["error"]


def test_search_stops_on_errors():
    calls = []
    res = search_max_context(Cell("ulysses", nproc=4), SearchSpec(start=4096, block=256),
                             _fake_run(10**6, calls, error_at=16384))
    # an error says nothing about memory: no maximum is claimed, the lengths so far are told
    assert res["status"] == "error"
    assert res["max_seq_len"] is None and res["first_failing_seq_len"] is None
    assert "16384 tokens ended with status error; so far 8192 passed" in res["error"]
    assert "run the search again; a sweep: --retry-failed" in res["error"]
    assert "no maximum" in res["error"] and res["error"].endswith("boom")
    with pytest.raises(ValueError, match="search.start"):
        SearchSpec(start=1000, block=256).validate(4)
    with pytest.raises(ValueError, match=r"search.start \(8388608\) must not exceed search.limit"):
        SearchSpec(start=8 * 2**20, block=256, limit=2**20).validate(4)


@pytest.mark.parametrize("fields, msg", [
    ({"checkpoint": "no"}, r"StackConfig.checkpoint must be True or False, got 'no'"),
    ({"tiled": None}, r"StackConfig.tiled must be True or False, got None"),
    ({"checkpoint": False}, r"StackConfig.offload needs checkpoint=True"),
    ({"offload": False, "offload_first": True}, r"StackConfig.offload_first needs offload=True"),
    ({"tiled": False, "residual_ffn": True}, r"StackConfig.residual_ffn needs tiled=True"),
    ({"keep_on_host": True}, r"StackConfig.keep_on_host needs keep_attention=True"),
    ({"offload": False, "keep_attention": True, "keep_on_host": True},
     r"StackConfig.keep_on_host needs offload=True"),
    ({"megatron_fpdt": True}, r"StackConfig.megatron_fpdt runs without tiled"),
])
def test_stack_config_holds_its_documented_dependencies(fields, msg):
    """A level made by code (a ladder rung's ``dataclasses.replace``) is checked as the named
    levels are: a block dropped an offload without checkpointing while ``block_offloads``
    still said it offloaded, and ``checkpoint="no"`` was true."""
    with pytest.raises(ValueError, match=msg):
        dataclasses.replace(STACKS["alst"], **fields)
