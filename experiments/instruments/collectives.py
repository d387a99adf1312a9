"""Count collectives, and the bytes they move, by intercepting the c10d ops at the dispatcher.

torch.distributed's functions (``all_to_all_single``, ``send``, ``all_gather``...) dispatch
``c10d.*`` ops, so a ``TorchDispatchMode`` sees every collective of every library (ours,
DeepSpeed's) without patching, on gloo, nccl and the fake process group alike. The functional
collectives (``torch.distributed._functional_collectives``, which torch's own CP ring uses)
dispatch ``_c10d_functional.*`` ops instead, which name their group by a string; they are
counted the same way. Only shapes and dtypes are read, never data, so the bytes are counted
under FakeTensorMode too.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch._C._distributed_c10d import ProcessGroup
from torch.utils._python_dispatch import TorchDispatchMode

# op name -> (schema argument holding the payload, rule for the bytes this rank sends). The
# payload is the buffer the collective moves: the gathered output of an all-gather, the input of
# a reduce-scatter and of an all-to-all, the tensor of an all-reduce, send, recv and broadcast.
_BYTES: dict[str, tuple[str, str]] = {
    "_allgather_base_": ("output_tensor", "ring"),
    "allgather_into_tensor_coalesced_": ("outputs", "ring"),
    "allgather_": ("output_tensors", "ring"),
    "_reduce_scatter_base_": ("input_tensor", "ring"),
    "reduce_scatter_tensor_coalesced_": ("inputs", "ring"),
    "reduce_scatter_": ("input_tensors", "ring"),
    "allreduce_": ("tensors", "all_reduce"),
    "allreduce_coalesced_": ("tensors", "all_reduce"),
    "alltoall_base_": ("input", "all_to_all"),
    "alltoall_": ("input_tensors", "all_to_all"),
    "send": ("tensors", "all"),
    "recv_": ("tensors", "none"),
    "recv_any_source_": ("tensors", "none"),
    "broadcast_": ("tensors", "root"),
}
# _c10d_functional op name -> (payload: "input" or "gathered" (the input x the group size, the
# output it returns), rule). Schemas: all_gather_into_tensor(input, group_size, group_name),
# reduce_scatter_tensor(input, reduce_op, group_size, group_name), all_reduce(input, reduce_op,
# group_name), all_to_all_single(input, output_split_sizes, input_split_sizes, group_name).
_FUNCTIONAL_BYTES: dict[str, tuple[str, str]] = {
    "all_gather_into_tensor": ("gathered", "ring"),
    "reduce_scatter_tensor": ("input", "ring"),
    "all_reduce": ("input", "all_reduce"),
    "all_to_all_single": ("input", "all_to_all"),
}
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")


def _sent(rule: str, payload: int, p: int, is_root: bool, kept: int | None = None) -> int:
    """Bytes one rank sends for a ``payload``-byte collective over ``p`` ranks.

    The ring-algorithm factors of nccl-tests' PERFORMANCE.md ("bus bandwidth",
    github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md): each rank sends (P-1)/P of the
    gathered output (all-gather), of its input (reduce-scatter), and 2(P-1)/P of the tensor for
    an all-reduce (a reduce-scatter, then an all-gather). An all-to-all sends its input but the
    chunk it keeps (``kept`` bytes, its own of ``_shares``): 1/P of it with even splits.
    Broadcast: the root sends the tensor once, the others are counted as sending nothing (a
    ring or tree relays it, but only the root's bytes are new on the wire). Integer
    arithmetic, floored per call.
    """
    if rule == "all_to_all":
        return payload - kept if kept is not None else payload * (p - 1) // p
    if rule == "ring":
        return payload * (p - 1) // p
    if rule == "all_reduce":
        return payload * 2 * (p - 1) // p
    if rule == "root":
        return payload if is_root else 0
    return payload if rule == "all" else 0


def _shares(bound: dict, payload_arg: str) -> list[int] | None:
    """Bytes of an all-to-all's input bound for each rank of its group: the
    ``input_split_sizes`` rows of an uneven split, each tensor of the list form; None for even
    splits (no sizes given: 1/P each)."""
    x = bound[payload_arg]
    if isinstance(x, (list, tuple)):
        return [_nbytes(y) for y in x]
    splits = bound.get("input_split_sizes")
    if not splits:
        return None
    return [int(n) * (_nbytes(x) // x.shape[0]) for n in splits]


def _nbytes(x) -> int:
    """Bytes of a tensor or a (nested) list of tensors, from shape and dtype only."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


def _process_group(value) -> ProcessGroup:
    # The c10d ops take the group boxed as a ScriptObject, which exposes no methods.
    return value if isinstance(value, ProcessGroup) else ProcessGroup.unbox(value)


@dataclass(frozen=True)
class CollectiveCall:
    """One c10d call with a byte rule: what it moves and among whom (shapes only)."""

    op: str  # c10d op name, e.g. "alltoall_base_"
    payload: int  # bytes of the buffer the call moves (see ``_BYTES``)
    sent: int  # bytes this rank sends (``_sent``)
    group: ProcessGroup
    peer: int | None  # send / recv: the peer's rank in ``group``; else None
    # an all-to-all with split sizes: its input's bytes for each rank of ``group`` (``_shares``);
    # None for even splits (the payload's P-th each) and other ops
    shares: tuple[int, ...] | None = None


def _describe_functional(name: str, bound: dict) -> CollectiveCall | None:
    """The ``CollectiveCall`` of a ``_c10d_functional`` op (its group named by a string)."""
    if name not in _FUNCTIONAL_BYTES:
        return None  # wait_tensor, broadcast, ...: no byte rule
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(bound["group_name"])
    payload_kind, rule = _FUNCTIONAL_BYTES[name]
    payload = _nbytes(bound["input"]) * (group.size() if payload_kind == "gathered" else 1)
    shares = _shares(bound, "input") if rule == "all_to_all" else None
    return _call(name, rule, payload, group, False, None, shares)


def _call(name: str, rule: str, payload: int, group: ProcessGroup, is_root: bool,
          peer: int | None, shares: list[int] | None) -> CollectiveCall:
    """A ``CollectiveCall`` from its parts (``shares``: an uneven all-to-all's, ``_shares``)."""
    kept = None if shares is None else shares[group.rank()]
    return CollectiveCall(name, payload, _sent(rule, payload, group.size(), is_root, kept), group,
                          peer, None if shares is None else tuple(shares))


def describe_collective(func, args, kwargs) -> CollectiveCall | None:
    """The ``CollectiveCall`` of a c10d or functional collective op, or None for ops without a
    byte rule (barrier, wait_tensor...)."""
    name = func.__name__.split(".")[0]
    # trailing defaulted arguments may be left out of args: strict=False
    schema = func._schema.arguments
    if func.namespace == "_c10d_functional":
        return _describe_functional(
            name, {a.name: v for a, v in zip(schema, args, strict=False)} | kwargs)
    if name not in _BYTES:
        return None
    bound = {a.name: v for a, v in zip(schema, args, strict=False)} | kwargs
    group = next(_process_group(bound[a.name]) for a in schema
                 if str(a.type).endswith("c10d.ProcessGroup"))
    is_root = bound.get("root_rank") == group.rank()
    payload_arg, rule = _BYTES[name]
    payload = _nbytes(bound[payload_arg])
    peer = bound.get("dst", bound.get("src"))
    shares = _shares(bound, payload_arg) if rule == "all_to_all" else None
    return _call(name, rule, payload, group, is_root, None if peer is None else int(peer), shares)


class CollectiveCounter(TorchDispatchMode):
    """Counts c10d ops by name (e.g. ``alltoall_base_``) and their bytes while active.

    Attributes:
        counts: number of calls per op name.
        bytes_sent: bytes this rank sends per op name, with the ring factors of ``_sent`` (e.g. an
            all-gather of an N-byte output over P ranks: N * (P-1) // P; an all-to-all: its
            input but the chunk it keeps, of even or uneven splits). Integers, exact up to the
            floor of each call's fraction.
        payload_bytes: size of the buffer each call moves, per op name (all-gather: the output;
            reduce-scatter and all-to-all: the input; all-reduce, send, recv, broadcast: the
            tensor).

    Ops without a byte rule (barrier, gather, ...) are counted in ``counts`` only.

    Usage::

        with CollectiveCounter() as cc:
            y = attn(x)
        cc.counts["alltoall_base_"], cc.bytes_sent["alltoall_base_"]
    """

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.bytes_sent: Counter[str] = Counter()
        self.payload_bytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.observe(func, args, kwargs, None)
        return func(*args, **kwargs)

    def observe(self, func, args, kwargs, out) -> None:
        """Count one op if it is a collective (as a mode, or as a ``MemoryTracker`` observer;
        only the arguments are read)."""
        if func.namespace in COLLECTIVE_NAMESPACES:
            name = func.__name__.split(".")[0]
            self.counts[name] += 1
            call = describe_collective(func, args, kwargs)
            if call is not None:
                self.payload_bytes[name] += call.payload
                self.bytes_sent[name] += call.sent

    # a replayed call's share (``experiments.emulation.replay``): what it added, added again
    def mark(self) -> tuple[Counter, Counter, Counter]:
        return Counter(self.counts), Counter(self.bytes_sent), Counter(self.payload_bytes)

    def since(self, mark) -> tuple[Counter, Counter, Counter]:
        now = (self.counts, self.bytes_sent, self.payload_bytes)
        return tuple(Counter({k: v - m.get(k, 0) for k, v in n.items() if v != m.get(k, 0)})
                     for n, m in zip(now, mark, strict=True))

    def apply(self, delta) -> None:
        for n, d in zip((self.counts, self.bytes_sent, self.payload_bytes), delta, strict=True):
            n.update(d)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def total_bytes_sent(self) -> int:
        """Bytes this rank sent over all collectives."""
        return sum(self.bytes_sent.values())
