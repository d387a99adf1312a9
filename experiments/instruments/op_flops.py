"""Count the FLOPs of the ops a program runs, by torch's own per-op formulas.

Used by the emulator on fake tensors (only shapes are read), so a paper-scale step's FLOPs per
rank are counted without running it; recomputation is counted as it runs.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

_aten = torch.ops.aten
# In-place products: the same FLOPs as their out-of-place op, whose formula torch registers
# (``flop_registry`` has ``addmm``, not ``addmm_``: ``dx.addmm_(g, w)`` would count nothing).
_IN_PLACE = {_aten.addmm_: _aten.addmm, _aten.baddbmm_: _aten.baddbmm}


def _as_query_heads(q_shape, kv_shape) -> tuple[int, ...]:
    """A (B, Hkv, S, D) K/V shape as if expanded to the query's heads: the FLOPs of GQA, where
    every query head attends over its KV head's keys."""
    b, _, s, d = kv_shape
    return (b, q_shape[1], s, d)


def _sdpa_fwd_flops(query, key, value, *args, out_val=None, **kwargs) -> int:
    q = tuple(query.shape)
    return sdpa_flop_count(q, _as_query_heads(q, key.shape), _as_query_heads(q, value.shape))


def _sdpa_bwd_flops(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    q = tuple(query.shape)
    return sdpa_backward_flop_count(tuple(grad_out.shape), q, _as_query_heads(q, key.shape),
                                    _as_query_heads(q, value.shape))


# Counted here by torch's SDPA formulas (BHSD inputs, as these ops take them):
# - PyTorch's cuDNN attention ops take K/V with fewer heads than q (GQA); torch's own formulas
#   for them assert equal head counts before torch 2.13 (2.11: "sdpa_flop_count:
#   query/key/value shapes are incompatible");
# - the CPU flash kernel (``kernel="sdpa"`` on a CPU, what an ``--emulate-device cpu`` step
#   runs) has no formula in torch's registry (2.13): its attention counted nothing.
_OWN = {_aten._scaled_dot_product_cudnn_attention: _sdpa_fwd_flops,
        _aten._scaled_dot_product_cudnn_attention_backward: _sdpa_bwd_flops,
        _aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_fwd_flops,
        _aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_bwd_flops}


def flop_formula(func):
    """Torch's FLOPs formula of an op (``formula(*args, **kwargs, out_val=out)``), or None."""
    packet = func._overloadpacket
    return _OWN.get(packet) or flop_registry.get(_IN_PLACE.get(packet, packet))


class CountedFlops(TorchDispatchMode):
    """Total FLOPs of the ops run while active, by torch's own per-op formulas
    (``torch.utils.flop_counter.flop_registry``, which ``register_flop_formula`` extends).

    ``torch.utils.flop_counter.FlopCounterMode`` counts the same ops but also tracks modules
    with global hooks, which fail on a tiled MLP (``upipe.stack.tiled``, as DeepSpeed's
    ``TiledMLP``, calls the MLP under no_grad on inputs that require grad); only the total is
    needed here.
    """

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.observe(func, args, kwargs, out)
        return out

    def observe(self, func, args, kwargs, out) -> None:
        """Add one op's FLOPs (as a mode, or as a ``MemoryTracker`` observer)."""
        formula = flop_formula(func)
        if formula is not None:
            self.total += int(formula(*args, **kwargs, out_val=out))

    # a replayed call's share (``experiments.emulation.replay``): what it added, added again
    def mark(self) -> int:
        return self.total

    def since(self, mark: int) -> int:
        return self.total - mark

    def apply(self, delta: int) -> None:
        self.total += delta
