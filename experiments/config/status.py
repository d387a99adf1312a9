"""The status of a row or a search: what happened to a cell, in one word
(docs/design.md#measurement)."""

from __future__ import annotations


class Status:
    """Row and search statuses, as written to ``row.json`` and the tables.

    Plain strings (not an Enum) so that rows, CSVs, pandas filters and JSON compare them as the
    text they are stored as.
    """

    OK = "ok"
    """the cell ran (or, emulated, fits) and was measured"""
    OOM = "oom"
    """out of memory, as the GPU allocator or the budget (a CPU run's tracked budget, the
    emulated device or host budget) says; nothing else is an OOM"""
    ERROR = "error"
    """anything else went wrong (a rank raised, or was killed from outside): re-run by
    ``--retry-failed``"""
    TIMEOUT = "timeout"
    """the cell ran past its wall-clock limit and its ranks were killed"""
    INVALID = "invalid"
    """the cell's configuration breaks a rule; nothing was launched"""
    SKIPPED = "skipped"
    """the method cannot run (or be emulated) on this machine; nothing was launched"""

    ALL = (OK, OOM, ERROR, TIMEOUT, INVALID, SKIPPED)
    RETRYABLE = (ERROR, TIMEOUT)
    """statuses ``--retry-failed`` runs again (the others are results)"""
    RESULTS = (OK, OOM)
    """statuses that answer the cell's question (the command exits 0 for them)"""
