"""Label what a module allocates, in forward and backward, for the memory tracker.

``label_modules`` attributes a module's allocations to a tracker category (or phase) across
autograd and activation checkpointing; ``label_fsdp_model_states`` counts FSDP2's gathered
parameters and gradient reductions as model states. Used by the measured harness and the
emulator alike.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from experiments.instruments.memory import MemoryTracker


class _OnBackward(torch.autograd.Function):
    """Identity whose backward calls ``fn`` first: marks where a module's backward starts/ends."""

    @staticmethod
    def forward(ctx, x, fn):
        ctx.fn = fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.fn()
        return grad, None


def label_modules(
    modules: list[nn.Module], tracker: MemoryTracker, name: str, *,
    push: Callable[[str], None] | None = None, pop: Callable[[], None] | None = None,
    backward_name: str | None = None,
) -> list:
    """Label everything ``modules`` allocate, in forward and backward; returns the hook handles.

    By default the label is the tracker's category ``name``. ``push``/``pop`` replace the
    tracker's ``push_category``/``pop_category`` (e.g. ``push_phase``/``pop_phase`` to record
    each module's forward and backward peaks); ``backward_name`` (default ``name``) is the label
    pushed while a module's backward runs, ``name`` the one while its forward runs.

    Forward: pre/post hooks push and pop the label. Backward: an identity node on the output
    pushes it (the module's backward starts there) and one on the input pops it (it ends
    there). Under activation checkpointing the nodes of the original forward are the ones
    backward runs, so recomputation does not unbalance the labels: a recomputed forward pushes
    and pops ``name`` again, nested in whatever label is current then (e.g. inside its own
    backward's label when the checkpoint wraps the labelled module itself).
    """
    push = tracker.push_category if push is None else push
    pop = tracker.pop_category if pop is None else pop
    bwd_name = name if backward_name is None else backward_name

    def pre(_, args):
        push(name)
        return (_OnBackward.apply(args[0], pop), *args[1:])

    def post(_, args, out):
        pop()
        if out is None:  # the forward raised; nothing to mark
            return None
        return _OnBackward.apply(out, lambda: push(bwd_name))

    handles = []
    for m in modules:
        # always_call: a non-reentrant checkpoint stops its recomputation with an exception as
        # soon as the last saved tensor is recomputed (early stop), possibly inside the module;
        # without the pop then, the pushed label would stay on for the rest of the backward.
        handles += [m.register_forward_pre_hook(pre),
                    m.register_forward_hook(post, always_call=True)]
    return handles


class _Restore:
    """A handle whose ``remove()`` drops an instance attribute that shadows a method."""

    def __init__(self, obj, name: str):
        self.obj, self.name = obj, name

    def remove(self) -> None:
        self.obj.__dict__.pop(self.name, None)


#: the FSDP2 parameter-group methods whose allocations are model states: the gathered
#: parameters (``unshard`` starts the all-gather, ``wait_for_unshard`` copies it out into the
#: unsharded parameters, allocating their storage on the first gather and growing it again after
#: each reshard) and the sharded gradients (``post_backward``'s reduce-scatter output)
FSDP_MODEL_STATE_METHODS = ("unshard", "wait_for_unshard", "post_backward")


def label_fsdp_model_states(model: nn.Module, tracker: MemoryTracker) -> list:
    """Count what FSDP2 allocates for the parameters and their gradients as model states
    (category "model"): ``FSDP_MODEL_STATE_METHODS`` of every parameter group run under it.

    FSDP2 makes the unsharded parameters and the sharded gradients with plain ops (``empty``,
    a storage ``resize_``, the copy-out) in its hooks, where no label of ours is active: without
    this the gathered parameters were counted as "other" (only the all-gather's flat buffer, an
    ``fsdp::`` op, was "model"). Running the methods under the category attributes each
    allocation when it is made, so the breakdown is right at every moment (and in every phase
    of the emulator). Returns handles whose ``remove()`` restores FSDP2's methods. Reaches into
    FSDP2's per-module state (private API, stable from torch 2.5 to 2.13).
    """
    handles = []
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        group = m._get_fsdp_state()._fsdp_param_group
        if group is None:
            continue
        for name in FSDP_MODEL_STATE_METHODS:
            original = getattr(group, name)

            def labelled(*args, _original=original, **kwargs):
                with tracker.category("model"):
                    return _original(*args, **kwargs)

            setattr(group, name, labelled)
            handles.append(_Restore(group, name))
    return handles
