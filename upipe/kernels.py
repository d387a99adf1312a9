"""Attention kernel dispatch: forward returning (out, logsumexp) and the matching backward.

Every method calls attention through these two functions so that the kernel is a config axis.
Tensors use the (batch, seq, heads, head_dim) layout ("BSHD", flash-attn's); GQA is expressed by
``k``/``v`` having fewer heads than ``q`` (query head h uses KV head h // (Hq/Hkv)).

Kernels (selected by name):

* ``"sdpa"`` -- PyTorch's SDPA kernels called through their private aten ops, because the public
  ``F.scaled_dot_product_attention`` does not return the log-sum-exp that UPipe and the ring
  methods need. CPU: ``_scaled_dot_product_flash_attention_for_cpu`` (+ backward; native GQA).
  CUDA: ``_scaled_dot_product_flash_attention`` for fp16/bf16, ``_efficient_attention`` for fp32
  (K/V expanded to the query heads for GQA, their gradients summed back).
* ``"math"`` -- plain PyTorch, fp32 (fp64 for fp64 inputs) softmax; materialises (S, S) scores.
  The readable reference every other kernel is tested against. GQA via a reshape, no repeat.
* ``"flash-attn"`` -- Dao-AILab flash-attn 2 (CUDA only), behind an import check.
* ``"fa3"`` -- FlashAttention-3, the Hopper kernels of the same repository (``hopper/``, Python
  module ``flash_attn_interface``; CUDA only, H100-class GPUs), behind an import check.
* ``"auto"`` -- ``"sdpa"`` (the project's default on CPU and CUDA).

``kernel_dispatch`` changes the choice for code running inside it: kernels picked as if the
tensors lived on another device type, and named kernels replaced by other implementations. The
emulator (``experiments/emulate.py``) uses both: its fake tensors live on the CPU but must take
the CUDA path (the CUDA aten ops' meta functions give the CUDA output shapes), and a kernel
whose library is absent here (flash-attn, fa3) is replaced by a model of what it allocates.

``kernel_unavailable_reason`` says why a kernel cannot run on a device type here (CUDA-only
kernels on CPU, an absent library), as a method's ``unavailable_reason`` does for the method.

Packed documents (``blocks``, ``upipe.documents``): attention splits into one dense block per
document shared by the query and key sets, each run by the same kernel on slices of q, k, v
(views along the sequence), written into one output and LSE; rows in no block get output 0 and
LSE -inf (no visible key: the LSE merge then ignores them). No (S, S) mask is built. flash-attn
runs the aligned case (each document's queries over its own keys, covering every row) as one
call of its varlen kernel instead.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable

import torch

from upipe.documents import DocBlocks
from upipe.pure import metadata_pure

KERNELS = ("auto", "sdpa", "math", "flash-attn", "fa3")


def check_kernel(name: str) -> str:
    """Validate a kernel name and resolve ``"auto"``; raises ``ValueError`` naming the field."""
    if name not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {name!r}")
    return "sdpa" if name == "auto" else name


# (forward, backward): forward(q, k, v, causal, scale) -> (out, lse);
# backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)
KernelImpl = tuple[Callable, Callable]

# (device type the kernels are chosen for or None: the tensors', {kernel name: replacement},
#  the scope around PyTorch's fused attention ops called directly, or None)
_DISPATCH: contextvars.ContextVar[
    tuple[str | None, dict[str, KernelImpl], Callable[[], contextlib.AbstractContextManager] | None]
] = contextvars.ContextVar("upipe_kernel_dispatch", default=(None, {}, None))


@contextlib.contextmanager
def kernel_dispatch(device_type: str | None = None,
                    overrides: dict[str, KernelImpl] | None = None,
                    op_scope: Callable[[], contextlib.AbstractContextManager] | None = None):
    """Inside, pick kernels as if tensors were on ``device_type``, use ``overrides[name]``
    instead of the kernel ``name`` (names as resolved: ``"auto"`` is ``"sdpa"``), and run code
    that calls PyTorch's fused attention ops itself (``torch-cp``'s ring) inside ``op_scope()``
    (:func:`fused_op_scope`; the emulator's model of what those ops allocate inside)."""
    token = _DISPATCH.set((device_type, dict(overrides or {}), op_scope))
    try:
        yield
    finally:
        _DISPATCH.reset(token)


def kernel_dispatch_state() -> tuple:
    """What the ``kernel_dispatch`` in force decides, as a hashable value (device type,
    overrides, op scope): a call that runs kernels does the same under equal states."""
    device_type, overrides, op_scope = _DISPATCH.get()
    return device_type, tuple(sorted(overrides.items())), op_scope


def kernel_device_type(t: torch.Tensor) -> str:
    """The device type kernels are chosen for with ``t`` as input: ``kernel_dispatch``'s, else
    ``t``'s own (the emulator's fake CPU tensors take the CUDA path this way)."""
    return _DISPATCH.get()[0] or t.device.type


def fused_op_scope() -> contextlib.AbstractContextManager:
    """The context to call PyTorch's fused attention ops in: ``kernel_dispatch``'s ``op_scope``
    (the emulator allocates the ops' internal scratch there), else one that does nothing."""
    scope = _DISPATCH.get()[2]
    return scope() if scope is not None else contextlib.nullcontext()


def kernel_functions(kernel: str, device_type: str) -> KernelImpl:
    """The (forward, backward) pair the dispatch runs for ``kernel`` on ``device_type``,
    ignoring ``kernel_dispatch`` overrides (a replacement may wrap the real pair)."""
    kernel = check_kernel(kernel)
    if kernel == "math":
        return _math_forward, _math_backward
    if kernel == "flash-attn":
        return _flash_attn_forward, _flash_attn_backward
    if kernel == "fa3":
        return _fa3_forward, _fa3_backward
    if device_type == "cuda":
        return _sdpa_cuda_forward, _sdpa_cuda_backward
    return _sdpa_cpu_forward, _sdpa_cpu_backward


def _resolve(kernel: str, t: torch.Tensor) -> KernelImpl:
    device_type, overrides, _ = _DISPATCH.get()
    impl = overrides.get(kernel)
    return impl if impl is not None else kernel_functions(kernel, device_type or t.device.type)


def flash_attn_available() -> bool:
    """True when the optional flash-attn package imports (it needs CUDA)."""
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def fa3_available() -> bool:
    """True when FlashAttention-3's ``flash_attn_interface`` imports (built from flash-attention's
    ``hopper/`` directory; it needs CUDA)."""
    try:
        import flash_attn_interface  # noqa: F401
    except ImportError:
        return False
    return True


# CUDA-only kernels: name -> (whether its library imports, what to install)
_CUDA_ONLY = {
    "flash-attn": (flash_attn_available, "the optional flash-attn package (pip install "
                                         "'upipe[flash]')"),
    "fa3": (fa3_available, "FlashAttention-3 (module flash_attn_interface, built from "
                           "flash-attention's hopper/ directory; Hopper GPUs)"),
}


def kernel_unavailable_reason(kernel: str, device_type: str) -> str | None:
    """Why ``kernel`` cannot run on ``device_type`` ("cpu"/"cuda") on this machine, or None.

    flash-attn and fa3 are CUDA only and need their library; the harness turns a reason into a
    ``skipped`` row, as it does a method's ``unavailable_reason``.
    """
    kernel = check_kernel(kernel)
    if kernel not in _CUDA_ONLY:
        return None
    available, library = _CUDA_ONLY[kernel]
    if device_type != "cuda":
        return f"kernel {kernel!r} is CUDA only (not on {device_type!r})"
    if not available():
        return f"kernel {kernel!r} needs {library}, which is not installed"
    return None


def _default_scale(q: torch.Tensor, scale: float | None) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


@metadata_pure
def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float | None = None,
    kernel: str = "auto",
    blocks: DocBlocks | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query over every key (full-sequence, S_q == S_k when causal).

    Args:
        q: (B, S_q, Hq, D); k, v: (B, S_k, Hkv, D) with Hq % Hkv == 0.
        causal: mask key j > query i (top-left aligned; within each block when ``blocks``).
        scale: softmax scale, default 1/sqrt(D).
        kernel: a name from :data:`KERNELS`.
        blocks: packed documents: only these (q_start, q_end, k_start, k_end) blocks attend
            (``upipe.documents.Documents.blocks``); None: every query over every key.

    Returns:
        out (B, S_q, Hq, D) in q's dtype, lse (B, Hq, S_q) fp32 (natural log of the softmax
        denominator of the scaled scores; -inf, with out 0, for rows outside every block).
    """
    kernel = check_kernel(kernel)
    forward, _ = _resolve(kernel, q)
    scale = _default_scale(q, scale)
    if blocks is None or _whole(blocks, q, k):
        return forward(q, k, v, causal, scale)
    if _varlen_ok(kernel, blocks, q, k):
        return _flash_attn_varlen_forward(q, k, v, blocks, causal, scale)
    return _blockwise_forward(q, k, v, blocks, causal, scale, kernel)


@metadata_pure
def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    scale: float | None = None,
    kernel: str = "auto",
    blocks: DocBlocks | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`attention_forward` from its saved ``out`` and ``lse``.

    Shapes as in :func:`attention_forward`; ``dout`` like ``out``; ``blocks`` as given to it
    (``out``/``lse`` may be the final ones of a merge over several key sets). Returns
    (dq, dk, dv) with the shapes of (q, k, v): for GQA, dk/dv are already summed over each KV
    head's query heads; 0 outside every block.
    """
    kernel = check_kernel(kernel)
    _, backward = _resolve(kernel, q)
    scale = _default_scale(q, scale)
    lse = _kernel_lse(lse, q)
    if blocks is None or _whole(blocks, q, k):
        return backward(dout, q, k, v, out, lse, causal, scale)
    if _varlen_ok(kernel, blocks, q, k):
        return _flash_attn_varlen_backward(dout, q, k, v, out, lse, blocks, causal, scale)
    return _blockwise_backward(dout, q, k, v, out, lse, blocks, causal, scale, kernel)


