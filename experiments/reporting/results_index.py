"""The provenance index of ``results/``: one generated table in ``results/README.md``.

Every cell is read from the committed files, never typed by hand
(docs/conventions.md#provenance-travels-with-results): each sweep's ``sweep.json``, ``env.json``,
``rows.csv`` and ``max_context.csv``, ``baselines/`` and ``emulate_vs_allocator/``. The rows'
provenance wins; one only ``env.json`` records gets a dagger.

    python -m experiments.reporting.results_index          # rewrite the section (markers)
    python -m experiments.reporting.results_index --check  # exit 1 naming what is stale
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

from experiments.config.sizes import format_size
from experiments.config.status import Status
from experiments.reporting.sections import section, write_section

BEGIN, END = "<!-- results-index:begin -->", "<!-- results-index:end -->"
COMMAND = "python -m experiments.reporting.results_index"
# how the folders that are not sweeps are regenerated today (their json may name an older path)
GUARD_COMMAND = "python -m experiments.runner.max_context_guard --update"
GPU_CHECK_COMMAND = "python -m experiments.gpu allocator"
PAPER_GRID_COMMAND = "python -m experiments.reporting.paper_grid"
LADDER_COMMAND = "python -m experiments.runner.long_ladder"
AUDIT_COMMAND = "python -m experiments.emulation.audit results/<sweep> [--kernel K] [--method M]"
# GPU checks: (folder, what it shows, mode of every row, the command that regenerates it[,
# its table inside the folder, env.json beside it: default rows.csv])
GPU_FOLDERS = (
    ("emulate_vs_allocator", "emulator check on a GPU (no paper table)",
     "measured + emulated", GPU_CHECK_COMMAND),
    ("emulate_vs_allocator_beyond", "emulator check on a GPU of UPipe's options beyond the "
     "paper (overlap, the long stack, the chunked backward)", "measured + emulated",
     f"{GPU_CHECK_COMMAND} --set beyond --out results/emulate_vs_allocator_beyond"),
    ("chunked_backward_gpu", "UPipe's chunked attention backward against one kernel call "
     "(beyond the paper)", "measured",
     "python -m experiments.gpu chunked-backward --out results/chunked_backward_gpu"),
    ("time_validation_gpu", "emulated step time vs measured on one GPU, cuDNN (no paper "
     "table)", "measured + emulated",
     "upipe-bench validate-time --device cuda --quick --out results"),
    ("time_validation_gpu_sdpa", "emulated step time vs measured on one GPU, the flash kernel "
     "(no paper table)", "measured + emulated",
     "upipe-bench validate-time --device cuda --quick --out results (when auto meant sdpa)"),
    ("selective_recompute_gpu", "selective recomputation's speed-ups on one GPU, measured and "
     "emulated (beyond the paper)", "measured + emulated",
     "python -m experiments.gpu selective --out results"),
    ("kernels_gpu", "a training step with PyTorch's cuDNN attention against its flash kernel "
     "(no paper table)", "measured",
     "python -m experiments.gpu kernels --out results/kernels_gpu"),
    ("gpu_costs_h200", "what a step's kernels cost on one H200: steps by method and stages "
     "(the table counted), per-op times, kernel rates (its README; no paper table)", "measured",
     "python -m experiments.gpu costs --out results/gpu_costs_h200/steps", "steps/steps.csv"),
)
COLUMNS = ("sweep", "reproduces", "mode", "scale", "device", "date", "git rev", "versions",
           "rows (by status)", "plots", "regenerate")
STATUSES = Status.ALL
ENV = "†"  # marks a value taken from env.json because the rows carry none
ENTRY = re.compile(r"\| \[`([^`]+)`\]")  # a table row's first cell: the entry's name
RUN_ID = re.compile(r"(\d{4})(\d{2})(\d{2})T\d{6}Z")  # the runner's run_id: its start, UTC
# The paper artefact each sweep family reproduces (its -cpu / -emulated suffix stripped).
ARTEFACTS = {"table3_llama3_8b_h100x8": "Table 3 (Llama3-8B, 8x H100)",
             "bench_attention": "one attention layer per method (no paper table)",
             "table4_qwen3_32b_h100x16": "Table 4 (Qwen3-32B, 16x H100)",
             "memory_ladder_llama3_8b_h100x8": "memory ladder (stack levels, Llama3-8B)",
             "memory_wall_llama3_8b_h100x8": "the memory wall at 3M (the paper's figure, "
                                              "Llama3-8B)",
             "ablation_heads_per_stage_llama3_8b_h100x8": "heads-per-stage U ablation (Llama3-8B)",
             "time_validation_cpu": "emulated time vs measured CPU steps (no paper table)",
             "upipe_overlap": "UPipe's overlapped stages vs blocking and Ulysses (beyond the "
                              "paper)",
             "long_context_llama3_8b_h100x8": "UPipe to 8M tokens on one node, Llama3-8B "
                                              "(beyond the paper)",
             "long_context_qwen3_32b_h100x16": "UPipe on the long stack, Qwen3-32B on 16 GPUs "
                                               "(beyond the paper)",
             "two_node_llama3_8b_h100x16": "the two-node figure (Llama3-8B, 16x H100: USP 8x2 "
                                           "vs UPipe 8x2)"}
# sweeps regenerated by another command than ``upipe-bench sweep`` (which only measures them)
COMMANDS = {"time_validation_cpu": "upipe-bench validate-time"}
Rows = list[dict[str, str]]


def _csv(path: Path) -> Rows:
    """The rows of a CSV file as dicts of strings; [] when the file is absent."""
    return list(csv.DictReader(io.StringIO(path.read_text()))) if path.exists() else []


def _json(path: Path) -> dict:
    """A JSON file's object; {} when the file is absent."""
    return json.loads(path.read_text()) if path.exists() else {}


