"""Kernel ``cudnn`` (PyTorch's cuDNN attention ops) on a GPU: against the fp32 math reference.

Kernel level: ``attention_forward`` / ``attention_backward`` with ``kernel="cudnn"`` in bf16
against ``kernel="math"`` in fp32 on the same bf16-rounded inputs (upcast), so the difference is
the cuDNN kernel's own bf16 rounding: causal and full, GQA (8 query heads over 2 KV heads), head
dims 128 and 64, packed documents (``blocks``; a one-token document's 1 x 1 block, which cuDNN's
backward refuses, is an expected failure), and the zigzag
ring's backward of the second half's queries from the full sequence's out and LSE (a sliced,
non-contiguous LSE and BSHD slices of out and dout). ``"auto"`` resolves as ``auto_kernel``
rules for this GPU, and fp32 is refused by name.

Method level: every method that honours ``kernel=`` runs one layer's forward and backward as the
single rank of the ``fake`` process group (world size 1: every collective short-circuits, so the
layer computes exactly what one device computes; FPDT's chunk loop still merges partial LSEs and
runs its backward from the merged out / LSE) with ``kernel="cudnn"`` and with ``kernel="math"``
(bf16 module and inputs, fp32 attention inside), the same weights and inputs: the output, the
input gradient and every parameter gradient agree within bf16 tolerance.

Needs a CUDA GPU with cuDNN 9 (skipped otherwise, with ``kernel_unavailable_reason``'s reason).
"""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch
import torch.distributed as dist

from experiments.emulation.fake_step import fake_world
from upipe.documents import Documents
from upipe.kernels import (
    attention_backward,
    attention_forward,
    auto_kernel,
    fa3_available,
    flash_attn_available,
    kernel_unavailable_reason,
    resolve_kernel,
)
from upipe.registry import build_method

_REASON = kernel_unavailable_reason("cudnn", "cuda", torch.bfloat16)
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(_REASON is not None, reason=str(_REASON))]

# bf16 against an fp32 reference on the same rounded inputs (TestCUDAKernels' rule): 2^-8
# relative on O(1) outputs, four times that on gradients (sums over the sequence); the LSE is an
# fp32 reduction of exact bf16 products in both kernels
TOL_OUT = dict(atol=2e-2, rtol=2e-2)
TOL_GRAD = dict(atol=8e-2, rtol=8e-2)
TOL_LSE = dict(atol=2e-3, rtol=2e-3)


