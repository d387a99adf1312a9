"""Autocast (``torch.autocast``) at the edges of upipe's autograd Functions.

Autocast picks a dtype per op from lists of PyTorch's own ops. upipe's Functions compute with
what autocast does not see: private aten kernels (``upipe.kernels``), and hand-written
backwards that run after the autocast region has closed. Left alone, a Hugging Face model
trained the usual mixed-precision way (fp32 weights under ``torch.autocast(dtype=bf16)``)
crashed in UPipe's backward ("expected m1 and m2 to have the same dtype") and in the SDPA
kernels (q, k rotated in fp32, v in bf16), and the memory stack's recomputes ran in fp32 where
their forward had run in bf16.

Two rules, both PyTorch's own for custom Functions:

- ``cast_for_autocast``: a Function that computes its projections or attention itself runs
  on its floating inputs cast to the autocast dtype, with autocast off inside, exactly as on a
  model of that dtype (``torch.amp.custom_fwd(cast_inputs=...)``, which fixes the device type
  and dtype when it decorates; these are known only at the call). The casts are autograd ops:
  gradients reach fp32 weights in fp32.
- ``autocast_state`` / ``recompute_autocast``: a Function that recomputes its forward in
  backward recomputes under the autocast state its forward ran in (what
  ``torch.utils.checkpoint`` does).

Written here because both must work on CPU and under fake tensors, where autocast is simply
off: then nothing is cast and nothing is entered.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes in on ``device_type`` ("cuda", "cpu"), None when it is off."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def cast_for_autocast(fn: Callable, device_type: str, *args, **kwargs):
    """``fn(*args, **kwargs)``, under autocast as on inputs of autocast's dtype.

    Off autocast: the call itself. On: every floating tensor among ``args`` and ``kwargs``'
    values cast to the autocast dtype, and ``fn`` run with autocast off.
    """
    dtype = autocast_dtype(device_type)
    if dtype is None:
        return fn(*args, **kwargs)

    def cast(t):
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    with torch.autocast(device_type, enabled=False):
        return fn(*(cast(a) for a in args), **{k: cast(v) for k, v in kwargs.items()})


def autocast_state(device_type: str) -> dict:
    """The autocast state of ``device_type`` now, as ``torch.autocast``'s arguments (saved by a
    Function's forward for :func:`recompute_autocast`)."""
    return {"device_type": device_type, "enabled": torch.is_autocast_enabled(device_type),
            "dtype": torch.get_autocast_dtype(device_type)}


def recompute_autocast(state: dict) -> contextlib.AbstractContextManager:
    """The autocast state a forward saved (:func:`autocast_state`), for its recompute in
    backward; a no-op context when the forward ran without autocast."""
    return torch.autocast(**state) if state["enabled"] else contextlib.nullcontext()
