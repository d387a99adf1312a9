"""Packed documents through the Hugging Face drop-in: ``shard_batch(..., position_ids=...)``.

Ground truth: the *unmodified* model run on each document separately (positions from 0), its
token losses summed over all documents and divided by the number of targets of all of them
(``num_items_in_batch``), so a document's last token has no target. The sum over CP ranks of the
parallelized model's loss and of every gradient must equal it. Tolerance as tests/test_hf.py
(fp32; only summation order differs): 1e-5 of each tensor's largest entry plus 1e-6.

The documents are awkward on purpose (48 tokens: 1, 10, 20 and 17), so on 2 and 4 ranks they
straddle rank shards, zigzag chunks and FPDT chunks, and one of them is a single token.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers", reason="the hf extra (transformers) is absent")

from test_hf import SEQ, VOCAB, _close, _error, _model  # noqa: E402

DOC_LENS = (1, 10, 20, 17)  # sums to SEQ


def _packed_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, labels, position_ids) of a batch of 2 rows packing the same documents."""
    assert sum(DOC_LENS) == SEQ
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = ids.clone()
    labels[1, 12:15] = -100  # tokens without a loss inside a document
    pos = torch.cat([torch.arange(n) for n in DOC_LENS]).expand(2, -1)
    return ids, labels, pos


def _per_document_reference(ref, ids, labels) -> dict:
    """The unmodified model on each document alone: summed token loss / all targets."""
    docs = list(itertools.pairwise([0, *itertools.accumulate(DOC_LENS)]))
    n_targets = sum(int((labels[:, a + 1:b] != -100).sum()) for a, b in docs)
    loss = sum(ref(input_ids=ids[:, a:b], labels=labels[:, a:b],
                   num_items_in_batch=n_targets).loss for a, b in docs)
    loss.backward()
    return {"ref_loss": loss.detach(),
            "ref_grads": {n: p.grad for n, p in ref.named_parameters()}}


def _run_packed(family: str, method: str, options: dict, stack: str | None,
                mesh_shape: tuple | None = None) -> dict:
    from upipe.integrations import hf

    ref = _model(family)
    model = copy.deepcopy(ref)
    kw = dict(options)
    if mesh_shape is not None:
        from cases import cp_mesh

        kw["mesh"] = cp_mesh(*mesh_shape)
    hf.parallelize(model, method, kernel="math", stack=stack, **kw)
    ids, labels, pos = _packed_batch()
    batch = hf.shard_batch(model, ids, labels, position_ids=pos)
    out = model(**batch)
    out.loss.backward()
    res = {"loss": out.loss.detach(), "cu": batch.get("cu_seq_lens_q"),
           "grads": {n: p.grad for n, p in model.named_parameters()}}
    if dist.get_rank() == 0:
        res |= _per_document_reference(ref, ids, labels)
    return res


CASES = [  # (world, family, method, options, stack, mesh)
    (2, "llama", "upipe", {}, None, None),
    (2, "llama", "upipe", {}, "alst", None),
    (4, "llama", "upipe", {"heads_per_stage": 8}, None, None),
    (4, "llama", "ulysses", {}, "alst", None),
    (4, "llama", "zigzag-ring", {}, None, None),
    (2, "llama", "ring", {}, "offload", None),
    (4, "llama", "upipe", {}, None, (2, 2)),
    (2, "qwen3", "upipe", {}, None, None),
    (4, "qwen3", "upipe", {}, "alst", None),
    (2, "qwen3", "ulysses", {}, "ac", None),
    (2, "llama-plain", "fpdt", {"chunk_size": 16}, None, None),
]


@pytest.mark.parametrize(
    "world,family,method,options,stack,mesh", CASES,
    ids=[f"w{w}-{f}-{m}" + "".join(f"-{k}{v}" for k, v in o.items()) + f"-{s or 'nostack'}"
         + ("-mesh2x2" if mesh else "") for w, f, m, o, s, mesh in CASES])
def test_packed_loss_and_gradients_equal_each_document_run_alone(dist_pool, world, family, method,
                                                                  options, stack, mesh):
    results = dist_pool(world).run(_run_packed, family, method, options, stack, mesh)
    ref = results[0]
    assert all(r["cu"] == (0, 1, 11, 31, 48) for r in results)
    _close("loss", sum(r["loss"] for r in results), ref["ref_loss"])
    for name in ref["ref_grads"]:
        _close(name, sum(r["grads"][name] for r in results), ref["ref_grads"][name])