def _counts(values: Iterable[str], order: Iterable[str] = STATUSES) -> str:
    """'19 ok, 5 oom, 3 skipped': known values in ``order``, then the rest by name."""
    c, order = Counter(values), list(order)
    return ", ".join(f"{c[k]} {k}" for k in [k for k in order if k in c] + sorted({*c} - {*order}))


def _distinct(values: Iterable[str]) -> str:
    """Non-empty values; when several, most frequent first with their counts."""
    ranked = sorted(Counter(v for v in values if v).items(), key=lambda kv: (-kv[1], kv[0]))
    return ranked[0][0] if len(ranked) == 1 else ", ".join(f"{v} ({n})" for v, n in ranked)


def _from(rows: Rows, env: dict, key: str, fmt: Callable[[str], str] = str) -> str:
    """``key`` over the rows, else env.json's value marked ``ENV``, else '—'."""
    got = _distinct(fmt(r[key]) for r in rows if r.get(key))
    return got or (f"{fmt(env[key])} {ENV}" if env.get(key) else "—")


def _dates(rows: Rows, env: dict) -> str:
    """'2026-11-22 (2 runs)': the span of the rows' UTC dates (``date_utc``, else the start of
    the invocation that wrote the row, ``run_id`` = YYYYMMDDTHHMMSSZ) and how many wrote them."""
    runs = {r["run_id"] for r in rows if r.get("run_id")}
    dates = sorted(filter(None, (r.get("date_utc", "")[:10] or "-".join(
        m.groups() if (m := RUN_ID.fullmatch(r.get("run_id", ""))) else ()) for r in rows)))
    if not dates:
        return f"{env['date_utc'][:10]} {ENV}" if env.get("date_utc") else "—"
    span = dates[0] if dates[0] == dates[-1] else f"{dates[0]} – {dates[-1]}"
    return f"{span} ({len(runs)} run{'s' * (len(runs) != 1)})" if runs else span


def _short_rev(rev: str) -> str:
    """A git revision as the index prints it: 8 hex digits and its ``+dirty``."""
    return rev.removesuffix("+dirty")[:8] + "+dirty" * rev.endswith("+dirty")


def git_revisions(rows: Rows, env: dict) -> str:
    """The git revisions that wrote ``rows`` (``_short_rev``), most frequent first with their
    counts when several ('610a52f3 (71), b32103be (65)'); else env.json's, marked ``ENV``."""
    return _from(rows, env, "git_rev", _short_rev)


def table_revisions(table: Path, env: dict) -> str:
    """``git_revisions`` of the CSV file ``table`` (a sweep's rows.csv, a max_context.csv)."""
    return git_revisions(_csv(table), env)


