"""Per-rank bodies of the distributed tests (module-level so they pickle to spawned ranks)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from upipe import LlamaAttention, build_method
from upipe.norm import rms_norm

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


@dataclass(frozen=True)
class Case:
    """One correctness case: a method against the single-device reference."""

    method: str
    n_heads: int
    n_kv_heads: int
    seq: int
    causal: bool = True
    dtype: str = "fp32"
    head_dim: int = 16
    batch: int = 2
    options: dict = field(default_factory=dict)
    docs: tuple[int, ...] | None = None
    """packed documents' cu_seqlens (global); the reference then runs document by document"""
    input_norm: bool = False
    """an RMSNorm before the attention (weight ``norm.weight``), handed to the method as its
    fused ``input_norm`` and applied by the reference before it"""

    @property
    def dim(self) -> int:
        return 48  # deliberately not n_heads * head_dim: projections are rectangular

    def __hash__(self):
        return hash((self.method, self.n_heads, self.n_kv_heads, self.seq, self.causal,
                     self.dtype, repr(sorted(self.options.items())), self.docs, self.input_norm))


class RMSNorm(nn.Module):
    """The harness's pre-norm (``experiments.harness.model.RMSNorm``), a random weight."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class PreNorm(nn.Module):
    """``attn(norm(x))``; with ``fused`` the norm goes to the attention as ``input_norm``."""

    def __init__(self, norm: nn.Module, attn: nn.Module, fused: bool = False):
        super().__init__()
        self.norm, self.attn, self.fused = norm, attn, fused

    def forward(self, x, **kw):
        if self.fused:
            return self.attn(x, input_norm=self.norm, **kw)
        return self.attn(self.norm(x), **kw)


def cp_mesh(ring: int, ulysses: int):
    """A (ring, ulysses) DeviceMesh over the world, made once per shape on this rank
    (``job_mesh``: the session's ranks would otherwise gather a gloo group per case)."""
    from experiments.harness.train import job_mesh

    return job_mesh("cpu", (ring, ulysses), ("ring", "ulysses"))


def _reference_grads(ref, x, dy, docs=None):
    """The reference's output and gradients; with ``docs`` (cu_seqlens) it runs on each
    document alone (positions from 0), outputs concatenated: what packing must reproduce."""
    x = x.detach().requires_grad_(True)
    if docs is None:
        y = ref(x)
    else:
        y = torch.cat([ref(x[:, a:b]) for a, b in itertools.pairwise(docs) if b > a], dim=1)
    y.backward(dy)
    return y.detach(), x.grad, {n: p.grad for n, p in ref.named_parameters()}


def compare_unpacked_with_packed_reference(case: Case) -> dict[str, float]:
    """The negative control of the packed tests: the per-document truth of ``case.docs``
    against the method run *without* them (attention crossing documents)."""
    return compare_with_reference(case, pass_docs=False)


def compare_with_reference(case: Case, pass_docs: bool = True) -> dict[str, float]:
    """Run ``case`` on this rank; return {quantity: max abs error, ``ref_*``: reference error}.

    Recipe (docs/conventions.md#the-reference-comparison-recipe): same seed everywhere, full inputs
    and output gradient on every rank, an fp64 single-device ground truth, the reference in the
    case's dtype (its own rounding error sets the tolerance), the method on its own shard via its
    layout helper, and the weight gradients summed over ranks (CP ranks each see only their tokens).
    """
    torch.manual_seed(1234)
    dtype = DTYPES[case.dtype]
    ref = LlamaAttention(case.dim, case.n_heads, case.n_kv_heads, case.head_dim,
                         causal=case.causal)
    ref = (PreNorm(RMSNorm(case.dim), ref) if case.input_norm else ref).double()
    x = torch.randn(case.batch, case.seq, case.dim, dtype=torch.float64)
    dy = torch.randn_like(x)
    y64, dx64, dw64 = _reference_grads(ref, x, dy, case.docs)

    ref_lp = LlamaAttention(case.dim, case.n_heads, case.n_kv_heads, case.head_dim,
                            causal=case.causal)
    ref_lp = (PreNorm(RMSNorm(case.dim), ref_lp) if case.input_norm else ref_lp).to(dtype)
    ref_lp.load_state_dict(ref.state_dict())
    y_lp, dx_lp, dw_lp = _reference_grads(ref_lp, x.to(dtype), dy.to(dtype), case.docs)

    options = dict(case.options)
    group = dist.group.WORLD
    if "mesh" in options:  # (ring, ulysses) degrees; the mesh itself is built on the rank
        options["mesh"], group = cp_mesh(*options["mesh"]), None
    attn = build_method(case.method, case.dim, case.n_heads, case.n_kv_heads, case.head_dim,
                        group=group, causal=case.causal, **options)
    m = (PreNorm(RMSNorm(case.dim), attn, fused=True) if case.input_norm else attn).to(dtype)
    m.load_state_dict(ref.state_dict())
    x_loc = attn.shard(x.to(dtype)).detach().requires_grad_(True)
    packed = case.docs is not None and pass_docs
    y_loc = m(x_loc, cu_seqlens=list(case.docs)) if packed else m(x_loc)
    y_loc.backward(attn.shard(dy.to(dtype)))
    # fp32 reduction, as FSDP reduce-scatters gradients (bf16 partial sums would add rounding)
    dw = {n: p.grad.float() for n, p in m.named_parameters()}
    for g in dw.values():
        dist.all_reduce(g)

    err = lambda a, b: (a.double() - b.double()).abs().max().item()  # noqa: E731
    out = {
        "y": err(y_loc, attn.shard(y64)), "ref_y": err(y_lp, y64),
        "dx": err(x_loc.grad, attn.shard(dx64)), "ref_dx": err(dx_lp, dx64),
        "scale_y": y64.abs().max().item(), "scale_dx": dx64.abs().max().item(),
    }
    for n in dw64:
        q = n.removeprefix("attn.")  # PreNorm's attention: the same names as without
        out[q] = err(dw[n], dw64[n])
        out["ref_" + q] = err(dw_lp[n], dw64[n])
        out["scale_" + q] = dw64[n].abs().max().item()
    return out


def compare_on_gpu(case: Case, device: int | None = None) -> dict[str, float]:
    """``compare_with_reference`` with everything on a GPU: ``device``, default this rank's
    (rank % device count; ``0``: every rank on the first GPU, ``--shared-gpu``'s layout)."""
    index = dist.get_rank() % torch.cuda.device_count() if device is None else device
    torch.cuda.set_device(index)
    torch.set_default_device("cuda")
    try:
        return compare_with_reference(case)
    finally:
        torch.set_default_device(None)


def packed_refusal(method: str, options: dict) -> str:
    """The error ``method`` raises on this rank for packed documents ("" if none)."""
    m = build_method(method, 32, 4, 2, 8, group=dist.group.WORLD, **options)
    try:
        m(torch.randn(1, 16, 32), cu_seqlens=[0, 3, 16 * dist.get_world_size()])
    except ValueError as e:
        return str(e)
    return ""


def fake_packed_step(method: str, seq_local: int, options: dict, docs, kernel: str = "auto"):
    """One fake-tensor forward+backward of Llama3-8B attention at paper-like scale on this rank
    (rank 0 of the fake world), on the emulator's CUDA kernel path: (peak device bytes,
    collective counts). ``docs``: cu_seqlens (Python ints) or None."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from experiments.emulation.kernel_models import cuda_kernels
    from experiments.instruments.collectives import CollectiveCounter
    from experiments.instruments.memory import MemoryTracker

    options, group = dict(options), dist.group.WORLD
    if "mesh" in options:
        options["mesh"], group = cp_mesh(*options["mesh"]), None
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # fake parameters cannot be cast by Module.to()
    try:
        with FakeTensorMode():
            m = build_method(method, 4096, 32, 8, 128, group=group, kernel=kernel, **options)
            x = torch.randn(1, seq_local, 4096, dtype=torch.bfloat16, requires_grad=True)
            with cuda_kernels(), MemoryTracker() as mt, CollectiveCounter() as cc:
                y = m(x, cu_seqlens=docs)
                y.sum().backward()
    finally:
        torch.set_default_dtype(default)
    return mt.peak_device_bytes, dict(cc.counts)
