"""The result files on disk: written atomically, validated when read (DESIGN.md §7).

A sweep keeps one ``row.json`` per run and one JSON summary per max-context search; every
table is rebuilt from them. So a file that is truncated (a killed writer on a filesystem that
does not rename atomically, a copy cut short), malformed, or a JSON value that is not a row
must never be silently dropped or crash a rebuild without naming itself: ``read_row`` and
``read_search`` raise ``BadResultFile`` naming the file and what is wrong, and a resumed sweep
sets the file aside (``set_aside``) and runs its cell again.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from experiments.config.status import Status

# What every row and every search summary carries; a file without one of these is not a result.
# A row is its cell's identity (``harness.launch.describe``) plus what happened.
ROW_FIELDS = ("cell_id", "method", "heads_per_stage", "ring_degree", "chunk_size", "model",
              "seq_len", "nproc", "stack", "status", "mode")
SEARCH_FIELDS = ("method", "model", "nproc", "status", "mode", "max_seq_len",
                 "first_failing_seq_len")


class BadResultFile(ValueError):
    """A result file that cannot be read as what it should be; the message names the file."""

    def __init__(self, path: Path, why: str):
        super().__init__(f"{path}: {why}")
        self.path, self.why = Path(path), why


def write_text(path: Path, text: str) -> bool:
    """Write ``text`` atomically (a temporary file in the same folder, then a rename), so a
    reader or a killed writer never sees half a file; a file that already holds exactly
    ``text`` is left untouched. Returns whether it wrote."""
    path = Path(path)
    if path.is_file() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def write_json(path: Path, obj) -> None:
    """Write ``obj`` as JSON, atomically (``write_text``)."""
    write_text(path, json.dumps(obj, indent=1, default=str) + "\n")


def read_json(path: Path):
    """The JSON value in ``path``; ``BadResultFile`` (naming it) when it is not valid JSON."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadResultFile(path, f"not valid JSON ({e})") from None


def _checked(path: Path, obj, fields: tuple[str, ...], what: str) -> dict:
    if not isinstance(obj, dict):
        raise BadResultFile(path, f"a {what} must be a JSON object, got {type(obj).__name__}")
    missing = [f for f in fields if f not in obj]
    if missing:
        raise BadResultFile(path, f"a {what} must have {', '.join(fields)}; missing "
                                  f"{', '.join(missing)}")
    if obj["status"] not in Status.ALL:
        raise BadResultFile(path, f"status must be one of {list(Status.ALL)}, got "
                                  f"{obj['status']!r}")
    return obj


def read_row(path: Path) -> dict:
    """A run's ``row.json``, checked to be a row (``ROW_FIELDS``, a known status)."""
    return _checked(path, read_json(path), ROW_FIELDS, "row")


def read_search(path: Path) -> dict:
    """A search summary (``searches/<id>.json``), checked (``SEARCH_FIELDS``, a status)."""
    return _checked(path, read_json(path), SEARCH_FIELDS, "search summary")


def set_aside(path: Path) -> Path:
    """Rename a bad result file to ``<name>.bad`` (``.bad.1``, ... if taken) so that its cell
    runs again and the file stays for inspection; returns the new path."""
    path = Path(path)
    target, n = path.with_name(path.name + ".bad"), 0
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.bad.{n}")
    os.replace(path, target)
    return target
