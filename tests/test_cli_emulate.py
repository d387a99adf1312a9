"""The emulator's front ends: ``upipe-bench emulate``, ``max-context --emulate``, the emulated
sweep twins, the runner on an emulated sweep, its tables and plots; and the paper's stack as the
CLI default. CPU only: real emulations use the tiny preset with ``--emulate-device cpu --exact``
(a few seconds each); argument errors are caught before anything is emulated.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pandas as pd
import pytest

from experiments import cli
from experiments.cli import main, parser
from experiments.cli_args import cell_from_args, world_from_args
from experiments.config import (
    THROUGHPUT_PLOTS,
    Cell,
    Hardware,
    SearchSpec,
    Sweep,
    paper_stack,
)
from experiments.config.options import declared, every_option
from experiments.harness.launch import run_cell
from experiments.runner.sweep_runner import SweepRunner
from experiments.sweeps import SWEEPS, emulated_sweeps, get_sweep, paper_sweeps
from experiments.timing.profile import load_profile
from upipe.options import MethodOption
from upipe.registry import available_methods, get_method

TINY = ["--model", "tiny", "--world", "4", "--emulate-device", "cpu", "--exact"]
ROW_KEYS = {"status", "mode", "emulation", "peak_device_bytes", "peak_host_bytes",
            "peak_model_bytes", "peak_attention_bytes", "peak_other_bytes",
            "device_budget_bytes", "host_budget_bytes", "device_memory_bytes", "host_pinned",
            "rank_flops_per_step", "model_tflops_per_step", "comm_bytes_per_step",
            "comm_bytes_by_op",
            "hw_gpu_mem_gib", "hw_host_mem_gib", "hw_gpus_per_node", "hw_reserve_gib",
            "hw_device", "emulation_s"}


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_paper_stack():
    """docs/design.md#the-comparison: torch-cp on its TorchTitan fork's stack, ds-fpdt on
    Megatron-DeepSpeed's, every other method on ALST."""
    assert (paper_stack("torch-cp"), paper_stack("ds-fpdt")) == ("torchtitan", "megatron-ds")
    assert {paper_stack(m) for m in ("upipe", "ulysses", "usp", "fpdt", "zigzag-ring")} == {
        "alst"}


@pytest.mark.parametrize("command", ["run", "max-context", "emulate"])
def test_stack_defaults_to_the_papers(command):
    """Without --stack every command runs a method on the paper's stack for it; --stack wins."""
    emulated = command == "emulate"
    for method, stack in (("torch-cp", "torchtitan"), ("upipe", "alst"), ("ulysses", "alst")):
        a = parser().parse_args([command, "--method", method, "--nproc", "4"])
        assert cell_from_args(a, emulated=emulated).stack == stack
    a = parser().parse_args([command, "--method", "upipe", "--nproc", "4", "--stack", "ac"])
    assert cell_from_args(a, emulated=emulated).stack == "ac"
    # the paper's dtype for emulation, fp32 for CPU runs
    assert cell_from_args(a, emulated=emulated).dtype == ("bf16" if emulated else "fp32")


@pytest.mark.parametrize("args, names", [
    (["--mesh", "8by2"], ["--mesh", "UxR"]),
    (["--mesh", "0x2"], ["--mesh"]),
    (["--mesh", "2x2", "--world", "8"], ["--mesh", "--world"]),
    (["--mesh", "2x2", "--ring-degree", "1"], ["--mesh", "--ring-degree"]),
    (["--world", "4", "--nproc", "8"], ["--world", "--nproc"]),
    (["--gpu-mem", "0"], ["--gpu-mem", "positive"]),
    (["--gpu-mem", "-80"], ["--gpu-mem"]),
    (["--host-mem", "0"], ["--host-mem"]),
    (["--reserve", "90"], ["--reserve", "--gpu-mem"]),
])
def test_emulate_rejects_bad_input_naming_the_flag(capsys, args, names):
    code, out, err = _cli(capsys, "emulate", "--method", "upipe", *args)
    assert code == 2 and out == "", err
    for name in names:
        assert name in err, err