def _provenance(rows: Rows, env: dict, device: str = "") -> list[str]:
    """The device, date, git revision (8 hex digits and its ``+dirty``) and versions cells."""
    device = device or _distinct(r.get("device") or r.get("gpu_name") or "" for r in rows) or (
        env.get("gpu_name") or "cpu")
    return [f"{device} · host: {_from(rows, env, 'cpu_model')}", _dates(rows, env),
            git_revisions(rows, env),
            f"torch {_from(rows, env, 'torch_version')}; "
            f"deepspeed {_from(rows, env, 'deepspeed_version')}"]


def _tally(what: str, path: str, rows: Rows) -> str:
    """'[27 rows](<path>): 19 ok, 5 oom, 3 skipped'."""
    if not any("status" in r for r in rows):  # a table without statuses (a GPU benchmark's)
        return f"[{len(rows)} {what}]({path})"
    return f"[{len(rows)} {what}]({path}): {_counts(r.get('status', '?') for r in rows)}"


def _line(name: str, artefact: str, rows: Rows, scale: str, provenance: list[str],
          tables: str, plots: str, command: str) -> str:
    """One table row."""
    modes = [r["mode"] for r in rows]
    mode = modes[0] if len(set(modes)) == 1 else _counts(modes, ("measured", "emulated"))
    cells = [f"[`{name}`]({name}/)", artefact, mode, scale, *provenance, tables, plots or "—",
             command]
    return "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |"


def sweep_line(d: Path) -> str:
    """The table row of the sweep directory ``d`` (sweep.json, env.json, rows.csv, ...)."""
    spec, env, rows = _json(d / "sweep.json"), _json(d / "env.json"), _csv(d / "rows.csv")
    name = d.name  # the runner writes sweep <name> to <results>/<name>/
    tables = _tally("rows", f"{name}/rows.csv", rows)
    if (maxctx := d / "max_context.csv").exists():
        tables += "<br>" + _tally("searches", f"{name}/{maxctx.name}", _csv(maxctx))
    plots = ", ".join(f"[{p.stem}]({name}/{p.name})" for p in sorted(d.glob("*.png")))
    artefact = ARTEFACTS.get(re.sub(r"-(cpu|emulated)$", "", name), spec.get("description", "—"))
    command = f"`{COMMANDS[name]}`" if name in COMMANDS else f"`upipe-bench sweep {name}`"
    return _line(name, artefact, rows, spec.get("scale", "—"), _provenance(rows, env), tables,
                 plots, f"{command}<br>`ONLY={name} ./run_all.sh`")


def other_lines(results: Path) -> list[str]:
    """Table rows of the CI max-context baseline and of the emulator's GPU check (result
    folders that are not sweeps)."""
    lines = []
    if rows := _csv(results / "baselines" / "max_context.csv"):
        env = _json(results / "baselines" / "max_context.json")
        # a baseline's name ends in its hardware: '<method>-<model>-8x80GB', '-2xcpu-51MiB'
        hw = _distinct(f"{r['mode']} {r['name'].split(r['model'] + '-')[-1]}"
                       for r in rows)
        lines.append(_line(
            "baselines", "CI guard: max context per method (no paper table)", rows, "—",
            _provenance([], env, hw), _tally("searches", "baselines/max_context.csv", rows), "",
            f"`{GUARD_COMMAND}`"))
    for name, what, mode, command, *table in GPU_FOLDERS:
        table = Path(table[0] if table else "rows.csv")
        if rows := _csv(results / name / table):
            env = _json(results / name / table.parent / "env.json")
            # the provenance is env.json's (it corrects the rows' git_rev)
            moded = [{**r, "mode": mode} for r in rows]
            lines.append(_line(
                name, what, moded, "gpu",
                _provenance([], env, _distinct(r.get("device", "") for r in rows)),
                _tally("rows", f"{name}/{table.as_posix()}", rows), "",
                f"`{command}` (needs a GPU)"))
    for path in sorted(results.glob("long_ladder_*-emulated/ladder.csv")):
        # runner.long_ladder's records: a rung each, its provenance in env.json
        if rows := _csv(path):
            name, env = path.parent.name, _json(path.parent / "env.json")
            lines.append(_line(
                name, "UPipe from ALST to the long level, one mechanism a rung (beyond the "
                "paper; docs/results.md#one-node-to-8m-tokens-beyond-the-paper)",
                [{"mode": "emulated"}], "emulated",
                _provenance([], env, _distinct(r.get("device", "") for r in rows)),
                _tally("rungs", f"{name}/{path.name}", rows), "",
                f"`{LADDER_COMMAND} --model {rows[0]['model']} --gpus {rows[0]['nproc']} "
                f"--seq-len {format_size(int(rows[0]['seq_len']))}`"))
    if rows := _csv(results / "fit_audit" / "rows.csv"):
        # each row names the code and machine that audited it, and the sweep it audited
        match = _counts((r.get("match", "?") for r in rows), ("yes", "no"))
        sweeps = ", ".join(sorted({f"`{r['sweep']}`" for r in rows}))
        lines.append(_line(
            "fit_audit", f"fitted rows of {sweeps} against the exact emulation of their cells "
            "(no paper table)", [{"mode": "emulated"}], "emulated", _provenance(rows, {}),
            f"[{len(rows)} rows](fit_audit/rows.csv) (match: {match})", "",
            f"`{AUDIT_COMMAND}`"))
    if rows := _csv(results / "paper_grid" / "grid_vs_paper.csv"):
        # derived from the emulated Table 3/4 rows, whose provenance is their sweeps'
        agree = _counts((r.get("agree", "?") for r in rows), ("yes", "no", "—"))
        lines.append(_line(
            "paper_grid", "Tables 3 and 4: emulated tokens/s and fits / OOM beside the "
            "paper's published cells",
            [{"mode": "emulated"}], "emulated",
            ["derived from the emulated Table 3/4 sweeps' rows", "—", "—", "—"],
            f"[{len(rows)} cells](paper_grid/grid_vs_paper.csv) (agree: {agree}); "
            "[the table](paper_grid/grid_vs_paper.md); "
            "[the report](paper_grid/reproduction.md)", "",
            f"`{PAPER_GRID_COMMAND}`"))
    return lines


