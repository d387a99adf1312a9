"""A small host-memory store for activation chunks (FPDT's offload;
docs/design.md#three-execution-modes-one-code-path, docs/design.md#emulation).

FPDT (Yao et al., arXiv 2408.16978) keeps every sequence chunk of Q/K/V/output in host memory
and brings back only the chunk(s) in use (DeepSpeed's ``SequenceChunk`` in
``deepspeed/sequence/fpdt_layer.py``: pinned host buffers, copies on a side stream). This is the
same idea behind one interface that also runs on CPU and under FakeTensorMode:

* ``put(t) -> h``: a host copy of the device tensor ``t``. The handle ``h`` *is* the host tensor,
  so a caller can keep it with ``ctx.save_for_backward`` (and activation checkpointing then drops
  and recomputes it like any saved tensor, instead of leaking it on a ``ctx`` attribute).
* ``get(h) -> t``: a device copy; ``write(h, t)`` overwrites ``h`` in place (accumulators);
  ``zeros(...)``: a zeroed host accumulator; ``prefetch(h)``: make ``get``'s copy early;
  ``sync()``: end of a forward/backward, order every pending copy before later work.

Where the bytes are counted: host allocations are made inside ``host_context()`` (the harness
passes its ``MemoryTracker.host``), so on a CPU run, where "device" and host are both CPU memory,
the tracker still tells them apart; ``get``'s copy is made outside, a device allocation, as the
H2D copy is on a GPU. With ``enabled=False`` tensors stay on the device (``put``/``get`` return
their argument): the no-offload baseline.

Prefetch follows the same memory timeline on every device: ``prefetch(h)`` allocates the device
copy at once and the store holds it until ``get(h)`` hands it over (or ``sync()`` drops it). On
CUDA that is what overlapping the copy needs; on CPU and under FakeTensorMode nothing is
overlapped, but making the copy at prefetch time means a CPU run and the fake-tensor emulation
count the prefetched chunk's bytes, alive alongside the chunk in use, as a GPU run holds them.
As on CUDA, a ``write(h, ...)`` after ``prefetch(h)`` is not seen by the prefetched copy.

CUDA (not exercised on CPU CI): host buffers are pinned (``pin_memory``) so copies can be
asynchronous; device->host copies and prefetches run on one side stream, FIFO, so a prefetch of a
buffer never overtakes the copy that fills it; the compute stream waits only on the event of the
copy it needs, and ``record_stream`` keeps a device buffer alive until the stream reading it is
done with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch


class HostStore:
    """Puts tensors in host memory and brings them back to ``device``.

    Args:
        device: where ``get`` returns tensors (the compute device).
        enabled: offload at all (False: tensors stay on the device).
        host_context: zero-argument callable returning a context manager entered around every
            host allocation (a tracker's ``host``).
        pin_memory: pin host buffers of CUDA tensors (ignored without CUDA).
    """

    def __init__(
        self,
        device: torch.device,
        enabled: bool = True,
        host_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        pin_memory: bool = True,
    ):
        self.device, self.enabled = torch.device(device), enabled
        self.host_context, self.pin_memory = host_context, pin_memory
        self._cuda = self.enabled and self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        # id(host tensor) -> (host tensor, event of its last device->host copy)
        self._pending: dict[int, tuple[torch.Tensor, torch.cuda.Event]] = {}
        # id(host tensor) -> (host tensor, device copy, event of the host->device copy; None
        # off CUDA, where the copy is complete when made)
        self._prefetched: dict[int, tuple[torch.Tensor, torch.Tensor,
                                          torch.cuda.Event | None]] = {}

    def _empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        with self.host_context():
            return torch.empty(shape, dtype=dtype, device="cpu",
                               pin_memory=self._cuda and self.pin_memory)

    def zeros(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed accumulator in host memory (on the device when disabled)."""
        if not self.enabled:
            return torch.zeros(shape, dtype=dtype, device=self.device)
        return self._empty(shape, dtype).zero_()

    def put(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of ``t`` (``t`` itself when disabled)."""
        if not self.enabled:
            return t
        h = self._empty(t.shape, t.dtype)
        self.write(h, t)
        return h

    def write(self, h: torch.Tensor, t: torch.Tensor) -> None:
        """Overwrite the host tensor ``h`` with the device tensor ``t``."""
        if h is t:  # disabled: ``get`` returned the stored tensor, updated in place
            return
        if not self._cuda:
            h.copy_(t)
            return
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)  # t is computed; earlier reads of h are enqueued
        with torch.cuda.stream(self._stream):
            h.copy_(t, non_blocking=True)
            self._pending[id(h)] = (h, self._stream.record_event())
        t.record_stream(self._stream)  # t's memory is not reused before the copy read it

    def prefetch(self, h: torch.Tensor) -> None:
        """Make the device copy of ``h`` now, for the next ``get(h)`` to return.

        CUDA: the copy runs on the side stream, so ``get`` need not wait for it. Elsewhere it is
        made synchronously, only so the copy is alive (and counted) from here on, as on CUDA.
        No-op when disabled or when ``h`` is already prefetched.
        """
        if not self.enabled or id(h) in self._prefetched:
            return
        if not self._cuda:
            self._prefetched[id(h)] = (h, h.clone(), None)  # a "device" allocation, as in get
            return
        with torch.cuda.stream(self._stream):  # after any copy into h: same stream, FIFO
            d = h.to(self.device, non_blocking=True)
            self._prefetched[id(h)] = (h, d, self._stream.record_event())

    def get(self, h: torch.Tensor) -> torch.Tensor:
        """A device copy of the host tensor ``h`` (``h`` itself when disabled): the prefetched
        copy if there is one (the store lets go of it), else a new one."""
        if not self.enabled:
            return h
        entry = self._prefetched.pop(id(h), None)
        if entry is not None and entry[0] is not h:  # a guard: the entry keeps h (its id) alive
            entry = None
        if not self._cuda:
            # a "device" allocation (made outside host_context), like the prefetched one
            return entry[1] if entry is not None else h.clone()
        current = torch.cuda.current_stream(self.device)
        if entry is not None:
            current.wait_event(entry[2])
            entry[1].record_stream(current)
            return entry[1]
        pending = self._pending.get(id(h))
        if pending is not None and pending[0] is h:
            current.wait_event(pending[1])
        return h.to(self.device, non_blocking=True)

    def metadata_key(self) -> tuple | None:
        """What decides a ``@metadata_pure`` call's use of this store (``upipe.pure``): its
        settings, when no copy is pending or prefetched (None otherwise: a pending copy changes
        what ``get`` allocates)."""
        if self._pending or self._prefetched:
            return None
        return self.device, self.enabled, self.pin_memory, self.host_context

    def sync(self) -> None:
        """Order every copy issued so far before later work on the current stream, and forget
        the per-tensor events (so the store holds no tensor after a forward or backward)."""
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        self._pending.clear()
        self._prefetched.clear()
