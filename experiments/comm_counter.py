"""Count collectives by intercepting the c10d ops at the dispatcher.

torch.distributed's functions (``all_to_all_single``, ``send``, ``all_gather``...) dispatch
``c10d.*`` ops, so a ``TorchDispatchMode`` sees every collective of every library (ours,
DeepSpeed's) without patching, on gloo, nccl and the fake process group alike.
"""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode


class CollectiveCounter(TorchDispatchMode):
    """Counts c10d ops by name (e.g. ``alltoall_base_``) while active.

    Usage::

        with CollectiveCounter() as cc:
            y = attn(x)
        cc.counts["alltoall_base_"]
    """

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.counts[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())
