"""Live tensor-memory tracking by intercepting every op at the dispatcher
(docs/design.md#measurement, docs/design.md#emulation).

``MemoryTracker`` is a ``TorchDispatchMode``: each op output whose storage it has not seen (and
that does not alias an op input) is a new allocation of ``storage.nbytes()``; a weakref callback on
the storage's Python object removes it when the storage is freed. Torch preserves a storage's
Python object for the storage's whole life (``t.untyped_storage() is t.untyped_storage()``;
checked on torch 2.13 by ``tests/test_memory.py``), so the callback fires exactly when the memory
goes back to the allocator. Views and in-place ops allocate nothing and add nothing.

The same code measures real CPU tensors (gloo ranks) and fake ones (``FakeTensorMode`` + the
``fake`` process group: meta storages still report ``nbytes``), which is how paper-scale peaks
are predicted without a GPU. What it cannot see: scratch that a kernel allocates internally and
frees before returning (e.g. flash-attention workspaces); docs/design.md#emulation models those per
kernel.

Why hand-written rather than ``torch.distributed._tools.mem_tracker.MemTracker``: that tool is
private API, and it classifies bytes by device, so host-offloaded activations (CPU tensors) and
"device" tensors of a CPU run (also CPU tensors) cannot be told apart. Here allocations made
inside ``tracker.host()`` are host bytes, everything else device bytes, on any device.

Other instruments of the same step (FLOPs, collectives, the emulator's work per window) can ride
on the tracker's dispatch instead of stacking modes of their own: each ``observers`` entry's
``observe(func, args, kwargs, out)`` is called after the tracker has counted the op's outputs.
One Python dispatch layer instead of several is most of an emulated step's instrument cost (an
emulated step dispatches ~200K ops; a mode layer costs several microseconds per op).

Two optional refinements: ``round_bytes=512`` counts each device storage as the CUDA caching
allocator does (so the tracked peak can be compared with ``torch.cuda.max_memory_allocated``),
and phases (``tracker.phase("forward")``, nested) record the device peak of each stretch of the
program, independently of the categories that split the bytes.

Usage (enter the tracker *inside* ``FakeTensorMode`` so that it sees the fake ops, not the meta
ops fake mode runs underneath)::

    with MemoryTracker() as mt:
        mt.track(model, x)                 # pre-existing tensors count toward the absolute peak
        with mt.category("attention"):
            model(x).backward(dy)
    mt.peak_device_bytes, mt.peak_by_category["attention"]
"""

from __future__ import annotations

import contextlib
import sys
import time
import warnings
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass_type,
)
from torch.utils._pytree import tree_leaves, tree_map_only

DEVICE, HOST = "device", "host"
_P2P_OPS = frozenset({"send", "recv_", "recv_any_source_"})
# a device query (C++ code asks a fake or subclass tensor for its device after most view ops:
# a third of an emulated step's dispatches); it allocates nothing and observers ignore it
_DEVICE_QUERY = torch.ops.prim.device.default


class Observer(Protocol):
    """An instrument that sees each op the tracker dispatches (``MemoryTracker.observers``).

    One whose state is additive may also have ``mark() -> state``, ``since(mark) -> share``
    (what it added since, or None if that cannot be added again elsewhere) and
    ``apply(share)``: the emulator then replays calls of metadata-pure functions on this
    tracker (``experiments.emulation.replay``).
    """

    def observe(self, func, args, kwargs, out) -> None:
        """Called after ``func(*args, **kwargs)`` returned ``out`` and its outputs are counted."""


@dataclass
class Allocation:
    """One live storage: its size when counted, where it lives, who made it."""

    nbytes: int  # as counted: device sizes rounded up to the tracker's round_bytes
    kind: str  # DEVICE or HOST
    category: str
    desc: str  # "op: dtype[shape]" of the tensor that first exposed the storage


# torch.tensor(python data) builds its tensor without dispatching and then "lifts" it: a real run
# returns the same tensor, FakeTensorMode a new fake one; count both as the allocation they are.
_FRESH_CONSTANTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)
# A functional collective's result is its op's output once waited on: eager ``wait_tensor``
# returns its input (c10d functional's C++ kernel), the fake kernel a fresh tensor like it.
_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default
# the functional collectives that move data (not wait_tensor or _wrap_tensor_autograd)
_FUNCTIONAL_COLLECTIVES = frozenset({
    "all_gather_into_tensor", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced", "all_reduce", "all_reduce_coalesced",
    "all_to_all_single", "broadcast"})


