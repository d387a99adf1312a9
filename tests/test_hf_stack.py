"""``hf.parallelize(..., stack=...)``: the memory stack in a Hugging Face causal LM changes memory,
not the step.

Recipe (docs/conventions.md#the-reference-comparison-recipe, as tests/test_hf.py): every rank builds
the same random-init tiny model, keeps an unmodified copy, converts the other with
``parallelize(..., stack=...)``, runs its shard of one full batch forward and backward; the sum over
ranks of the loss and of every gradient must equal the unmodified model's on the full sequence. The
sequence is long enough for the tiled MLP to use several shards (local L > hidden) and the chunked
loss several chunks.

Tolerance: fp32 throughout. Checkpointing and offload replay the same ops on the same values
(exact); the CP paths, the tiled MLP (weight gradients summed over sequence shards) and the
chunked loss (the head's gradient summed over token chunks) change only fp32 summation order,
i.e. a few ulp of the largest value: 1e-5 relative to each tensor's largest entry, with 1e-6
absolute for near-zero tensors (the same rule as tests/test_hf.py).

The memory test (one process, CP degree 1) measures each level's peak with the project's
tracker and asserts what each saves, from the shapes; ``pytest -s`` prints the figures.
"""

from __future__ import annotations

import copy
import dataclasses
from functools import partial

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is absent")

from test_hf import _batch, _close, _run  # noqa: E402  (the recipe and its tolerance; no tests)

from experiments.config import STACKS  # noqa: E402  (after the importorskip)
from experiments.instruments.memory import MemoryTracker  # noqa: E402
from upipe.stack import LEVELS, MemoryStack, loss_chunk_tokens  # noqa: E402

HIDDEN = 32
SEQ = 280  # not a power of two; divisible by 2 x 4 (zigzag on 4 ranks); local 140 or 70 > HIDDEN
VOCAB = 96
TILED_ONLY = MemoryStack(checkpoint=False, offload=False, tiled=True, chunked_loss=False)
LOSS_ONLY = MemoryStack(checkpoint=False, offload=False, tiled=False, chunked_loss=True)
# alst with its last two layers not checkpointed (the first recomputes)
UNCHECKPOINTED = dataclasses.replace(LEVELS["alst"], uncheckpointed_layers=2)


def _model(family: str):
    """Tiny random-init model, 3 layers (the middle one offloaded), hidden 32 < local L: 8 query
    heads, 2 KV heads, head_dim 16 (not hidden / heads). Built in training mode, which
    transformers' checkpointing needs."""
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48,
                  num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=512)
    torch.manual_seed(0)
    if family == "llama":  # Llama 3.1's rope scaling, untied head
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}))
    if family == "qwen3":  # per-head q/k RMSNorm
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    if family == "qwen3-tied":  # lm_head.weight is the embedding (small Qwen3 models)
        return transformers.Qwen3ForCausalLM(
            transformers.Qwen3Config(**common, tie_word_embeddings=True))
    raise ValueError(family)


CASES = [  # (world, family, method, stack)
    (2, "llama", "upipe", "ac"),
    (2, "llama", "upipe", "offload"),
    (2, "llama", "upipe", "alst"),
    (4, "llama", "ulysses", "alst"),
    (4, "llama", "zigzag-ring", "alst"),
    (2, "qwen3", "ulysses", "offload"),
    (4, "qwen3", "upipe", "alst"),
    (2, "qwen3", "upipe", TILED_ONLY),
    (4, "llama", "upipe", LOSS_ONLY),
    (2, "qwen3-tied", "ulysses", "alst"),
    (2, "llama", "upipe", "alst-attn"),
    (4, "llama", "upipe", "alst-attn-host"),
    (2, "qwen3", "ulysses", "alst-attn-host"),
    (4, "llama", "upipe", UNCHECKPOINTED),
]


