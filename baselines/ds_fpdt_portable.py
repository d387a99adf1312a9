"""DeepSpeed's FPDT off CUDA and under fake tensors: what ``fpdt_layer`` needs, scoped to a call.

``deepspeed/sequence/fpdt_layer.py`` (DeepSpeed 0.19.8) reaches three things through its module
globals, and this module replaces exactly those, only while an FPDT autograd Function runs
(forward, or its backward) and only in that module's namespace; torch itself is not patched:

* ``_flash_attn_forward`` / ``_flash_attn_backward`` (flash-attn's private API, bound at import,
  None without flash-attn) and ``flash_attn_version`` (which of three call conventions FPDT uses).
  The stand-ins speak flash-attn >= 2.7's convention: forward ``(q, k, v, dropout_p,
  softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
  return_softmax) -> (out, softmax_lse, S_dmask, rng_state)``, q/k/v/out BSHD, softmax_lse
  (B, H, S_q) fp32 -- the layout FPDT's LSE merge (``update_out_and_lse``) transposes -- and
  backward writing dq, dk, dv into FPDT's buffers. They run upipe's kernel dispatch
  (``upipe.kernels``): on real CPU tensors the module's kernel (``sdpa``/``math``), so the result
  is real attention; where the dispatch picks kernels for CUDA (the emulator's ``cuda_kernels``)
  the kernel ``flash-attn``, so the emulator's flash-attn 2 memory model is what runs, or
  ``fa3`` where the module names it (the paper's patched FPDT, ``FA3_KERNEL``), on real CUDA
  too.
  One difference from flash-attn: ``attention_backward`` returns new dq/dk/dv that are then copied
  into FPDT's buffers, where flash-attn writes them directly; one chunk's q+k+v bytes, alive only
  during the call (the emulated model's wrapper allocates the same three, ``kernel_models``).
* ``get_accelerator()``: DeepSpeed's CPU accelerator returns ``None`` streams, on which FPDT calls
  ``wait_stream``/``synchronize``. The stand-in's streams, events, ``synchronize`` and
  ``pin_memory`` do nothing (no copy to overlap, no pinned memory without CUDA);
  ``current_device_name`` is the compute device; ``on_accelerator`` is False for host buffers.
  Beside them, FPDT's own LSE merge ``_update_out_and_lse`` is marked metadata-pure, unchanged
  otherwise, so that the emulator replays it (``upipe.pure``).
* ``torch.empty`` / ``torch.zeros``, for the host bytes (any device): FPDT makes every host
  buffer with the literal ``device='cpu'`` (``SequenceChunk.__init__``, the dQ accumulators of
  ``_FPDTGPUOffloadingAttentionImpl_.backward``) and every device buffer with a device object
  (``chunk.device``, ``grad_output.device``, and ``current_device_name()``, which the stand-in
  accelerator returns as a ``torch.device``). The first kind is made inside ``host_context()``
  (the harness passes its tracker's ``host``), so a CPU run, where both are CPU memory, counts
  host bytes apart, as ``upipe.host.HostStore`` does for our own ``fpdt``: host or device is
  decided from where FPDT makes the tensor.

Hand-written because no library runs FPDT without CUDA and flash-attn; ``mock.patch.multiple``
(standard library) does the patching and restores every name on exit, exceptions included.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import torch
from packaging import version

from upipe.kernels import attention_backward, attention_forward, kernel_device_type
from upipe.pure import metadata_pure

# the flash-attn call convention the stand-ins speak (FPDT switches on flash_attn_version)
STAND_IN_API = version.parse("2.7.0")
# The paper's FPDT runs call FlashAttention-3 instead of flash-attn 2: the authors' patch of
# fpdt_layer (togethercomputer/Untied-Ulysses, FPDT/Megatron-DeepSpeed/megatron/patch/
# fpdt_layer.py: _flash_attn_forward_fa3 / _flash_attn_backward_fa3 where use_fa3, which
# run_single_8B.sh's --use-flash-attn-v3 sets). With this kernel the stand-ins replace FPDT's
# two flash-attn calls on CUDA too, and run upipe's fa3 (the same kernels, forward and
# backward, on the same chunk pairs); nothing else of FPDT changes.
FA3_KERNEL = "fa3"
_HOST_FLAG = "_upipe_fpdt_host"  # set on the host buffers FPDT makes (see _HostTorch)


@dataclass(frozen=True)
class FPDTCall:
    """What one FPDT call runs with: the module's kernel (used where kernels are picked for a
    CPU device, and on CUDA when it is ``fa3``), the compute device, and the context host
    allocations are made in."""

    kernel: str
    device: torch.device
    host_context: Callable[[], contextlib.AbstractContextManager]
    stand_ins: bool  # False on CUDA: the real accelerator and flash-attn (fa3: FA3_KERNEL)


_CALL: contextvars.ContextVar[FPDTCall | None] = contextvars.ContextVar("fpdt_call", default=None)


def _dispatch_kernel(q: torch.Tensor, kernel: str) -> str:
    """Where kernels are picked for CUDA: FlashAttention-3 when the module names it (the
    paper's patched FPDT, ``FA3_KERNEL``), else flash-attn (FPDT's own); elsewhere the
    module's kernel."""
    if kernel_device_type(q) != "cuda":
        return kernel
    return "fa3" if kernel == FA3_KERNEL else "flash-attn"


