"""Which Hugging Face families the drop-in converts (upipe/integrations/hf_families.py).

Every family the allow-list admits runs, converted, against its unconverted copy (the recipe and
tolerance of tests/test_hf.py: fp32, only summation order differs, 1e-5 of each tensor's largest
entry plus 1e-6); every other causal-LM family of the installed ``transformers`` is refused by
name. Sliding windows: refused wherever an admitted family declares one shorter than the
longest span attention sees, accepted (and exact) where the window covers it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is absent")

from test_hf import SEQ, VOCAB, _batch, _close, _error, _run  # noqa: E402
from test_hf_packed import _packed_batch, _per_document_reference  # noqa: E402

from upipe.integrations.hf_families import FAMILIES  # noqa: E402

COMMON = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=8, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256)
# the MoE families' expert fields, as each names them, at a tiny size (set where present)
EXPERTS = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=32, shared_expert_intermediate_size=32)


def _family_model(spec) -> nn.Module:
    """Tiny random-init model of a family: ``spec`` is a model_type, or (model_type, config
    overrides) for the window cases."""
    model_type, overrides = (spec, {}) if isinstance(spec, str) else spec
    cfg = transformers.CONFIG_MAPPING[model_type](**COMMON, **overrides)
    for name, value in EXPERTS.items():
        if hasattr(cfg, name):
            setattr(cfg, name, value)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def test_every_admitted_family_is_a_causal_lm_of_the_installed_transformers():
    assert set(FAMILIES) <= set(_causal_lm_types())


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_admitted_family_equals_its_unconverted_copy(dist_pool, model_type):
    results = dist_pool(2).run(_run, model_type, "upipe", {}, None, _family_model)
    ref = results[0]
    _close("loss", sum(r["loss"] for r in results), ref["ref_loss"])
    assert set(results[0]["grads"]) == set(ref["ref_grads"])
    for name in ref["ref_grads"]:
        _close(name, sum(r["grads"][name] for r in results), ref["ref_grads"][name])


class _Shell(nn.Module):
    """A model that is only its config: the family check comes before anything else."""

    def __init__(self, config):
        super().__init__()
        self.config = config


def _default_config(model_type: str):
    try:
        return transformers.CONFIG_MAPPING[model_type]()
    except Exception:  # a few need arguments (sub-configs, validated sizes): the type is enough
        cfg = transformers.PretrainedConfig()
        cfg.model_type = model_type
        return cfg


def test_every_other_family_is_refused_by_name():
    """Among them the ones that used to convert and give other numbers: Cohere and ERNIE-4.5
    (interleaved RoPE), DiffLlama, Llama 4, HunYuan; and the ones refused for a reason that did
    not say the family was unsupported (GPT-2, Gemma3, OLMo3, StableLM, Nemotron)."""
    from upipe.integrations import hf

    others = [t for t in _causal_lm_types() if t not in FAMILIES]
    assert {"cohere", "ernie4_5", "diffllama", "llama4", "gpt2", "gemma3", "olmo3", "stablelm",
            "nemotron"} <= set(others)
    for model_type in others:
        cfg = _default_config(model_type)  # gpt-sw3's config is GPT-2's: model_type 'gpt2'
        with pytest.raises(ValueError) as e:
            hf.parallelize(_Shell(cfg), "upipe")
        assert f"model_type {cfg.model_type!r} is not supported" in str(e.value), model_type
        assert str(sorted(FAMILIES)) in str(e.value)


@pytest.mark.parametrize("model_type, field, value", [
    ("starcoder2", "residual_dropout", 0.1), ("mixtral", "output_router_logits", True),
    ("qwen2_moe", "output_router_logits", True), ("qwen3_moe", "output_router_logits", True)])
def test_what_a_family_computes_beyond_attention_is_refused(model_type, field, value):
    from upipe.integrations import hf

    model = _family_model((model_type, {field: value}))
    with pytest.raises(ValueError, match=rf"{field} \({value}\) must be off for model_type"):
        hf.parallelize(model, "upipe")


def _router_loss_at_the_call() -> str | None:
    from upipe.integrations import hf

    model = hf.parallelize(_family_model("mixtral"), "upipe", kernel="math")
    err = _error(model, **hf.shard_batch(model, *_batch()), output_router_logits=True)
    dist.barrier()
    return err


def test_the_router_loss_asked_for_at_the_call_is_refused_on_every_rank(dist_pool):
    for err in dist_pool(2).run(_router_loss_at_the_call):
        assert "output_router_logits (True) must be off" in err


# (model_type, config overrides): a window shorter than SEQ (48), declared where the family does
SHORT_WINDOWS = [
    ("mistral", {"sliding_window": 32}),  # config, every layer (MistralConfig's default: 4096)
    ("mixtral", {"sliding_window": 32}),
    ("starcoder2", {"sliding_window": 32}),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 32}),  # config, its mask
    ("qwen2", {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 1}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 1}),
    ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 2}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 32,  # per-layer types given
               "layer_types": ["full_attention", "sliding_attention"], "max_window_layers": 2}),
]


def _short_windows() -> list:
    """Every rank: the error of a call with each short window (all ranks refuse; none hangs)."""
    from upipe.integrations import hf

    ids, labels = _batch()
    out = []
    for spec in SHORT_WINDOWS:
        model = hf.parallelize(_family_model(spec), "upipe", kernel="math")
        out.append(_error(model, **hf.shard_batch(model, ids, labels)))
    dist.barrier()
    return out


def test_a_sliding_window_shorter_than_the_sequence_is_refused_wherever_declared(dist_pool):
    for errors in dist_pool(2).run(_short_windows):
        for (model_type, _), err in zip(SHORT_WINDOWS, errors, strict=True):
            assert err is not None, model_type
            assert "sliding_window (32) must be None or at least" in err, (model_type, err)
            assert "(48 tokens: the sequence)" in err


@pytest.mark.parametrize("spec", [
    ("mistral", {"sliding_window": SEQ}),  # covers the sequence: what HF computes is full causal
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}),
], ids=["mistral-window-48", "qwen2-window-on-no-layer"])
def test_a_window_that_changes_nothing_is_accepted_and_exact(dist_pool, spec):
    results = dist_pool(2).run(_run, spec, "upipe", {}, None, _family_model)
    ref = results[0]
    _close("loss", sum(r["loss"] for r in results), ref["ref_loss"])
    for name in ref["ref_grads"]:
        _close(name, sum(r["grads"][name] for r in results), ref["ref_grads"][name])


def _packed_window(window: int) -> dict:
    """Packed documents (longest: 20 tokens) under a Mistral window of ``window`` tokens."""
    from upipe.integrations import hf

    ref = _family_model(("mistral", {"sliding_window": window}))
    model = hf.parallelize(copy.deepcopy(ref), "upipe", kernel="math")
    ids, labels, pos = _packed_batch()
    batch = hf.shard_batch(model, ids, labels, position_ids=pos)
    err = _error(model, **batch)
    if err is not None:
        return {"error": err}
    out = model(**batch)
    out.loss.backward()
    res = {"error": None, "loss": out.loss.detach(),
           "grads": {n: p.grad for n, p in model.named_parameters()}}
    return res | (_per_document_reference(ref, ids, labels) if dist.get_rank() == 0 else {})


def test_packed_documents_need_the_window_to_cover_the_longest_document(dist_pool):
    for r in dist_pool(2).run(_packed_window, 19):
        assert "sliding_window (19)" in r["error"] and "longest packed document" in r["error"]
    results = dist_pool(2).run(_packed_window, 20)
    assert all(r["error"] is None for r in results)
    ref = results[0]
    _close("loss", sum(r["loss"] for r in results), ref["ref_loss"])
    for name in ref["ref_grads"]:
        _close(name, sum(r["grads"][name] for r in results), ref["ref_grads"][name])


def test_layer_window_reads_every_declaration_and_refuses_unknown_layers():
    from types import SimpleNamespace as NS

    from upipe.integrations.hf_families import Family, layer_window

    attn, plain = NS(sliding_window=None), Family()
    assert layer_window(NS(sliding_window=8), plain, attn, 0) is None  # not read by the family
    assert layer_window(NS(sliding_window=8), Family(window_in_config=True), attn, 0) == 8
    assert layer_window(NS(), plain, NS(sliding_window=5), 0) == 5  # the module's own
    types = NS(sliding_window=8, layer_types=["full_attention", "sliding_attention"])
    assert [layer_window(types, plain, attn, i) for i in (0, 1)] == [None, 8]
    with pytest.raises(ValueError, match="sliding_window is not set"):
        layer_window(NS(sliding_window=None, layer_types=["sliding_attention"]), plain, attn, 0)
    with pytest.raises(ValueError, match=r"layer_types\[0\] is 'chunked_attention'"):
        layer_window(NS(layer_types=["chunked_attention"]), plain, attn, 0)
