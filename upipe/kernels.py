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
* ``"cudnn"`` -- PyTorch's cuDNN attention ops (``_scaled_dot_product_cudnn_attention`` and its
  backward; CUDA only, fp16/bf16, sm80+, cuDNN 9): NVIDIA's fused kernels, in every CUDA build of
  PyTorch, no extra package. They return the log-sum-exp the merges need (as (B, H, S, 1),
  returned here as (B, H, S)) and take K/V with fewer heads than q (GQA) as they are.
* ``"auto"`` -- the fastest kernel this machine runs for the tensors' device and dtype
  (:func:`auto_kernel`): on a CUDA GPU of compute capability 9.x (Hopper) ``fa3`` if it is
  installed, else ``cudnn``; on other GPUs ``flash-attn`` if installed, else ``sdpa``; fp32 and
  the CPU ``sdpa``. Resolved at each call from the tensors (``resolve_kernel``), so a module
  built with ``"auto"`` runs what its inputs' device allows.

``kernel_dispatch`` changes the choice for code running inside it: kernels picked as if the
tensors lived on another device type, and named kernels replaced by other implementations. The
emulator (``experiments/emulation/emulate.py``) uses both: its fake tensors live on the CPU but must
take the CUDA path (the CUDA aten ops' meta functions give the CUDA output shapes), and a kernel
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
import functools
import math
from collections.abc import Callable

import torch

from upipe.amp import cast_for_autocast
from upipe.documents import DocBlocks
from upipe.pure import metadata_pure

KERNELS = ("auto", "sdpa", "math", "flash-attn", "fa3", "cudnn")
HALF = (torch.float16, torch.bfloat16)


def check_kernel(name: str) -> str:
    """Validate a kernel name (``"auto"`` stays ``"auto"``: it is resolved per call, from the
    tensors, by :func:`resolve_kernel`); raises ``ValueError`` naming the field."""
    if name not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {name!r}")
    return name


# (forward, backward): forward(q, k, v, causal, scale) -> (out, lse);
# backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)
KernelImpl = tuple[Callable, Callable]

# (device type the kernels are chosen for or None: the tensors', {kernel name: replacement},
#  the scope around PyTorch's fused attention ops called directly, or None, what "auto" is for
#  a call's query or None: the machine's own choice)
_DISPATCH: contextvars.ContextVar[
    tuple[str | None, dict[str, KernelImpl], Callable[[], contextlib.AbstractContextManager] | None,
          Callable[[torch.Tensor], str] | None]
] = contextvars.ContextVar("upipe_kernel_dispatch", default=(None, {}, None, None))


@contextlib.contextmanager
def kernel_dispatch(device_type: str | None = None,
                    overrides: dict[str, KernelImpl] | None = None,
                    op_scope: Callable[[], contextlib.AbstractContextManager] | None = None,
                    auto: Callable[[torch.Tensor], str] | None = None):
    """Inside, pick kernels as if tensors were on ``device_type``, use ``overrides[name]``
    instead of the kernel ``name`` (names as resolved: ``"auto"`` is what it picks), run code
    that calls PyTorch's fused attention ops itself (``torch-cp``'s ring) inside ``op_scope()``
    (:func:`fused_op_scope`; the emulator's model of what those ops allocate inside), and
    resolve ``"auto"`` to ``auto(q)`` for a call's query (B, S, H, D) (the emulator: what
    ``"auto"`` picks on the emulated GPU, not on this machine)."""
    token = _DISPATCH.set((device_type, dict(overrides or {}), op_scope, auto))
    try:
        yield
    finally:
        _DISPATCH.reset(token)


def kernel_dispatch_state() -> tuple:
    """What the ``kernel_dispatch`` in force decides, as a hashable value (device type,
    overrides, op scope, auto): a call that runs kernels does the same under equal states."""
    device_type, overrides, op_scope, auto = _DISPATCH.get()
    return device_type, tuple(sorted(overrides.items())), op_scope, auto


def kernel_device_type(t: torch.Tensor) -> str:
    """The device type kernels are chosen for with ``t`` as input: ``kernel_dispatch``'s, else
    ``t``'s own (the emulator's fake CPU tensors take the CUDA path this way)."""
    return _DISPATCH.get()[0] or t.device.type


def auto_kernel(device_type: str, dtype: torch.dtype, capability: tuple[int, int] | None = None,
                installed: frozenset[str] | set[str] = frozenset(),
                head_dim: int | None = None) -> str:
    """What ``"auto"`` runs: the fastest kernel a machine runs for ``dtype``, by rule (no timing).

    ``capability``: the CUDA GPU's compute capability; ``installed``: the kernels that can run
    there beside ``sdpa`` (``"fa3"``, ``"flash-attn"``: their libraries import; ``"cudnn"``:
    PyTorch loads cuDNN 9). CPU and fp32: ``sdpa``. On compute capability 9.x (Hopper)
    fp16/bf16: ``fa3`` if installed (FlashAttention-3's Hopper kernels, the paper's), else
    ``cudnn`` (measured on one H200 at about 2x PyTorch's flash
    backend forward and 1.7x backward: results/gpu_costs_h200/kernels/attention.csv, and
    arXiv 2407.08608 Figs. 5-6 on the H100), if the head dim is one it takes. Elsewhere
    ``flash-attn`` if installed, else ``sdpa``: cuDNN's attention is slower than
    FlashAttention-2 on the A100 (0.82x, huggingface/transformers PR #48163's benchmark across
    six GPUs, which is why PyTorch's own SDPA prefers cuDNN on sm90 only).
    """
    if device_type != "cuda" or dtype not in HALF:
        return "sdpa"
    hopper = capability is not None and capability[0] == 9
    if hopper and "fa3" in installed:
        return "fa3"
    if hopper and "cudnn" in installed and cudnn_shape_reason(head_dim, capability) is None:
        return "cudnn"
    return "flash-attn" if "flash-attn" in installed else "sdpa"


@functools.cache
def machine_auto_kernel(device_index: int, dtype: torch.dtype, head_dim: int) -> str:
    """:func:`auto_kernel` on this machine's CUDA device ``device_index`` (cached: a failed
    import is retried on every call otherwise)."""
    installed = {name for name, (available, _) in _CUDA_ONLY.items() if available()}
    cap = torch.cuda.get_device_capability(device_index)
    return auto_kernel("cuda", dtype, cap, installed, head_dim)


def resolve_kernel(kernel: str, t: torch.Tensor) -> str:
    """The kernel ``kernel`` names for inputs like ``t`` (B, S, H, D): itself unless
    ``"auto"``, which :func:`auto_kernel` resolves for ``t``'s device and dtype (inside a
    ``kernel_dispatch`` with ``auto``, that function's choice: the emulated GPU's)."""
    kernel = check_kernel(kernel)
    if kernel != "auto":
        return kernel
    device_type, _, _, auto = _DISPATCH.get()
    if auto is not None:
        return auto(t)
    if (device_type or t.device.type) != "cuda" or t.device.type != "cuda":
        return "sdpa"
    return machine_auto_kernel(t.device.index or 0, t.dtype, t.shape[-1])


def fused_op_scope() -> contextlib.AbstractContextManager:
    """The context to call PyTorch's fused attention ops in: ``kernel_dispatch``'s ``op_scope``
    (the emulator allocates the ops' internal scratch there), else one that does nothing."""
    scope = _DISPATCH.get()[2]
    return scope() if scope is not None else contextlib.nullcontext()


def kernel_functions(kernel: str, device_type: str) -> KernelImpl:
    """The (forward, backward) pair the dispatch runs for ``kernel`` (a resolved name, not
    ``"auto"``) on ``device_type``, ignoring ``kernel_dispatch`` overrides (a replacement may
    wrap the real pair)."""
    kernel = check_kernel(kernel)
    if kernel == "auto":
        raise ValueError("kernel_functions takes a resolved kernel name: resolve 'auto' first "
                         "(resolve_kernel)")
    if kernel == "math":
        return _math_forward, _math_backward
    if kernel == "flash-attn":
        return _flash_attn_forward, _flash_attn_backward
    if kernel == "fa3":
        return _fa3_forward, _fa3_backward
    if kernel == "cudnn":
        return _cudnn_forward, _cudnn_backward
    if device_type == "cuda":
        return _sdpa_cuda_forward, _sdpa_cuda_backward
    return _sdpa_cpu_forward, _sdpa_cpu_backward


def _resolve(kernel: str, t: torch.Tensor) -> KernelImpl:
    kernel = resolve_kernel(kernel, t)
    device_type, overrides, _, _ = _DISPATCH.get()
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


# cuDNN's SDPA needs cuDNN 9 (PyTorch's SDPA checks the same before it picks the backend)
CUDNN_MIN_VERSION = 90000
# the head dims cuDNN's SDPA takes (NVIDIA cudnn-frontend docs, "Attention", support matrix):
# up to 128 forward and backward on Ampere/Ada, up to 256 on Hopper; a multiple of 8 (its tensor
# core tiles)
CUDNN_MAX_HEAD_DIM = {8: 128, 9: 256}


def cudnn_unavailable_reason() -> str | None:
    """Why PyTorch's cuDNN attention cannot run on this machine's CUDA device, or None."""
    if not torch.cuda.is_available():
        return "kernel 'cudnn' needs a CUDA GPU, and torch sees none"
    if not torch.backends.cudnn.is_available():
        return "kernel 'cudnn' needs cuDNN, which this torch build does not load"
    if not hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
        return ("kernel 'cudnn' needs torch's cuDNN attention op, absent in torch "
                f"{torch.__version__}")
    version = torch.backends.cudnn.version() or 0
    if version < CUDNN_MIN_VERSION:
        return f"kernel 'cudnn' needs cuDNN >= 9.0, this torch loads {version}"
    cap = torch.cuda.get_device_capability()
    if cap[0] < 8:
        return (f"kernel 'cudnn' needs compute capability 8.0 or newer (cuDNN's SDPA), this GPU "
                f"has {cap[0]}.{cap[1]}")
    return None


def cudnn_shape_reason(head_dim: int | None, capability: tuple[int, int] | None = None
                       ) -> str | None:
    """Why cuDNN's SDPA refuses ``head_dim`` on a GPU of ``capability`` (None: Hopper's
    limit), or None."""
    if head_dim is None:
        return None
    limit = CUDNN_MAX_HEAD_DIM.get(capability[0] if capability else 9, 128)
    if head_dim % 8 or head_dim > limit:
        return (f"kernel 'cudnn' takes head dims that are multiples of 8 up to {limit} on this "
                f"GPU, got {head_dim}")
    return None


def cudnn_dtype_reason(dtype) -> str | None:
    """Why cuDNN's SDPA refuses ``dtype`` (a torch dtype or its name), or None."""
    name = str(dtype).removeprefix("torch.")
    if name in ("float16", "fp16", "bfloat16", "bf16"):
        return None
    return (f"kernel 'cudnn' takes fp16/bf16 only (cuDNN's SDPA has no {name} kernel); use "
            "'sdpa' (PyTorch's memory-efficient kernel in fp32) or 'auto'")


# CUDA-only kernels: name -> (whether its library imports, what to install)
_CUDA_ONLY = {
    "flash-attn": (flash_attn_available, "the optional flash-attn package (pip install "
                                         "'upipe[flash]')"),
    "fa3": (fa3_available, "FlashAttention-3 (module flash_attn_interface, built from "
                           "flash-attention's hopper/ directory; Hopper GPUs)"),
    "cudnn": (lambda: cudnn_unavailable_reason() is None, "cuDNN 9 and a GPU of compute "
                                                          "capability 8.0+"),
}


def kernel_unavailable_reason(kernel: str, device_type: str, dtype=None,
                              head_dim: int | None = None) -> str | None:
    """Why ``kernel`` cannot run on ``device_type`` ("cpu"/"cuda") on this machine, or None;
    ``dtype`` (a torch dtype or its name) and ``head_dim``, when given, are checked too.

    flash-attn, fa3 and cudnn are CUDA only; flash-attn and fa3 need their library, cudnn
    PyTorch's cuDNN attention (cuDNN 9, sm80+) and fp16/bf16 inputs. The harness turns a reason
    into a ``skipped`` row, as it does a method's ``unavailable_reason``.
    """
    kernel = check_kernel(kernel)
    if kernel not in _CUDA_ONLY:
        return None
    if device_type != "cuda":
        return f"kernel {kernel!r} is CUDA only (not on {device_type!r})"
    if kernel == "cudnn":
        reason = cudnn_dtype_reason(dtype) if dtype is not None else None
        reason = reason or cudnn_unavailable_reason()
        cap = torch.cuda.get_device_capability() if reason is None else None
        return reason or cudnn_shape_reason(head_dim, cap)
    available, library = _CUDA_ONLY[kernel]
    if not available():
        return f"kernel {kernel!r} needs {library}, which is not installed"
    return None


def _default_scale(q: torch.Tensor, scale: float | None) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


@metadata_pure
def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
               blocks: DocBlocks | None) -> None:
    """Refuse shapes a kernel would take and compute nonsense from (the CPU SDPA attended a v
    shorter than k as if it were a view of k's length), with the rule."""
    if (q.dim() != 4 or k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0]
            or q.shape[3] != k.shape[3] or k.shape[2] < 1 or q.shape[2] % k.shape[2]):
        raise ValueError(f"attention needs q (B, S_q, Hq, D) and k, v (B, S_k, Hkv, D) with Hq "
                         f"a multiple of Hkv, got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if causal and blocks is None and q.shape[1] != k.shape[1]:
        raise ValueError(f"causal attention needs as many queries as keys (S_q == S_k), got "
                         f"{q.shape[1]} and {k.shape[1]}")


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
        out (B, S_q, Hq, D) in q's dtype, lse (B, Hq, S_q) fp32, fp64 for fp64 inputs (natural
        log of the softmax denominator of the scaled scores; -inf, with out 0, for rows outside
        every block).
    """
    _check_qkv(q, k, v, causal, blocks)
    kernel = resolve_kernel(kernel, q)
    forward, _ = _resolve(kernel, q)
    scale = _default_scale(q, scale)
    if blocks is None or _whole(blocks, q, k):
        return forward(q, k, v, causal, scale)
    if _varlen_ok(kernel, blocks, q, k):
        return _flash_varlen_functions()[0](q, k, v, blocks, causal, scale)
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
    kernel = resolve_kernel(kernel, q)
    _, backward = _resolve(kernel, q)
    scale = _default_scale(q, scale)
    lse = _kernel_lse(lse, q)
    if blocks is None or _whole(blocks, q, k):
        return backward(dout, q, k, v, out, lse, causal, scale)
    if _varlen_ok(kernel, blocks, q, k):
        return _flash_varlen_functions()[1](dout, q, k, v, out, lse, blocks, causal, scale)
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
    # the kernels' own LSE dtype: fp32, fp64 for fp64 inputs (the CPU op's backward refuses an
    # fp32 LSE beside fp64 tensors, and the math kernel's would lose fp64's precision)
    lse_dtype = _work_dtype(q)
    if _covers_rows(blocks, sq):
        out = q.new_empty(shape)
        lse = torch.empty((b, h, sq), dtype=lse_dtype, device=q.device)
    else:  # rows without a visible key: output 0, LSE -inf (the merge's identity)
        out = q.new_zeros(shape)
        lse = torch.full((b, h, sq), float("-inf"), dtype=lse_dtype, device=q.device)
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
    return out.to(q.dtype), lse.reshape(b, hq, sq).to(_work_dtype(q))  # fp64 kept for fp64


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


# ``kernel_dispatch`` overrides key of a replacement for the varlen path's pair
# (``_flash_attn_varlen_forward(q, k, v, blocks, causal, scale)``,
# ``_flash_attn_varlen_backward(dout, q, k, v, out, lse, blocks, causal, scale)``): the
# emulator's model of what it allocates. A dispatch replacing "flash-attn" without one runs
# packed documents block by block.
FLASH_VARLEN = "flash-attn varlen"


def _flash_varlen_functions() -> tuple[Callable, Callable]:
    """The varlen (forward, backward) pair: ``kernel_dispatch``'s replacement, else flash-attn's
    through the functions below."""
    impl = _DISPATCH.get()[1].get(FLASH_VARLEN)
    return impl if impl is not None else (_flash_attn_varlen_forward,
                                          _flash_attn_varlen_backward)


def _varlen_ok(kernel: str, blocks: DocBlocks, q: torch.Tensor, k: torch.Tensor) -> bool:
    """flash-attn's varlen kernel runs ``blocks`` in one call when they are aligned (each
    document's queries over its own keys, the ranges tiling both sequences) and the library,
    or a replacement of its varlen path (``FLASH_VARLEN``: the emulator's model), is in
    use; a replacement of flash-attn without that one runs them block by block."""
    device_type, overrides, _, _ = _DISPATCH.get()
    replaced = "flash-attn" in overrides and FLASH_VARLEN not in overrides
    if kernel != "flash-attn" or replaced or q.shape[1] != k.shape[1]:
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
# cuDNN (PyTorch's cuDNN attention ops; CUDA only; exercised by the gpu-marked tests)


def _cudnn_check(q: torch.Tensor) -> None:
    """Refuse what cuDNN's SDPA does not take, naming the rule (before the op's own, less
    specific, error)."""
    if kernel_device_type(q) != "cuda":
        raise RuntimeError(f"kernel='cudnn' is CUDA only; the tensors are on {q.device.type!r}")
    reason = cudnn_dtype_reason(q.dtype)
    if reason is None and q.device.type == "cuda":
        reason = cudnn_shape_reason(q.shape[-1], torch.cuda.get_device_capability(q.device))
    if reason is not None:
        raise ValueError(reason)


def _last_dim_dense(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last (head) dim is dense, else a contiguous copy: cuDNN takes any
    strides but a unit one there."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _cudnn_forward(q, k, v, causal, scale):
    """(B, S_q, H, D), (B, S_k, Hkv, D) x 2 -> out (B, S_q, H, D), lse (B, H, S_q) fp32.

    The op takes (B, H, S, D) views of the BSHD inputs (no copy) and K/V with their own head
    count (GQA, no repeated K/V); its output has q's memory layout, so ``out`` comes back BSHD
    contiguous; its LSE is (B, H, S_q, 1), returned as the (B, H, S_q) view.
    """
    _cudnn_check(q)
    qh, kh, vh = (_last_dim_dense(t).transpose(1, 2) for t in (q, k, v))
    with fused_op_scope():
        out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            qh, kh, vh, None, True, 0.0, causal, False, scale=scale)
    return out.transpose(1, 2), lse[..., 0]


def _cudnn_backward(dout, q, k, v, out, lse, causal, scale):
    """Gradients from the saved out and (B, H, S_q) lse; dk/dv with k/v's head count.

    cuDNN reads dO in O's layout, so dout and out are made BSHD contiguous where they are not
    (a slice of a larger BSHD tensor is: its strides are those of a BSHD tensor), and the LSE is
    passed as the op's (B, H, S_q, 1) view of a contiguous (B, H, S_q) one (``_kernel_lse``).
    """
    _cudnn_check(q)
    if k.shape[1] == 1:
        # cuDNN's backward refuses one key ("s_q = s_kv = 1 is not supported", an H100 with
        # cuDNN 9.19): a one-token document's block. Its softmax is 1 whatever the scores, so
        # the math kernel's backward is exact and costs next to nothing at this size
        return _math_backward(dout, q, k, v, out, lse, causal, scale)
    q, k, v, out, dout = (_last_dim_dense(t) for t in (q, k, v, out, dout))
    if dout.stride() != out.stride():
        dout, out = dout.contiguous(), out.contiguous()
    t = lambda x: x.transpose(1, 2)  # noqa: E731  BSHD <-> BHSD views
    no_rng = torch.empty((), dtype=torch.int64, device=q.device)  # dropout is 0: unused
    with fused_op_scope():
        # attn_bias and cum_seq_q/k undefined (None): no bias, dense (not ragged) inputs
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            t(dout), t(q), t(k), t(v), t(out), lse[..., None], no_rng, no_rng, None, None,
            None, q.shape[1], k.shape[1], 0.0, causal, scale=scale)
    return t(dq), t(dk), t(dv)


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
    # under autocast: on q, k, v of its dtype (upipe.amp), as torch's SDPA is
    return cast_for_autocast(_Attention.apply, q.device.type, q, k, v, causal, scale,
                             check_kernel(kernel), blocks)