@pytest.mark.parametrize("args, names", [
    (["--emulate", "--world", "4", "--granularity", "4098"], ["--granularity", "(4)"]),
    # the default 64K granularity does not split over 3 ranks (ring: no head rule to trip first)
    (["--emulate", "--method", "ring", "--world", "3", "--seq-len", "3K"], ["--granularity"]),
    (["--emulate", "--world", "4", "--granularity", "8K", "--block", "1K"],
     ["--block", "--granularity"]),
    (["--emulate", "--world", "4", "--granularity", "8K", "--start", "12K"], ["--start"]),
    (["--gpu-mem", "40"], ["--gpu-mem", "--emulate"]),  # hardware flags need --emulate
    (["--exact", "--nproc", "4"], ["--exact", "--emulate"]),
    (["--emulate", "--gpu-mem", "0"], ["--gpu-mem"]),
])
def test_max_context_rejects_bad_input_naming_the_flag(capsys, args, names):
    method = [] if "--method" in args else ["--method", "upipe"]
    code, out, err = _cli(capsys, "max-context", *method, "--model", "tiny", *args)
    assert code == 2 and out == "", err
    for name in names:
        assert name in err, err


@pytest.mark.slow  # about 1 s on 2 cores (docs/testing.md)
def test_emulate_json_row(capsys):
    code, out, err = _cli(capsys, "emulate", "--method", "upipe", "--seq-len", "4K", "--json",
                          *TINY)
    assert code == 0, err
    row = json.loads(out)
    assert ROW_KEYS <= set(row), ROW_KEYS - set(row)
    assert row["status"] == "ok", row["error"]
    assert (row["mode"], row["emulation"]) == ("emulated", "exact")
    # the paper's defaults: bf16, the method's paper stack, the H100's memory (no allocator
    # reserve on a cpu device: a gloo run's tracker counts live tensors only)
    assert (row["dtype"], row["stack"], row["nproc"], row["seq_len"]) == ("bf16", "alst", 4, 4096)
    assert row["device_budget_bytes"] == int(79.65 * 2**30)
    assert row["host_budget_bytes"] == 2048 * 2**30 // 4  # one node's RAM over its 4 ranks
    assert 0 < row["peak_device_bytes"] < row["device_budget_bytes"]
    assert row["peak_host_bytes"] > 0  # the ALST stack offloads block inputs
    parts = row["peak_model_bytes"] + row["peak_attention_bytes"] + row["peak_other_bytes"]
    assert parts == row["peak_device_bytes"]
    assert isinstance(row["comm_bytes_by_op"], dict)
    assert sum(row["comm_bytes_by_op"].values()) == row["comm_bytes_per_step"] > 0
    assert row["hw_device"] == "cpu" and row["hw_gpu_mem_gib"] == 79.65
    assert row["hw_reserve_gib"] == 0.0  # resolved for the device


def test_keep_blocks_flag_reaches_the_cell_and_is_checked(capsys):
    """--keep-blocks: the cell keeps the attention in its last K blocks (its id says so); on a
    stack that keeps none, or beyond the model's layers, the error names the field."""
    a = parser().parse_args(["emulate", "--method", "upipe", "--stack", "alst-attn-host",
                                   "--keep-blocks", "1", *TINY])
    cell = cell_from_args(a, emulated=True)
    assert cell.keep_blocks == 1 and "-alst-attn-host-k1-" in cell.cell_id()
    for args, rule in ((["--stack", "alst", "--keep-blocks", "1"], "keep_blocks needs a stack"),
                       (["--stack", "alst-attn", "--keep-blocks", "9"], "keep_blocks must be")):
        code, out, err = _cli(capsys, "emulate", "--method", "upipe", *args, *TINY)
        assert code == 2 and out == "" and rule in err, err


