"""Replaying calls of metadata-pure functions in the fake-tensor step (``upipe.pure``).

Under ``FakeTensorMode`` a call of a ``@metadata_pure`` function (the ring's loops, the
attention kernel dispatch and LSE merge, the all-to-alls, UPipe's per-stage projections, the
RMSNorm and its backward, the megatron-ds stack's norm tiles and MLP chunks)
allocates, frees, communicates and computes what its arguments' metadata decide, nothing else.
``CallReplay`` is the step's ``metadata_pure_hook``: the first call with a given signature runs
the function and records, from the ``MemoryTracker``'s event log, every allocation and free it
made (their bytes, kind and category, in order), the share it added to each observer (FLOPs,
collective bytes, work of its window) and its outputs' metadata. A later call with the same
signature replays that: each temporary is counted and uncounted at its turn (so the tracker's
peaks, phase peaks and breakdowns come out as they would), each output's storage is allocated
at its turn, the observers get their shares, and the outputs are fake tensors with the recorded
shapes and strides. No op of the function is dispatched again: UPipe on a ring mesh runs the
same ring loop for each head stage of each layer, forward, recomputed and backward, and most of
an emulated step's ops (each a FakeTensor dispatch) are in it.

The signature: the function; each tensor argument's shape, stride, dtype, device,
requires_grad, storage size (not its offset in it: where a view starts changes no op's
allocations), which arguments share a storage, and where the tracker counts it (device, host,
untracked); numbers, strings, dtypes and devices by value, dataclasses field by field, lists,
tuples and dicts item by item, an object defining ``metadata_key()`` by its key (a host store:
``upipe.pure``), any other object by identity (a process group, a function; an
object with an equality of its own is refused); grad mode, the kernel dispatch in force, and
the tracker's current kind and category. A recording is refused (the function then always runs)
when the call did anything a replay could not repeat: freed or resized memory it did not
allocate, kept memory alive beyond its outputs, returned a view of an argument or a tensor that
requires grad, closed a phase it did not open or left one open, opened or closed a category
or host scope, or added work outside its window. Phases it opened and closed (a module's
phase label, pushed by its hooks) are recorded among the allocations and opened and closed
again at their turn. Calls nest: a marked call inside one being recorded is recorded (the
tracker's logs nest) or replayed there, and the outer recording keeps what the inner replay
counted, so the first call of a chunked loop (one recording per query chunk of FPDT's backward,
per head stage of UPipe's chunked backward) no longer dispatches every block of it op by op.
Real tensors never match: in a real run the hook calls the function.

Written by hand: FakeTensorMode's own cache works op by op (each call still pays a dispatch);
nothing in torch replays a whole function's effect on a dispatch-mode tracker.
tests/test_replay.py checks that a step emulated with replay measures what it measures without.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from experiments.instruments.memory import Allocation, MemoryTracker
from upipe.kernels import kernel_dispatch_state
from upipe.pure import KEY

# arguments compared by value; any other object is compared by identity
_VALUES = (type(None), bool, int, float, str, slice, torch.dtype, torch.device)
_VALUE_TYPES = frozenset(_VALUES)


class _NoSignature(Exception):
    """An argument that cannot be part of a signature (a real tensor, an unhashable value)."""


@dataclass
class _Recording:
    """What one call did, to do again."""

    # in order: ("count", Allocation, delta bytes) for a temporary, ("output", storage index)
    events: list[tuple]
    # per output storage: numel, dtype, device, and (shape, stride) when one output is all of it
    storages: list[tuple[int, torch.dtype, torch.device, tuple | None]]
    # per output leaf: ("tensor", storage index, shape, stride, offset) | ("value", v)
    leaves: list[tuple]
    spec: object  # the outputs' pytree spec
    shares: list  # per observer, its ``since`` delta


class CallReplay:
    """The fake step's ``metadata_pure_hook`` (see the module).

    Attributes:
        recorded: first calls of a signature (run and recorded, the recording kept or
            refused); replayed: calls replayed; direct: calls run again without one (no
            signature, or a refused recording). A call inside a call being recorded counts
            as any other.
    """

    def __init__(self, tracker: MemoryTracker):
        self.tracker = tracker
        self._recordings: dict[tuple, _Recording | None] = {}  # None: refused, run each time
        self.recorded = self.replayed = self.direct = 0

    def __call__(self, fn: Callable, args: tuple, kwargs: dict):
        # a call inside one being recorded is recorded or replayed too: the tracker's log of the
        # outer call holds the inner call's events either way (a replay's temporaries as
        # ("count", ...) events), so the outer recording replays what the inner call did
        try:
            key = self._signature(fn, args, kwargs)
        except _NoSignature:
            self.direct += 1
            return fn(*args, **kwargs)
        if key in self._recordings:
            rec = self._recordings[key]
            if rec is None:
                self.direct += 1
                return fn(*args, **kwargs)
            self.replayed += 1
            return self._replay(rec)
        out, self._recordings[key] = self._record(fn, args, kwargs)
        self.recorded += 1
        return out

    # -- signature -----------------------------------------------------------------------------

    def _signature(self, fn, args, kwargs) -> tuple:
        storages: dict[int, int] = {}

        def enc(x):
            t = type(x)
            if t is FakeTensor:
                s = x.untyped_storage()
                # not the storage offset: where a view starts changes no op's allocations
                # (a chunk's slice of a buffer is the same call at every offset)
                return ("T", tuple(x.shape), x.stride(), x.dtype, x.device, x.requires_grad,
                        storages.setdefault(id(s), len(storages)), s.nbytes(),
                        self.tracker.kind(x))
            # the common cases by exact type first: a signature is taken per call, tens of
            # thousands of times per emulated step (a subclass takes the checks below)
            if t in _VALUE_TYPES:
                return t, x  # by value, and True apart from 1
            if t is tuple or t is list:
                return t, tuple([enc(y) for y in x])
            if isinstance(x, torch.Tensor):
                raise _NoSignature  # a real tensor
            if isinstance(x, (list, tuple)):
                return type(x), tuple([enc(y) for y in x])
            if isinstance(x, dict):
                return dict, tuple((k, enc(v)) for k, v in x.items())
            if dataclasses.is_dataclass(x) and not isinstance(x, type):
                return type(x), tuple(enc(getattr(x, f.name)) for f in dataclasses.fields(x))
            if isinstance(x, _VALUES):
                return type(x), x  # by value, and True apart from 1
            keyed = getattr(type(x), KEY, None)
            if keyed is not None:  # equal keys, the same call (upipe.pure)
                key = keyed(x)
                try:
                    hash(key)
                except TypeError:
                    key = None
                if key is None:
                    raise _NoSignature
                return type(x), key
            if type(x).__eq__ is not object.__eq__ or type(x).__hash__ is None:
                raise _NoSignature  # an equality of its own, not known to mean "same call"
            return x  # by identity (a process group, a function); the key keeps it alive

        return (fn, enc(args), enc(kwargs), torch.is_grad_enabled(), kernel_dispatch_state(),
                self.tracker.context)

    # -- record --------------------------------------------------------------------------------

    def _record(self, fn, args, kwargs) -> tuple[object, _Recording | None]:
        tr = self.tracker
        observers = list(tr.observers)
        marks = ([o.mark() for o in observers]
                 if all(hasattr(o, "mark") for o in observers) else None)
        with tr.log() as events:
            out = fn(*args, **kwargs)  # its locals are freed as it returns: inside the log
        if marks is None:
            return out, None
        shares = [o.since(m) for o, m in zip(observers, marks, strict=True)]
        if any(s is None for s in shares):
            return out, None
        return out, self._recording(out, events, shares)

    def _recording(self, out, events, shares) -> _Recording | None:
        kind, category = self.tracker.context
        leaves, spec = tree_flatten(out)
        out_storage: dict[int, int] = {}  # storage key -> index among the output storages
        storages, recorded_leaves = [], []
        for t in leaves:
            if not isinstance(t, torch.Tensor):
                recorded_leaves.append(("value", t))
                continue
            if type(t) is not FakeTensor or t.requires_grad:
                return None
            s = t.untyped_storage()
            idx = out_storage.setdefault(id(s), len(out_storage))
            if idx == len(storages):
                if s.nbytes() % t.element_size():
                    return None
                numel = s.nbytes() // t.element_size()
                # the only view of its storage, spanning it: made by one empty_strided
                whole = ((tuple(t.shape), t.stride()) if _spans_storage(t, numel) and sum(
                    isinstance(u, torch.Tensor) and u.untyped_storage() is s for u in leaves) == 1
                    else None)
                storages.append((numel, t.dtype, t.device, whole))
            elif storages[idx][1] != t.dtype:
                return None
            recorded_leaves.append(("tensor", idx, tuple(t.shape), t.stride(),
                                    t.storage_offset()))
        # which allocations survive the call (storage ids are reused once freed: by position)
        live: dict[int, int] = {}  # storage key -> index of its allocation event
        depth = 0  # phases opened inside and not closed yet
        for i, event in enumerate(events):
            if event[0] == "alloc":
                live[event[1]] = i
            elif event[0] == "free" and event[1] in live:
                del live[event[1]]
            elif event[0] == "count":  # a temporary of a call replayed inside this one
                continue
            elif event[0] == "phase":
                depth += 1 if event[1] is not None else -1
                if depth < 0:
                    return None  # closed a phase opened outside
            elif event[0] != "resize" or event[1] not in live:
                # memory it did not allocate, a carried collective result, or a category or
                # kind changed
                return None
        if depth:  # left a phase open
            return None
        if set(live) != set(out_storage):  # an output not made inside, or a temporary kept
            return None
        survivors = {i: key for key, i in live.items()}
        replay: list[tuple] = []
        counted: dict[int, Allocation] = {}  # storage key -> its temporary, as counted now
        for i, event in enumerate(events):
            if i in survivors:  # an output's storage: made again at replay by the op counting it
                if (event[2].kind, event[2].category) != (kind, category):
                    return None
                replay.append(("output", out_storage[event[1]]))
            elif event[0] in ("phase", "count"):
                # a phase opened and closed at its turn (the phase peaks follow); an inner
                # replayed call's temporary, counted again at its turn
                replay.append(event)
            elif event[0] == "alloc":
                counted[event[1]] = alloc = dataclasses.replace(event[2])
                replay.append(("count", alloc, alloc.nbytes))
            elif event[1] not in counted:  # a resize of an output
                return None
            elif event[0] == "free":
                alloc = counted.pop(event[1])
                replay.append(("count", alloc, -alloc.nbytes))
            else:
                counted[event[1]].nbytes += event[2]
                replay.append(("count", counted[event[1]], event[2]))
        return _Recording(replay, storages, recorded_leaves, spec, shares)

    # -- replay --------------------------------------------------------------------------------

    def _replay(self, rec: _Recording):
        tr = self.tracker
        bases: list[torch.Tensor | None] = [None] * len(rec.storages)
        for event in rec.events:
            if event[0] == "count":
                tr.count_replayed(event[1], event[2])
            elif event[0] == "phase":
                tr.push_phase(event[1]) if event[1] is not None else tr.pop_phase()
            else:
                numel, dtype, device, whole = rec.storages[event[1]]
                bases[event[1]] = (torch.empty_strided(*whole, dtype=dtype, device=device)
                                   if whole else torch.empty(numel, dtype=dtype, device=device))
        for observer, share in zip(tr.observers, rec.shares, strict=True):
            observer.apply(share)
        leaves = [leaf[1] if leaf[0] == "value"
                  else bases[leaf[1]] if rec.storages[leaf[1]][3]
                  else bases[leaf[1]].as_strided(leaf[2], leaf[3], leaf[4])
                  for leaf in rec.leaves]
        return tree_unflatten(leaves, rec.spec)


def _spans_storage(t: torch.Tensor, numel: int) -> bool:
    """Whether ``t`` is all of a ``numel``-element storage's extent from offset 0, as
    ``empty_strided`` of its shape and stride makes it."""
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) \
        if t.numel() else 0
    return t.storage_offset() == 0 and extent == numel
