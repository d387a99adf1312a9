"""One sweep at a time per results directory.

Two sweeps writing the same ``results/<sweep>/`` would run every cell twice, keep whichever row
was written last, and record timings taken while the other sweep loaded the machine. The runner
holds an exclusive ``flock`` on ``<dir>/.lock`` for as long as it runs; a second sweep on the
same directory is refused at once with a message naming the holder. The kernel drops a flock
when its process ends, however it ends, so a crashed or killed sweep never leaves the directory
locked (the file stays, harmlessly).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import os
import sys
from pathlib import Path


class ResultsInUse(ValueError):
    """Another process holds the results directory (a ValueError: the CLI reports it as bad
    input, exit status 2)."""


@contextlib.contextmanager
def results_lock(directory: Path):
    """Hold ``directory``'s lock for the duration, or raise ``ResultsInUse`` naming who holds
    it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / ".lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = path.read_text().strip() or "another process"
            raise ResultsInUse(
                f"{directory} is in use by another sweep ({holder}); wait for it to finish, "
                "or give another --out") from None
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}, started {started}: {' '.join(sys.argv)}".encode())
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
