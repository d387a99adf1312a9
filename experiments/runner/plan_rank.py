"""How the plan's rows compare: the ranking ``upipe-bench plan`` prints (``rank``: what fits
first, fastest first) and the fastest row that fits (``best_fitting``)."""

from __future__ import annotations

from experiments.config import Status


def _order(row: dict) -> tuple:
    status = row["status"]
    if status == Status.OK:
        return (0, -(row.get("tokens_per_s_per_gpu") or 0.0))
    if status == Status.OOM:
        return (1, row.get("peak_device_bytes") or 0)
    return (2 if status == Status.SKIPPED else 3, 0)


def row_identity(row: dict) -> tuple:
    """A row's configuration as a sortable tuple: ``rank``'s tie-break."""
    return (str(row.get("method") or ""), row.get("ring_degree") or 0,
            row.get("heads_per_stage") or 0, bool(row.get("overlap")), str(row.get("stack") or ""),
            row.get("keep_blocks") or 0, row.get("chunk_size") or 0)


def rank(rows: list[dict]) -> list[dict]:
    """Best first: fitting rows by tokens/s per GPU, then rows over a budget by device peak,
    then skipped and invalid ones; rows equal on that (most skipped rows) in the order of their
    configuration (method, ring degree, heads per stage, ...), not in the order they finished:
    the table is the same for any number of workers."""
    return sorted(rows, key=lambda r: (_order(r), row_identity(r)))


def best_fitting(rows: list[dict]) -> dict | None:
    """The fastest row that fits (``status`` ok, with a time), or None."""
    timed = [r for r in rows if r["status"] == Status.OK and r.get("tokens_per_s_per_gpu")]
    return max(timed, key=lambda r: (r["tokens_per_s_per_gpu"], row_identity(r)), default=None)