def _position_ids_handling() -> dict:
    """Every rank: what the converted model does with position_ids and masks given directly."""
    from upipe.integrations import hf

    torch.manual_seed(0)
    model = hf.parallelize(_model("llama"), "upipe", kernel="math")
    ids, labels, pos = _packed_batch()
    m = model.upipe_cp_method
    packed = hf.shard_batch(model, ids, labels, position_ids=pos)
    plain = hf.shard_batch(model, ids, labels)
    with torch.no_grad():
        base = model(**plain).loss
        own = model(**plain, position_ids=m.shard(torch.arange(SEQ).expand(2, -1))).loss
        ones = model(**plain, attention_mask=torch.ones_like(plain["input_ids"])).loss
        packed_loss = model(**packed).loss
        consistent = model(**packed, position_ids=m.shard(pos)).loss
    out = {"own_positions_honoured": torch.equal(base, own),
           "all_ones_mask_accepted": torch.equal(base, ones),
           "consistent_position_ids_honoured": torch.equal(packed_loss, consistent),
           "packed_differs": not torch.equal(packed_loss, base)}
    # packed position_ids without the documents: refused, not ignored (the defect)
    out["bare_packed_position_ids"] = _error(model, **plain, position_ids=m.shard(pos))
    padding = torch.ones_like(plain["input_ids"])
    padding[0, -1] = 0
    out["padding_mask"] = _error(model, **plain, attention_mask=padding)
    dist.barrier()  # every rank got here: nothing hung
    return out


def test_position_ids_are_honoured_or_refused_never_ignored(dist_pool):
    for r in dist_pool(2).run(_position_ids_handling):
        assert r["own_positions_honoured"] and r["all_ones_mask_accepted"]
        assert r["consistent_position_ids_honoured"] and r["packed_differs"]
        assert "must be this rank's tokens' own positions" in r["bare_packed_position_ids"]
        assert "attention_mask with padding" in r["padding_mask"]
        assert "position_ids to hf.shard_batch" in r["padding_mask"]  # points to packing


def _ranks_disagree() -> dict:
    """Every rank: the error of a call where only rank 0's position_ids are wrong, and of one
    where the ranks pass different documents; then a barrier (nothing hung)."""
    from upipe.integrations import hf

    torch.manual_seed(0)
    model = hf.parallelize(_model("llama"), "upipe", kernel="math")
    ids, labels, pos = _packed_batch()
    m = model.upipe_cp_method
    plain = hf.shard_batch(model, ids, labels)
    own = m.shard(torch.arange(SEQ).expand(2, -1))
    out = {"positions": _error(model, **plain,
                               position_ids=torch.zeros_like(own) if m.rank == 0 else own)}
    cu = (0, 10, SEQ) if m.rank == 0 else (0, 20, SEQ)
    out["documents"] = _error(model, **plain, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    dist.barrier()
    return out


def test_a_refusal_on_one_rank_is_raised_on_every_rank(dist_pool):
    """One rank's bad position_ids used to raise there while the other died in gloo ("Connection
    closed by peer"); ranks given different documents computed wrong attention silently."""
    first, second = dist_pool(2).run(_ranks_disagree)
    assert "must be this rank's tokens' own positions" in first["positions"]
    assert "another rank of the CP group refused its batch" in second["positions"]
    for r in (first, second):
        assert "were given different cu_seq_lens_q/_k" in r["documents"]


def test_bad_position_ids_are_refused():
    from upipe.documents import cu_seqlens_from_position_ids

    assert cu_seqlens_from_position_ids(torch.tensor([0, 1, 0, 0, 1, 2])) == [0, 2, 3, 6]
    for bad, rule in [(torch.tensor([1, 2, 3]), "start at 0"),
                      (torch.tensor([0, 1, 3, 4]), "count up by 1"),
                      (torch.tensor([[0, 1, 0, 1], [0, 1, 2, 3]]), "same documents"),
                      (torch.tensor([0.0, 1.0]), "integers")]:
        with pytest.raises(ValueError, match=rule):
            cu_seqlens_from_position_ids(bad)
