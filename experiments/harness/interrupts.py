"""SIGTERM and SIGHUP end a command the way Ctrl-C does: its ranks first, then the command.

A signal's default action ends the process at once, skipping every ``finally``: the ranks a
launcher spawned (``launch._spawn``, ``calibrate._spawn``) would run on to the end of their
cell, and a sweep's results lock would be freed while they still load the machine. Raised as
:class:`Terminated`, a ``KeyboardInterrupt``, the signal takes the Ctrl-C path everywhere: the
launchers' ``finally`` kills the ranks, the lock is released after that, and the CLI prints one
line and exits ``128 + signal``.
"""

from __future__ import annotations

import contextlib
import signal
import threading

#: what ends a command from outside, besides Ctrl-C's SIGINT (a scheduler, ``kill``, a hang-up)
TERMINATING = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """A terminating signal, raised in the main thread; ``signum`` names it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise(signum, frame):
    raise Terminated(signum)


@contextlib.contextmanager
def terminating_signals_raise():
    """Within the block, SIGTERM and SIGHUP raise :class:`Terminated` in the main thread (their
    previous handlers come back after). Off the main thread, where handlers cannot be set,
    nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _raise) for s in TERMINATING}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


__all__ = ["TERMINATING", "Terminated", "terminating_signals_raise"]
