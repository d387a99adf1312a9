"""The result files on disk: written atomically, validated when read (docs/design.md#measurement).

A sweep keeps one ``row.json`` per run and one JSON summary per max-context search; every
table is rebuilt from them. So a file that is truncated (a killed writer on a filesystem that
does not rename atomically, a copy cut short), malformed, or a JSON value that is not a row
must never be silently dropped or crash a rebuild without naming itself: ``read_row`` and
``read_search`` raise ``BadResultFile`` naming the file and what is wrong, and a resumed sweep
sets the file aside (``set_aside``) and runs its cell again. A row that is valid JSON but not
its folder's (copied from another cell, or its fields or metrics edited) is as bad as a cut one.

The files are meant to be shared and committed, so they get the permissions of any file this
process creates (0666 less its umask), not ``mkstemp``'s private 0600.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from experiments.config.options import number_options
from experiments.config.status import Status
from experiments.row import NUMBERS, REQUIRED, Row, unknown_keys

# What every row and every search summary carries; a file without one of these is not a result.
# A row is typed in experiments/row.py: its required keys, its numbers, the keys it may have.
ROW_FIELDS = REQUIRED
SEARCH_FIELDS = ("method", "model", "nproc", "status", "mode", "max_seq_len",
                 "first_failing_seq_len")
CELL_FILE = "cell.json"  # beside each row.json: the cell's resolved config (Cell.to_dict)

# The process's umask, read once at import: os.umask can only be read by setting it, so reading
# it on every write would race with another thread creating a file meanwhile (the import lock
# serialises this). The probe value is the strictest one, so such a file would be private at
# worst, never world-writable.
_UMASK = os.umask(0o077)
os.umask(_UMASK)


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
            os.fchmod(f.fileno(), 0o666 & ~_UMASK)  # mkstemp's 0600 would stay after the rename
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
    """A run's ``runs/<cell_id>/row.json``, checked to be a row (``ROW_FIELDS``, a known status,
    numbers or null, only the columns ``experiments.row.Row`` declares: ``row_problem``) and its
    folder's: its ``cell_id`` is the folder's name and the cell fields it carries are those of
    the folder's ``cell.json`` (when there is one)."""
    path = Path(path)
    row = _checked(path, read_json(path), ROW_FIELDS, "row")
    why = row_problem(row, _labels(path.with_name(CELL_FILE)))
    if why:
        raise BadResultFile(path, why)
    folder = path.parent.name
    if row["cell_id"] != folder:
        raise BadResultFile(path, f"the row of cell {row['cell_id']!r} in the folder of cell "
                                  f"{folder!r}: a row must be in its own cell's folder")
    cell_path = path.with_name(CELL_FILE)
    if cell_path.is_file():
        try:
            cell = read_json(cell_path)
        except BadResultFile as e:  # the row cannot be matched to its cell: as bad
            raise BadResultFile(path, f"its cell.json cannot be read ({e})") from None
        # overrides (text in the row, pairs in cell.json) and extra (merged into the row) are
        # in the cell id's hash, checked above; the other fields are columns read as they are
        differ = [f"{k} {row[k]!r} (cell.json: {v!r})" for k, v in cell.items()
                  if k not in ("overrides", "extra") and k in row and row[k] != v]
        if differ:
            raise BadResultFile(path, f"a row must carry its cell's fields, but these differ "
                                      f"from {cell_path}: {', '.join(differ)}")
    return row


def row_problem(row: dict, labels: tuple[str, ...] = ()) -> str | None:
    """What makes ``row`` no :class:`experiments.row.Row`, or None: a key it does not declare
    (``labels``: the cell's own extra labels), or a number (its ``NUMBERS`` and the methods'
    integer options) that is text or a bool."""
    unknown = unknown_keys(row, labels)
    if unknown:
        return (f"{', '.join(map(repr, unknown))} is no column of a row (experiments/row.py "
                "declares them)")
    for name in NUMBERS + number_options():
        value = row.get(name)
        if value is not None and (type(value) is bool or not isinstance(value, (int, float))):
            return f"{name} must be a number or null, got {value!r}"
    return None


def _labels(cell_path: Path) -> tuple[str, ...]:
    """The extra labels of the cell in ``cell_path`` (none when it cannot be read: read_row
    then says so itself)."""
    try:
        extra = read_json(cell_path).get("extra") if cell_path.is_file() else None
    except (BadResultFile, AttributeError):
        return ()
    return tuple(extra) if isinstance(extra, dict) else ()


def write_row(path: Path, row: Row, labels: tuple[str, ...] = ()) -> None:
    """Write a run's row, refusing one that ``read_row`` would refuse (a producer's misspelt
    or undeclared column fails where it is written, not in a later rebuild)."""
    missing = [f for f in ROW_FIELDS if f not in row]
    why = (f"a row must have {', '.join(ROW_FIELDS)}; missing {', '.join(missing)}" if missing
           else row_problem(row, labels))
    if why:
        raise ValueError(f"{path}: {why}")
    write_json(path, row)


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