def _id(case) -> str:
    w, family, method, stack = case
    name = (stack if isinstance(stack, str) else "uncheckpointed" if stack.uncheckpointed_layers
            else "tiled" if stack.tiled else "chunked_loss")
    return f"w{w}-{family}-{method}-{name}"


@pytest.mark.parametrize("world,family,method,stack", CASES, ids=[_id(c) for c in CASES])
def test_stack_computes_the_unmodified_models_step(dist_pool, world, family, method, stack):
    results = dist_pool(world).run(_run, family, method, {"stack": stack},
                                   build=_model, batch=partial(_batch, SEQ, VOCAB))
    ref = results[0]
    _close("loss", sum(r["loss"] for r in results), ref["ref_loss"])
    chunked = LEVELS[stack].chunked_loss if isinstance(stack, str) else stack.chunked_loss
    assert all(r["logits"] != chunked for r in results)  # no logits under the chunked loss
    names = ref["ref_grads"].keys()
    assert set(results[0]["grads"]) == set(names)  # same parameters, same names
    for name in names:
        _close(name, sum(r["grads"][name] for r in results), ref["ref_grads"][name])


def test_levels_are_the_harness_ladder():
    """The named levels switch what the harness's stacks of the same name switch."""
    for name, stack in LEVELS.items():
        harness = STACKS[name]
        assert (stack.checkpoint, stack.offload, stack.tiled, stack.chunked_loss,
                stack.keep_attention, stack.keep_on_host) == (
            harness.checkpoint, harness.offload, harness.tiled, harness.chunked_loss,
            harness.keep_attention, harness.keep_on_host), name


def test_bad_stack_is_refused_before_any_change():
    from upipe.integrations import hf

    model = _model("llama")
    with pytest.raises(ValueError, match="stack 'zero3' is not a memory-stack level"):
        hf.parallelize(model, "ulysses", stack="zero3")
    assert not hasattr(model, "upipe_cp_method")  # untouched: it can still be converted
    with pytest.raises(ValueError, match=r"MemoryStack.offload needs checkpoint=True"):
        MemoryStack(checkpoint=False, offload=True, tiled=False, chunked_loss=False)
    with pytest.raises(ValueError, match=r"MemoryStack.tiled must be a bool"):
        MemoryStack(checkpoint=True, offload=False, tiled="yes", chunked_loss=False)
    for bad in (["alst"], 3):  # a list raised "unhashable type"
        with pytest.raises(ValueError, match=r"is not a memory-stack level: choose one of"):
            hf.parallelize(model, "ulysses", stack=bad)
    for bad in (-1, 1.0, True):
        with pytest.raises(ValueError, match=r"MemoryStack.uncheckpointed_layers must be an int "
                                             ">= 0"):
            dataclasses.replace(LEVELS["alst"], uncheckpointed_layers=bad)
    with pytest.raises(ValueError, match=r"uncheckpointed_layers needs checkpoint=True"):
        MemoryStack(False, False, False, False, uncheckpointed_layers=1)
    too_many = dataclasses.replace(LEVELS["alst"], uncheckpointed_layers=len(
        model.model.layers) + 1)
    with pytest.raises(ValueError, match=r"uncheckpointed_layers must be at most the model's "):
        hf.parallelize(model, "ulysses", stack=too_many)
    assert not hasattr(model, "upipe_cp_method")  # refused before any change
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(VOCAB))
    with pytest.raises(ValueError, match=r"MemoryStack.chunked_loss needs .* bias-free"):
        hf.parallelize(model, "ulysses", stack="alst")
    hf.parallelize(model, "ulysses", stack="offload")  # the head is not the offload's business


def test_tiling_a_mixture_of_experts_is_refused_by_name():
    """A MoE block's router takes the whole (B, L, hidden) input: the tiled levels crashed in
    it (a view of a non-contiguous shard, then a 2-D shard where it unpacks three sizes). The
    levels without tiling convert it (their exactness: tests/test_hf_families.py)."""
    from upipe.integrations import hf

    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2)
    for level in ("alst", "alst-attn", "alst-attn-host"):
        model = transformers.MixtralForCausalLM(cfg)
        with pytest.raises(ValueError, match="MemoryStack.tiled needs a dense, per-token MLP .* "
                                             "MixtralSparseMoeBlock is a mixture of experts"):
            hf.parallelize(model, "ulysses", stack=level)
        assert not hasattr(model, "upipe_cp_method")  # refused before any change


