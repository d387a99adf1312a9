"""Packed documents in the harness (issue 16): the ``doc_len`` cell option, its documents, the
training step's labels and loss normalisation, a real gloo step and the emulated step.

The reference for a packed step is the same model run on each document alone (positions from
0, its own next-token labels): attention never crosses a document, so the packed loss sum and
gradients are the sums over the documents.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from experiments.cli import parser
from experiments.cli_args import cell_from_args
from experiments.config import STACKS, Cell, Hardware, resolve_model
from experiments.emulation.emulate import emulate_cell
from experiments.emulation.fit import lattice
from experiments.harness.launch import run_cell
from experiments.harness.model import Transformer, shifted_labels
from experiments.harness.train import build, packed_cu_seqlens
from upipe.documents import documents
from upipe.registry import available_methods, get_method
from upipe.stack import IGNORE_INDEX

REFUSING = [m for m in available_methods() if get_method(m).documents_unsupported]

# 3 layers (the middle one offloaded), 8 heads over 2 KV heads: test_train's small model
OVERRIDES = (("n_layers", "3"), ("dim", "64"), ("n_heads", "8"), ("n_kv_heads", "2"),
             ("head_dim", "8"), ("ffn_dim", "96"), ("vocab_size", "128"))
# 96 tokens as documents of 40 and 56: the boundary (40) is inside rank 0's shard on 2 ranks
PACKED = Cell("upipe", "tiny", seq_len=96, nproc=2, stack="alst", overrides=OVERRIDES,
              warmup=0, iters=0, lr=1e-3, doc_len=40)


# -- the cell option ---------------------------------------------------------------------------


@pytest.mark.parametrize("doc_len", [0, -4, 4097])
def test_doc_len_out_of_range_is_refused(doc_len):
    with pytest.raises(ValueError, match=r"doc_len must be between 2 and seq_len \(4096\)"):
        Cell("upipe", doc_len=doc_len).validate()


@pytest.mark.parametrize("method", REFUSING)
def test_methods_without_document_masking_refuse_doc_len(method):
    """Refused by validation, before any process starts: an ``invalid`` row, not a launch."""
    assert REFUSING  # torch-cp, rfa-zigzag and ds-fpdt at least
    cell = Cell(method, stack="native" if method == "torch-cp" else "alst", doc_len=1024,
                options={"chunk_size": 1024} if method == "ds-fpdt" else {})
    dataclasses.replace(cell, doc_len=None).validate()  # fine unpacked
    with pytest.raises(ValueError, match=rf"doc_len .*not supported by '{method}'"):
        cell.validate()
    row = run_cell(cell)
    assert row["status"] == "invalid" and "doc_len" in row["error"]


def test_doc_len_enters_the_id_only_when_set():
    """Ids of unpacked cells are those from before the field existed (results/ resumes by id);
    a row written before the field existed loads as an unpacked cell."""
    plain = Cell("upipe", seq_len=8192)
    packed = dataclasses.replace(plain, doc_len=2048)
    assert "-d" not in plain.cell_id().removeprefix("upipe")
    assert packed.cell_id().startswith("upipe-tiny-8K-d2K-p4-alst-fp32-")
    assert packed.cell_id()[-8:] != plain.cell_id()[-8:]
    assert Cell.from_dict(packed.to_dict()) == packed
    old = {k: v for k, v in plain.to_dict().items() if k != "doc_len"}
    assert Cell.from_dict(old) == plain and Cell.from_dict(old).cell_id() == plain.cell_id()


def test_doc_len_flag_takes_sizes():
    a = parser().parse_args(["run", "--method", "upipe", "--seq-len", "8K", "--doc-len", "2K"])
    assert cell_from_args(a).doc_len == 2048
    a = parser().parse_args(["emulate", "--method", "upipe", "--seq-len", "1M",
                             "--doc-len", "64K"])
    assert cell_from_args(a, emulated=True).doc_len == 65536
    with pytest.raises(ValueError, match="doc_len"):
        cell_from_args(parser().parse_args(["run", "--method", "torch-cp", "--doc-len", "1K"]))


# -- documents and labels ----------------------------------------------------------------------


def test_packed_cu_seqlens():
    assert packed_cu_seqlens(8, 2) == [0, 2, 4, 6, 8]
    assert packed_cu_seqlens(10, 4) == [0, 4, 10]  # the last document holds the remainder
    assert packed_cu_seqlens(8, 8) == [0, 8]  # one document: the unpacked path
    assert packed_cu_seqlens(8, None) is None
    assert documents(packed_cu_seqlens(96, 40), 96).bounds == (0, 40, 96)
    assert documents(packed_cu_seqlens(8, 8), 8) is None
    with pytest.raises(ValueError, match="doc_len"):
        packed_cu_seqlens(8, 9)


def test_labels_do_not_cross_documents():
    t = torch.arange(10).unsqueeze(0)
    labels = shifted_labels(t, [0, 4, 10])
    assert labels.tolist() == [[1, 2, 3, IGNORE_INDEX, 5, 6, 7, 8, 9, IGNORE_INDEX]]
    assert shifted_labels(t, [0, 0, 10]).tolist() == shifted_labels(t).tolist()  # empty doc
    state = build(dataclasses.replace(PACKED, nproc=1), PACKED.validate(), distributed=False)
    assert state.cu_seqlens == [0, 40, 96]
    assert state.n_label_tokens == 96 - 2 == int((state.labels != IGNORE_INDEX).sum())


CFG = resolve_model("tiny", OVERRIDES)


def _loss_and_grads(model: Transformer, tokens: torch.Tensor, cu_seqlens=None):
    model.zero_grad(set_to_none=True)
    loss = model(tokens, shifted_labels(tokens, cu_seqlens), cu_seqlens)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("method", ["ulysses", "upipe"])
@pytest.mark.parametrize("stack", ["none", "alst", "megatron-ds"])  # megatron-ds: reentrant
def test_packed_step_is_the_sum_of_its_documents(method, stack):
    """One process, world 1, fp32: the packed loss sum and gradients equal the sums over the
    documents run alone. Through every checkpoint (non-reentrant and reentrant: the recomputation
    gets the documents too), offload and the tiled MLP. Tolerance: the same per-document
    attention blocks; matmuls over 96 vs 40/56 rows and the summation order of the loss and
    of the gradients over tokens differ at fp32 round-off (~1e-7 relative of sums of <= 96)."""
    torch.manual_seed(0)
    model = Transformer(CFG, method, STACKS[stack])
    tokens = torch.randint(0, CFG.vocab_size, (1, 96), generator=torch.Generator().manual_seed(1))
    cu = [0, 40, 96]
    loss, grads = _loss_and_grads(model, tokens, cu)
    ref_loss, ref_grads = 0.0, {}
    for a, b in zip(cu[:-1], cu[1:], strict=True):
        doc_loss, doc_grads = _loss_and_grads(model, tokens[:, a:b])
        ref_loss = ref_loss + doc_loss
        ref_grads = {n: ref_grads.get(n, 0) + g for n, g in doc_grads.items()}
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    # and the documents matter: the unpacked step differs
    assert not torch.allclose(_loss_and_grads(model, tokens)[0], loss)


# -- a real 2-rank step, and the emulated one --------------------------------------------------


def _losses(cell_dict: dict) -> list[float]:
    """Three AdamW steps of the cell (in the DistPool's workers, or in this process)."""
    cell = Cell.from_dict(cell_dict)
    state = build(cell, cell.validate(), distributed=dist.is_initialized())
    sums = torch.stack([state.step() for _ in range(3)])
    if dist.is_initialized():
        dist.all_reduce(sums)
    return (sums / state.n_label_tokens).tolist()


def test_packed_gloo_step_matches_one_process(dist_pool):
    """2 gloo ranks (FSDP2, UPipe, the ALST stack) train the packed sequence as one process
    does; 1e-5 relative as tests/test_train.py (per-rank partial gradient sums vs one device's,
    carried by AdamW)."""
    reference = _losses(dataclasses.replace(PACKED, nproc=1).to_dict())
    for rank_losses in dist_pool(2).run(_losses, PACKED.to_dict()):
        torch.testing.assert_close(rank_losses, reference, rtol=1e-5, atol=0)
    assert reference[2] < reference[0]


KEYS = ("tracked_peak_device_bytes", "peak_host_bytes", "peak_model_bytes",
        "peak_attention_bytes", "peak_other_bytes")


def _real_memory(cell_dict: dict) -> dict:
    from experiments.harness.measure import measure_cell

    cell = Cell.from_dict(cell_dict)
    row = measure_cell(cell, cell.validate())
    assert row["status"] == "ok", row["error"]
    return {k: row[k] for k in KEYS}


@pytest.mark.slow  # about 4 s on 2 cores (docs/testing.md)
def test_emulated_packed_step_equals_the_real_one_and_needs_no_more(dist_pool):
    """The emulator passes the documents as the real run does (host ints under fake tensors):
    its memory equals the real gloo run's to the byte (as tests/test_emulate.py for unpacked
    cells), and packing never raises the peak (each document's attention block is a part of
    the unpacked one)."""
    cell = dataclasses.replace(PACKED, seq_len=512, doc_len=160, warmup=1)
    real = dist_pool(2).run(_real_memory, cell.to_dict())[0]  # rank 0, as the emulator plays
    hw = Hardware(device="cpu")
    emulated = emulate_cell(cell, hw, exact=True, count=False)
    unpacked = emulate_cell(dataclasses.replace(cell, doc_len=None), hw, exact=True, count=False)
    assert emulated["status"] == unpacked["status"] == "ok", emulated["error"]
    assert {k: emulated[k] for k in KEYS} == real
    assert emulated["peak_device_bytes"] <= unpacked["peak_device_bytes"]
    # the model FLOPs count each document's attention only (160^2 + 160^2 + 192^2 of 512^2)
    assert emulated["doc_len"] == 160
    assert emulated["model_tflops_per_step"] < unpacked["model_tflops_per_step"]
    assert lattice(dataclasses.replace(cell, doc_len=3000), CFG.dim) % 3000 == 0
