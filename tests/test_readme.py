"""The README's numbers come from the code: its headline table and its ``plan`` example.

The headline table is a generated section (``experiments.reporting.readme_headline``) rendered
from the committed results; the ``upipe-bench plan`` example is run here, in process, and its
output must be what the README shows under the same command line (up to trailing spaces, which
the table's last column pads with). Both fail when a change to the results or to the emulator
moves a number without the README following. The plan runs on idle cores from the session's
start (tests/background.py).
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from experiments import cli
from experiments.reporting import readme_headline

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PLAN = re.compile(r"```console\n\$ (upipe-bench plan [^\n]*)\n(.*?)```", re.S)


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip("\n").splitlines()]


def test_headline_table_is_up_to_date():
    assert not readme_headline.stale(ROOT / "results", README), (
        f"README.md's headline table is stale: run `{readme_headline.COMMAND}` and commit "
        "README.md")


def test_headline_table_without_results_shows_the_paper_and_dashes(tmp_path):
    """Rendered from an empty results folder: a row per method of the paper's tables, the
    paper's numbers beside '—' where ours would be, not an error."""
    rows = [r.split(" | ") for r in readme_headline.render(tmp_path).splitlines()
            if r.startswith("| ") and "`" in r]
    assert len(rows) == len(readme_headline.PAPER_MAX_CONTEXT)
    assert all(r[4] == "—" and r[6] == "— |" and r[3] != "—" for r in rows), rows


def test_readme_has_one_plan_example():
    assert len(PLAN.findall(README.read_text())) == 1, "README.md should show one plan example"


def _printed(argv: list[str]) -> tuple[int, str]:
    """``upipe-bench`` with ``argv``: its exit code and what it printed to stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(argv)
    return code, out.getvalue()


def _plan_example() -> dict:
    command, _ = PLAN.search(README.read_text()).groups()
    return {"plan": (_printed, command.split()[1:] + ["--no-progress"])}


@pytest.mark.slow
@pytest.mark.background(jobs=_plan_example, first=True)  # one of the longest jobs
def test_plan_example_shows_what_the_command_prints(background):
    """About 45 CPU-s (5 configurations, 4 of them emulated: 27 s on 2 cores)."""
    command, shown = PLAN.search(README.read_text()).groups()
    code, printed = background()["plan"]
    assert code == 0
    assert _lines(printed) == _lines(shown), (
        f"README.md's output of `{command}` is stale; today it prints:\n{printed}")
