"""``python -m experiments.gpu <check>``: the GPU checks' one entry point (experiments/gpu/)."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import experiments.gpu.__main__ as entry
from experiments import cli

GPU_COSTS_PARTS = {"dispatch", "memory", "matmul", "attention", "host_copy", "steps", "calibrate"}


def test_help_lists_every_check(capsys):
    assert entry.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("allocator", "chunked-backward", "costs", "kernels"))
    assert "validate-time --device cuda" in out


def test_no_check_or_an_unknown_one_is_refused_with_the_list(capsys):
    assert entry.main([]) == 2
    assert entry.main(["bogus"]) == 2
    err = capsys.readouterr().err
    assert "unknown check 'bogus'" in err and "allocator" in err


def test_a_check_gets_the_flags_after_its_name(monkeypatch):
    seen = []
    monkeypatch.setitem(entry.CHECKS, "kernels", (lambda argv: seen.append(argv) or 7, "x"))
    assert entry.main(["kernels", "--out", "d", "--quick"]) == 7
    assert seen == [["--out", "d", "--quick"]]


def test_the_gpu_script_names_only_checks_and_flags_that_exist():
    """scripts/gpu_checks.sh runs on a lent GPU, where a typo costs device time: every
    ``python3 -m experiments.gpu <check>`` it names is a check, and its flags parse; its
    validate-time line parses with the CLI's own parser; bash reads the script."""
    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu_checks.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text().replace("\\\n", " ")
    calls = re.findall(r"python3 -m (experiments\.\S+) ([^;\n>]*)", text)
    checks = [(m, shlex.split(args.replace('"$out', '"OUT'))) for m, args in calls]
    assert {m for m, _ in checks} == {"experiments.gpu", "experiments.cli"}
    for module, argv in checks:
        if module == "experiments.gpu":
            assert argv[0] in entry.CHECKS, argv[0]
            if "--skip" in argv:  # gpu_costs' parts
                assert set(argv[argv.index("--skip") + 1].split(",")) <= GPU_COSTS_PARTS
        else:
            assert argv[0] == "validate-time"
            a = cli.parser().parse_args(argv)
            assert a.device == "cuda" and a.quick
