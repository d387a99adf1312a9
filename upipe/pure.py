"""Functions that do the same for the same tensor metadata, and a hook around their calls.

``@metadata_pure`` marks a function whose allocations, frees, collectives and kernels depend
only on its arguments' metadata (shape, stride, dtype, device) and its other arguments, never
on tensor values, and that leaves no trace but its return value and in-place writes into
tensors it was given (no state kept, no memory held after it returns). The ring's forward and
backward loops are such functions: a ring step's sends, receives, kernel and merge are fixed
by the shapes.

``metadata_pure_hook(hook)``: inside it, a call of a marked function ``f(*args, **kwargs)``
becomes ``hook(f, args, kwargs)``. Without a hook (every real run) the call is direct. The
emulator installs one (``experiments/emulation/replay.py``): under fake tensors, where no value
exists, it runs each marked function once per argument signature and replays what that run
allocated and did for later calls with the same signature -- UPipe on a ring mesh runs the same
ring loop for each of its head stages, thousands of times per emulated step.

An argument object that is neither a tensor nor a plain value is the same argument only when it
is the same object, unless its type defines ``metadata_key()``: a hashable value such that two
objects with equal keys make the marked function do the same, or None when the object's state
says nothing so simple (the call then runs). A chunk's host store (``upipe.host.HostStore``) is
made anew in each layer's forward and backward, and is keyed by its settings while no copy is
pending, so FPDT's chunk loops replay across layers. A ``Span`` (rows of a tensor argument) is
keyed by its length, not its start: a loop over a tensor's shards or chunks passes the whole
tensor and a span instead of a view per shard, so the emulator builds no view for a replayed
call (each view is a fake-tensor dispatch: thousands per step at millions of tokens).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable

import torch

Hook = Callable[[Callable, tuple, dict], object]
KEY = "metadata_key"  # the method an argument object may define (see the module)

_HOOK: contextvars.ContextVar[Hook | None] = contextvars.ContextVar("upipe_pure_hook",
                                                                    default=None)


def metadata_pure(fn: Callable) -> Callable:
    """Mark ``fn`` as pure in its tensors' metadata (see the module); calls go through the
    ``metadata_pure_hook`` in force, if any."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        hook = _HOOK.get()
        if hook is None:
            return fn(*args, **kwargs)
        return hook(fn, args, kwargs)

    return call


@contextlib.contextmanager
def metadata_pure_hook(hook: Hook | None):
    """Route calls of ``@metadata_pure`` functions through ``hook`` inside (None: direct)."""
    token = _HOOK.set(hook)
    try:
        yield
    finally:
        _HOOK.reset(token)


class Span:
    """Rows ``[start, start + length)`` of dimension ``dim`` of a tensor, as an argument of a
    ``@metadata_pure`` function: ``of(t)`` is that view of ``t``. Its key is (length, dim): where
    a view starts changes no op's allocations (the emulator's replay compares tensors without
    their storage offset for the same reason)."""

    __slots__ = ("start", "length", "dim")

    def __init__(self, start: int, length: int, dim: int = 0):
        self.start, self.length, self.dim = start, length, dim

    def of(self, t: torch.Tensor) -> torch.Tensor:
        return t.narrow(self.dim, self.start, self.length)

    def metadata_key(self) -> tuple[int, int]:
        return self.length, self.dim

    def __repr__(self) -> str:
        return f"Span({self.start}, {self.length}, dim={self.dim})"
