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
    if family == "qwen3-eps":  # K's norm with an epsilon of its own: each norm keeps its own
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
        for layer in model.model.layers:
            layer.self_attn.k_norm.variance_epsilon = 0.5
        return model
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
    (2, "qwen3-eps", "upipe", {}, None),
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


def _ignore_index_run() -> dict:
    """This rank's loss share with targets marked by ``ignore_index=-1``, and (rank 0) the
    unmodified model's with the same targets marked -100."""
    from upipe.integrations import hf

    ref = _model("llama")
    model = hf.parallelize(copy.deepcopy(ref), "upipe", kernel="math")
    ids, labels = _batch()
    mine = labels.masked_fill(labels == -100, -1)
    mine[1, 20:30] = -1
    out = {"loss": model(**hf.shard_batch(model, ids, mine, ignore_index=-1)).loss.detach()}
    if dist.get_rank() == 0:
        want = labels.clone()
        want[1, 20:30] = -100
        out["ref_loss"] = ref(input_ids=ids, labels=want).loss.detach()
    return out


@pytest.mark.slow  # about 1 s on 2 cores (docs/testing.md)
def test_ignore_index_marks_tokens_without_a_loss(dist_pool):
    """``shard_batch(..., ignore_index=)`` names the no-target value of the labels it is given;
    the batch it returns marks those tokens -100, which the model's loss ignores unasked."""
    results = dist_pool(2).run(_ignore_index_run)
    _close("loss", sum(r["loss"] for r in results), results[0]["ref_loss"])


class _Adapter(torch.nn.Module):
    """A module swapped in for a projection, as PEFT's LoRA layers are: base + B(A(x))."""

    def __init__(self, base: torch.nn.Linear):
        super().__init__()
        self.base = base
        self.a = torch.nn.Linear(base.in_features, 4, bias=False)
        self.b = torch.nn.Linear(4, base.out_features, bias=False)

    def forward(self, x):
        return self.base(x) + self.b(self.a(x))


class _LinearLoRA(torch.nn.Linear):
    """A LoRA layer that is an nn.Linear (loralib's style): its own forward adds B(A(x))."""

    def __init__(self, base: torch.nn.Linear):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None)
        self.load_state_dict(base.state_dict())
        self.lora_a = torch.nn.Linear(base.in_features, 4, bias=False)
        self.lora_b = torch.nn.Linear(4, base.out_features, bias=False)

    def forward(self, x):
        return super().forward(x) + self.lora_b(self.lora_a(x))


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
    one_rank = torch.ones_like(batch["input_ids"])
    one_rank[:, -1] = int(dist.get_rank() == 0)  # padding in rank 1's shard alone
    msgs.append(_error(model, **batch, attention_mask=one_rank))
    msgs.append(_error(model, input_ids=batch["input_ids"], labels=batch["labels"]))
    msgs.append(_error(hf.parallelize, transformers.LlamaForSequenceClassification(
        transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=96, intermediate_size=64,
                                 num_hidden_layers=1, num_attention_heads=8,
                                 num_key_value_heads=2, pad_token_id=0)), "upipe"))
    msgs.append(_error(hf.parallelize, _model("llama"), "upipe", heads_per_stage=4.0))
    layer = model.model.layers[1].self_attn
    layer.q_proj = _Adapter(layer.q_proj)  # as PEFT injects LoRA
    msgs.append(_error(model, **batch))
    # an nn.Linear subclass before parallelize, in the last layer: refused, nothing converted
    fresh = _model("llama")
    fresh.model.layers[1].self_attn.q_proj = _LinearLoRA(fresh.model.layers[1].self_attn.q_proj)
    msgs.append(_error(hf.parallelize, fresh, "upipe"))
    msgs.append(type(fresh.model.layers[0].self_attn).__name__)
    # the decoder called directly (a custom loss): the model's checks, on every rank
    model = hf.parallelize(_model("llama"), "upipe")
    local = batch["input_ids"].shape[1]
    packed = torch.arange(SEQ // 2).repeat(2)[None]  # two documents' positions, unsharded
    msgs.append(_error(model.model, input_ids=batch["input_ids"],
                       position_ids=packed[:, dist.get_rank() * local:][:, :local]))
    msgs.append(_error(model.model, input_ids=batch["input_ids"], attention_mask=one_rank))
    msgs.append(_error(model, **batch, output_attentions=True))
    # a call through the causal LM is checked once, and a direct call after it still is
    model(**batch)
    assert _error(model.model, input_ids=batch["input_ids"], attention_mask=padding)
    dist.barrier()  # every rank got here: nothing hung
    return msgs


@pytest.mark.slow  # about 1-2 s on 2 cores (docs/testing.md)
def test_misuse_is_refused_on_every_rank(dist_pool):
    for rank, msgs in enumerate(dist_pool(2).run(_bad_inputs)):
        (fpdt, heads, short, mask, cache, twice, one_rank, labels, head, u_float, lora,
         subclass, first_layer, direct_positions, direct_one_rank, attentions) = msgs
        assert fpdt is not None and "'fpdt' does not support ['qkv_bias']" in fpdt
        assert heads is not None and "heads_per_stage" in heads
        assert short is not None and "divisible" in short
        assert mask is not None and "attention_mask" in mask
        assert cache is not None and "use_cache=False" in cache
        assert twice is not None and "already context-parallel ('upipe')" in twice
        # the rank with padding names it; the other stops too instead of entering a collective
        assert one_rank is not None and ("attention_mask with padding" in one_rank if rank == 1
                                         else "another rank of the CP group" in one_rank)
        assert labels is not None and "need shift_labels and num_items_in_batch" in labels
        assert head is not None and "must be a causal LM (LlamaForCausalLM)" in head
        assert u_float is not None and "heads_per_stage must be an integer, got 4.0" in u_float
        assert lora is not None and "self_attn.q_proj was replaced" in lora
        # a LoRA nn.Linear subclass was taken and its forward never ran (loss without it)
        assert subclass is not None and "must be an nn.Linear, got _LinearLoRA" in subclass
        assert first_layer == "LlamaAttention"  # a refusal at layer 1 left layer 0 as it was
        # model.model(...) ignored packed position_ids, and a one-rank mask killed the others
        # (rank 0's share of two 24-token documents is its global positions; rank 1's is not)
        assert direct_positions is not None and (
            "position_ids must be" in direct_positions if rank == 1
            else "another rank of the CP group" in direct_positions)
        assert direct_one_rank is not None and (
            "attention_mask with padding" in direct_one_rank if rank == 1
            else "another rank of the CP group" in direct_one_rank)
        assert attentions is not None and "output_attentions is not supported" in attentions


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
