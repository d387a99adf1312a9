"""Collectives that write their outputs on the ``fake`` process group, for measured steps.

A GPU check runs one GPU as rank 0 of P on the ``fake`` process group: its collectives return at
once and write nothing, so every all-to-all's receive buffer (``torch.empty_like``) holds
whatever the allocator's block held before: old activations, gradients, zeros, fp32 bytes read as
bf16. The kernels that read those buffers then run on data no real run has, and a kernel's speed
depends on its data (a bf16 product on zeros ran 13% faster than on random data on an H200 of
this workplace); two methods with the same kernels can differ by what their buffers happened to
hold. ``loopback_collectives`` makes each collective write what rank 0 of P ranks whose data is
alike would receive:

- all-to-all: this rank's own input (each rank's chunks are alike);
- all-gather (into one tensor or a list): this rank's input, once per rank;
- reduce-scatter: this rank's chunk of its own input (a real one sums P such chunks);
- batched P2P: each receive buffer the same-shaped tensor the batch sends (a ring rotation);
- all-reduce and broadcast: nothing (the buffer already holds this rank's data).

The copies are memory-bound kernels on the calling stream, about what a collective's own
kernels write; the time model prices none of them (the measured cells have no communication).
It wraps the ``torch.distributed`` functions the methods, DeepSpeed and FSDP2 call, so it works
on CPU and CUDA tensors alike. Newer torch's fake backend writes the collectives' outputs itself
(torch 2.13 does, for all but P2P; torch 2.11, on the lent GPUs, does not): each function is
probed on tiny CPU tensors when the context opens and wrapped only where the backend leaves its
output unwritten, so nothing is copied twice. Written by hand: P2P is written by no version.
torch's functional collectives (its own CP ring, ``torch-cp``) are not wrapped: no GPU check
measures that method.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist


def _fake(group) -> bool:
    return dist.get_backend(group) == "fake"


def _all_to_all(out: torch.Tensor, inp: torch.Tensor) -> None:
    n = min(out.numel(), inp.numel())  # uneven splits: the common prefix
    out.view(-1)[:n].copy_(inp.reshape(-1)[:n])


def _gather(out: torch.Tensor, inp: torch.Tensor) -> None:
    out.view(-1, inp.numel()).copy_(inp.reshape(1, -1))


def _scatter(out: torch.Tensor, inp: torch.Tensor) -> None:
    out.copy_(inp.reshape(-1, out.numel())[0].view_as(out))


def _p2p(ops) -> None:
    sent = {}
    for op in ops:
        if op.op in (dist.isend, getattr(dist, "send", None)):
            sent.setdefault((tuple(op.tensor.shape), op.tensor.dtype), op.tensor)
    for op in ops:
        if op.op in (dist.irecv, getattr(dist, "recv", None)):
            src = sent.get((tuple(op.tensor.shape), op.tensor.dtype))
            if src is not None:
                op.tensor.copy_(src)


def _wrap(name: str, fill):
    """``torch.distributed.<name>`` calling the original, then ``fill(output, input)`` (its
    first two parameters, passed by position or by name) on a fake group."""
    original = getattr(dist, name)
    sig = inspect.signature(original)
    out_name, in_name = list(sig.parameters)[:2]

    def wrapped(*args, **kwargs):
        work = original(*args, **kwargs)
        bound = sig.bind(*args, **kwargs).arguments
        if _fake(bound.get("group")):
            fill(bound[out_name], bound[in_name])
        return work

    return original, wrapped


def _wrap_p2p():
    original = dist.batch_isend_irecv

    def wrapped(ops):
        works = original(ops)
        if ops and _fake(ops[0].group):
            _p2p(ops)
        return works

    return original, wrapped


FILLS = {
    "all_to_all_single": _all_to_all,
    "all_gather_into_tensor": _gather,
    "all_gather_single": _gather,  # torch >= 2.13's FSDP2
    "reduce_scatter_tensor": _scatter,
    "reduce_scatter_single": _scatter,
    "all_gather": lambda outs, inp: [o.copy_(inp) for o in outs],
}


def _nan(*shape) -> torch.Tensor:
    return torch.full(shape, float("nan"))


def _writes(name: str) -> bool:
    """Whether the stock ``torch.distributed.<name>`` writes its output on the current (fake)
    default group: called once on tiny CPU tensors whose outputs start as NaN."""
    p = dist.get_world_size()
    if name == "batch_isend_irecv":
        recv = _nan(2)
        ops = [dist.P2POp(dist.isend, torch.ones(2), (dist.get_rank() + 1) % p),
               dist.P2POp(dist.irecv, recv, (dist.get_rank() - 1) % p)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return not recv.isnan().any().item()
    if name == "all_gather":
        outs = [_nan(2) for _ in range(p)]
        dist.all_gather(outs, torch.ones(2))
        return not any(o.isnan().any().item() for o in outs)
    out, inp = {"all_to_all_single": (_nan(p, 2), torch.ones(p, 2)),
                "reduce_scatter_tensor": (_nan(2), torch.ones(2 * p)),
                "reduce_scatter_single": (_nan(2), torch.ones(2 * p))}.get(
        name, (_nan(2 * p), torch.ones(2)))  # the gathers: 1-D, as FSDP2 calls them
    with warnings.catch_warnings():  # torch 2.13 deprecates the *_tensor spellings
        warnings.simplefilter("ignore", FutureWarning)
        getattr(dist, name)(out, inp)
    return not out.isnan().any().item()


@contextlib.contextmanager
def loopback_collectives(always: bool = False) -> Iterator[list[str]]:
    """Within: the collectives of the module's docstring write their outputs on ``fake``
    process groups (other groups are untouched), each wrapped only where the stock backend
    leaves its output unwritten (``always``: every one, for tests); yields the names wrapped
    (a measured row records them); the originals are restored after. Outside a fake default
    group it changes nothing."""
    saved = {}
    fake = dist.is_initialized() and _fake(None)
    try:
        for name, fill in FILLS.items():
            if fake and hasattr(dist, name) and (always or not _writes(name)):
                saved[name], wrapped = _wrap(name, fill)
                setattr(dist, name, wrapped)
        if fake and (always or not _writes("batch_isend_irecv")):
            saved["batch_isend_irecv"], wrapped = _wrap_p2p()
            dist.batch_isend_irecv = wrapped
        yield sorted(saved)
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)
