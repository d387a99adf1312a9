"""``python -m experiments.gpu <check>``: the GPU checks' one entry point (experiments/gpu/)."""

from __future__ import annotations

import experiments.gpu.__main__ as entry


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