def test_save_pretrained_names_the_models_own_class(tmp_path):
    """The stack swaps the model's class for a subclass (the chunked loss): the config that
    save_pretrained writes must still name a class transformers has."""
    import json

    from upipe.integrations.hf_stack import apply_stack

    model = _model("llama")
    apply_stack(model, LEVELS["alst"], cp=1, reentrant=False)
    assert type(model) is not transformers.LlamaForCausalLM  # the mixin is in
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"]
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(again) is transformers.LlamaForCausalLM


def test_chunked_loss_takes_labels_as_transformers_does():
    """One process: plain ``labels`` (shifted here, mean over non-ignored targets), a custom
    ``ignore_index``, and no labels (the model's own forward: logits) all match the unmodified
    model; ``return_dict=False`` gives the tuple (loss,)."""
    from upipe.integrations import hf

    ref = _model("llama")
    model = hf.parallelize(copy.deepcopy(ref), "ulysses", stack=LOSS_ONLY)
    ids, labels = _batch(SEQ, VOCAB)
    _close("loss", model(input_ids=ids, labels=labels).loss, ref(input_ids=ids, labels=labels).loss)
    marked = labels.masked_fill(labels == -100, -1)
    _close("ignore_index", model(input_ids=ids, labels=marked, ignore_index=-1).loss,
           ref(input_ids=ids, labels=labels).loss)
    _close("logits", model(input_ids=ids).logits, ref(input_ids=ids).logits)
    (loss,) = model(input_ids=ids, labels=labels, return_dict=False)
    _close("tuple loss", loss, ref(input_ids=ids, labels=labels).loss)


# ---- memory: one process (CP degree 1), a few thousand tokens, vocab large relative to hidden

M_SEQ, M_HIDDEN, M_FFN, M_VOCAB, M_LAYERS = 2048, 64, 256, 8192, 4
MEMORY_STACKS = {"none": None, "ac": "ac", "offload": "offload",
                 "offload+chunked_loss": MemoryStack(True, True, False, True), "alst": "alst",
                 "alst-attn": "alst-attn", "alst-attn-host": "alst-attn-host",
                 "alst+2 uncheckpointed": UNCHECKPOINTED}


