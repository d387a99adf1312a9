"""Packed sequences (``cu_seqlens``): every method against the reference run document by document.

The recipe and tolerance are the correctness matrix's (tests/test_correctness.py,
docs/conventions.md#the-reference-comparison-recipe): the ground truth runs each document alone
(positions from 0) and concatenates, so attention crossing a document or RoPE positions not
restarting would show as errors far above the tolerance. Documents are chosen awkward on purpose: a
one-token document, one shorter than a shard, one straddling rank shards (and ring blocks, zigzag
chunks, FPDT chunks), several ranks long; and a single document, which must be today's unpacked
path bit for bit.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from cases import Case, compare_with_reference, packed_refusal
from test_correctness import assert_close_to_reference

from upipe import build_method
from upipe.documents import Documents, documents

# (world, seq, cu_seqlens): shards of 37, 15, 14 and 11 / 10 tokens; every boundary set has a
# one-token document, one shorter than a shard and one crossing at least one shard boundary.
DOCS = {
    (1, 37): (0, 1, 12, 37),
    (2, 30): (0, 1, 9, 22, 30),  # 15 per rank: 9..22 straddles the shards
    (2, 28): (0, 5, 6, 20, 28),  # zigzag: chunks of 7; 6..20 crosses three of them
    (4, 44): (0, 7, 8, 31, 44),  # 11 per rank: 8..31 spans three shards
    (4, 40): (0, 1, 9, 23, 40),  # zigzag / hybrid: chunks of 5 (10 for a 2x2 mesh)
}

# (world, method, n_heads, n_kv_heads, seq, options)
CASES = [
    (1, "upipe", 8, 2, 37, {}), (1, "ulysses", 8, 2, 37, {}), (1, "ring", 8, 2, 37, {}),
    (2, "upipe", 8, 2, 30, {}), (2, "upipe", 8, 2, 30, {"heads_per_stage": 4}),
    (2, "upipe", 4, 1, 30, {}),
    (2, "ulysses", 8, 2, 30, {}), (2, "ds-ulysses", 8, 2, 30, {}),
    (2, "ring", 8, 2, 30, {}), (2, "zigzag-ring", 8, 2, 28, {}),
    (2, "fpdt", 8, 2, 30, {"chunk_size": 10}),
    (2, "fpdt", 8, 2, 30, {"chunk_size": 10, "offload": False}),
    (4, "upipe", 16, 4, 44, {}), (4, "ulysses", 8, 2, 44, {}), (4, "ds-ulysses", 8, 2, 44, {}),
    (4, "ring", 8, 2, 44, {}), (4, "zigzag-ring", 8, 2, 40, {}),
    (4, "fpdt", 8, 2, 44, {"chunk_size": 12}),
    (4, "usp", 8, 2, 40, {"mesh": (2, 2)}), (4, "upipe", 8, 2, 40, {"mesh": (2, 2)}),
    # UPipe's chunked backward: chunks of 7 cut across the documents of the 44 tokens
    (4, "upipe", 16, 4, 44, {"chunk_size": 7}),
]
# full (non-causal) attention exercises the ring's and FPDT's skipped pairs in both directions
FULL = {(2, "ring"), (4, "zigzag-ring"), (2, "fpdt"), (4, "usp"), (4, "upipe")}


def _params() -> list:
    out = []
    for world, method, h, hkv, seq, options in CASES:
        docs = DOCS[world, seq]
        for causal in (True, False) if (world, method) in FULL else (True,):
            for dtype in ("fp32", "bf16"):
                case = Case(method, h, hkv, seq, causal=causal, dtype=dtype, options=options,
                            docs=docs)
                tag = "".join(f"-{k}{v}" for k, v in options.items())
                out.append(pytest.param(world, case, id=f"{method}{tag}-w{world}-h{h}kv{hkv}-"
                                        f"s{seq}-{'causal' if causal else 'full'}-{dtype}"))
    return out


@pytest.mark.parametrize("world,case", _params())
def test_packed_matches_reference_per_document(dist_pool, world, case):
    results = dist_pool(world).run(compare_with_reference, case)
    assert len(results) == world
    assert_close_to_reference(results, case)


@pytest.mark.parametrize("method,world,seq,options", [
    ("upipe", 2, 30, {}), ("ring", 2, 30, {}), ("fpdt", 2, 30, {"chunk_size": 10}),
])
def test_the_check_catches_attention_across_documents(dist_pool, method, world, seq, options):
    """The per-document reference must tell packed from unpacked attention: run the method
    without ``cu_seqlens`` and compare against the per-document truth; it must fail."""
    from cases import compare_unpacked_with_packed_reference

    case = Case(method, 8, 2, seq, options=options, docs=DOCS[world, seq])
    results = dist_pool(world).run(compare_unpacked_with_packed_reference, case)
    with pytest.raises(AssertionError, match="y: error"):
        assert_close_to_reference(results, case)


def test_documents_rules():
    assert documents(None, 10) is None
    assert documents([0, 10], 10) is None  # one document: the unpacked path
    assert documents(torch.tensor([0, 0, 4, 4, 10]), 10) == Documents((0, 4, 10))  # empties
    for bad, rule in [([1, 10], "start at 0"), ([0, 4, 9], "end at the global sequence length"),
                      ([0, 6, 4, 10], "non-decreasing"), ([0], "at least"),
                      ([0, 4.0, 10], "ints"), (torch.tensor([[0, 10]]), "1-D"),
                      ("0,10", "sequence of ints")]:
        with pytest.raises(ValueError, match=rule):
            documents(bad, 10)


def test_blocks_and_positions_follow_the_layout():
    d = Documents((0, 1, 9, 22, 30))
    # rank 1 of a zigzag layout over 2 ranks of 28 would be chunks 1 and 2; here a 2-rank
    # contiguous split at 15: documents 2 (9..22) and 3 (22..30) reach rank 1's tokens
    assert d.positions([(15, 15)]).tolist() == list(range(6, 13)) + list(range(8))
    assert d.blocks([(15, 15)], [(0, 15)]) == ((0, 7, 9, 15),)  # queries 15..21 over keys 9..14
    assert d.blocks([(15, 15)], [(15, 15)]) == ((0, 7, 0, 7), (7, 15, 7, 15))
    # a zigzag pair (chunks 0 and 3 of 4 x 7): local order follows global order
    assert d.blocks([(0, 7), (21, 7)], [(0, 7), (21, 7)]) == (
        (0, 1, 0, 1), (1, 7, 1, 7), (7, 8, 7, 8), (8, 14, 8, 14))
    assert d.blocks([(22, 8)], [(0, 9)]) == ()  # no shared document: the block is skipped


@pytest.mark.parametrize("method,options,seq", [
    ("upipe", {}, 32), ("ulysses", {}, 32), ("ring", {}, 32), ("zigzag-ring", {}, 32),
    ("fpdt", {"chunk_size": 8}, 32), ("ds-ulysses", {}, 32),
])
def test_one_document_is_the_unpacked_path_bit_for_bit(method, options, seq):
    torch.manual_seed(0)
    m = build_method(method, 32, 4, 2, 8, **options)
    x = torch.randn(2, seq, 32, requires_grad=True)
    y0 = m(x)
    y1 = m(x, cu_seqlens=[0, seq])
    assert torch.equal(y0, y1)
    g0 = torch.autograd.grad(y0.sum(), (x, *m.parameters()))
    g1 = torch.autograd.grad(y1.sum(), (x, *m.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True))


@pytest.mark.parametrize("method", ["torch-cp", "rfa-zigzag", "ds-fpdt"])
def test_methods_without_document_masking_refuse_cu_seqlens(dist_pool, method):
    """Refused on every rank before any collective (a 2-rank run that would hang otherwise)."""
    from upipe.registry import get_method

    cls = get_method(method)
    assert cls.documents_unsupported
    if cls.unavailable_reason("cpu") is not None:
        pytest.skip(cls.unavailable_reason("cpu"))
    options = {"chunk_size": 8} if method == "ds-fpdt" else {}
    for msg in dist_pool(2).run(packed_refusal, method, options):
        assert msg.startswith(f"method '{method}' does not support cu_seqlens")


def test_bad_cu_seqlens_is_refused_before_any_work():
    m = build_method("upipe", 32, 4, 2, 8)
    with pytest.raises(ValueError, match="end at the global sequence length 16"):
        m(torch.randn(1, 16, 32), cu_seqlens=[0, 3, 12])


def _paper_like_docs(seq: int) -> list[int]:
    """A one-token document, then documents of a 1/8 of the sequence shifted by 3 tokens
    (so they straddle every shard, ring block and FPDT chunk), the rest as the last one."""
    return [0, 1, *range(1 + seq // 8 + 3, seq, seq // 8), seq]


@pytest.mark.parametrize("method,options,kernel", [
    ("upipe", {}, "auto"), ("upipe", {"heads_per_stage": 16}, "flash-attn"),
    ("ulysses", {}, "auto"), ("ds-ulysses", {}, "flash-attn"), ("ring", {}, "auto"),
    ("zigzag-ring", {}, "flash-attn"), ("fpdt", {"chunk_size": 32768}, "auto"),
    ("usp", {"mesh": (2, 4)}, "flash-attn"), ("upipe", {"mesh": (2, 4)}, "auto"),
])
def test_emulated_packed_step_runs_and_costs_no_more(dist_pool, method, options, kernel):
    """Under fake tensors (the emulator's CUDA kernel path, rank 0 of 8, 16K tokens per rank,
    Llama3-8B attention): packing keeps the collective counts and does not raise the peak, but
    for one thing: the CUDA backward kernels read the LSE as a contiguous array, so a document's
    rows of it are copied first (``upipe.kernels._kernel_lse``), at most one block's LSE
    (B x all 32 heads x L fp32: 2 MiB) beside the kernel; and flash-attn's one varlen call
    over aligned documents pads each document by 128 rows in its fp32 backward scratch
    (softmax_d and dq_accum: the rank's 32 / 8 heads x (D 128 + 1) x 4 B a row, plus the
    (n_docs + 1) int32 cu_seqlens; experiments/emulation/kernel_models.py)."""
    from cases import fake_packed_step

    seq_local = 16 * 1024
    pool = dist_pool(8, fake=True)
    [(peak, counts)] = pool.run(fake_packed_step, method, seq_local, options, None, kernel)
    docs = _paper_like_docs(8 * seq_local)
    [(peak_docs, counts_docs)] = pool.run(fake_packed_step, method, seq_local, options, docs,
                                          kernel)
    assert counts_docs == counts
    lse_copy = 1 * 32 * seq_local * 4
    n_docs = len(docs) - 1
    varlen_pad = (n_docs * 128 * (32 // 8) * (128 + 1) * 4 + (n_docs + 1) * 4
                  if kernel == "flash-attn" else 0)
    assert peak_docs <= peak + lse_copy + varlen_pad, (
        f"packed peak {peak_docs} B above unpacked {peak} B")


@pytest.mark.gpu
def test_flash_attn_varlen_equals_the_blockwise_path():
    """flash-attn runs aligned document blocks as one varlen call; it must equal the same
    kernel run document by document (the path every other kernel takes)."""
    from upipe.kernels import attention_backward, attention_forward, flash_attn_available

    if not flash_attn_available():
        pytest.skip("flash-attn not installed")
    torch.manual_seed(0)
    q = torch.randn(2, 300, 8, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 300, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    d = Documents((0, 1, 77, 230, 300))
    out, lse = attention_forward(q, k, v, causal=True, kernel="flash-attn", blocks=d.full_blocks())
    dout = torch.randn_like(out)
    grads = attention_backward(dout, q, k, v, out, lse, causal=True, kernel="flash-attn",
                               blocks=d.full_blocks())
    for (a, b) in itertools.pairwise(d.bounds):
        o, l_ = attention_forward(q[:, a:b], k[:, a:b], v[:, a:b], causal=True, kernel="flash-attn")
        torch.testing.assert_close(out[:, a:b], o)
        torch.testing.assert_close(lse[:, :, a:b], l_)
        g = attention_backward(dout[:, a:b], q[:, a:b], k[:, a:b], v[:, a:b], o, l_,
                               causal=True, kernel="flash-attn")
        for full, part in zip(grads, g, strict=True):
            torch.testing.assert_close(full[:, a:b], part)


@pytest.mark.parametrize("world,method,seq,kernel", [
    (1, "upipe", 37, "auto"), (1, "ulysses", 37, "math"),
    (2, "ring", 30, "auto"), (2, "zigzag-ring", 28, "math"),
])
def test_fp64_keeps_fp64_precision_on_packed_documents(dist_pool, world, method, seq, kernel):
    """fp64 packed documents: the output and dx within a few fp64 ulps of the fp64 truth (the
    weight gradients are summed over ranks in fp32, as FSDP reduces them). The CPU op's backward
    refused the fp32 LSE the documents' blocks were gathered into; the math kernel's LSE and
    the ring's sums rounded to fp32 (dx off by 2e-8 to 4e-8)."""
    case = Case(method, 8, 2, seq, dtype="fp64", options={"kernel": kernel},
                docs=DOCS[world, seq])
    for errors in dist_pool(world).run(compare_with_reference, case):
        assert errors["y"] < 1e-12 and errors["dx"] < 1e-12, errors
