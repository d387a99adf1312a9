"""The session's background work (tests/background.py): its workers yield to every other
process, its results come back (errors included), a stopped run does not wait for a job, and
the tests that read it run last."""

from __future__ import annotations

import os
import sys
import time

import pytest
from background import MARKER, Background, last, start

linux = pytest.mark.skipif(not sys.platform.startswith("linux"),
                           reason="SCHED_IDLE and autogroups are Linux's")


def _priority() -> dict:
    autogroup = None
    if os.path.exists("/proc/self/autogroup"):  # a kernel built with autogroup
        with open("/proc/self/autogroup") as f:
            autogroup = f.read()
    return {"policy": os.sched_getscheduler(0), "own_session": os.getsid(0) == os.getpid(),
            "autogroup": autogroup}


@linux
def test_workers_run_at_idle_priority_in_a_session_of_their_own():
    jobs = Background(workers=1)
    try:
        jobs.submit("t", {"p": (_priority,)})
        got = jobs.results("t")["p"]
    finally:
        jobs.stop()
    assert got["policy"] == os.SCHED_IDLE
    assert got["own_session"]  # so its autogroup is its own: torchrun's ranks are in theirs
    assert got["autogroup"] is None or got["autogroup"].rstrip().endswith("nice 19")


def test_results_come_back_and_a_failed_job_raises_in_the_test():
    jobs = Background(workers=1)
    try:
        jobs.submit("good", {"sum": (sum, [1, 2, 3]), "max": (max, 4, 9)})
        jobs.submit("bad", {"x": (int, "x")})
        assert jobs.results("good") == {"sum": 6, "max": 9}
        assert jobs.results("good") == {"sum": 6, "max": 9}  # read twice, computed once
        with pytest.raises(ValueError, match="invalid literal"):
            jobs.results("bad")
        with pytest.raises(RuntimeError, match=f"mark it @pytest.mark.{MARKER}"):
            jobs.results("unknown")
    finally:
        jobs.stop()


@linux  # elsewhere a running job is waited for
def test_stop_ends_a_running_job_instead_of_waiting_for_it():
    jobs = Background(workers=1)
    jobs.submit("started", {"pid": (os.getpid,)})
    jobs.results("started")  # the worker is up, in its own session
    jobs.submit("t", {"long": (time.sleep, 300)})
    time.sleep(0.2)  # the idle worker takes the job at once
    t0 = time.monotonic()
    jobs.stop()
    assert time.monotonic() - t0 < 30


class _Mark:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


class _Item:
    def __init__(self, name: str, mark: _Mark | None = None):
        self.name, self.nodeid, self.mark = name, name, mark

    def get_closest_marker(self, name: str):
        return self.mark if name == MARKER else None


def _one(value: int) -> dict:
    return {"v": (abs, value)}


def test_marked_tests_run_last_in_their_order():
    items = [_Item("a", _Mark()), _Item("b"), _Item("c", _Mark()), _Item("d")]
    last(items)
    assert [i.name for i in items] == ["b", "d", "a", "c"]


def test_jobs_start_in_test_order_with_the_first_marked_ahead():
    items = [_Item("a", _Mark(jobs=lambda: _one(-1))), _Item("b"),
             _Item("c", _Mark(jobs=lambda: _one(-2), first=True)),
             _Item("d", _Mark(jobs=lambda: _one(-3)))]
    jobs = Background(workers=1)
    try:
        start(items, into=jobs)
        assert list(jobs._jobs) == ["c", "a", "d"]
        assert [jobs.results(k)["v"] for k in "acd"] == [1, 2, 3]
    finally:
        jobs.stop()
