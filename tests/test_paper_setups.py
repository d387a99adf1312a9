"""The disagreements' mechanisms in the reproduction report (``reporting.paper_setups``): every
finding is rendered, and every file of this repository it names exists."""

from __future__ import annotations

import re
from pathlib import Path

from experiments.reporting.paper_setups import FINDINGS, findings_md

ROOT = Path(__file__).resolve().parents[1]


def test_every_finding_is_a_row_of_the_section():
    md = "\n".join(findings_md())
    assert md.startswith("## Where the emulation disagrees, and why")
    for f in FINDINGS:
        assert f"| {f.cells} | {f.mechanism} | {f.evidence} | {f.status} |" in md
        assert "|" not in f.cells + f.mechanism + f.evidence + f.status  # one table cell each


def test_the_files_of_this_repository_a_finding_names_exist():
    named = {m for f in FINDINGS for m in re.findall(r"\b((?:baselines|experiments|upipe|"
                                                     r"results)/[\w/.]+)", f.evidence + f.status)}
    assert named, "the findings name files of this repository"
    missing = sorted(n for n in named if not (ROOT / n.rstrip(".")).exists())
    assert not missing, missing
