"""Mixed precision the usual way: fp32 weights under ``torch.autocast(dtype=bf16)`` (upipe.amp).

Before ``upipe.amp``, UPipe's backward crashed under autocast ("expected m1 and m2 to have the
same dtype"), so did every method on the CPU SDPA kernel (q, k rotated in fp32, v in bf16), and
the memory stack's recomputes ran in fp32 where their forward had run in bf16. Checked here:

- the exact rules (one process): attention and UPipe under autocast compute what they compute
  on inputs cast to bf16, bit for bit; the tiled MLP and the chunked loss recompute in bf16
  and give the input gradient the untiled module and the plain loss give under autocast, bit
  for bit;
- a Hugging Face model made context-parallel by each method, on 2 gloo ranks, against the
  unmodified model under the same autocast. bf16 makes the two differ by rounding only; the
  bound is the rounding autocast itself brings: for every gradient, the CP model under
  autocast is at most twice as far from the unmodified model under autocast as that one is
  from the fp32 model (measured: at most 1.32 times, 2026-11-29).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from upipe.kernels import attention
from upipe.stack import chunked_linear_cross_entropy
from upipe.stack.tiled import tiled, tiled_residual

BF16 = torch.bfloat16


def _autocast():
    return torch.autocast("cpu", dtype=BF16)


def _leaf(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).requires_grad_()


def test_attention_under_autocast_is_attention_on_bf16_inputs():
    """q, k in fp32 (rotated by fp32 tables), v in bf16 (unrotated), the CPU SDPA kernel: the
    output and the gradients are those of the bf16 inputs (cast back to each input's dtype)."""
    q, k, v = _leaf(1, 12, 4, 8, seed=1), _leaf(1, 12, 2, 8, seed=2), _leaf(1, 12, 2, 8,
                                                                         dtype=BF16, seed=3)
    dout = torch.randn(1, 12, 4, 8, generator=torch.Generator().manual_seed(4)).to(BF16)
    with _autocast():
        out = attention(q, k, v, causal=True, kernel="auto")
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q16, k16, v16 = (t.detach().to(BF16).requires_grad_() for t in (q, k, v))
    want = attention(q16, k16, v16, causal=True, kernel="auto")
    want_grads = torch.autograd.grad(want, (q16, k16, v16), dout)
    assert out.dtype == BF16 and torch.equal(out, want)
    for got, w, t in zip(grads, want_grads, (q, k, v), strict=True):
        assert got.dtype == t.dtype and torch.equal(got, w.to(t.dtype))


def _upipe_on_one_rank(autocast: bool) -> tuple:
    """UPipe (fused output projection) on a 1-rank group: out and every input's gradient,
    under autocast with fp32 inputs, or without on the same inputs cast to bf16."""
    from upipe.rope import rope_tables
    from upipe.untied import upipe_attention

    dtype = torch.float32 if autocast else BF16
    x, wq, wk, wv, wo = (_leaf(*s, seed=i).detach().to(dtype).requires_grad_()
                         for i, s in enumerate([(1, 16, 32), (32, 32), (16, 32), (16, 32),
                                                (32, 32)]))
    cos, sin = (t.to(dtype) for t in rope_tables(torch.arange(16), 8, 10000.0, torch.float32))
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        out = upipe_attention(x, wq, wk, wv, cos, sin, wo, n_heads=4, n_kv_heads=2,
                              group=dist.group.WORLD, kernel="auto")
    out.sum().backward()
    return out.detach(), [t.grad for t in (x, wq, wk, wv, wo)]


def test_upipe_under_autocast_is_upipe_on_bf16_inputs(dist_pool):
    """The Function projects with the weights itself: under autocast it runs on every input
    cast to bf16, as a bf16 model; the fp32 weights get those gradients in fp32."""
    (out, grads), = dist_pool(1).run(_upipe_on_one_rank, True)
    (want, want_grads), = dist_pool(1).run(_upipe_on_one_rank, False)
    assert out.dtype == BF16 and torch.equal(out, want)
    for got, w in zip(grads, want_grads, strict=True):
        assert got.dtype == torch.float32 and torch.equal(got, w.float())


class _Recorded(nn.Module):
    """A per-token MLP that records the dtype of each call's output (forward and recompute)."""

    def __init__(self, dim: int):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.dtypes: list[torch.dtype] = []

    def forward(self, x):
        y = self.down(F.silu(self.up(x)))
        self.dtypes.append(y.dtype)
        return y


@pytest.mark.parametrize("x_dtype", [torch.float32, BF16])
@pytest.mark.parametrize("residual", [False, True], ids=["tiled", "tiled_residual"])
def test_tiled_recomputes_under_the_forwards_autocast(x_dtype, residual):
    """fp32 weights, fp32 or bf16 input (bf16 crashed in backward before), 20 tokens in 3
    shards: every call, the recompute's too, computes in bf16, and the input gradient is the
    untiled module's under autocast, bit for bit (rows do not mix; the weights' gradients sum
    the shards in their fp32 .grad, the untiled one in one bf16 product: not compared)."""
    torch.manual_seed(0)
    mlp = _Recorded(8)
    x = _leaf(1, 20, 8, dtype=x_dtype)
    with _autocast():
        y = tiled_residual((mlp,), x) if residual else tiled(mlp, x)
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert mlp.dtypes == [BF16] * 6  # 3 shards forward, 3 recomputed
    ref = copy.deepcopy(mlp)
    with _autocast():
        y_ref = x + ref(x) if residual else ref(x)
    (dx_ref,) = torch.autograd.grad(y_ref, x, torch.ones_like(y_ref))
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)