class _VocabRows:
    """Observer: the most rows of any op output whose last dimension is the vocabulary."""

    def __init__(self):
        self.rows = 0

    def observe(self, func, args, kwargs, out) -> None:
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == M_VOCAB:
                self.rows = max(self.rows, t.numel() // M_VOCAB)


def _measure(base, ids, stack) -> dict:
    from upipe.integrations import hf, hf_stack

    model = hf.parallelize(copy.deepcopy(base), "ulysses", stack=stack).train()
    batch = hf.shard_batch(model, ids)
    rows = _VocabRows()
    attention_runs = [0]  # forwards of the layers' attention, recomputations included
    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(lambda *_: attention_runs.__setitem__(
            0, attention_runs[0] + 1))
    with MemoryTracker() as mt:
        mt.observers.append(rows)
        mt.track(model, batch)  # model states and inputs: not what the stack changes
        before = mt.current_device_bytes
        hf_stack.set_offload(model, host_context=mt.host)
        out = model(**batch)
        host_after_forward = mt.current_host_bytes
        out.loss.backward()
    return {"peak": mt.peak_device_bytes - before, "host": host_after_forward,
            "peak_host": mt.peak_host_bytes, "vocab_rows": rows.rows, "loss": out.loss.detach(),
            "attention_runs": attention_runs[0]}


@pytest.mark.slow  # about 7 s on 2 cores (docs/testing.md)
def test_each_level_saves_what_it_claims():
    cfg = transformers.LlamaConfig(
        vocab_size=M_VOCAB, hidden_size=M_HIDDEN, intermediate_size=M_FFN,
        num_hidden_layers=M_LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=M_SEQ)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, M_VOCAB, (1, M_SEQ), generator=torch.Generator().manual_seed(1))
    m = {name: _measure(base, ids, stack) for name, stack in MEMORY_STACKS.items()}
    mib = 2**20
    print(f"\nHF Llama, {M_LAYERS} layers, hidden {M_HIDDEN}, ffn {M_FFN}, vocab {M_VOCAB}, "
          f"{M_SEQ} tokens, fp32, CPU (activation peak above model states and inputs)")
    for name, r in m.items():
        print(f"  {name:22s} device peak {r['peak'] / mib:7.1f} MiB   host "
              f"{r['peak_host'] / mib:4.1f} MiB   largest (n, vocab) tensor: n = {r['vocab_rows']}")

    for name, r in m.items():  # every level computes the same loss (see the module docstring)
        _close(f"{name} loss", r["loss"], m["none"]["loss"])
    row, logits = M_SEQ * M_HIDDEN * 4, M_SEQ * M_VOCAB * 4  # fp32 bytes
    # checkpointing: every layer but the one being recomputed drops its MLP's four (L, ffn)
    # activations (gate, up, silu(gate), their product) until backward
    assert m["none"]["peak"] - m["ac"]["peak"] >= (M_LAYERS - 1) * 4 * M_SEQ * M_FFN * 4
    # offload: the middle layers' (L, hidden) inputs live on host, not on the device
    off = (M_LAYERS - 2) * row
    assert m["offload"]["host"] == m["offload"]["peak_host"] == off
    assert m["ac"]["host"] == 0 and m["ac"]["peak"] - m["offload"]["peak"] >= off
    # chunked loss: no (L, vocab) tensor at all (at most a chunk of rows): the logits, their
    # log-softmax and gradient are gone
    chunk = loss_chunk_tokens(M_HIDDEN, M_VOCAB)
    assert m["offload"]["vocab_rows"] == M_SEQ and m["alst"]["vocab_rows"] <= chunk
    assert m["offload"]["peak"] - m["offload+chunked_loss"]["peak"] >= logits
    # tiled MLP: those four (L, ffn) activations exist for one of L / hidden shards at a time
    shards = -(-M_SEQ // M_HIDDEN)
    saved = 4 * M_SEQ * M_FFN * 4 * (1 - 1 / shards)
    assert m["offload+chunked_loss"]["peak"] - m["alst"]["peak"] >= saved
    # selective recomputation: the recompute skips the attention (alst runs each layer's twice)
    assert m["alst"]["attention_runs"] == 2 * M_LAYERS
    for name in ("alst-attn", "alst-attn-host"):
        assert m[name]["attention_runs"] == M_LAYERS, name
    # what the attention half saves stays on the device in alst-attn: at least its output and
    # the residual sum of every layer beyond alst's checkpointed inputs; in alst-attn-host the
    # middle layers' go to host memory instead (at least those two tensors each), less device
    assert m["alst-attn"]["peak"] - m["alst"]["peak"] >= 2 * (M_LAYERS - 1) * row
    assert m["alst-attn"]["host"] == m["alst"]["host"]
    assert m["alst-attn-host"]["host"] - m["alst"]["host"] >= 2 * (M_LAYERS - 2) * row
    assert m["alst-attn-host"]["peak"] < m["alst-attn"]["peak"]
    # the last two layers uncheckpointed: their forward runs once, and what they save stays
    # on the device (the third layer's input is no longer offloaded)
    plain = m["alst+2 uncheckpointed"]
    assert plain["attention_runs"] == 2 * M_LAYERS - 2
    assert plain["host"] == m["alst"]["host"] - row
    assert plain["peak"] > m["alst"]["peak"]
