"""Generated sections of a markdown file: the text between a begin and an end marker.

A generated section (the results index in ``results/README.md``, the headline table in
``README.md``) is rendered from committed files and written between two HTML comments, so the
prose around it stays hand-written and a test can tell when the committed section is stale.
"""

from __future__ import annotations

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