def _inputs(s: int, hq: int, hkv: int, d: int, b: int = 2, seed: int = 3):
    """bf16 (q, k, v, dout) on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = ((b, s, hq, d), (b, s, hkv, d), (b, s, hkv, d), (b, s, hq, d))
    return [torch.randn(sh, device="cuda", generator=gen).to(torch.bfloat16) for sh in shapes]


def _fwd_bwd(q, k, v, dout, kernel, causal, blocks=None):
    """(out, lse, dq, dk, dv) of ``kernel``; ``math`` runs on the fp32 upcast of the inputs."""
    if kernel == "math":
        q, k, v, dout = (t.float() for t in (q, k, v, dout))
    out, lse = attention_forward(q, k, v, causal=causal, kernel=kernel, blocks=blocks)
    grads = attention_backward(dout, q, k, v, out, lse, causal=causal, kernel=kernel,
                               blocks=blocks)
    return out, lse, *grads


def _assert_matches(got, ref, names=("out", "lse", "dq", "dk", "dv")):
    for name, g, r in zip(names, got, ref, strict=True):
        assert g.shape == r.shape, name
        tol = TOL_LSE if name == "lse" else TOL_OUT if name == "out" else TOL_GRAD
        if name != "lse":
            assert g.dtype == torch.bfloat16, name
        torch.testing.assert_close(g.float(), r.float(), **tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("d", [128, 64])
@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_matches_fp32_math(d, causal):
    """Dense, GQA 8/2, 300 tokens (not a multiple of a tile)."""
    q, k, v, dout = _inputs(300, 8, 2, d)
    got = _fwd_bwd(q, k, v, dout, "cudnn", causal)
    assert got[1].dtype == torch.float32 and got[1].shape == (2, 8, 300)
    assert got[3].shape == k.shape and got[4].shape == v.shape  # GQA: per KV head
    _assert_matches(got, _fwd_bwd(q, k, v, dout, "math", causal))


@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_packed_documents_match_fp32_math(causal):
    """Packed documents of 2, 75, 153 and 70 tokens: one cuDNN call per document block."""
    q, k, v, dout = _inputs(300, 8, 2, 128)
    blocks = Documents((0, 2, 77, 230, 300)).full_blocks()
    got = _fwd_bwd(q, k, v, dout, "cudnn", causal, blocks)
    _assert_matches(got, _fwd_bwd(q, k, v, dout, "math", causal, blocks))


def test_cudnn_one_token_document():
    """A packed document of one token: its block is 1 x 1, whose backward cuDNN refuses ('s_q =
    s_kv = 1 is not supported', an H100, cuDNN 9.19); upipe.kernels runs that block's backward
    with the math kernel."""
    q, k, v, dout = _inputs(300, 8, 2, 128)
    blocks = Documents((0, 1, 77, 300)).full_blocks()
    got = _fwd_bwd(q, k, v, dout, "cudnn", True, blocks)
    _assert_matches(got, _fwd_bwd(q, k, v, dout, "math", True, blocks))


@pytest.mark.parametrize("d", [128, 64])
def test_cudnn_zigzag_half_backward_from_the_full_lse(d):
    """The zigzag ring's second half of queries: its backward over the earlier key half (full)
    and over its own (causal), each fed the full sequence's out, dout and LSE sliced to rows
    [s/2, s) -- views, not contiguous copies -- as the ring feeds the merged out / LSE."""
    s = 256
    q, k, v, dout = _inputs(s, 8, 2, d)
    half = slice(s // 2, s)
    early = slice(0, s // 2)
    results = {}
    for kernel in ("cudnn", "math"):
        qq, kk, vv, do = (t.float() for t in (q, k, v, dout)) if kernel == "math" else (
            q, k, v, dout)
        out, lse = attention_forward(qq, kk, vv, causal=True, kernel=kernel)
        lse_half = lse[:, :, half]
        assert not lse_half.is_contiguous() and not out[:, half].is_contiguous()
        parts = [out, lse]
        for keys, causal in ((early, False), (half, True)):
            parts += attention_backward(do[:, half], qq[:, half], kk[:, keys], vv[:, keys],
                                        out[:, half], lse_half, causal=causal, kernel=kernel)
        results[kernel] = parts
    names = ("out", "lse", "dq_early", "dk_early", "dv_early", "dq_diag", "dk_diag", "dv_diag")
    _assert_matches(results["cudnn"], results["math"], names)
    # the two blocks' dq add up to the full backward's rows [s/2, s)
    full = _fwd_bwd(q, k, v, dout, "cudnn", True)
    dq_half = results["cudnn"][2].float() + results["cudnn"][5].float()
    torch.testing.assert_close(dq_half, full[2][:, half].float(), **TOL_GRAD)


def test_auto_resolves_as_the_rule_says_on_this_gpu():
    q = torch.zeros(1, 8, 4, 128, device="cuda", dtype=torch.bfloat16)
    cap = torch.cuda.get_device_capability()
    installed = {name for name, ok in (("fa3", fa3_available()),
                                       ("flash-attn", flash_attn_available())) if ok} | {"cudnn"}
    assert resolve_kernel("auto", q) == auto_kernel("cuda", q.dtype, cap, installed, 128)
    if cap[0] == 9 and "fa3" not in installed:
        assert resolve_kernel("auto", q) == "cudnn"
    assert resolve_kernel("auto", q.float()) == "sdpa"  # fp32: cuDNN has no kernel
    assert resolve_kernel("cudnn", q) == "cudnn"


def test_cudnn_refuses_fp32_by_name():
    q, k, v, _ = (t.float() for t in _inputs(64, 8, 2, 64))
    with pytest.raises(ValueError, match="fp16/bf16"):
        attention_forward(q, k, v, causal=True, kernel="cudnn")
    out, lse = attention_forward(q, k, v, causal=True, kernel="sdpa")
    with pytest.raises(ValueError, match="fp16/bf16"):
        attention_backward(out, q, k, v, out, lse, causal=True, kernel="cudnn")


# -- method level ------------------------------------------------------------------------------

DIM, HEADS, KV_HEADS, HEAD_DIM, SEQ = 512, 8, 2, 128, 1024
DOCS = [0, 100, 611, 1024]  # packed documents (global cu_seqlens)
# (method, options, packed)
METHOD_CASES = [
    ("ulysses", {}, False), ("ulysses", {}, True),
    ("upipe", {"heads_per_stage": 2}, False), ("upipe", {"heads_per_stage": 2}, True),
    ("zigzag-ring", {}, False), ("zigzag-ring", {}, True),
    ("ring", {}, False),
    ("usp", {"mesh": (1, 1)}, False),
    ("fpdt", {"chunk_size": 256}, False), ("fpdt", {"chunk_size": 256}, True),
    ("ds-ulysses", {}, False),
]


def _layer_step(method: str, options: dict, kernel: str, device: str, packed: bool) -> dict:
    """One bf16 layer's output, input gradient and parameter gradients (fp32 copies) on the
    single rank of the fake process group; the same weights and inputs for every kernel."""
    options = dict(options)
    group = dist.group.WORLD if dist.is_initialized() else None
    if "mesh" in options:
        from torch.distributed.device_mesh import init_device_mesh

        options["mesh"] = init_device_mesh(device, options["mesh"],
                                           mesh_dim_names=("ring", "ulysses"))
        group = None
    torch.manual_seed(1234)
    m = build_method(method, DIM, HEADS, KV_HEADS, HEAD_DIM, group=group, causal=True,
                     kernel=kernel, **options)
    m = m.to(device=device, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(99)
    x = torch.randn(1, SEQ, DIM, generator=gen).to(device=device, dtype=torch.bfloat16)
    dy = torch.randn(1, SEQ, DIM, generator=gen).to(device=device, dtype=torch.bfloat16)
    x = m.shard(x).detach().requires_grad_(True)
    y = m(x, cu_seqlens=DOCS) if packed else m(x)
    y.backward(m.shard(dy))
    out = {"y": y.detach().float(), "dx": x.grad.float()}
    out |= {n: p.grad.float() for n, p in m.named_parameters()}
    return out


def compare_kernels_on_a_layer(method, options, packed, kernel="cudnn", reference="math",
                               device="cuda") -> dict[str, float]:
    """{quantity: max |kernel - reference| / max |reference|} of one layer's step at world
    size 1 (a CPU dry run: ``kernel="sdpa", device="cpu"``). ds-ulysses runs without a process
    group (its local attention alone): DeepSpeed's all-to-all runs even on one rank, and the
    fake group's leaves its output unwritten."""
    world = contextlib.nullcontext() if method == "ds-ulysses" else fake_world(1)
    with world:
        got = _layer_step(method, options, kernel, device, packed)
        ref = _layer_step(method, options, reference, device, packed)
    assert got.keys() == ref.keys()
    return {n: ((got[n] - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-30)).item()
            for n in ref}


# bf16 end to end (projections, RoPE, the all-to-all's layouts) in both runs: only attention
# differs, by its bf16 rounding, against each quantity's largest value
METHOD_TOL = 3e-2


@pytest.mark.parametrize("method,options,packed", METHOD_CASES,
                         ids=[f"{m}{'-packed' if p else ''}" for m, _, p in METHOD_CASES])
def test_method_with_cudnn_matches_math(method, options, packed):
    if method == "ds-ulysses" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("ds-ulysses needs deepspeed, not installed")
    errors = compare_kernels_on_a_layer(method, options, packed)
    assert {"y", "dx", "wq.weight", "wk.weight", "wv.weight", "wo.weight"} <= errors.keys()
    bad = {n: e for n, e in errors.items() if not e <= METHOD_TOL}  # NaN fails too
    assert not bad, f"{method}: relative errors above {METHOD_TOL}: {bad} (all: {errors})"
