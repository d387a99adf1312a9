"""The generated provenance index of results/README.md: committed up to date, rendered from the
files (status and mode counts, provenance from rows or env.json, the regenerating command)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from experiments.reporting.results_index import (
    BEGIN,
    COMMAND,
    END,
    ENTRY,
    ENV,
    main,
    render,
    stale,
    sweep_line,
)

RESULTS = Path(__file__).resolve().parent.parent / "results"
NAME = "toy_sweep-cpu"


def test_committed_index_is_up_to_date():
    bad = stale(RESULTS)
    assert not bad, (f"results/README.md's results index is stale for {bad}: run `{COMMAND}` "
                     "and commit results/README.md")


def test_every_result_folder_has_its_row():
    """'One row per result directory': gpu_costs_h200 had none, and --check could not tell (it
    compares the rows it renders)."""
    listed = set(ENTRY.findall(render(RESULTS)))
    folders = {d.name for d in RESULTS.iterdir() if d.is_dir()}
    assert folders - listed == set()


def _sweep(root: Path, rows: list[dict], env: dict | None = None) -> Path:
    """A tiny sweep directory: sweep.json, env.json, rows.csv, one plot."""
    d = root / NAME
    d.mkdir(parents=True)
    (d / "sweep.json").write_text(json.dumps({"name": NAME, "scale": "cpu",
                                              "description": "a toy sweep"}))
    (d / "env.json").write_text(json.dumps(env or {
        "torch_version": "2.99.0", "git_rev": "0123456789abcdef+dirty", "run_id": "R0",
        "date_utc": "2030-01-02T03:04:05+00:00", "cpu_model": "Toy CPU"}))
    keys = sorted({k for r in rows for k in r})
    with open(d / "rows.csv", "w", newline="") as f:
        w = csv.DictWriter(f, keys)
        w.writeheader()
        w.writerows(rows)
    (d / "memory_vs_seq.png").write_bytes(b"")
    return d


def _row(status: str, mode: str, **kw) -> dict:
    return {"status": status, "mode": mode, "run_id": "20300101T000000Z", **kw}


def test_sweep_row_counts_statuses_and_modes(tmp_path):
    rows = [_row("ok", "measured"), _row("ok", "emulated"), _row("oom", "emulated"),
            _row("skipped", "measured"), _row("error", "measured")]
    cells = [c.strip() for c in sweep_line(_sweep(tmp_path, rows)).strip("|").split(" | ")]
    assert cells[0] == f"[`{NAME}`]({NAME}/)"
    assert cells[1] == "a toy sweep"  # no paper artefact known: the declaration's description
    assert cells[2] == "3 measured, 2 emulated"
    assert cells[3] == "cpu"
    assert cells[5] == "2030-01-01 (1 run)"  # the rows' run_id, not env.json's date
    assert cells[6] == f"01234567+dirty {ENV}"  # rows without git_rev: env.json's, marked
    assert cells[7].startswith(f"torch 2.99.0 {ENV}")
    assert cells[8] == f"[5 rows]({NAME}/rows.csv): 2 ok, 1 oom, 1 error, 1 skipped"
    assert cells[9] == f"[memory_vs_seq]({NAME}/memory_vs_seq.png)"
    assert cells[10] == f"`upipe-bench sweep {NAME}`<br>`ONLY={NAME} ./run_all.sh`"


def test_rows_provenance_wins_over_env(tmp_path):
    rows = [_row("ok", "measured", git_rev="fedcba9876543210", torch_version="2.13.0",
                 date_utc="2031-05-06T00:00:00+00:00", device="cpu (x86_64)"),
            _row("ok", "measured", git_rev="aaaaaaaaaaaaaaaa+dirty", torch_version="2.13.0",
                 date_utc="2031-05-07T00:00:00+00:00", device="cpu (x86_64)")]
    line = sweep_line(_sweep(tmp_path, rows))
    assert "fedcba98" in line and "aaaaaaaa+dirty" in line and "torch 2.13.0;" in line
    assert "2031-05-06 – 2031-05-07 (1 run)" in line
    assert "0123456" not in line and "2.99.0" not in line


def test_write_then_check_names_the_stale_sweep(tmp_path, capsys):
    d = _sweep(tmp_path, [_row("ok", "emulated")])
    (tmp_path / "README.md").write_text(f"# results\n\nprose\n\n{BEGIN}\nold\n{END}\n\nmore\n")
    assert main(["--results", str(tmp_path)]) == 0
    text = (tmp_path / "README.md").read_text()
    assert text.startswith("# results\n\nprose\n\n") and text.endswith("\n\nmore\n")
    assert render(tmp_path) in text and stale(tmp_path) == []
    assert main(["--results", str(tmp_path), "--check"]) == 0

    with open(d / "rows.csv", "a", newline="") as f:  # a new row: the section is now stale
        csv.DictWriter(f, ["mode", "run_id", "status"]).writerow(_row("oom", "emulated"))
    assert stale(tmp_path) == [NAME]
    capsys.readouterr()
    assert main(["--results", str(tmp_path), "--check"]) == 1
    err = capsys.readouterr().err
    assert NAME in err and COMMAND in err


def test_missing_readme_or_markers(tmp_path):
    _sweep(tmp_path, [_row("ok", "measured")])
    assert "no" in stale(tmp_path)[0]  # no README at all
    main(["--results", str(tmp_path)])  # creates it
    assert stale(tmp_path) == []


def test_the_fit_audit_row_counts_matches_and_names_the_audited_sweeps(tmp_path):
    d = tmp_path / "fit_audit"
    d.mkdir()
    rows = [{"sweep": "b-emulated", "match": "yes", "git_rev": "89abcdef01", "torch_version": "2.9",
             "date_utc": "2030-01-02T03:04:05+00:00", "cpu_model": "Toy CPU"},
            {"sweep": "a-emulated", "match": "no", "git_rev": "89abcdef01", "torch_version": "2.9",
             "date_utc": "2030-01-02T03:04:05+00:00", "cpu_model": "Toy CPU"}]
    with open(d / "rows.csv", "w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    line = next(x for x in render(tmp_path).splitlines() if x.startswith("| [`fit_audit`]"))
    assert "fitted rows of `a-emulated`, `b-emulated`" in line
    assert "[2 rows](fit_audit/rows.csv) (match: 1 yes, 1 no)" in line
    assert "89abcdef" in line and "2030-01-02" in line and "Toy CPU" in line