@pytest.mark.slow  # about 4 s on 2 cores (docs/testing.md)
def test_emulate_text_and_stack_default(capsys):
    """torch-cp emulates on the torchtitan stack the paper runs it on; a method that cannot be
    emulated here (rfa-zigzag: flash-attn's code, absent) is a skipped row, exit 1; the text
    output names the status and the reason."""
    code, out, err = _cli(capsys, "emulate", "--method", "torch-cp", "--mesh", "4x1",
                          "--model", "tiny", "--seq-len", "4K", "--json")
    assert code == 0, err
    row = json.loads(out)
    assert (row["status"], row["stack"], row["nproc"], row["mode"]) == (
        "ok", "torchtitan", 4, "emulated")
    code, out, err = _cli(capsys, "emulate", "--method", "rfa-zigzag", "--world", "4", "--json")
    assert code == 1, err
    row = json.loads(out)
    assert (row["status"], row["stack"]) == ("skipped", "alst")
    assert "cannot be emulated" in row["error"]
    code, out, _ = _cli(capsys, "emulate", "--method", "rfa-zigzag", "--world", "4")
    assert code == 1 and "status" in out and "skipped" in out


def test_mesh_sets_world_and_ring_degree(capsys):
    """--mesh 2x2 is 4 ranks with ring degree 2 (the hybrid's 2-D mesh): checked with an
    invalid heads_per_stage so nothing is emulated."""
    code, out, _ = _cli(capsys, "emulate", "--method", "upipe", "--mesh", "2x2",
                        "--heads-per-stage", "3", "--json")
    assert code == 2  # heads_per_stage 3 is not a multiple of the Ulysses degree 2
    a = parser().parse_args(["emulate", "--method", "usp", "--mesh", "8x2"])
    assert world_from_args(a, 8) == (16, 2)
    a = parser().parse_args(["emulate", "--method", "usp", "--mesh", "8x2", "--world", "16",
                             "--ring-degree", "2"])
    assert world_from_args(a, 8) == (16, 2)
    a = parser().parse_args(["emulate", "--method", "usp"])
    assert world_from_args(a, 8) == (8, 1)  # the paper's one node


