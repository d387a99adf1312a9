"""``torch-cp``: PyTorch's native context parallelism -- the paper's "native PyTorch" baseline.

An adapter over ``torch.distributed.tensor.experimental`` (torch 2.13: ``_context_parallel/
_attention.py``): the local Q/K/V shards become DTensors sharded on the sequence dim of SDPA's
(B, H, S, D) layout, and with torch's CP dispatcher on, the fused SDPA ops on those DTensors run
torch's ring (``_templated_ring_attention``: K/V rotated by one all-gather, or an all-to-all per
step; dK/dV always by all-to-all in backward; an fp32 LSE merge).

Why an autograd.Function around the SDPA call: torch reads its CP switches when an op *runs*,
forward and backward alike -- the DTensor custom-op handlers that route SDPA to the ring
(``_enable_context_parallel_dispatcher``) and the process-global ``_cp_options``
(``enable_load_balance``, ``rotate_method``). Left on globally (TorchTitan's way), they would
also capture every other DTensor SDPA in the process (e.g. tensor-parallel attention) and make
one module's causal flag everyone's. So :class:`_TorchRingSDPA` switches them on around the
public ``F.scaled_dot_product_attention`` in forward, keeps that inner graph, and switches them
on again around its backward (the reentrant pattern of ``torch.utils.checkpoint``); the module
is then used like any nn.Module. The ring is torch's own; only the switching is ours.

Layout: always zigzag, which is torch's ``_HeadTailLoadBalancer`` order (rank r holds chunks r and
2W-1-r of 2W, in that order; ``_load_balancer.py``). Causal: load balancing on, so the ring's
per-step masking matches that layout. Non-causal: load balancing must be off (the ring raises
"Load balancing requires `is_causal=True`"); every step is then a full block and the key order
does not matter, so the same zigzag shard is exact.

GQA: torch's ring rotates K/V as given and relies on the SDPA kernel for the head mapping; the
efficient kernel (fp32) takes no ``enable_gqa``, so K/V are expanded to the query heads first
(``repeat_interleave``, as TorchTitan's ``repeat_kv`` did), which costs H/Hkv x the K/V traffic
and memory of a GQA-aware ring -- part of what this baseline measures.

CUDA only: on CPU SDPA runs ``aten._scaled_dot_product_flash_attention_for_cpu``, which has no CP
rule. Verified on 2 gloo ranks (torch 2.13, :class:`_TorchRingSDPA` called directly): causal fails
in forward with "NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu
.default does not have a sharding strategy registered", non-causal in backward with the same for
``..._for_cpu_backward``; under ``sdpa_kernel(MATH)``: "aten.add.Tensor got mixed torch.Tensor
and DTensor". So forward on a CPU tensor raises before any collective. Emulation does not work
either on a CPU-only torch build: fake CUDA tensors abort in autograd ("PyTorch is not linked with
support for cuda devices"), and without autograd SDPA falls back to redistributing (no ring).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from baselines.zigzag_ring import ZigzagRingAttention
from upipe.registry import register_method

ROTATE_METHODS = ("allgather", "alltoall")
_ROTATE_ENUM = {"allgather": "ALL_GATHER", "alltoall": "ALL_TO_ALL"}  # torch's _RotateMethod
_CPU_REASON = (
    "method 'torch-cp' needs a CUDA device: PyTorch's CP ring intercepts only the fused CUDA "
    "SDPA kernels (flash / efficient / cuDNN); on CPU SDPA dispatches to "
    "aten._scaled_dot_product_flash_attention_for_cpu, which has no context-parallel sharding "
    "rule"
)


def _cp_api():
    """torch's experimental CP module (imported lazily: it pulls in DTensor and flex attention)."""
    from torch.distributed.tensor.experimental import _context_parallel as cp

    return cp


@contextlib.contextmanager
def torch_cp_active(causal: bool, rotate_method: str):
    """torch's CP dispatcher and options on for the body, then put back as they were.

    A dispatcher someone else switched on (TorchTitan style) is left on; only the two options
    this call needs are set and restored.
    """
    cp = _cp_api()
    from torch.distributed.tensor import DTensor

    handlers = DTensor._op_dispatcher._custom_op_handlers
    op = torch.ops.aten._scaled_dot_product_flash_attention.default
    already_on = handlers.get(op) is cp._attention._sdpa_handler
    opts = cp._cp_options
    saved = (opts.enable_load_balance, opts.rotate_method)
    opts.enable_load_balance = causal  # head-tail balancing; the ring refuses it when non-causal
    # what set_rotate_method does, without its log line on every call
    opts.rotate_method = getattr(cp._RotateMethod, _ROTATE_ENUM[rotate_method])
    if not already_on:
        cp._enable_context_parallel_dispatcher()
    try:
        yield
    finally:
        if not already_on:
            cp._disable_context_parallel_dispatcher()
        opts.enable_load_balance, opts.rotate_method = saved


