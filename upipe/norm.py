"""Per-head RMSNorm on queries and keys ("QK-norm", Qwen3 / OLMo 2 style).

Qwen3 normalises every query and key head over ``head_dim`` with one shared weight before
RoPE. The all-heads methods call the model's own norm module (plain autograd); UPipe, whose
backward is written by hand, needs the function and its backward, which live here. The formula
is Hugging Face's ``Qwen3RMSNorm`` / ``LlamaRMSNorm``: normalise in fp32, cast back, then scale
by the weight in the input dtype, so results match the pretrained model bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

from upipe.pure import metadata_pure


# Both functions are metadata-pure (``upipe.pure``): the fused norms of the megatron-ds stack and
# UPipe's fused input norm call them once per token tile, the same call tile after tile, which the
# emulator then replays instead of dispatching its ops again.
@metadata_pure
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x**2, -1) + eps))`` over the last dim; x (..., D), weight (D,)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@metadata_pure
def rms_norm_backward(
    x: torch.Tensor, weight: torch.Tensor, eps: float, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) of :func:`rms_norm` at x for output gradient ``grad`` (x's shape).

    Autograd on a local graph of this one op: the tensors are a stage's few heads, so the
    recomputation is cheap, and it runs under fake tensors too.
    """
    with torch.enable_grad():
        xl = x.detach().requires_grad_(True)
        wl = weight.detach().requires_grad_(True)
        dx, dw = torch.autograd.grad(rms_norm(xl, wl, eps), (xl, wl), grad)
    return dx, dw


def norm_params(norm: nn.Module, size: int, name: str,
                over: str = "head_dim") -> tuple[torch.Tensor, float]:
    """(weight, eps) of an RMSNorm module over ``size`` features (``over`` names them: a head's
    ``head_dim``, or a block's ``dim`` for UPipe's fused input norm), read at call time (FSDP2
    swaps parameters), or a ValueError naming ``name`` and the rule."""
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if weight is None or eps is None or tuple(weight.shape) != (size,):
        raise ValueError(
            f"{name} must be an RMSNorm over {over} ({size}) with a `weight` of shape "
            f"({size},) and an epsilon (`variance_epsilon` or `eps`), got {type(norm).__name__}"
        )
    return weight, float(eps)