@pytest.mark.slow
def test_max_context_emulated_finds_a_length(capsys):
    """Tiny upipe on 4 ranks in an emulated 0.029 GiB device (1 GiB less a 0.971 GiB reserve):
    its peak is 0.0279 GiB at 6K tokens and 0.0300 GiB at 8K (bf16, CPU kernels), so the
    search grows 4K -> 8K (the limit), fails, and bisects once to 6K (2K granularity)."""
    code, out, err = _cli(capsys, "max-context", "--emulate", "--method", "upipe", *TINY,
                          "--gpu-mem", "1", "--reserve", "0.971", "--granularity", "2048",
                          "--start", "4K", "--limit", "8K", "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["status"] == "ok" and res["mode"] == "emulated", res
    assert res["granularity"] == 2048
    assert res["max_seq_len"] < res["first_failing_seq_len"] == res["max_seq_len"] + 2048
    assert [p["seq_len"] for p in res["probes"]] == [4096, 8192, 6144]
    assert res["n_probes"] == 3
    best = next(p for p in res["probes"] if p["seq_len"] == res["max_seq_len"])
    assert res["peak_device_bytes"] == best["peak_device_bytes"] <= res["device_budget_bytes"]
    assert res["peak_host_bytes"] == best["peak_host_bytes"] > 0
    assert res["peak_model_bytes"] > 0 and res["peak_attention_bytes"] > 0
    assert (res["hw_gpu_mem_gib"], res["hw_reserve_gib"], res["hw_device"]) == (1.0, 0.971, "cpu")
    assert res["emulation"] == "exact" and res["dtype"] == "bf16"


def test_emulated_sweeps_twin_every_paper_sweep(capsys):
    twins = {s.name: s for s in emulated_sweeps()}
    assert set(twins) == {f"{p.name}-emulated" for p in paper_sweeps()}
    for paper in paper_sweeps():
        twin = twins[f"{paper.name}-emulated"]
        assert (twin.scale, twin.hardware) == ("emulated", Hardware())
        # the paper's kernel (FlashAttention-3): what the paper ran, said in every emulated cell
        assert (twin.base, twin.axes) == (paper.base | {"kernel": "fa3"}, paper.axes)
        assert twin.description.startswith("Emulated: ")
        assert twin.plots == paper.plots  # the throughput plots too: emulated rows have times
        assert twin.plots  # every twin draws something
        assert twin.validate() == [], twin.name
        if paper.search is None:
            assert twin.search is None
        else:  # 64K-token granularity from 1M
            nproc = paper.base["nproc"]
            assert nproc * twin.search.block == 2**16
            assert (twin.search.start, twin.search.limit) == (2**20, 2**24)
    t4 = get_sweep("table4_qwen3_32b_h100x16-emulated")
    hybrids = {(c.method, c.nproc, c.ring_degree) for c in t4.cells() if c.ring_degree > 1}
    assert hybrids == {("usp", 16, 2), ("upipe", 16, 2)}  # 8 (Ulysses) x 2 (ring)
    assert {(c.method, c.ring_degree) for c in t4.search_cells()} >= {("usp", 2), ("upipe", 2)}
    # the CLI lists and dry-runs them without invalid cells
    code, out, _ = _cli(capsys, "sweep", "--dry-run", *twins)
    assert code == 0 and "INVALID" not in out
    assert "72 cells, 9 max-context searches, emulated on Hardware(" in out
    code, out, _ = _cli(capsys, "list", "sweeps", "--json")
    listed = json.loads(out)["sweeps"]
    assert all(listed[n]["scale"] == "emulated" for n in twins) and set(SWEEPS) == set(listed)


def test_sweep_validates_scale_and_hardware():
    with pytest.raises(ValueError, match="sweep.scale"):
        Sweep("x", "bad", "gpu", base={})
    with pytest.raises(ValueError, match="sweep.hardware"):
        Sweep("x", "no hardware", "emulated", base={})
    with pytest.raises(ValueError, match="sweep.hardware"):
        Sweep("x", "hardware on a cpu sweep", "cpu", base={}, hardware=Hardware())
    with pytest.raises(ValueError, match="gpu_mem_gib"):
        Sweep("x", "bad hardware", "emulated", base={}, hardware=Hardware(gpu_mem_gib=0))


def test_measured_rows_say_so():
    row = run_cell(Cell("upipe", options={"heads_per_stage": 3}))  # invalid: a row without a launch
    assert (row["status"], row["mode"]) == ("invalid", "measured")


@pytest.mark.slow
def test_emulated_sweep_runs_into_tables_and_plots(tmp_path):
    """An emulated sweep runs its cells and probes through the emulator in this process: rows
    say mode emulated, dict columns are JSON in the CSV, a method that cannot be emulated is a
    skipped row without probes, and the twin's memory plots draw from the emulated rows."""
    sweep = Sweep(
        "mini-emulated", "emulated test sweep", "emulated",
        base={"model": "tiny", "nproc": 4, "dtype": "bf16", "iters": 1},
        axes={"variant": [{"method": "upipe"}, {"method": "rfa-zigzag"}],
              "seq_len": ["4K", "8K"]},
        # 30 MiB per rank: upipe's step peaks at 26.5 MiB at 4K tokens and 30.7 MiB at 8K
        # (bf16, CPU kernels), so the search passes 4K and fails 8K: two probes, 4K apart
        search=SearchSpec(start=4096, block=1024, limit=8192),
        search_base={"budget_mib": 30},
        plots=("max_context", "memory_vs_seq"),
        hardware=Hardware(device="cpu"), exact=True)
    runner = SweepRunner(sweep, tmp_path, progress=False)
    paths = runner()
    rows = pd.read_csv(paths["rows_csv"])
    assert set(rows["mode"]) == {"emulated"}
    grid = rows[rows.iters == 1]
    assert sorted(zip(grid.method, grid.status, strict=True)) == [
        ("rfa-zigzag", "skipped")] * 2 + [("upipe", "ok")] * 2
    ok = grid[grid.status == "ok"].iloc[0]
    assert json.loads(ok["comm_bytes_by_op"]) and ok["emulation"] == "exact"
    assert (ok["hw_device"], ok["device_memory_bytes"]) == ("cpu", int(79.65 * 2**30))
    mc = pd.read_csv(paths["max_context_csv"]).set_index("method")
    assert set(mc["mode"]) == {"emulated"}
    assert (mc.loc["rfa-zigzag", "status"], mc.loc["rfa-zigzag", "n_probes"]) == ("skipped", 0)
    up = mc.loc["upipe"]
    assert (up["status"], up["max_seq_len"], up["first_failing_seq_len"]) == ("ok", 4096, 8192)
    assert 0 < up["peak_device_bytes"] <= 30 * 2**20 == up["device_budget_bytes"]
    assert set(paths) >= {"max_context", "memory_vs_seq"}
    for name in sweep.plots:
        assert paths[name].stat().st_size > 10_000
    recorded = json.loads((tmp_path / "mini-emulated" / "sweep.json").read_text())
    assert recorded["scale"] == "emulated" and recorded["hardware"]["device"] == "cpu"
    again = SweepRunner(sweep, tmp_path, progress=False)
    again()
    assert set(again.counts) == {"cached"}  # resumes like a measured sweep


@pytest.mark.slow  # about 2 s on 2 cores (docs/testing.md)
def test_plots_draw_from_emulated_rows(tmp_path):
    """Every plot an emulated twin declares draws from emulated rows (with the time model's
    step times), labelled emulated."""
    from experiments.reporting.plots import draw_plots
    from experiments.reporting.tables import MAXCTX, MAXCTX_COLUMNS, ROW_COLUMNS, ROWS

    GiB = 2**30
    hw = {"mode": "emulated", "device": "emulated cuda (80 GiB)", "hw_gpu_mem_gib": 80.0,
          "hw_reserve_gib": 4.0, "device_memory_bytes": 76 * GiB, "model": "llama3-8b",
          "nproc": 8, "status": "ok", "dtype": "bf16"}
    rows = []
    for method, u, f in (("ulysses", None, 1.0), ("upipe", None, 0.7), ("upipe", 16, 0.8)):
        for seq in (2**18, 2**20, 2**21):
            for stack in ("none", "ac", "offload", "alst"):
                peak = f * (16 + seq / 2**16) * GiB * (1.5 if stack == "none" else 1)
                step = seq / 2**16 * (1.0 if method == "ulysses" else 1.02)
                rows.append(hw | {"method": method, "heads_per_stage": u, "seq_len": seq,
                                  "stack": stack, "peak_device_bytes": peak, "iters": 8,
                                  "step_time_s": step, "tokens_per_s_per_gpu": seq / 8 / step,
                                  "peak_model_bytes": 16 * GiB,
                                  "peak_attention_bytes": 0.5 * (peak - 16 * GiB),
                                  "peak_other_bytes": 0.5 * (peak - 16 * GiB),
                                  "peak_host_bytes": seq * 2**13 if stack != "none" else 0})
    pd.DataFrame(rows).reindex(columns=ROW_COLUMNS + ["hw_gpu_mem_gib", "hw_reserve_gib"]
                               ).to_csv(tmp_path / ROWS, index=False)
    maxctx = [hw | {"method": m, "stack": "alst", "max_seq_len": n,
                    "first_failing_seq_len": n + 2**16} for m, n in (("ulysses", 3 * 2**20),
                                                                     ("upipe", 5 * 2**20))]
    pd.DataFrame(maxctx).reindex(columns=MAXCTX_COLUMNS).to_csv(tmp_path / MAXCTX, index=False)
    declared = sorted({p for s in emulated_sweeps() for p in s.plots})
    assert set(declared) == {"max_context", "memory_vs_seq", "memory_ladder", "heads_per_stage",
                             "memory_wall", *THROUGHPUT_PLOTS}
    assert set(draw_plots(tmp_path, declared)) == set(declared)


# -- refusals before any work: --hardware, --doc-len, max-context's cell, the help's defaults ----


def _profile_lacking(field: str, path) -> str:
    shipped = json.loads(Path(load_profile("h100-sxm").path).read_text())
    del shipped[field]
    path.write_text(json.dumps(shipped))
    return str(path)


@pytest.mark.parametrize("command", ["emulate", "plan"])
def test_hardware_errors_name_the_file_and_its_fields_as_they_are(tmp_path, capsys, command):
    """A --hardware profile's errors name its file and its JSON fields unchanged; only a field
    the message is about becomes its flag (--gpu-mem's flag is no name for a profile field)."""
    args = {"emulate": ["emulate", "--method", "upipe"],
            "plan": ["plan", "--model", "tiny", "--gpus", "2", "--seq-len", "2K"]}[command]
    unreadable = tmp_path / "gpu_profile.json"
    unreadable.write_text("{not json")
    lacking = _profile_lacking("gpu_mem_gib", tmp_path / "device_profile.json")
    for hardware, says in ((str(unreadable), [str(unreadable), "not readable JSON"]),
                           (lacking, [lacking, "lacks gpu_mem_gib"]),
                           ("", ["--hardware must be a profile name or a .json path"])):
        code, out, err = _cli(capsys, *args, "--hardware", hardware)
        assert code == 2 and out == "", err
        assert "--hardware" in err, err
        for text in says:
            assert text in err, err


@pytest.mark.parametrize("command, executor", [("run", "Launcher"), ("emulate", "Emulator")])
def test_documents_without_a_target_token_are_refused(monkeypatch, capsys, command, executor):
    """A document's last token has no target: --doc-len 1 leaves the loss none, refused with
    exit 2 before launching (a run failed after it, 35 s in; emulate passed)."""
    monkeypatch.setattr(cli, executor, lambda *a, **k: pytest.fail(f"{command} launched"))
    code, out, err = _cli(capsys, command, "--method", "upipe", "--nproc", "4", "--doc-len", "1")
    assert code == 2 and out == "", err
    assert "doc_len must be between 2 and seq_len (4096)" in err, err


def _searched(monkeypatch) -> list:
    """Replace max-context's search by one that records its first cell and passes."""
    bases = []

    def run_search(executor, base, spec, on_probe=None):
        bases.append(base)
        return {"status": "ok", "max_seq_len": spec.start, "first_failing_seq_len": None,
                "granularity": spec.granularity(base.nproc), "n_probes": 0, "error": "",
                "probes": []}

    monkeypatch.setattr(cli, "run_search", run_search)
    return bases


def test_max_context_checks_its_cell_at_the_search_start(monkeypatch, capsys):
    """--doc-len is checked against the lengths the search runs (from --start), not against
    the unused --seq-len default; the summary names the documents' length."""
    bases = _searched(monkeypatch)
    code, out, err = _cli(capsys, "max-context", "--method", "upipe", "--nproc", "4",
                          "--doc-len", "8K", "--start", "16K", "--json")
    assert code == 0, err
    assert [(b.seq_len, b.doc_len) for b in bases] == [(16384, 8192)]
    assert json.loads(out)["doc_len"] == 8192
    # and the reverse: valid at 4096 tokens, not at the search's first length
    code, out, err = _cli(capsys, "max-context", "--method", "upipe", "--nproc", "4",
                          "--doc-len", "2K", "--start", "1K", "--block", "256")
    assert code == 2 and out == "" and len(bases) == 1, err
    assert "doc_len must be between 2 and seq_len (1024)" in err and "--start" in err, err


def test_max_context_shows_the_methods_own_refusal_of_documents(monkeypatch, capsys):
    if "ds-fpdt" not in available_methods():
        pytest.skip("ds-fpdt not registered")
    bases = _searched(monkeypatch)
    code, out, err = _cli(capsys, "max-context", "--method", "ds-fpdt", "--nproc", "4",
                          "--doc-len", "8K", "--start", "16K")
    assert code == 2 and not bases, err
    assert "not supported by 'ds-fpdt'" in err, err


def _help(capsys, command: str) -> str:
    with pytest.raises(SystemExit):
        parser().parse_args([command, "--help"])
    return " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("command", ["run", "emulate", "max-context"])
def test_help_states_the_defaults_of_the_code(capsys, command):
    """Each method option's flag comes from the methods' declarations: --overlap's help states
    UPipe's own default (a cell leaves it unset: the method's), and --chunk-size's names every
    method that declares a chunk size, UPipe's chunked backward too."""
    text = _help(capsys, command)
    overlap = text.split("--overlap, --no-overlap")[1].split(" --")[0]
    default = inspect.signature(get_method("upipe")).parameters["overlap"].default
    assert Cell("upipe").option("overlap") is None
    assert f"(default: {'on' if default else 'off'})" in overlap, overlap
    chunk = text.rsplit("--chunk-size CHUNK_SIZE", 1)[1].split(" --")[0]  # not usage's
    takers = [m for m in available_methods() if "chunk_size" in declared(m)]
    assert "upipe" in takers
    for method in takers:
        assert method in chunk, chunk
    assert "upipe unchunked" in chunk and "fpdt 64K" in chunk, chunk  # defaults from the code
    for name in every_option():
        assert f"--{name.replace('_', '-')}" in text, name


def test_a_new_option_of_one_method_needs_no_line_outside_it(monkeypatch, capsys):
    """Declaring an option in the method class is all it takes: torch-cp's constructor has
    ``rotate_method``; once declared it is a flag, validated by its kind and choices, in the
    cell's options, its id and its row, with the default read from the constructor."""
    if "torch-cp" not in available_methods():
        pytest.skip("torch-cp not registered")
    cls = get_method("torch-cp")
    monkeypatch.setattr(cls, "declared_options", (MethodOption(
        "rotate_method", str, "how the ring passes K/V", tag="rot",
        choices=("allgather", "alltoall")),))
    text = _help(capsys, "emulate")
    assert "--rotate-method {allgather,alltoall}" in text
    assert "torch-cp: how the ring passes K/V (default: allgather)" in text, text
    a = parser().parse_args(["emulate", "--method", "torch-cp", "--rotate-method", "alltoall"])
    cell = cell_from_args(a, emulated=True)
    assert dict(cell.options) == {"rotate_method": "alltoall"}
    assert cell.cell_id().startswith("torch-cp-rotalltoall-tiny-")
    assert cell.to_dict()["rotate_method"] == "alltoall"
    with pytest.raises(ValueError, match=r"rotate_method of 'torch-cp' must be one of "
                                         r"\['allgather', 'alltoall'\], got 'ring'"):
        Cell("torch-cp", stack="native", options={"rotate_method": "ring"}).validate()
    with pytest.raises(ValueError, match="rotate_method applies to torch-cp only, not 'upipe'"):
        Cell("upipe", options={"rotate_method": "alltoall"}).validate()


def test_a_cpu_calibration_is_a_cpu_device_whose_memory_its_ranks_share():
    """--hardware with a CPU calibration (results/time_validation_cpu/profile.json, 23.5 GiB on
    2 ranks): the cpu device without --emulate-device (it was refused as a profile "for a cpu
    device" on cuda), each rank its part of the host's memory (each got all of it), and that
    memory as the host's for offload (it was the 2 TB default)."""
    from experiments.cli_args import hardware_from_args

    path = Path(__file__).resolve().parent.parent / "results/time_validation_cpu/profile.json"
    mem = load_profile(str(path)).gpu_mem_gib
    a = parser().parse_args(["emulate", "--method", "upipe", "--model", "tiny", "--world", "2",
                             "--hardware", str(path)])
    hw = hardware_from_args(a, 2)
    assert (hw.device, hw.gpu_mem_gib, hw.host_mem_gib) == ("cpu", mem / 2, mem)
    assert hw.device_budget(cell_from_args(a)) == int(mem / 2 * 2**30)  # no reserve on cpu
    a = parser().parse_args(["emulate", "--method", "upipe", "--model", "tiny", "--world", "2",
                             "--hardware", str(path), "--host-mem", "64", "--gpu-mem", "3"])
    hw = hardware_from_args(a, 2)
    assert (hw.gpu_mem_gib, hw.host_mem_gib) == (3.0, 64.0)  # given: as given
