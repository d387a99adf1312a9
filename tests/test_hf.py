"""upipe.integrations.hf: a Hugging Face causal LM made context-parallel equals the original.

Recipe (docs/conventions.md#the-reference-comparison-recipe): every rank builds the same random-init
tiny model (seeded), keeps an unmodified copy, converts the other with ``parallelize``, runs its
shard of one full batch (``shard_batch``) forward and backward, and returns its loss share and
gradients. The sum over ranks must equal the unmodified model's mean token loss and gradients on the
full sequence.

Tolerance: fp32 throughout; the CP paths differ from the reference only in summation order
(per-rank partial losses and gradients summed over ranks, LSE-merged ring blocks, per-stage
weight-row accumulation), i.e. a few ulp of the largest value: 1e-5 relative to each tensor's
largest entry, with 1e-6 absolute for near-zero tensors.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is absent")

SEQ = 48  # not a power of two; divisible by 2 x 4 (zigzag on 4 ranks)
VOCAB = 96


def _model(family: str):
    """Tiny random-init model: 8 query heads, 2 KV heads, head_dim 16 (not hidden / heads)."""
    common = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=256)
    torch.manual_seed(0)
    if family == "llama":  # Llama 3.1's "llama3" rope scaling: non-default inverse frequencies
        cfg = transformers.LlamaConfig(**common, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
        return transformers.LlamaForCausalLM(cfg)
    if family == "llama-plain":  # theta's RoPE, bias-free: what every method computes
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    if family == "qwen2":  # q/k/v biases
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    if family == "qwen3":  # per-head q/k RMSNorm
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    raise ValueError(family)


def _batch(seq: int = SEQ, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, seq), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # tokens without a loss: counted out of num_items_in_batch
    return ids, labels


def _run(family: str, method: str, options: dict, mesh_shape: tuple | None = None,
         build=_model, batch=_batch) -> dict:
    """On every rank: this rank's loss share and gradients, and the reference's (rank 0).

    ``build(family)`` and ``batch()`` make the model and the full batch (tests/test_hf_stack.py
    passes its own); ``options`` go to ``parallelize``.
    """
    from upipe.integrations import hf

    ref = build(family)
    model = copy.deepcopy(ref)
    kw = dict(options)
    if mesh_shape is not None:
        from cases import cp_mesh

        kw["mesh"] = cp_mesh(*mesh_shape)
    hf.parallelize(model, method, kernel="math", **kw)
    ids, labels = batch()
    out = model(**hf.shard_batch(model, ids, labels))
    out.loss.backward()
    res = {"loss": out.loss.detach(), "logits": out.logits is not None,
           "grads": {n: p.grad for n, p in model.named_parameters()}}
    if dist.get_rank() == 0:
        r = ref(input_ids=ids, labels=labels)
        r.loss.backward()
        res["ref_loss"] = r.loss.detach()
        res["ref_grads"] = {n: p.grad for n, p in ref.named_parameters()}
    return res


def _close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    tol = 1e-5 * want.abs().max().item() + 1e-6
    err = (got - want).abs().max().item()
    assert err <= tol, f"{name}: max |diff| {err:.3g} > {tol:.3g}"


CASES = [  # (world, family, method, options, mesh)
    (2, "llama", "upipe", {}, None),
    (2, "llama", "upipe", {"heads_per_stage": 4}, None),
    (4, "llama", "upipe", {}, None),
    (4, "llama", "ulysses", {}, None),
    (4, "llama", "zigzag-ring", {}, None),
    (4, "llama", "upipe", {}, (2, 2)),
    (2, "qwen2", "upipe", {}, None),
    (2, "qwen2", "upipe", {"overlap": True}, None),  # biases, with the kept last stage
    (4, "qwen2", "ulysses", {}, None),
    (2, "qwen3", "upipe", {}, None),
    (2, "qwen3", "upipe", {"overlap": True}, None),  # QK-norm, with the kept last stage
    (4, "qwen3", "upipe", {}, None),
    (2, "qwen3", "ring", {}, None),
    (2, "llama-plain", "fpdt", {"chunk_size": 16}, None),
]


@pytest.mark.parametrize("world,family,method,options,mesh", CASES,
                         ids=[f"w{w}-{f}-{m}" + "".join(f"-{k}{v}" for k, v in o.items())
                              + ("-mesh2x2" if mesh else "") for w, f, m, o, mesh in CASES])
@pytest.mark.slow  # about 4 s on 2 cores (docs/testing.md)
def test_same_loss_and_gradients_as_the_unmodified_model(dist_pool, world, family, method,
                                                         options, mesh):
    results = dist_pool(world).run(_run, family, method, options, mesh)
    ref = results[0]
    _close("loss", sum(r["loss"] for r in results), ref["ref_loss"])
    names = ref["ref_grads"].keys()
    assert set(results[0]["grads"]) == set(names)  # same parameters, same names
    for name in names:
        got = sum(r["grads"][name] for r in results)
        _close(name, got, ref["ref_grads"][name])


def _error(fn, *args, **kwargs) -> str | None:
    try:
        fn(*args, **kwargs)
    except ValueError as e:
        return str(e)
    return None


def _bad_inputs() -> list:
    """Each misuse raises a ValueError on every rank before any collective (no rank hangs)."""
    from upipe.integrations import hf

    msgs = [_error(hf.parallelize, _model("qwen2"), "fpdt"),  # fpdt: bias-free projections only
            _error(hf.parallelize, _model("llama"), "upipe", heads_per_stage=3)]
    model = hf.parallelize(_model("llama"), "upipe")
    ids, _ = _batch()
    msgs.append(_error(hf.shard_batch, model, ids[:, :SEQ - 1]))  # not divisible by CP
    batch = hf.shard_batch(model, ids)
    padding = torch.ones_like(batch["input_ids"])
    padding[:, -1] = 0  # a padding mask (an all-ones one is accepted: tests/test_hf_packed.py)
    msgs.append(_error(model, **batch, attention_mask=padding))
    msgs.append(_error(model, **batch, use_cache=True))
    msgs.append(_error(hf.parallelize, model, "ulysses"))  # twice
    dist.barrier()  # every rank got here: nothing hung
    return msgs


@pytest.mark.slow  # about 1-2 s on 2 cores (docs/testing.md)
def test_misuse_is_refused_on_every_rank(dist_pool):
    for fpdt, heads, short, mask, cache, twice in dist_pool(2).run(_bad_inputs):
        assert fpdt is not None and "'fpdt' does not support ['qkv_bias']" in fpdt
        assert heads is not None and "heads_per_stage" in heads
        assert short is not None and "divisible" in short
        assert mask is not None and "attention_mask" in mask
        assert cache is not None and "use_cache=False" in cache
        assert twice is not None and "already context-parallel ('upipe')" in twice


def _bf16_errors(family: str) -> tuple[float, float]:
    """Max |logit error| vs an fp32 reference: the HF model in bf16 (SDPA) and the converted one."""
    from upipe.integrations import hf

    ref = _model(family).cuda()
    ids = _batch()[0].cuda()
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        base = ref.to(torch.bfloat16)
        plain = base(input_ids=ids).logits.float()
        model = hf.parallelize(copy.deepcopy(base), "upipe")  # one process: CP degree 1
        got = model(input_ids=ids).logits.float()
    return (plain - want).abs().max().item(), (got - want).abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_bf16_on_cuda_is_as_accurate_as_the_unmodified_model(family):
    """CUDA kernels (SDPA flash in bf16), single process: the flash-attention tolerance rule
    (error at most about twice the plain model's in the same precision, vs fp32)."""
    plain_err, err = _bf16_errors(family)
    assert err <= 2 * plain_err + 1e-3, f"upipe {err:.3g} vs unmodified bf16 {plain_err:.3g}"
