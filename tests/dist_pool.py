"""A small pytest-native harness that runs a function on W CPU ranks (gloo) and never hangs.

A ``DistPool`` keeps W spawned worker processes with an initialised gloo process group, so a
parametrised test pays the process start-up once per world size, not once per case. ``run``
sends a picklable module-level function to every rank, returns the per-rank results, re-raises
any rank's exception with its traceback, and on a timeout kills the pool (the next ``run``
restarts it) instead of hanging. The gloo timeout is short so a rank stuck in a collective whose
peer failed errors out too.
"""

from __future__ import annotations

import datetime
import os
import queue
import sys
import time
import traceback

import torch.multiprocessing as mp

from experiments.harness.ranks import free_port

_CTX = mp.get_context("spawn")


def _worker(rank, world, port, inbox, outbox, pg_timeout_s):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # W ranks share 2 cores
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=pg_timeout_s),
    )
    while True:
        task = inbox.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            outbox.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # report, keep serving
            outbox.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()
    # Leave without finalizing, as launched ranks do (experiments/harness/launch.py): gloo's
    # threads outlive destroy_process_group while anything holds the group (pytorch#190489), and
    # after DeepSpeed (ds-ulysses, FPDT) finalizing took 4-5 s per pool at every session's end.
    # Nothing is lost: the parent sends the stop only after it has every result.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class DistPool:
    """W ranks as processes; ``run(fn, *args)`` -> [result of rank 0, ..., rank W-1] (the
    emulation path, rank 0 of a P-rank job on the fake process group, is ``InFakeWorld``)."""

    def __init__(self, world: int, timeout_s: float = 300.0, pg_timeout_s: float = 60.0):
        self.world = world
        self.timeout_s, self.pg_timeout_s = timeout_s, pg_timeout_s
        self.procs = []

    def _start(self):
        port = free_port()
        self.outbox = _CTX.Queue()
        self.inboxes = [_CTX.Queue() for _ in range(self.world)]
        self.procs = [
            _CTX.Process(
                target=_worker,
                args=(r, self.world, port, self.inboxes[r], self.outbox, self.pg_timeout_s),
                daemon=True,
            )
            for r in range(self.world)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, **kwargs) -> list:
        if not self.procs or not all(p.is_alive() for p in self.procs):
            self.close()
            self._start()
        for q in self.inboxes:
            q.put((fn, args, kwargs))
        results, errors = [None] * self.world, []
        deadline = time.monotonic() + self.timeout_s
        pending = self.world
        while pending:
            try:
                rank, ok, value = self.outbox.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close()
                    why = f"ranks {dead} died" if dead else f"timed out after {self.timeout_s}s"
                    raise TimeoutError(f"{fn.__name__} on {self.world} ranks: {why}") from None
                continue
            pending -= 1
            if ok:
                results[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        if errors:
            raise RuntimeError(f"{fn.__name__} failed:\n" + "\n".join(errors))
        return results

    def close(self):
        for q in getattr(self, "inboxes", []):
            try:
                q.put(None)
            except Exception:
                pass
        # one deadline for all ranks: a stuck pool costs 5 s to close, not 5 s per rank
        deadline = time.monotonic() + 5
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
        self.procs = []


class InFakeWorld:
    """``run(fn, *args)`` -> ``[fn(*args)]`` in this process, as rank 0 of a ``world``-rank job on
    the ``fake`` process group made for the call (``fake_step.fake_world``, as the emulator
    makes it): no collective moves data, so one process is the whole job, and no pool process
    need start (a fake pool's start cost about 2.5 s of every test run)."""

    def __init__(self, world: int):
        self.world = world

    def run(self, fn, *args, **kwargs) -> list:
        from experiments.emulation.fake_step import fake_world

        with fake_world(self.world):
            return [fn(*args, **kwargs)]
