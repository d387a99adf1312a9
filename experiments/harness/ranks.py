"""Ranks as spawned processes: started with the terminating signals held, ended on the way out.

Both launchers, ``launch._spawn`` (a cell's ranks) and ``calibrate._spawn`` (a calibration's),
start W interpreters with ``torch.multiprocessing.start_processes`` and wait for them. Two
things must hold for each, whatever happens:

- A Ctrl-C, SIGTERM or SIGHUP (``interrupts.TERMINATING``) that arrives while the ranks start
  would leave the ones already started waiting for the others at their rendezvous, until the
  process group's timeout. ``started_ranks`` holds those signals back until every rank is
  known, and raises one inside the block that ends the ranks. Holding takes two things. The
  signals are blocked for the launching thread, and a child inherits the mask, so a rank
  does not die of a terminal's Ctrl-C while its interpreter starts (``enter_rank`` takes
  SIGTERM and SIGHUP again). And a handler records them meanwhile: the kernel hands a
  process's signal to any thread that does not block it (a queue's feeder, a process
  group's worker), and Python then runs the handler in the main thread, blocked or not.
- Ranks still running when the launcher leaves (a timeout, an interrupt, one rank failing)
  are killed: ``started_ranks``' ``finally``.

torch's ``start_processes`` does neither (its ``ProcessContext.join`` ends the other ranks only
when one fails), so this is written here, once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator

import torch
import torch.multiprocessing as mp

from experiments.harness.interrupts import TERMINATING


def threads_per_rank(nproc: int) -> int:
    """OMP_NUM_THREADS if set, else the cores shared out over the ranks."""
    return int(os.environ.get("OMP_NUM_THREADS", 0)) or max(1, (os.cpu_count() or 1) // nproc)


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago (for a spawned group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


HELD = (signal.SIGINT, *TERMINATING)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Within the block the ``HELD`` signals wait (the module doc): blocked for this thread,
    and recorded where one reaches another thread. On leaving, their handlers are back and the
    first one recorded is raised again through its own handler (``KeyboardInterrupt``,
    ``interrupts.Terminated``, or the default action). Off the main thread, where handlers
    cannot be set, they are only blocked."""
    pending: list[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, lambda signum, frame: pending.append(signum))
                    for s in HELD}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # one pending here is recorded
        for s, handler in previous.items():  # None: set outside Python, taken as the default
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        if pending:
            signal.raise_signal(pending[0])


@contextlib.contextmanager
def started_ranks(fn: Callable, args: tuple, nprocs: int) -> Iterator[mp.ProcessContext]:
    """``nprocs`` spawned processes running ``fn(rank, *args)``, started with SIGINT, SIGTERM and
    SIGHUP held back (one that came meanwhile is raised before the block's body); every one
    still alive when the block ends, or when the start is interrupted, is killed (SIGKILL)."""
    pc = None
    try:
        with _signals_held():
            pc = mp.start_processes(fn, args, nprocs=nprocs, join=False, start_method="spawn")
        yield pc
    finally:  # a timeout, an interrupt, or one rank failing: end every rank still running
        for p in [] if pc is None else pc.processes:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)


def join_until(pc: mp.ProcessContext, deadline: float | None,
               tick: Callable[[], None] | None = None) -> bool:
    """Wait for every rank of ``pc`` to end: True when they have, False once ``time.monotonic()``
    passes ``deadline`` (None: no deadline). ``tick`` runs about once a second while they run
    (to drain a result pipe, which blocks a rank once 64 KiB are unread). A rank that fails
    raises what ``ProcessContext.join`` raises (``ProcessRaisedException``,
    ``ProcessExitedException``)."""
    while not pc.join(timeout=1.0):
        if tick is not None:
            tick()
        if deadline is not None and time.monotonic() > deadline:
            return False
    return True


def join_draining(pc: mp.ProcessContext, deadline: float | None, results) -> tuple[bool, list]:
    """``join_until`` reading ``results`` (a ``SimpleQueue`` the ranks put into) while the ranks
    run: a pipe holds 64 KiB, and a rank whose ``put`` does not fit waits until it is read,
    while its peers wait for it at their next collective, until the deadline. Returns (whether
    every rank ended before ``deadline``, what they put, in order)."""
    got = []

    def drain():
        while not results.empty():
            got.append(results.get())

    done = join_until(pc, deadline, drain)
    drain()
    return done, got


def enter_rank(threads: int) -> None:
    """A spawned rank's first step: Ctrl-C is ignored (the launcher turns it into one line and
    ends the ranks itself, rather than each rank printing a traceback), SIGTERM and SIGHUP are
    taken again (held while the launcher started the ranks, ``started_ranks``), stdout goes to
    stderr (the launcher's stdout carries its output, e.g. ``--json``), and torch uses
    ``threads`` threads."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, TERMINATING)
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    torch.set_num_threads(threads)


def exit_without_finalizing(code: int) -> None:
    """End this rank now, skipping the interpreter's finalization.

    ``destroy_process_group`` does not join gloo's worker threads while anything still holds
    the group (the model, an autograd graph, torch's own caches). A worker that releases its
    last collective's tensors after Python began finalizing needs the GIL, is ended by
    ``pthread_exit`` inside a C++ destructor, and aborts the rank ("terminate called without
    an active exception"; pytorch/pytorch#190489, seen in about 1 in 10 short cells). A rank's
    results are already delivered (the result queue, flushed streams), so it leaves without
    finalizing, as ``os.fork``'s children do.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
