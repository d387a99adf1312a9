"""``rfa-zigzag``: ring-flash-attn's zigzag ring (zhuzilin/ring-flash-attention, PyPI
``ring-flash-attn``), the implementation most zigzag-ring users run.

An adapter, not a re-implementation: ``zigzag_ring_flash_attn_func(q, k, v, causal=True,
group=...)`` takes batch-first (B, L, H, D) shards in the zigzag layout (rank r holds chunks r and
2W-1-r of 2W, ``upipe.layout``), moves K/V around the ring with ``batch_isend_irecv``, merges the
blocks in fp32 with their LSE, and passes dK/dV around in backward. It calls flash-attn's private
``_flash_attn_forward/_backward``, so it runs on CUDA in fp16/bf16 only, causal only (its forward
asserts ``causal == True``), and handles GQA natively (K/V keep their head count). This module
adds the projections, RoPE at the zigzag global positions and the output projection.

Requirements (the ``flash`` extra: ``pip install 'upipe[flash]'``): flash-attn, ring-flash-attn,
and a transformers version its unconditional HF-adapter import accepts (the survey found
transformers 5.x breaks ``import ring_flash_attn``). All are imported only when the module is
built; ``unavailable_reason`` says which piece is missing.
"""

from __future__ import annotations

import importlib

import torch

from baselines.zigzag_ring import ZigzagRingAttention
from upipe.registry import register_method

FLASH_EXTRA = "pip install 'upipe[flash]'"
HALF_DTYPES = (torch.float16, torch.bfloat16)


def import_problem(module: str) -> str | None:
    """Why ``module`` is unusable ("not installed", or the error its import raises), or None.

    Not cached: once the module is imported this is a ``sys.modules`` lookup, so ``forward`` can
    afford it, and an install (or a test's stand-in) is seen without a restart.
    """
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:
            return "not installed"
        return f"import failed ({type(e).__name__}: {e})"
    except Exception as e:  # a broken install or a dependency clash, not only ImportError
        return f"import failed ({type(e).__name__}: {e})"
    return None


def missing_packages(packages: dict[str, str]) -> list[str]:
    """``"name (why)"`` for each unusable package; ``packages`` maps module -> install name."""
    problems = {name: import_problem(module) for module, name in packages.items()}
    return [f"{name} ({why})" for name, why in problems.items() if why is not None]


def requirements_reason(
    method: str, device_type: str, packages: dict[str, str], extra: str
) -> str | None:
    """One sentence naming everything ``method`` lacks on ``device_type`` here, or None."""
    missing = []
    if device_type != "cuda":
        missing.append(f"a CUDA device (got device type {device_type!r})")
    elif not torch.cuda.is_available():
        missing.append("a CUDA device (none is available)")
    missing += missing_packages(packages)
    if not missing:
        return None
    return f"method {method!r} needs " + "; ".join(missing) + f" -- install with: {extra}"


def require_packages(method: str, packages: dict[str, str], extra: str) -> None:
    """ImportError naming the missing packages and the install command, if any are missing."""
    missing = missing_packages(packages)
    if missing:
        raise ImportError(f"method {method!r} needs " + "; ".join(missing) + f": {extra}")


def check_half_precision(method: str, x: torch.Tensor) -> None:
    """flash-attn has fp16/bf16 kernels only; say so before anything runs."""
    if x.dtype not in HALF_DTYPES:
        raise ValueError(
            f"method {method!r} runs flash-attn kernels, which take fp16/bf16 only; got x of dtype "
            f"{x.dtype}: cast the module and its input, e.g. .to(torch.bfloat16)"
        )


_PACKAGES = {"flash_attn": "flash-attn", "ring_flash_attn": "ring-flash-attn"}


@register_method("rfa-zigzag")
class RFAZigzagAttention(ZigzagRingAttention):
    """ring-flash-attn zigzag ring; forward(x_local (B, L, dim)) -> (B, L, dim), CUDA fp16/bf16.

    Causal only. Head rules are the ring's (any GQA ratio on any number of ranks); the layout is
    zigzag. ``group`` is passed through (ring-flash-attn 0.1.8 maps group ranks to global ones).
    """

    own_kernel = ("flash-attn", "ring-flash-attn calls flash-attn's kernels itself")
    p2p_exchange = "ring-flash-attn moves its K/V blocks by batch_isend_irecv"
    documents_unsupported = (
        "ring-flash-attn's varlen zigzag (zigzag_ring_flash_attn_varlen_func) zigzags every "
        "document separately, a layout other than this method's; use 'zigzag-ring'")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not self.causal:
            raise ValueError(
                "causal must be True for 'rfa-zigzag': ring-flash-attn's zigzag ring asserts "
                "causal (zigzag_ring_flash_attn.py); use 'torch-cp' or 'ring' for full attention"
            )
        require_packages("rfa-zigzag", _PACKAGES, FLASH_EXTRA)
        from ring_flash_attn import zigzag_ring_flash_attn_func

        self._zigzag = zigzag_ring_flash_attn_func

    @classmethod
    def unavailable_reason(cls, device_type: str) -> str | None:
        return requirements_reason("rfa-zigzag", device_type, _PACKAGES, FLASH_EXTRA)

    def forward(self, x: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
        reason = self.unavailable_reason(x.device.type)
        if reason is not None:  # before any collective, so no peer waits on this rank
            raise RuntimeError(reason)
        check_half_precision("rfa-zigzag", x)
        self.check_input(x)
        self.documents(cu_seqlens, x)  # refused with packed documents (documents_unsupported)
        q, k, v = self.project_qkv(x)  # (B, L, H, D), (B, L, Hkv, D) x 2; RoPE at zigzag positions
        o = self._zigzag(q, k, v, causal=True, group=self.group)
        return self.wo(o.flatten(2))
