"""Work a test needs, started when the session starts, in processes that run only on idle cores.

Without this the suite keeps about 1.6 of the 2 cores busy (docs/testing.md): while the pytest
process runs a fake step, or waits on a launch that does not fill both cores, a core idles.
The longest in-process tests are pure CPU-bound computations whose inputs are known before any
test runs: the max-context guard's emulated searches (tests/test_max_context_regression.py),
the README's plan example (tests/test_readme.py), and the emulations behind the fit's, the
cuDNN kernel's and partial keeping's checks. A test marked
``@pytest.mark.background(jobs=...)`` has them computed here, from the end of collection on, in
two worker processes of the lowest priority (``_idle_priority``), and such tests run last, so
the workers have the whole session's idle time. The test then reads the results (the
``background`` fixture, tests/conftest.py), waiting for what is left.

``jobs`` (a keyword: pytest takes a lone callable argument for the function to mark) is a
callable that takes the test's parameters (``@pytest.mark.parametrize``'s, by name) and returns
``{key: (fn, *args)}``: each ``fn(*args)`` picklable (it runs in a spawned process; keywords
through ``functools.partial``) and independent of every other test, so what it computes is the
same whenever it runs. ``first=True`` submits the test's jobs before the others'.

The workers' scheduling class is inherited by their children (the plan's own worker
processes). Nothing here is timed: a test that measures time does not read background
results.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import os
import signal
from collections.abc import Callable

import pytest

MARKER = "background"
WORKERS = 2


def _idle_priority() -> None:
    """Worker initializer: the lowest priority Linux has, so the suite's own work is not slowed.

    ``SCHED_IDLE`` ranks a process below every other one of its scheduling group, but Linux's
    autogroup first shares the CPU between groups, one per session, and torchrun starts each
    rank in a session of its own: against a rank the worker's group competed as an equal, and
    the torchrun examples took 45-85 s instead of 6-13 s (tests/test_examples.py, measured). So
    the worker also leaves for a session (and group) of its own, whose nice is set to 19."""
    if not hasattr(os, "SCHED_IDLE"):  # not Linux
        os.nice(19)
        return
    os.setsid()
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write("19")
    except OSError:  # a kernel without autogroup: SCHED_IDLE alone decides
        pass
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


class Background:
    """Jobs by key on ``workers`` processes of the lowest priority, started on first use."""

    def __init__(self, workers: int = WORKERS):
        self.workers = workers
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._jobs: dict[str, dict] = {}

    def submit(self, key: str, jobs: dict[object, tuple]) -> None:
        """Start ``{name: (fn, *args)}`` as the jobs of ``key``."""
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                self.workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=_idle_priority)
        self._jobs[key] = {name: self._pool.submit(*job) for name, job in jobs.items()}

    def results(self, key: str) -> dict:
        """``{name: fn(*args)}`` of ``key``'s jobs, waiting for those not done; a job's
        exception is raised here."""
        if key not in self._jobs:
            raise RuntimeError(
                f"{key} has no background jobs: mark it @pytest.mark.{MARKER}(jobs=...)")
        return {name: future.result() for name, future in self._jobs[key].items()}

    def stop(self) -> None:
        """Drop the jobs nobody read (a run stopped early) and end the workers. A worker still
        running a job is ended with its children (its session's process group) rather than
        waited for: the plan's job alone takes a minute or more. ``_processes`` is the
        executor's own table of workers (Python 3.14 has ``terminate_workers()``)."""
        if self._pool is None:
            return
        if any(not f.done() for jobs in self._jobs.values() for f in jobs.values()):
            for pid in list(getattr(self._pool, "_processes", None) or {}):
                with contextlib.suppress(OSError):  # gone, or not a group leader (not Linux)
                    os.killpg(pid, signal.SIGTERM)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pool, self._jobs = None, {}


SESSION = Background()


def marked(items: list[pytest.Item]) -> list[pytest.Item]:
    return [item for item in items if item.get_closest_marker(MARKER) is not None]


def last(items: list[pytest.Item]) -> None:
    """Move the marked tests to the end of the run (in place, otherwise in order): their
    background work then has the whole session."""
    late = marked(items)
    items[:] = [item for item in items if item not in late] + late


def start(items: list[pytest.Item], into: Background = SESSION) -> None:
    """Submit every marked test's jobs (the tests that will run, after deselection) to the
    session's workers."""
    # a test marked first=True (one job much longer than the others) starts before the rest:
    # last in the queue, the README's plan example ran alone after every other test (a minute)
    ordered = sorted(marked(items), key=lambda i: not i.get_closest_marker(MARKER).kwargs.get(
        "first", False))
    for item in ordered:
        jobs: Callable[..., dict] = item.get_closest_marker(MARKER).kwargs["jobs"]
        into.submit(item.nodeid, jobs(**(item.callspec.params if hasattr(item, "callspec")
                                            else {})))