def _check_plain(dropout_p, window_left, window_right, softcap, alibi_slopes) -> None:
    """FPDT passes none of these (no dropout, window or bias); the stand-in supports none."""
    if dropout_p or window_left != -1 or window_right != -1 or softcap or alibi_slopes is not None:
        raise NotImplementedError("the FPDT flash-attn stand-in has no dropout, window, softcap "
                                  "or ALiBi (FPDT uses none)")


def _stand_in_forward(kernel: str) -> Callable:
    def forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left=-1,
                window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False):
        """q (B, S_q, H, D), k/v (B, S_k, Hkv, D) -> (out like q, lse (B, H, S_q) fp32, None,
        None)."""
        _check_plain(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
        out, lse = attention_forward(q, k, v, causal=causal, scale=softmax_scale,
                                     kernel=_dispatch_kernel(q, kernel))
        return out, lse, None, None
    return forward


def _stand_in_backward(kernel: str) -> Callable:
    def backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                 window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                 deterministic=False, rng_state=None):
        """Gradients of ``forward`` written into dq, dk, dv (shapes of q, k, v)."""
        _check_plain(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
        grads = attention_backward(dout, q, k, v, out, softmax_lse, causal=causal,
                                   scale=softmax_scale, kernel=_dispatch_kernel(q, kernel))
        for buf, g in zip((dq, dk, dv), grads, strict=True):
            buf.copy_(g)
    return backward


_SIDE_STREAM: contextvars.ContextVar[bool] = contextvars.ContextVar("fpdt_side_stream",
                                                                     default=False)


def on_side_stream() -> bool:
    """Whether FPDT runs inside ``get_accelerator().stream(s)`` of a side stream ``s`` (one it
    made with ``Stream()``, not the default stream) of the stand-in accelerator. fpdt_layer
    issues every host copy of its offloading path so (``SequenceChunk``'s offload and
    ``load_to_gpu``, the dQ write-back), where on CUDA they run beside the attention kernels
    of the compute stream (it waits for them once per chunk pair); the emulator's time model
    prices such copies as side copies (``experiments.timing.op_costs``)."""
    return _SIDE_STREAM.get()


class _NoStream:
    """A stream/event whose ordering calls do nothing: off CUDA every op is complete when it
    returns, so there is nothing to order. ``side``: a stream FPDT made for its copies."""

    def __init__(self, side: bool = False):
        self.side = side

    def wait_stream(self, other) -> None: ...
    def wait_event(self, event) -> None: ...
    def synchronize(self) -> None: ...
    def record_event(self, event=None) -> _NoStream: return self


class _StandInAccelerator:
    """The part of DeepSpeed's accelerator API fpdt_layer calls, for a device without streams."""

    def __init__(self, device: torch.device):
        self.device = device

    def current_device_name(self) -> torch.device:  # a device object: not a host buffer
        return self.device

    def Stream(self) -> _NoStream:  # noqa: N802  (DeepSpeed's name)
        return _NoStream(side=True)

    def default_stream(self, device_index=None) -> _NoStream:
        return _NoStream()

    @contextlib.contextmanager
    def stream(self, stream: _NoStream):
        """Nothing to switch; records whether the work inside is on a side stream
        (``on_side_stream``)."""
        token = _SIDE_STREAM.set(stream.side)
        try:
            yield
        finally:
            _SIDE_STREAM.reset(token)

    def synchronize(self, device_index=None) -> None: ...

    def pin_memory(self, tensor: torch.Tensor, make_copy: bool = True) -> torch.Tensor:
        return tensor  # no pinned memory without CUDA

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return not getattr(tensor, _HOST_FLAG, False)


class _HostTorch:
    """``torch`` as fpdt_layer sees it: the same module, but ``empty``/``zeros`` with the literal
    ``device='cpu'`` (FPDT's host buffers) are made in ``host_context()`` and flagged as host."""

    def __init__(self, host_context: Callable[[], contextlib.AbstractContextManager]):
        self._host_context = host_context

    def __getattr__(self, name: str):
        return getattr(torch, name)

    def _make(self, factory: Callable, args, kwargs) -> torch.Tensor:
        device = kwargs.get("device")
        if not (isinstance(device, str) and device == "cpu"):
            return factory(*args, **kwargs)
        with self._host_context():
            t = factory(*args, **kwargs)
        setattr(t, _HOST_FLAG, True)
        return t

    def empty(self, *args, **kwargs) -> torch.Tensor:
        return self._make(torch.empty, args, kwargs)

    def zeros(self, *args, **kwargs) -> torch.Tensor:
        return self._make(torch.zeros, args, kwargs)


@functools.cache
def _pure_merge() -> Callable:
    """FPDT's LSE merge of two partial results (``_update_out_and_lse``: new out and lse from
    its arguments' shapes alone), marked metadata-pure (``upipe.pure``) so the emulator replays
    it: it runs once per chunk pair."""
    from deepspeed.sequence import fpdt_layer

    merge = fpdt_layer._update_out_and_lse
    return metadata_pure(getattr(merge, "__wrapped__", merge))


def _names(call: FPDTCall) -> dict:
    """fpdt_layer globals to replace for ``call``: the flash-attn functions off CUDA and, on
    CUDA too, where the module runs FlashAttention-3; the accelerator and the merge off CUDA."""
    names = {"torch": _HostTorch(call.host_context)}
    if call.stand_ins or call.kernel == FA3_KERNEL:
        names |= {"_flash_attn_forward": _stand_in_forward(call.kernel),
                  "_flash_attn_backward": _stand_in_backward(call.kernel),
                  "flash_attn_version": STAND_IN_API}
    if call.stand_ins:
        names |= {"get_accelerator": lambda: _StandInAccelerator(call.device),
                  "_update_out_and_lse": _pure_merge()}
    return names


def _scope(call: FPDTCall) -> contextlib.AbstractContextManager:
    from deepspeed.sequence import fpdt_layer

    return mock.patch.multiple(fpdt_layer, create=True, **_names(call))


@functools.cache  # one subclass per FPDT Function, made on first use
def _wrapped(impl: type) -> type:
    """``impl`` (one of FPDT's autograd Functions) with forward and backward run in the scope of
    the call that applied it (the call is kept on ``ctx`` for backward)."""

    class Scoped(impl):
        @staticmethod
        def forward(ctx, *args):
            ctx.fpdt_call = call = _CALL.get()
            with _scope(call):
                return impl.forward(ctx, *args)

        @staticmethod
        def backward(ctx, *grads):
            with _scope(ctx.fpdt_call):
                return impl.backward(ctx, *grads)

    Scoped.__name__ = Scoped.__qualname__ = f"Scoped{impl.__name__}"
    return Scoped


@contextlib.contextmanager
def fpdt_call(call: FPDTCall):
    """Run ``FPDT_Attention`` inside: its autograd Functions run ``call``'s stand-ins and host
    accounting in forward and again in their backward, whenever that runs."""
    from deepspeed.sequence import fpdt_layer

    impls = {name: _wrapped(getattr(fpdt_layer, name))
             for name in ("_FPDTGPUAttentionImpl_", "_FPDTGPUOffloadingAttentionImpl_")}
    token = _CALL.set(call)
    try:
        with mock.patch.multiple(fpdt_layer, **impls):
            yield
    finally:
        _CALL.reset(token)


@contextlib.contextmanager
def flash_attn_stand_ins(kernel: str, device: torch.device):
    """Only the flash-attn names, for ``FPDT_Attention``'s constructor (it refuses to build when
    they are None, i.e. without flash-attn)."""
    call = FPDTCall(kernel, device, contextlib.nullcontext, stand_ins=True)
    names = {k: v for k, v in _names(call).items() if k.startswith("_flash")}
    from deepspeed.sequence import fpdt_layer

    with mock.patch.multiple(fpdt_layer, **names):
        yield