def _sdpa_on_shards(q, k, v, mesh, causal: bool) -> torch.Tensor:
    """Public SDPA on the shards as DTensors (Shard(2) over ``mesh``): torch's ring when the CP
    dispatcher is on. (B, H, L, D) x 3 -> local out (B, H, L, D)."""
    from torch.distributed.tensor import DTensor, Shard

    dq, dk, dv = (DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in (q, k, v))
    return F.scaled_dot_product_attention(dq, dk, dv, is_causal=causal).to_local()


class _TorchRingSDPA(torch.autograd.Function):
    """torch's ring SDPA on local shards q, k, v (B, H, L, D) -> out (B, H, L, D).

    Forward runs :func:`_sdpa_on_shards` inside :func:`torch_cp_active` and keeps that small
    graph; backward replays it inside the same context, so the fused backward op reaches torch's
    ring backward too. What the inner graph saves is what native CP saves (q, k, v, out, LSE).
    """

    @staticmethod
    def forward(ctx, q, k, v, mesh, causal, rotate_method):
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        with torch.enable_grad(), torch_cp_active(causal, rotate_method):
            out = _sdpa_on_shards(*leaves, mesh, causal)
        ctx.graph = (leaves, out)
        ctx.causal, ctx.rotate_method = causal, rotate_method
        return out.detach()

    @staticmethod
    def backward(ctx, dout):
        leaves, out = ctx.graph
        del ctx.graph  # the inner graph's saved tensors are freed after this one use
        with torch_cp_active(ctx.causal, ctx.rotate_method):
            grads = torch.autograd.grad(out, leaves, dout)
        return (*grads, None, None, None)


def torch_ring_sdpa(q, k, v, mesh, *, causal: bool, rotate_method: str = "allgather"):
    """torch's native CP ring attention on this rank's shards, differentiable.

    q, k, v: (B, H, L, D) with equal head counts (expand GQA K/V first), the local tokens of a
    head-tail (zigzag) layout when causal; ``mesh``: the 1-D CP DeviceMesh. Returns (B, H, L, D).
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _TorchRingSDPA.apply(q, k, v, mesh, causal, rotate_method)
    with torch_cp_active(causal, rotate_method):  # no graph wanted (eval, inference)
        return _sdpa_on_shards(q, k, v, mesh, causal)


@register_method("torch-cp")
class TorchCPAttention(ZigzagRingAttention):
    """PyTorch-native ring CP attention; forward(x_local (B, L, dim)) -> (B, L, dim), CUDA only.

    Option ``rotate_method``: how torch's ring moves K/V, ``"allgather"`` (torch's default: one
    all-gather of K/V, then a slice per step) or ``"alltoall"`` (a permute per step). Head rules
    are the ring's (any GQA ratio on any number of ranks); the layout is zigzag (see the module
    docstring). ``group`` becomes a 1-D DeviceMesh, built on first use per device type.
    """

    def __init__(self, *args, rotate_method: str = "allgather", **kwargs):
        if rotate_method not in ROTATE_METHODS:
            raise ValueError(
                f"rotate_method must be one of {ROTATE_METHODS}, got {rotate_method!r}"
            )
        self.rotate_method = rotate_method
        super().__init__(*args, **kwargs)
        self._meshes: dict = {}

    def options(self) -> dict:
        return {"rotate_method": self.rotate_method}

    @classmethod
    def unavailable_reason(cls, device_type: str) -> str | None:
        if device_type != "cuda":
            return _CPU_REASON if device_type == "cpu" else (
                f"method 'torch-cp' needs a CUDA device, got device type {device_type!r}"
            )
        if not torch.cuda.is_available():
            return "method 'torch-cp' needs a CUDA device; none is available"
        try:
            _cp_api()
        except ImportError as e:
            return f"method 'torch-cp' needs torch's experimental context_parallel module ({e})"
        return None

    def _mesh(self, device_type: str):
        """The CP group as a 1-D DeviceMesh (no collective: the group exists already)."""
        if device_type not in self._meshes:
            from torch._subclasses.fake_tensor import unset_fake_temporarily
            from torch.distributed.device_mesh import DeviceMesh

            group = self.group if self.group is not None else dist.group.WORLD
            with unset_fake_temporarily():  # the mesh holds a real rank tensor, read with tolist()
                self._meshes[device_type] = DeviceMesh.from_group(
                    group, device_type, mesh_dim_names=("cp",)
                )
        return self._meshes[device_type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        reason = self.unavailable_reason(x.device.type)
        if reason is not None:  # before any collective, so no peer waits on this rank
            raise RuntimeError(reason)
        self.check_input(x)
        q, k, v = self.project_qkv(x)  # (B, L, H, D), (B, L, Hkv, D) x 2; RoPE at zigzag positions
        g = self.n_heads // self.n_kv_heads
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k.repeat_interleave(g, 2),
                                                   v.repeat_interleave(g, 2)))
        if dist.is_available() and dist.is_initialized():
            oh = torch_ring_sdpa(qh, kh, vh, self._mesh(x.device.type), causal=self.causal,
                                 rotate_method=self.rotate_method)
        else:  # one process, no group: torch's ring would be one local block anyway
            oh = F.scaled_dot_product_attention(qh, kh, vh, is_causal=self.causal)
        return self.wo(oh.transpose(1, 2).flatten(2))
