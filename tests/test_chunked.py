"""UPipe's chunked attention backward (upipe/chunked.py) against one kernel call: the same
gradients, dense and with packed documents, causal and not, GQA, a last chunk shorter than the
others (so blocks pair a short query chunk with full key chunks), on CPU and on a GPU."""

from __future__ import annotations

import pytest
import torch

from upipe.chunked import accumulator_dtype, chunk_spans, chunked_attention_backward
from upipe.documents import documents
from upipe.kernels import attention_backward, attention_forward


def _case(s, hq, hkv, dtype, device, causal, docs=None, kernel="math"):
    """(one call's dq, dk, dv; the chunked backward's) at 7-token chunks (s = 7k + r)."""
    torch.manual_seed(5)
    q, k, v = (torch.randn(2, s, h, 16, dtype=dtype, device=device) for h in (hq, hkv, hkv))
    blocks = None if docs is None else docs.full_blocks()
    out, lse = attention_forward(q, k, v, causal=causal, kernel=kernel, blocks=blocks)
    dout = torch.randn_like(out)
    ref = attention_backward(dout, q, k, v, out, lse, causal=causal, kernel=kernel, blocks=blocks)
    acc = [torch.zeros(t.shape, dtype=accumulator_dtype(dtype), device=device) for t in (k, v)]
    dq = chunked_attention_backward(dout, q, k, v, out, lse, *acc, chunk=7, causal=causal,
                                    kernel=kernel, docs=docs)
    return ref, (dq, *acc)


def test_chunk_spans_cover_the_sequence_once():
    assert chunk_spans(23, 7) == [(0, 7), (7, 14), (14, 21), (21, 23)]
    assert chunk_spans(14, 7) == [(0, 7), (7, 14)]


@pytest.mark.parametrize("chunk", [-2, 0, 2.5, None, True])
def test_a_chunk_that_is_not_a_positive_integer_is_refused(chunk):
    """A negative chunk made no span: the chunked backward returned dq as torch.empty left it
    and dk/dv at zero, without a word."""
    t = torch.zeros(1, 4, 1, 2)  # (B, S, H, D)
    with pytest.raises(ValueError, match="chunk must be a positive number of tokens"):
        chunked_attention_backward(t, t, t, t, t, torch.zeros(1, 1, 4), t.clone(), t.clone(),
                                   chunk=chunk, causal=True)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 1)])
@pytest.mark.parametrize("packed", [False, True])
def test_chunked_backward_is_one_call_in_fp64(causal, hq, hkv, packed):
    """fp64 (math kernel): equal to rounding. Packed: documents of 5, 11, 1 and 6 tokens cut
    across the chunks, a one-token document alone in its chunk pair."""
    docs = documents([0, 5, 16, 17, 23], 23) if packed else None
    ref, got = _case(23, hq, hkv, torch.float64, "cpu", causal, docs)
    for r, g in zip(ref, got, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_chunked_backward_on_cuda_sdpa(causal):
    """PyTorch's flash SDPA (bf16): blocks of unequal query and key lengths reach its backward
    (the key length is the op's max_k); within bf16 rounding of one call."""
    ref, got = _case(1000, 4, 1, torch.bfloat16, "cuda", causal, kernel="sdpa")
    for r, g in zip(ref, got, strict=True):
        torch.testing.assert_close(g.float(), r.float(), rtol=2e-2, atol=2e-2)