_C10D_API = "torch.distributed.distributed_c10d"


def _issued_blocking(depth: int = 12) -> bool:
    """Whether the c10d op being dispatched now comes from a ``torch.distributed`` call made
    with ``async_op=False`` (read from that call's frame, within ``depth`` frames of here).

    Such a call waits on its Work and drops it before it returns, so once the program goes on,
    only the backend still holds the op's tensors, and it lets go as soon as its worker thread
    runs again. An ``async_op=True`` call hands its Work to the program, which may hold it (and
    the tensors) for as long as it likes. Ops issued any other way count as asynchronous.
    """
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        if (frame.f_globals.get("__name__") == _C10D_API
                and "async_op" in frame.f_code.co_varnames):
            return not frame.f_locals.get("async_op", True)
        frame = frame.f_back
    return False


def _storage(t: torch.Tensor):
    """The tensor's untyped storage, or None for tensors without one (sparse, some subclasses)."""
    if not torch._C._has_storage(t):
        return None
    return t.untyped_storage()


# type -> whether it is a wrapper subclass (``plain_tensors``): asked once per type, not per
# tensor
_WRAPPER_TYPES: dict[type, bool] = {}


def plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors holding ``t``'s memory: itself, or a wrapper subclass's inner tensors.

    A DTensor (FSDP2 parameters, their gradients and optimizer states) has no storage of its
    own; its local shard does. The mode sees DTensor ops only at the subclass level (the local
    ops run while the mode is disabled), so outputs are unwrapped here.
    """
    cls = type(t)
    wrapper = _WRAPPER_TYPES.get(cls)
    if wrapper is None:
        wrapper = _WRAPPER_TYPES[cls] = is_traceable_wrapper_subclass_type(cls)
    # checked first: a wrapper subclass reports a storage of its global size that holds nothing
    if not wrapper:
        return [t]
    names, _ = t.__tensor_flatten__()
    inner = (getattr(t, n) for n in names)
    return [p for x in inner if isinstance(x, torch.Tensor) for p in plain_tensors(x)]


def tensor_leaves(tree, out: list) -> list:
    """Append the tensors in an op's arguments or outputs to ``out``, in order; returns it.

    What ``tree_leaves`` finds, without its generic pytree machinery (more than half of the
    tracker's own cost per op): op schemas nest tensors only in lists, tuples (named or not)
    and, for keyword arguments, a dict.
    """
    if isinstance(tree, torch.Tensor):
        out.append(tree)
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            tensor_leaves(x, out)
    elif isinstance(tree, dict):
        for x in tree.values():
            tensor_leaves(x, out)
    return out


def _storage_ids(tree) -> set[int]:
    """The ids of the storages behind the tensors in ``tree`` (an op's arguments)."""
    return {id(s) for t in tensor_leaves(tree, []) for p in plain_tensors(t)
            if (s := _storage(p)) is not None}


class MemoryTracker(TorchDispatchMode):
    """Tracks live tensor storage bytes while active: current, peak, device/host, per category.

    Attributes (bytes):
        current_bytes, peak_bytes: all tracked bytes (device + host).
        current_device_bytes, peak_device_bytes; current_host_bytes, peak_host_bytes.
        current_by_category, peak_by_category: device bytes per label of ``category()``
            ("other" outside any).
        breakdown_at_peak: {category: device bytes} at the moment of the device peak.
        peak_by_phase: {phase key: the highest device bytes seen while that key was current};
            a key is the tuple of ``phase()`` names open (``()`` outside any). Exclusive: bytes
            reached inside a nested phase count for the nested key only, so the inclusive peak
            of phase ``p`` is the max over the keys that start with ``p``.
        breakdown_by_phase: {phase key: {category: device bytes}} when that key's peak was set.
        peak_allocations: the live ``Allocation`` list at the device peak, when constructed with
            ``snapshot_peak=True`` (for explaining a peak; costs a list copy per new peak).
        observers: ``Observer``s called for every op after it is counted (append to add one).
    """

    def __init__(
        self, snapshot_peak: bool = False, settle_comm: bool = True,
        settle_timeout_s: float = 0.01, namespace_categories: dict[str, str] | None = None,
        round_bytes: int = 1, settle_waited_timeout_s: float = 10.0,
    ):
        super().__init__()
        if round_bytes < 1:
            raise ValueError(f"round_bytes must be >= 1, got {round_bytes}")
        self.snapshot_peak = snapshot_peak
        # Device storages count as ceil(nbytes / round_bytes) * round_bytes. With 512 this is
        # what torch.cuda.max_memory_allocated counts: the CUDA caching allocator rounds every
        # request up to a multiple of kMinBlockSize = 512 bytes (round_size in
        # c10/cuda/CUDACachingAllocator.cpp). Host storages are never rounded.
        self.round_bytes = round_bytes
        # op namespace -> category for its outputs (e.g. {"fsdp": "model"}: FSDP2's all-gather
        # and reduce-scatter buffers are model-state traffic wherever they run)
        self.namespace_categories = dict(namespace_categories or {})
        self.settle_comm, self.settle_timeout_s = settle_comm, settle_timeout_s
        self.settle_waited_timeout_s = settle_waited_timeout_s
        # aliases of the tensors of collectives the program may still hold (async handles) and
        # of those it has waited on (blocking calls): settled with the short and long timeout
        self._comm_aliases: list[torch.Tensor] = []
        self._comm_waited: list[torch.Tensor] = []
        # collectives the program had waited on whose tensors the backend still held after the
        # long timeout: the live bytes counted then may include them (warned, see ``_settle``)
        self.unsettled_collectives = 0
        # functional collective in flight: its output's storage id -> aliases of its tensors
        self._in_flight: dict[int, list[torch.Tensor]] = {}
        self._live: dict[int, tuple[Allocation, weakref.ref]] = {}
        self._kind_stack = [DEVICE]
        self._category_stack = ["other"]
        self.current = {DEVICE: 0, HOST: 0}
        self.peak = {DEVICE: 0, HOST: 0}
        self.peak_bytes = 0
        self.current_by_category: dict[str, int] = defaultdict(int)
        self.peak_by_category: dict[str, int] = defaultdict(int)
        self.breakdown_at_peak: dict[str, int] = {}
        self.peak_allocations: list[Allocation] = []
        self._phase_stack: list[str] = []
        self._phase_key: tuple[str, ...] = ()  # tuple(self._phase_stack), kept built
        self.peak_by_phase: dict[tuple[str, ...], int] = {}
        self.breakdown_by_phase: dict[tuple[str, ...], dict[str, int]] = {}
        self.observers: list[Observer] = []
        # the bookkeeping events while ``log()`` is open: ("alloc", key, Allocation),
        # ("free", key), ("resize", key, delta), ("carry", key), ("phase", name | None),
        # ("context",) (for the emulator's replay)
        self._log: list[tuple] | None = None

    # -- public API ----------------------------------------------------------------------------

    @property
    def current_bytes(self) -> int:
        self._settle_comm()
        return self.current[DEVICE] + self.current[HOST]

    @property
    def current_device_bytes(self) -> int:
        self._settle_comm()
        return self.current[DEVICE]

    @property
    def current_host_bytes(self) -> int:
        self._settle_comm()
        return self.current[HOST]

    @property
    def peak_device_bytes(self) -> int:
        return self.peak[DEVICE]

    @property
    def peak_host_bytes(self) -> int:
        return self.peak[HOST]

    def track(self, *objs, category: str = "model") -> None:
        """Count pre-existing tensors (and modules' parameters, buffers and existing grads).

        Storages already tracked are not counted twice. Use it for parameters and inputs so that
        the peak is absolute, not only what the measured code allocated.
        """
        for obj in objs:
            if isinstance(obj, nn.Module):
                tensors = [*obj.parameters(), *obj.buffers()]
                tensors += [p.grad for p in obj.parameters() if p.grad is not None]
            else:
                tensors = [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]
            with self.category(category):
                for t in tensors:
                    for p in plain_tensors(t):
                        self._add(p, "track")

    @contextlib.contextmanager
    def category(self, name: str):
        """Attribute allocations made inside to ``name`` (nested: the innermost label wins)."""
        self.push_category(name)
        try:
            yield self
        finally:
            self.pop_category()

    def push_category(self, name: str) -> None:
        """``category(name)`` entered by hand (for autograd hooks that cannot use ``with``)."""
        self._context_changed()
        self._category_stack.append(name)

    def pop_category(self) -> None:
        if len(self._category_stack) > 1:
            self._context_changed()
            self._category_stack.pop()

    @contextlib.contextmanager
    def phase(self, name: str):
        """Record the device peak of the code inside under the key ``(*outer phases, name)``."""
        self.push_phase(name)
        try:
            yield self
        finally:
            self.pop_phase()

    def push_phase(self, name: str) -> None:
        """``phase(name)`` entered by hand (for autograd hooks that cannot use ``with``).

        The new key's peak starts at (or is raised to) the current device bytes, so a phase that
        allocates nothing still has an entry: the bytes live while it ran.
        """
        self._settle_comm()
        if self._log is not None:
            self._log.append(("phase", name))
        self._phase_stack.append(name)
        self._phase_key = tuple(self._phase_stack)
        self._raise_phase_peak()

    def pop_phase(self) -> None:
        """Close the innermost phase (at the root: nothing to close)."""
        if self._phase_stack:
            self._settle_comm()
            if self._log is not None:
                self._log.append(("phase", None))
            self._phase_stack.pop()
            self._phase_key = tuple(self._phase_stack)

    @contextlib.contextmanager
    def host(self):
        """Count allocations made inside as host (offloaded) bytes instead of device bytes."""
        self._context_changed()
        self._kind_stack.append(HOST)
        try:
            yield self
        finally:
            self._context_changed()
            self._kind_stack.pop()

    def reset_peak(self) -> None:
        """Restart every peak from the current live bytes; phase peaks restart empty."""
        self._settle_comm()
        self.peak = dict(self.current)
        self.peak_bytes = self.current_bytes
        self.peak_by_category = defaultdict(int, self.current_by_category)
        self.peak_by_phase, self.breakdown_by_phase = {}, {}
        self._snapshot()

    @contextlib.contextmanager
    def log(self):
        """Record the bookkeeping events inside into the list yielded: ("alloc", storage key,
        Allocation), ("free", key), ("resize", key, delta bytes), ("carry", key) (a functional
        collective's result), ("phase", name) and ("phase", None) (a phase opened, the innermost
        closed), ("context",) (a category or kind opened or closed), ("count", Allocation, delta
        bytes) (a replayed call's temporary, ``count_replayed``) -- what
        ``experiments.emulation.replay`` needs to replay a call. Nested: an inner log's events
        are the outer one's too (a call recorded inside a call being recorded)."""
        outer = self._log
        self._log = events = []
        try:
            yield events
        finally:
            self._log = outer
            if outer is not None:
                outer.extend(events)

    def _context_changed(self) -> None:
        """A category or kind opens or closes: logged (a call during which one does cannot be
        replayed under a single context). Settles a collective's buffers first, as a phase
        change does (a new phase starts from the live bytes)."""
        self._settle_comm()
        if self._log is not None:
            self._log.append(("context",))

    @property
    def logging(self) -> bool:
        """Whether ``log()`` is open."""
        return self._log is not None

    @property
    def context(self) -> tuple[str, str]:
        """(kind, category) a new allocation gets now."""
        return self._kind_stack[-1], self._category_stack[-1]

    def count_replayed(self, alloc: Allocation, delta: int) -> None:
        """Count ``delta`` bytes of ``alloc`` as a live storage's allocation (> 0) or free
        (< 0) would be, without a storage: a replayed call's temporaries
        (``experiments.emulation.replay``)."""
        if self._log is not None:  # replayed inside a call being recorded: part of it
            self._log.append(("count", alloc, delta))
        self._count(alloc, delta)

    def live_allocations(self) -> list[Allocation]:
        """The tracked storages alive now."""
        return [a for a, _ in self._live.values()]

    @property
    def phase_key(self) -> tuple[str, ...]:
        """The phase labels open now, outermost first (``()`` outside any)."""
        return self._phase_key

    def device_bytes(self, tensors) -> int:
        """The device bytes counted for the storages behind ``tensors`` (each storage once;
        host and untracked storages count 0)."""
        seen, total = set(), 0
        for t in tensors:
            for p in plain_tensors(t):
                s = _storage(p)
                if s is None or id(s) in seen:
                    continue
                seen.add(id(s))
                entry = self._live.get(id(s))
                if entry is not None and entry[0].kind == DEVICE:
                    total += entry[0].nbytes
        return total

    def kind(self, t: torch.Tensor) -> str | None:
        """Where ``t``'s storage is counted: DEVICE, HOST, or None if it is not tracked (a
        wrapper subclass: its first inner storage's kind)."""
        for p in plain_tensors(t):
            s = _storage(p)
            entry = None if s is None else self._live.get(id(s))
            if entry is not None:
                return entry[0].kind
        return None

    def tracks(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage (a wrapper subclass's: all inner storages) is counted."""
        stores = [_storage(p) for p in plain_tensors(t)]
        return all(s is not None and id(s) in self._live for s in stores)

    # -- dispatch ------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _DEVICE_QUERY:
            return func(*args, **kwargs)
        if self.settle_comm and func.namespace == "c10d" and func._opname not in _P2P_OPS:
            pending = self._comm_waited if _issued_blocking() else self._comm_aliases
            args, kwargs = tree_map_only(
                torch.Tensor, lambda t: self._comm_alias(t, pending), (args, kwargs))
        functional = self.settle_comm and func.namespace == "_c10d_functional" and (
            func is _WAIT_TENSOR or func._opname in _FUNCTIONAL_COLLECTIVES)
        if functional and func is not _WAIT_TENSOR:
            held: list[torch.Tensor] = []
            args, kwargs = tree_map_only(
                torch.Tensor, lambda t: held.append(torch.ops.aten.alias.default(t)) or held[-1],
                (args, kwargs))
        out = func(*args, **kwargs)
        if functional:
            if func is _WAIT_TENSOR:
                self._settle(self._in_flight.pop(id(_storage(args[0])), []), waited=True)
            else:
                self._in_flight[id(_storage(out))] = held
        label = self.namespace_categories.get(func.namespace)
        if label is not None:
            self._category_stack.append(label)
            try:
                self._add_outputs(func, args, kwargs, out)
            finally:
                self._category_stack.pop()
        else:
            self._add_outputs(func, args, kwargs, out)
        for observer in self.observers:
            observer.observe(func, args, kwargs, out)
        return out

    def _add_outputs(self, func, args, kwargs, out) -> None:
        """Count each output storage that is new: neither tracked nor one of the op's inputs
        (a view of, or an in-place op on, an untracked input allocates nothing here).

        The inputs' storages are collected only for an output whose storage is untracked (a
        fresh allocation, or a view of an untracked input); ops without tensor outputs (most
        are ``prim.device`` queries) and views, in-place and out= ops on tracked storages,
        together most ops of an emulated step, need no input set.
        """
        if func is _WAIT_TENSOR:
            self._carry(args[0], out)
            return
        inputs = None
        for t in tensor_leaves(out, []):
            for p in plain_tensors(t):
                s = _storage(p)
                if s is None:
                    continue
                entry = self._live.get(id(s))
                if entry is not None:  # seen: only a resize (out= ops) changes its bytes
                    self._resize(entry[0], s)
                    continue
                if inputs is None:  # torch.tensor(data) is created below the dispatcher
                    fresh = func in _FRESH_CONSTANTS
                    inputs = set() if fresh else _storage_ids((args, kwargs))
                if id(s) not in inputs:
                    self._add_storage(s, func.__name__, p)

    def __enter__(self):
        _ResizeHook.install(self)
        return super().__enter__()

    def __exit__(self, *exc):
        self._comm_aliases.clear()
        self._comm_waited.clear()
        self._in_flight.clear()
        _ResizeHook.remove(self)
        return super().__exit__(*exc)

    # -- collectives ---------------------------------------------------------------------------
    #
    # A backend's Work holds its send/receive tensors until a comm thread (gloo's worker) lets
    # go of it, shortly after wait() returns; how long after depends on thread scheduling. The
    # program may already have dropped a send buffer that the comm thread still holds, so raw
    # real-run peaks vary run to run and exceed emulated ones. To measure what the program
    # holds, each collective gets fresh aliases (same storage) of its tensors, and before the
    # next allocation (or resize that grows, phase change, peak reset, read of the live bytes)
    # the tracker waits until it holds the only reference to them again, i.e. the backend has
    # let go: the bytes are then freed before anything that could raise a peak is counted.
    # Not before the next op: gloo runs a reduce-scatter's own split and copy through the
    # dispatcher inside ``wait()`` on the calling thread (FSDP2 reduce-scatters every gradient),
    # while its Work still holds the aliases, so a wait there waited on itself for the full
    # timeout.
    #
    # How long to wait depends on who may still hold the Work. After a blocking call
    # (``async_op=False``, ``_issued_blocking``) only the backend does, and it lets go within
    # microseconds unless its thread is starved (a loaded 2-core machine): the tracker waits up
    # to ``settle_waited_timeout_s`` (10 s), so a starved thread does not turn into a send
    # buffer counted beside the next allocations (a CI run once counted UPipe's 64 KiB query
    # send buffer in one of two identical steps; with no wait at all, 53 of 400 blocking
    # all-to-alls counted it, none with the wait on this machine, one in a loaded CI run with
    # no wait timed out, cause not found: tests/test_memory.py; another loaded CI run measured
    # one rank of a chunked UPipe layer unlike the other three, not reproduced here either, so
    # ``test_fake_equals_real_gloo`` measures a case whose ranks disagree once more). A Work
    # handed to the program (async ops) may be held as long as the program likes, and while it
    # is, no wait can help: after ``settle_timeout_s`` (10 ms, enough for a backend that is not
    # starved) its buffers stay counted, as they are really held. These waits stall async
    # overlap once per collective (they were 0.25 s: a UPipe overlap layer measured in 20 s
    # instead of 10); time runs untracked.
    #
    # Functional collectives (torch's CP ring) run asynchronously until the program waits on
    # their result (``wait_tensor``): their tensors are aliased when issued and settled at that
    # wait (with the long timeout: the program has waited), so an exchange in flight beside the
    # attention is not stalled.
    #
    # Point-to-point ops are not settled: a ring keeps its send and receive buffers itself until
    # it waits (upipe.ring.RingComm), so they are counted for exactly as long as the program
    # holds them, and settling would only time out on every in-flight send.

    def _comm_alias(self, t: torch.Tensor, pending: list[torch.Tensor]) -> torch.Tensor:
        alias = torch.ops.aten.alias.default(t)
        pending.append(alias)
        return alias

    def _settle_comm(self) -> None:
        if self._comm_waited:
            self._settle(self._comm_waited, waited=True)
            self._comm_waited.clear()
        if self._comm_aliases:
            self._settle(self._comm_aliases)
            self._comm_aliases.clear()

    def _settle(self, aliases: list[torch.Tensor], waited: bool = False) -> None:
        """Wait until the tracker holds the only reference to ``aliases``: the backend has let
        go of the collective's tensors. Up to ``settle_waited_timeout_s`` when the program has
        waited on the collective (``waited``), else ``settle_timeout_s``; a waited collective
        still held after that is counted in ``unsettled_collectives`` and warned about."""
        timeout = self.settle_waited_timeout_s if waited else self.settle_timeout_s
        deadline = time.monotonic() + timeout
        while any(a._use_count() > 1 for a in aliases):
            if time.monotonic() > deadline:
                if waited:
                    self.unsettled_collectives += 1
                    warnings.warn(
                        f"a collective's backend still held its tensors {timeout:g} s after the "
                        "program waited on it: the tracked bytes count them until it lets go",
                        RuntimeWarning, stacklevel=2)
                break
            time.sleep(1e-4)

    # -- bookkeeping ---------------------------------------------------------------------------

    def _add(self, t: torch.Tensor, op: str) -> None:
        """Count ``t``'s storage unless it is tracked already (``track``)."""
        s = _storage(t)
        if s is None:
            return
        entry = self._live.get(id(s))
        if entry is not None:  # seen: only a resize changes its bytes
            self._resize(entry[0], s)
            return
        self._add_storage(s, op, t)

    def _add_storage(self, s, op: str, t: torch.Tensor | None) -> None:
        self._settle_comm()  # what a collective's backend has let go of is gone before this
        key = id(s)
        desc = op if t is None else f"{op}: {str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
        kind = self._kind_stack[-1]
        alloc = Allocation(self._counted(kind, s.nbytes()), kind, self._category_stack[-1], desc)
        # The callback runs while the storage object is being destroyed, before its id can be
        # reused, so keying by id is safe; it holds the tracker only weakly.
        self_ref = weakref.ref(self)
        ref = weakref.ref(s, lambda _, k=key: (tr := self_ref()) is not None and tr._free(k))
        self._live[key] = (alloc, ref)
        if self._log is not None:  # a copy: a resize changes the live one's bytes
            self._log.append(("alloc", key, Allocation(alloc.nbytes, kind, alloc.category, desc)))
        self._count(alloc, alloc.nbytes)

    def _carry(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """``dst`` is ``src``'s memory under another storage object (a fake ``wait_tensor``'s
        result): the allocation moves to ``dst``'s storage, uncounted again, and is freed with
        it. (``src``'s callback then finds no entry under its key: nothing is freed twice.)"""
        s_src, s_dst = _storage(src), _storage(dst)
        if s_dst is None or s_dst is s_src or id(s_dst) in self._live:
            return
        entry = self._live.pop(id(s_src), None) if s_src is not None else None
        if entry is None:  # an untracked input: its result is untracked too, as in eager
            return
        if self._log is not None:
            self._log.append(("carry", id(s_src)))
        key, self_ref = id(s_dst), weakref.ref(self)
        ref = weakref.ref(s_dst, lambda _, k=key: (tr := self_ref()) is not None and tr._free(k))
        self._live[key] = (entry[0], ref)

    def _on_resize(self, s) -> None:
        key = id(s)
        if key in self._live:
            self._resize(self._live[key][0], s)
        elif s.nbytes() > 0:
            self._add_storage(s, "resize_", None)

    def _counted(self, kind: str, nbytes: int) -> int:
        """What a storage of ``nbytes`` counts as: device sizes rounded up to ``round_bytes``."""
        if kind == HOST:
            return nbytes
        return -(-nbytes // self.round_bytes) * self.round_bytes

    def _resize(self, alloc: Allocation, s) -> None:
        """Count the change of a tracked storage's size (rounded like its allocation was)."""
        nbytes = self._counted(alloc.kind, s.nbytes())
        if nbytes > alloc.nbytes:
            self._settle_comm()
        if nbytes != alloc.nbytes:
            if self._log is not None:
                self._log.append(("resize", id(s), nbytes - alloc.nbytes))
            self._count(alloc, nbytes - alloc.nbytes)
            alloc.nbytes = nbytes

    def _free(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            if self._log is not None:
                self._log.append(("free", key))
            self._count(entry[0], -entry[0].nbytes)

    def _count(self, alloc: Allocation, delta: int) -> None:
        self.current[alloc.kind] += delta
        if alloc.kind == DEVICE:  # categories split the device bytes (docs/design.md#measurement)
            self.current_by_category[alloc.category] += delta
        if delta <= 0:
            return
        if alloc.kind == DEVICE:
            self._raise_phase_peak()
        cat = alloc.category
        self.peak_by_category[cat] = max(self.peak_by_category[cat], self.current_by_category[cat])
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        if self.current[HOST] > self.peak[HOST]:
            self.peak[HOST] = self.current[HOST]
        if self.current[DEVICE] > self.peak[DEVICE]:
            self.peak[DEVICE] = self.current[DEVICE]
            self._snapshot()

    def _raise_phase_peak(self) -> None:
        # runs on every device allocation: one lookup and compare; the copy only on a new peak
        key, cur = self._phase_key, self.current[DEVICE]
        if cur > self.peak_by_phase.get(key, -1):
            self.peak_by_phase[key] = cur
            self.breakdown_by_phase[key] = {k: v for k, v in self.current_by_category.items() if v}

    def _snapshot(self) -> None:
        self.breakdown_at_peak = {k: v for k, v in self.current_by_category.items() if v}
        if self.snapshot_peak:
            self.peak_allocations = [
                Allocation(a.nbytes, a.kind, a.category, a.desc) for a in self.live_allocations()
            ]


class _ResizeHook:
    """Sees ``UntypedStorage.resize_``, which changes a storage's size below the dispatcher.

    FSDP2 frees an unsharded parameter by resizing its storage to 0 bytes after use and grows
    it again before the next all-gather; without this the tracker would keep counting every
    unsharded parameter as live. While any tracker is active, ``resize_`` is wrapped to report
    the storage to the active trackers (a grown, untracked storage is a new allocation).
    """

    _trackers: list[MemoryTracker] = []
    _original = None

    @classmethod
    def install(cls, tracker: MemoryTracker) -> None:
        if not cls._trackers:
            cls._original = torch.UntypedStorage.resize_

            def resize_(storage, size):
                out = cls._original(storage, size)
                for tr in cls._trackers:
                    tr._on_resize(storage)
                return out

            torch.UntypedStorage.resize_ = resize_
        cls._trackers.append(tracker)

    @classmethod
    def remove(cls, tracker: MemoryTracker) -> None:
        if tracker in cls._trackers:
            cls._trackers.remove(tracker)
        if not cls._trackers and cls._original is not None:
            torch.UntypedStorage.resize_ = cls._original
            cls._original = None
