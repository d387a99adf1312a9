"""Generated sections of a markdown file: the text between a begin and an end marker.

A generated section (the results index in ``results/README.md``, the headline table in
``README.md``) is rendered from committed files and written between two HTML comments, so the
prose around it stays hand-written and a test can tell when the committed section is stale.
``section_main`` is the command line of the sections written into docs (rewrite, or ``--check``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path


def section(text: str, begin: str, end: str) -> str | None:
    """The section of ``text`` from ``begin`` to ``end``, markers included; None when the
    markers are missing or out of order."""
    i, j = text.find(begin), text.find(end)
    return text[i:j + len(end)] if 0 <= i < j else None


def write_section(path: Path, new: str, begin: str, end: str, default: str = "") -> Path:
    """Replace the section of ``path`` by ``new`` (markers included); without one, append
    ``new`` to the file's text (``default`` when the file is absent)."""
    text = path.read_text() if path.exists() else default
    old = section(text, begin, end)
    path.write_text(text.replace(old, new) if old else f"{text.rstrip()}\n\n{new}\n")
    return path


def is_stale(path: Path, new: str, begin: str, end: str) -> bool:
    """Whether ``path``'s committed section differs from ``new`` (markers included)."""
    text = path.read_text() if path.exists() else ""
    return section(text, begin, end) != new


def section_main(argv: list[str] | None, *, description: str, results: Path, doc: Path,
                 render: Callable[[Path], str], begin: str, end: str, what: str,
                 command: str) -> int:
    """The CLI of a generated section: rewrite it in ``doc`` from ``render(results)``, or with
    ``--check`` exit 1 when it is stale. ``what`` names the section in messages."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--results", type=Path, default=results, help="results root")
    p.add_argument("--doc", type=Path, default=doc, help="the file to write")
    p.add_argument("--check", action="store_true", help="exit 1 when the section is stale")
    args = p.parse_args(argv)
    new = render(args.results)
    if not args.check:
        write_section(args.doc, new, begin, end)
        print(f"wrote {what} in {args.doc}")
    elif is_stale(args.doc, new, begin, end):
        print(f"{args.doc}: {what} is stale. Run: {command}", file=sys.stderr)
        return 1
    return 0