# ---------------------------------------------------------------------------------------------
# packed documents: one dense kernel call per document block


def _kernel_lse(lse: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The LSE as the backward kernel reads it. The CUDA kernels (FlashAttention's and
    PyTorch's) index it as a contiguous (B, H, S) array, so a slice (a zigzag half, a document's
    rows) is copied first, as ring-flash-attn does before its backward calls; the CPU op takes
    strides. A no-op for a contiguous LSE."""
    return lse.contiguous() if kernel_device_type(q) == "cuda" else lse


def _whole(blocks: DocBlocks, q: torch.Tensor, k: torch.Tensor) -> bool:
    """One block covering every query and key: the dense call, bit for bit."""
    return blocks == ((0, q.shape[1], 0, k.shape[1]),)


def _covers_rows(blocks: DocBlocks, n: int) -> bool:
    """Whether the blocks' query ranges tile [0, n) (then no row needs a default)."""
    return sum(qb - qa for qa, qb, _, _ in blocks) == n


def attention_blocks_forward(q, k, v, *, causal: bool, scale: float | None = None,
                             kernel: str = "auto", blocks: DocBlocks):
    """Yield ``((q_start, q_end), out_b, lse_b)`` per document block: the dense kernel on the
    block's slices (out_b (B, n, Hq, D), lse_b (B, Hq, n)). For callers that fold each block
    into buffers of their own (a ring's running output, FPDT's merge), so no block-sized
    temporary is needed beside them. Written by hand: the CPU and CUDA SDPA ops have no varlen
    form, and this must also run under fake tensors."""
    forward, _ = _resolve(check_kernel(kernel), q)
    scale = _default_scale(q, scale)
    for qa, qb, ka, kb in blocks:
        o, l_ = forward(q[:, qa:qb], k[:, ka:kb], v[:, ka:kb], causal, scale)
        yield (qa, qb), o, l_


def attention_blocks_backward(dout, q, k, v, out, lse, *, causal: bool,
                              scale: float | None = None, kernel: str = "auto",
                              blocks: DocBlocks):
    """Yield ``(q_start, q_end, k_start, k_end), dq_b, dk_b, dv_b`` per document block, from
    the final ``out``/``lse`` (FlashAttention-2's backward needs only those). Documents are
    disjoint, so the blocks' query ranges are, and their key ranges too."""
    _, backward = _resolve(check_kernel(kernel), q)
    scale = _default_scale(q, scale)
    for qa, qb, ka, kb in blocks:
        grads = backward(dout[:, qa:qb], q[:, qa:qb], k[:, ka:kb], v[:, ka:kb], out[:, qa:qb],
                         _kernel_lse(lse[:, :, qa:qb], q), causal, scale)
        yield (qa, qb, ka, kb), *grads


def _blockwise_forward(q, k, v, blocks, causal, scale, kernel):
    """Every document block into one (out, lse)."""
    b, sq, h, _ = q.shape
    shape = (b, sq, h, v.shape[3])
    if _covers_rows(blocks, sq):
        out = q.new_empty(shape)
        lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    else:  # rows without a visible key: output 0, LSE -inf (the merge's identity)
        out = q.new_zeros(shape)
        lse = torch.full((b, h, sq), float("-inf"), dtype=torch.float32, device=q.device)
    for (qa, qb), o, l_ in attention_blocks_forward(q, k, v, causal=causal, scale=scale,
                                                    kernel=kernel, blocks=blocks):
        out[:, qa:qb] = o
        lse[:, :, qa:qb] = l_
        del o, l_
    return out, lse


def _blockwise_backward(dout, q, k, v, out, lse, blocks, causal, scale, kernel):
    """Every document block's gradients into (dq, dk, dv) like (q, k, v), 0 outside them."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (qa, qb, ka, kb), dq_b, dk_b, dv_b in attention_blocks_backward(
            dout, q, k, v, out, lse, causal=causal, scale=scale, kernel=kernel, blocks=blocks):
        dq[:, qa:qb] = dq_b
        dk[:, ka:kb] = dk_b
        dv[:, ka:kb] = dv_b
        del dq_b, dk_b, dv_b
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# CPU SDPA


def _sdpa_cpu_forward(q, k, v, causal, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, scale=scale
    )
    return out.transpose(1, 2), lse


def _sdpa_cpu_backward(dout, q, k, v, out, lse, causal, scale):
    t = lambda x: x.transpose(1, 2)  # noqa: E731  BSHD <-> BHSD views
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        t(dout), t(q), t(k), t(v), t(out), lse, 0.0, causal, scale=scale
    )
    return t(dq), t(dk), t(dv)


# ---------------------------------------------------------------------------------------------
# math reference


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _grouped(q: torch.Tensor, n_kv: int) -> torch.Tensor:
    """(B, S, Hq, D) -> (B, Hkv, g, S, D) view-compatible grouping of query heads per KV head."""
    b, s, hq, d = q.shape
    return q.reshape(b, s, n_kv, hq // n_kv, d).permute(0, 2, 3, 1, 4)


def _math_probs(q, k, causal, scale):
    """Scaled scores (B, Hkv, g, Sq, Sk) in the work dtype, masked when causal."""
    wd = _work_dtype(q)
    qg = _grouped(q.to(wd), k.shape[2])
    kt = k.to(wd).permute(0, 2, 3, 1)[:, :, None]  # (B, Hkv, 1, D, Sk)
    scores = (qg @ kt) * scale
    if causal:
        sq, sk = scores.shape[-2:]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return scores


def _math_forward(q, k, v, causal, scale):
    b, sq, hq, d = q.shape
    scores = _math_probs(q, k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)  # (B, Hkv, g, Sq)
    probs = torch.exp(scores - lse[..., None])
    vg = v.to(scores.dtype).permute(0, 2, 1, 3)[:, :, None]  # (B, Hkv, 1, Sk, D)
    out = (probs @ vg).permute(0, 3, 1, 2, 4).reshape(b, sq, hq, d)
    return out.to(q.dtype), lse.reshape(b, hq, sq).float()


def _math_backward(dout, q, k, v, out, lse, causal, scale):
    b, sq, hq, d = q.shape
    n_kv = k.shape[2]
    wd = _work_dtype(q)
    scores = _math_probs(q, k, causal, scale)
    probs = torch.exp(scores - lse.to(wd).reshape(b, n_kv, hq // n_kv, sq)[..., None])
    dog = _grouped(dout.to(wd), n_kv)  # (B, Hkv, g, Sq, D)
    og = _grouped(out.to(wd), n_kv)
    vg = v.to(wd).permute(0, 2, 1, 3)[:, :, None]  # (B, Hkv, 1, Sk, D)
    kg = k.to(wd).permute(0, 2, 1, 3)[:, :, None]
    dv = (probs.transpose(-1, -2) @ dog).sum(2)  # (B, Hkv, Sk, D)
    dp = dog @ vg.transpose(-1, -2)
    delta = (dog * og).sum(-1, keepdim=True)  # rowsum(dO * O), FlashAttention-2 Alg. 2
    ds = probs * (dp - delta) * scale
    dq = ds @ kg  # (B, Hkv, g, Sq, D)
    dk = (ds.transpose(-1, -2) @ _grouped(q.to(wd), n_kv)).sum(2)
    dq = dq.permute(0, 3, 1, 2, 4).reshape(b, sq, hq, d)
    return dq.to(q.dtype), dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype)


# ---------------------------------------------------------------------------------------------
# CUDA SDPA (not exercised on CPU CI; the CPU op above is)


def _expand_kv(x: torch.Tensor, n_q: int) -> torch.Tensor:
    """(B, S, Hkv, D) -> (B, H, S, D) with each KV head repeated for its query heads."""
    return x.repeat_interleave(n_q // x.shape[2], dim=2).transpose(1, 2)


def _sum_kv(dx: torch.Tensor, n_kv: int) -> torch.Tensor:
    """(B, H, S, D) gradient of expanded K/V -> (B, S, Hkv, D)."""
    b, h, s, d = dx.shape
    return dx.reshape(b, n_kv, h // n_kv, s, d).sum(2).transpose(1, 2)


def _sdpa_cuda_forward(q, k, v, causal, scale):
    hq, s = q.shape[2], q.shape[1]
    qh, kh, vh = q.transpose(1, 2), _expand_kv(k, hq), _expand_kv(v, hq)
    if q.dtype in (torch.float16, torch.bfloat16):
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            qh, kh, vh, 0.0, causal, False, scale=scale
        )
    else:
        res = torch.ops.aten._scaled_dot_product_efficient_attention(
            qh, kh, vh, None, True, 0.0, causal, scale=scale
        )
    out, lse = res[0], res[1]
    return out.transpose(1, 2), lse[..., :s].contiguous()  # efficient pads lse to 32


def _sdpa_cuda_backward(dout, q, k, v, out, lse, causal, scale):
    hq, s_q, s_k, n_kv = q.shape[2], q.shape[1], k.shape[1], k.shape[2]
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    kh, vh = _expand_kv(k, hq), _expand_kv(v, hq)
    no_rng = torch.empty((), dtype=torch.int64, device=q.device)  # dropout is 0: unused
    with fused_op_scope():
        if q.dtype in (torch.float16, torch.bfloat16):
            # cum_seq_q/k must be *undefined* (None), as the forward returns them for dense
            # inputs: a defined (even empty) tensor selects the varlen kernel, which then fails
            # with "batch size must be positive".
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                t(dout), t(q), kh, vh, t(out), lse, None, None, s_q, s_k, 0.0, causal, no_rng,
                no_rng, scale=scale,
            )
        else:
            dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                t(dout), t(q), kh, vh, None, t(out), lse, no_rng, no_rng, 0.0,
                [True, True, True, False], causal, scale=scale,
            )
    return t(dq), _sum_kv(dk, n_kv), _sum_kv(dv, n_kv)


# ---------------------------------------------------------------------------------------------
# flash-attn (optional extra, CUDA only)


def _require_flash_attn():
    if not flash_attn_available():
        raise RuntimeError(
            "kernel='flash-attn' needs the optional flash-attn package (pip install "
            "'upipe[flash]', CUDA only); use kernel='sdpa' otherwise"
        )
    from flash_attn import flash_attn_interface

    return flash_attn_interface


def _flash_attn_forward(q, k, v, causal, scale):
    fa = _require_flash_attn()
    # flash-attn >= 2.6 keyword names; its private API is the only one returning the LSE.
    out, lse, *_ = fa._flash_attn_forward(
        q, k, v, dropout_p=0.0, softmax_scale=scale, causal=causal,
        window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
        return_softmax=False,
    )
    return out, lse


def _flash_attn_backward(dout, q, k, v, out, lse, causal, scale):
    fa = _require_flash_attn()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fa._flash_attn_backward(
        dout, q, k, v, out, lse, dq, dk, dv, dropout_p=0.0, softmax_scale=scale, causal=causal,
        window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
        deterministic=False, rng_state=None,
    )
    return dq, dk, dv


def _varlen_ok(kernel: str, blocks: DocBlocks, q: torch.Tensor, k: torch.Tensor) -> bool:
    """flash-attn's varlen kernel runs ``blocks`` in one call when they are aligned (each
    document's queries over its own keys, the ranges tiling both sequences) and the real
    library is in use (the emulator's replacement is modelled block by block)."""
    device_type, overrides, _ = _DISPATCH.get()
    if kernel != "flash-attn" or "flash-attn" in overrides or q.shape[1] != k.shape[1]:
        return False
    if (device_type or q.device.type) != "cuda":
        return False
    edges = [0]
    for qa, qb, ka, kb in blocks:
        if (qa, qb) != (ka, kb) or qa != edges[-1]:
            return False
        edges.append(qb)
    return edges[-1] == q.shape[1]


def _varlen_meta(blocks: DocBlocks, b: int, s: int, device) -> tuple[torch.Tensor, int]:
    """flash-attn's (cu_seqlens int32 (B*n+1,), max_seqlen) for the batch flattened to B*S
    tokens: every sequence of the batch holds the same documents."""
    edges = [qb for _, qb, _, _ in blocks]
    cu = [0] + [i * s + e for i in range(b) for e in edges]
    return torch.tensor(cu, dtype=torch.int32, device=device), max(
        qb - qa for qa, qb, _, _ in blocks)


def _flash_attn_varlen_forward(q, k, v, blocks, causal, scale):
    """Aligned document blocks in one flash-attn varlen call; (B*S, H, D) packed tokens.
    Its LSE is (H, B*S) (flash-attn >= 2.4's unpadded layout), returned as (B, H, S)."""
    fa = _require_flash_attn()
    b, s, h, _ = q.shape
    cu, max_len = _varlen_meta(blocks, b, s, q.device)
    out, lse, *_ = fa._flash_attn_varlen_forward(
        q.reshape(b * s, h, -1), k.reshape(b * s, k.shape[2], -1),
        v.reshape(b * s, v.shape[2], -1), cu, cu, max_len, max_len, dropout_p=0.0,
        softmax_scale=scale, causal=causal, window_size_left=-1, window_size_right=-1,
        softcap=0.0, alibi_slopes=None, return_softmax=False,
    )
    return out.view(b, s, h, -1), lse.view(h, b, s).transpose(0, 1)


def _flash_attn_varlen_backward(dout, q, k, v, out, lse, blocks, causal, scale):
    fa = _require_flash_attn()
    b, s, h, _ = q.shape
    cu, max_len = _varlen_meta(blocks, b, s, q.device)
    flat = lambda x: x.reshape(b * s, x.shape[2], -1)  # noqa: E731
    dq, dk, dv = torch.empty_like(flat(q)), torch.empty_like(flat(k)), torch.empty_like(flat(v))
    fa._flash_attn_varlen_backward(
        flat(dout), flat(q), flat(k), flat(v), flat(out),
        lse.transpose(0, 1).reshape(h, b * s), dq, dk, dv, cu, cu, max_len, max_len,
        dropout_p=0.0, softmax_scale=scale, causal=causal, window_size_left=-1,
        window_size_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False,
        rng_state=None,
    )
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)


# ---------------------------------------------------------------------------------------------
# FlashAttention-3 (Hopper, CUDA only)


def _require_fa3(q: torch.Tensor):
    if not fa3_available():
        raise RuntimeError(
            "kernel='fa3' needs FlashAttention-3 (module flash_attn_interface, built from "
            "flash-attention's hopper/ directory; CUDA, Hopper GPUs); use kernel='flash-attn' "
            "or 'sdpa' otherwise"
        )
    if q.device.type != "cuda":
        raise RuntimeError(f"kernel='fa3' is CUDA only; the tensors are on {q.device.type!r}")
    import flash_attn_interface

    return flash_attn_interface


# FA3's private functions are the only ones returning the LSE. Written against flash-attention's
# hopper/flash_attn_interface.py at commit c082294e (plain functions, backward flag ``causal``,
# ``window_size`` a pair) and at commit 01afd16d (torch.library custom ops, package flash_attn_3
# 3.0.0: backward flag ``is_causal``, ``window_size_left``/``_right``): keyword names differ
# between them, the positional order up to (softmax_scale, causal) does not, so that prefix is
# passed positionally and everything after it keeps its default (no window, no softcap,
# num_splits=1, deterministic=False).
_FA3_FWD_UNUSED = 20  # k_new, v_new, qv, out, cu_seqlens_q/k/k_new, seqused_q/k, max_seqlen_q/k,
#                       page_table, kv_batch_idx, leftpad_k, rotary_cos/sin, seqlens_rotary,
#                       q/k/v_descale
_FA3_BWD_UNUSED = 6  # cu_seqlens_q/k, seqused_q/k, max_seqlen_q/k


def _fa3_forward(q, k, v, causal, scale):
    fa3 = _require_fa3(q)
    # no_grad: the custom-op version registers its own autograd, whose graph would keep q, k,
    # v, out and lse alive beside the caller's (upipe's backward is attention_backward)
    with torch.no_grad():
        out, lse, *_ = fa3._flash_attn_forward(q, k, v, *(None,) * _FA3_FWD_UNUSED, scale,
                                               causal)
    return out, lse


def _fa3_backward(dout, q, k, v, out, lse, causal, scale):
    fa3 = _require_fa3(q)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fa3._flash_attn_backward(dout, q, k, v, out, lse, *(None,) * _FA3_BWD_UNUSED, dq, dk, dv,
                             scale, causal)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# differentiable wrapper (used by methods that rely on autograd, e.g. Ulysses)


class _Attention(torch.autograd.Function):
    """Autograd over the dispatch: saves q, k, v, out and lse, as every fused kernel does."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, kernel, blocks):
        out, lse = attention_forward(q, k, v, causal=causal, scale=scale, kernel=kernel,
                                     blocks=blocks)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kw = dict(causal=causal, scale=scale, kernel=kernel, blocks=blocks)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, **ctx.kw)
        return dq, dk, dv, None, None, None, None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float | None = None,
    kernel: str = "auto",
    blocks: DocBlocks | None = None,
) -> torch.Tensor:
    """Differentiable attention, (B, S, Hq, D) x (B, S, Hkv, D) -> (B, S, Hq, D); ``blocks``:
    packed documents, as in :func:`attention_forward`."""
    return _Attention.apply(q, k, v, causal, scale, check_kernel(kernel), blocks)