def _footnote(dirs: list[Path]) -> str:
    """The dagger's meaning, naming the sweeps whose env.json is from a run that wrote no row."""
    note = (f"{ENV} from `env.json` (`baselines`: `max_context.json`): the rows carry none. A "
            "sweep's `env.json` describes the last invocation that ran one of its cells (code "
            "before 7f33356 rewrote it on every invocation, a resume that ran nothing too).")
    later = [f"`{d.name}` (run {run})" for d in dirs
             if (run := _json(d / "env.json").get("run_id"))
             and run not in {r.get("run_id") for r in _csv(d / "rows.csv")}]
    return note + (f" `env.json` from a run that wrote no row: {', '.join(later)}." * bool(later))


def render(results: Path) -> str:
    """The generated section of ``results/README.md``, markers included."""
    dirs = sorted(p.parent for p in results.glob("*/sweep.json"))
    header = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return "\n".join([
        BEGIN, f"<!-- generated by `{COMMAND}`: edit the files it reads, not this table -->", "",
        *header, *map(sweep_line, dirs), *other_lines(results), "", _footnote(dirs), END])


def stale(results: Path) -> list[str]:
    """What differs between README.md's section and ``render``: the names of the entries whose
    row changed, appeared or went (or a description); [] when the section is up to date."""
    readme = results / "README.md"
    old = section(readme.read_text(), BEGIN, END) if readme.exists() else None
    new = render(results)
    if old is None:
        return [f"{readme} has no {BEGIN} ... {END} section"]
    changed = set(old.splitlines()) ^ set(new.splitlines())
    names = sorted({m.group(1) for m in map(ENTRY.match, changed) if m})
    return names or (["the header or footnote"] if old != new else [])


def write(results: Path) -> Path:
    """Rewrite the section in ``results/README.md`` (appended, or a new file, when absent)."""
    return write_section(results / "README.md", render(results), BEGIN, END, "# results\n")


def main(argv: list[str] | None = None) -> int:
    """The CLI: write the index, or with ``--check`` report what is stale (exit status 1)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=Path("results"), help="results root")
    p.add_argument("--check", action="store_true", help="exit 1 when the section is stale")
    args = p.parse_args(argv)
    if not args.check:
        print(f"wrote the results index in {write(args.results)}")
    elif bad := stale(args.results):
        print(f"{args.results / 'README.md'}: results index is stale for: {', '.join(bad)}. "
              f"Run: {COMMAND} --results {args.results}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