@pytest.mark.parametrize("h_dtype", [torch.float32, BF16])
def test_chunked_loss_recomputes_under_the_forwards_autocast(h_dtype):
    """The hidden states' gradient equals the plain loss's under autocast, bit for bit (bf16 h
    with an fp32 head crashed in backward before; fp32 h recomputed the logits in fp32: dh
    0.7% off). The loss sums the chunks' sums in fp32: equal to fp32 round-off. The head's
    gradient sums the chunks in fp32, the plain loss in one bf16 product: equal to bf16
    rounding."""
    h, w = _leaf(40, 16, dtype=h_dtype, seed=1), _leaf(24, 16, seed=2)
    labels = torch.randint(0, 24, (40,), generator=torch.Generator().manual_seed(3))
    labels[:3] = -100
    with _autocast():
        got = chunked_linear_cross_entropy(h, w, labels, 7)
        want = F.cross_entropy(F.linear(h, w).float(), labels, reduction="sum")
    dh, dw = torch.autograd.grad(got, (h, w))
    dh_ref, dw_ref = torch.autograd.grad(want, (h, w))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)  # the chunks' sums, in fp32
    assert torch.equal(dh, dh_ref)
    torch.testing.assert_close(dw, dw_ref, rtol=0, atol=2**-8 * dw_ref.abs().max().item())


HF_METHODS = [("upipe", {}), ("upipe", {"stack": "alst", "overlap": True}), ("ulysses", {}),
              ("zigzag-ring", {}), ("fpdt", {"chunk_size": 8}), ("torch-cp", {}),
              ("usp-ulysses", {})]


def _hf_under_autocast() -> dict:
    """Per method: this rank's loss share and gradients under autocast; rank 0 also the
    unmodified model's under autocast and in fp32 (tests/test_hf.py's recipe)."""
    from test_hf import _batch, _model

    from upipe.integrations import hf

    ids, labels = _batch()
    res = {}
    for method, options in HF_METHODS:
        model = hf.parallelize(_model("llama-plain"), method, kernel="auto", **options)
        with _autocast():
            out = model(**hf.shard_batch(model, ids, labels))
        out.loss.backward()
        res[method, tuple(options)] = (out.loss.detach(),
                                       {n: p.grad for n, p in model.named_parameters()})
    if dist.get_rank() == 0:
        for name, ctx in (("ref", _autocast()), ("fp32", torch.autocast("cpu", enabled=False))):
            ref = _model("llama-plain")
            with ctx:
                r = ref(input_ids=ids, labels=labels)
            r.loss.backward()
            res[name] = (r.loss.detach(), {n: p.grad for n, p in ref.named_parameters()})
    return res


@pytest.mark.slow  # about 6 s on 2 cores
def test_hf_methods_under_autocast_stay_within_autocasts_own_rounding(dist_pool):
    pytest.importorskip("transformers", reason="the hf extra (transformers) is absent")
    results = dist_pool(2).run(_hf_under_autocast)
    ref_loss, ref = results[0]["ref"]
    _, fp32 = results[0]["fp32"]
    for method, options in HF_METHODS:
        key = method, tuple(options)
        loss = sum(r[key][0] for r in results)
        assert abs(loss - ref_loss) <= 1e-3 * abs(ref_loss), (key, loss, ref_loss)
        for name, want in ref.items():
            got = sum(r[key][1][name] for r in results)
            own = (want - fp32[name]).abs().max().item()
            err = (got - want).abs().max().item()
            assert err <= 2 * own + 1e-6 * want.abs().max().item(), (key, name, err, own)
