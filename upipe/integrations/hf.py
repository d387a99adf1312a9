"""UPipe (or any registered CP method) inside a Hugging Face causal LM.

One call, :func:`parallelize`, turns a ``transformers`` causal LM of a verified family (Llama,
Mistral, Mixtral, Qwen2/3 and their MoE variants, Starcoder2, Gemma: ``hf_families.FAMILIES``;
any other model type is refused) into a context-parallel model: every decoder layer's
``self_attn`` is replaced by a :class:`CPSelfAttention` that runs the chosen method on this
rank's sequence shard with the layer's *own* modules (``q_proj``, ``k_proj``, ``v_proj``,
``o_proj``, and Qwen3's ``q_norm`` / ``k_norm``), shared, not copied. Head order is the
checkpoint's, and the state-dict keys stay Hugging Face's, so ``save_pretrained`` /
``load_state_dict`` work unchanged. RoPE uses the model's own inverse frequencies (its rope
scaling included) at each token's *global* position.

:func:`shard_batch` cuts a full batch into this rank's part in the method's sequence layout and
shifts the labels *before* sharding (a token's target may live on the next rank), so::

    model = parallelize(model, "upipe", group=cp_group)          # before FSDP / checkpointing
    out = model(**shard_batch(model, input_ids))                  # labels default to input_ids
    out.loss.backward()   # this rank's token-loss sum / the batch's token count

Packed documents (transformers' ``DataCollatorWithFlattening`` convention: ``position_ids`` that
restart at 0 in each document) go through ``shard_batch(model, input_ids, labels,
position_ids=...)``: it returns the documents' global ``cu_seq_lens_q``/``cu_seq_lens_k`` (the
flash-attention kwargs transformers passes down to every attention module), with which attention
never crosses a document and RoPE restarts in each, and labels with no target across a document
boundary. ``position_ids`` given to the model directly are honoured when they are the tokens' own
positions (those ``cu_seq_lens`` imply, or the global ones), and refused otherwise.

``out.loss`` summed over the CP ranks is the full sequence's mean token loss, and so are the
gradients: sum them over the CP group (FSDP2 and DDP *average* over ranks, so scale the loss by
the CP degree, or set FSDP2's gradient divide factor, when the CP ranks are also data ranks).

``parallelize(..., stack="alst")`` also switches on the long-context memory stack
(``upipe.integrations.hf_stack``): layer checkpointing, host offload of the checkpointed inputs,
tiled MLPs and a chunked loss that never builds full logits (``out.logits`` is then None).

Limits, each a ValueError at :func:`parallelize` or at the call (before any collective, and on
every rank of the CP group when one rank refuses its batch): the verified families' causal LMs
only (a sequence or token classifier would pool or average each rank's tokens alone); causal
self-attention without attention dropout, soft-capping or a non-default attention scale; a
sliding window only when it covers the longest span attention sees (the sequence, or each packed
document), where it changes nothing; no padding ``attention_mask`` (pack the documents instead;
an all-ones mask, a tokenizer's default, is accepted) and no KV cache (training only); RoPE types
whose frequencies depend on the length ("dynamic", "longrope") are refused; ``labels`` only with
:func:`shard_batch`'s ``shift_labels`` and ``num_items_in_batch`` (on more than one rank); no
projection or norm module replaced after :func:`parallelize` (adapters such as LoRA: merge them
into the weights first). The ranks agree on a
call's refusal by one three-integer all-reduce (and a host read of it) per call and CP mesh axis,
which also refuses ranks given different ``cu_seq_lens``.
"""

from __future__ import annotations

import functools
import itertools
import weakref
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from upipe.documents import cu_seqlens_from_position_ids, documents
from upipe.integrations.hf_families import check_family, check_off, layer_window
from upipe.integrations.hf_stack import apply_stack, check_stack
from upipe.module import ContextParallelAttention
from upipe.registry import build_method
from upipe.rope import default_inv_freq
from upipe.stack import MemoryStack
from upipe.stack.loss import IGNORE_INDEX

_NEEDS = "upipe.integrations.hf needs Hugging Face transformers >= 4.56: pip install 'upipe[hf]'"
try:
    import transformers
    from packaging.version import Version
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
except ImportError as e:  # an optional extra
    raise ImportError(_NEEDS) from e
if Version(transformers.__version__) < Version("4.56"):  # mask interface, shift_labels
    raise ImportError(f"{_NEEDS} (found {transformers.__version__})")

#: the attention implementation name the converted model's config carries
ATTN_IMPLEMENTATION = "upipe_cp"
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def _never_called(module, *args, **kwargs):
    raise RuntimeError(f"{type(module).__name__} runs outside upipe.integrations.hf.parallelize; "
                       f"attn_implementation {ATTN_IMPLEMENTATION!r} has no per-call kernel")


def _no_mask(*, attention_mask=None, **_) -> None:
    """Mask builder for the converted model: the CP method masks causally by global position
    (and by document with ``cu_seq_lens``), so no (L, L) mask is ever built. An all-ones mask
    (no padding: what tokenizers return by default) is accepted; a padding mask cannot be
    honoured and is refused."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("attention_mask with padding is not supported under context "
                         "parallelism: pack the documents into full-length sequences and pass "
                         "their position_ids to hf.shard_batch (documents are then kept apart)")
    return None


AttentionInterface.register(ATTN_IMPLEMENTATION, _never_called)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)


class CPSelfAttention(nn.Module):
    """A decoder layer's self-attention, run by a CP method on this rank's sequence shard.

    forward(hidden_states (B, L_local, hidden)) -> (out (B, L_local, hidden), None), the
    ``(attn_output, attn_weights)`` pair Hugging Face's decoder layers unpack.
    The layer's own projection (and norm) modules stay registered here under their Hugging Face
    names; ``self.method`` (a :class:`~upipe.module.ContextParallelAttention`) computes with the
    same modules and is deliberately not a registered submodule, so every parameter appears once.
    """

    #: this module's names of the shared modules -> the method's
    SHARED = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
              "q_norm": "q_norm", "k_norm": "k_norm"}

    def __init__(self, attn: nn.Module, method: ContextParallelAttention):
        super().__init__()
        self.layer_idx = getattr(attn, "layer_idx", None)
        for name in self.SHARED:
            if getattr(attn, name, None) is not None:
                setattr(self, name, getattr(attn, name))
        object.__setattr__(self, "method", method)

    def check_shared(self) -> None:
        """ValueError when a module the method computes with was replaced after
        :func:`parallelize` (a LoRA adapter injected by PEFT, a quantised swap). The method
        holds the modules it was given and reads their weights row by row (UPipe a stage's
        heads at a time), so it would go on training the old module and ignore the new one."""
        for name, attr in self.SHARED.items():
            mine = getattr(self, name, None)
            if mine is not getattr(self.method, attr):
                raise ValueError(
                    f"self_attn.{name} was replaced after hf.parallelize (now "
                    f"{type(mine).__name__}): the CP method computes with the module it was "
                    "given and would ignore the new one. Adapters such as LoRA are not "
                    "supported: merge them into the weights before parallelize")

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                past_key_values=None, cache=None, cu_seq_lens_q=None, cu_seq_lens_k=None,
                **kwargs) -> tuple[torch.Tensor, None]:
        # the decoder layers pass the KV cache as ``past_key_values`` in older transformers and
        # as ``cache`` in newer ones (5.24 does; it deprecates ``past_key_values`` until 5.40)
        if past_key_values is not None or cache is not None:
            raise ValueError("a KV cache (past_key_values) is not supported under context "
                             "parallelism: call the model with use_cache=False (training only)")
        if attention_mask is not None:
            raise ValueError("attention_mask is not supported under context parallelism")
        # position_embeddings / position_ids: the method rotates at each token's own position
        # (global, or within its document); the model's hook checked any position_ids given
        cu_seqlens = _cu_seqlens(cu_seq_lens_q, cu_seq_lens_k)
        return self.method(hidden_states, cu_seqlens=cu_seqlens), None

    def extra_repr(self) -> str:
        return f"method={self.method.registry_name!r}, {self.method.extra_repr()}"


def _cu_seqlens(cu_q, cu_k):
    """The documents' cu_seqlens from transformers' flash-attention kwargs (self-attention:
    both the same), as given (ints or a CPU tensor), or None."""
    if cu_k is None or cu_q is None:
        return cu_q if cu_k is None else cu_k
    as_list = lambda c: c.tolist() if isinstance(c, torch.Tensor) else list(c)  # noqa: E731
    if as_list(cu_q) != as_list(cu_k):
        raise ValueError("cu_seq_lens_q and cu_seq_lens_k must be equal (self-attention over "
                         "the same packed documents)")
    return cu_q


def _check_batch(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook of a converted model: the packed documents, ``position_ids`` and sliding
    window of a call, checked once per step before any collective (layers get the cu_seq_lens
    as ints).

    ``cu_seq_lens_q``/``_k`` (global, flash-attn's convention, from :func:`shard_batch` or a
    flattening collator with batch 1) become a tuple of ints (one host read of a device
    tensor). ``position_ids`` must be the positions the method rotates at: within each document
    with cu_seq_lens, else the tokens' global positions; other values would need documents the
    method was not given, so they are refused rather than ignored. A sliding window must cover
    the longest span attention sees (the sequence, or the longest document), and what the
    family's ``off_fields`` name stays off in the call's arguments too. Then the ranks
    agree (:func:`_agree`): a refusal on one rank is raised on every rank.
    """
    m = model.upipe_cp_method
    x = kwargs.get("input_ids", args[0] if args else None)
    if x is None:
        x = kwargs.get("inputs_embeds")
    if x is None:
        return args, kwargs
    cu, error = None, None
    try:
        cu = _cu_seqlens(kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"))
        if isinstance(cu, torch.Tensor):
            cu = cu.tolist()
        docs = documents(cu, x.shape[1] * m.cp)
        if cu is not None:
            kwargs = dict(kwargs, cu_seq_lens_q=tuple(cu), cu_seq_lens_k=tuple(cu))
        _check_positions(m, kwargs.get("position_ids"), x.shape[1], docs)
        check_off(model.upipe_cp_family, model.config.model_type, kwargs.get)
        _check_window(model.upipe_cp_window, x.shape[1] * m.cp, docs)
        # transformers' causal LMs take (input_ids, attention_mask, ...): here, not in the mask
        # builder, so that a rank whose batch alone has padding stops every rank
        _no_mask(attention_mask=kwargs.get("attention_mask", args[1] if len(args) > 1 else None))
        _check_labels(m, kwargs)
        if kwargs.get("output_attentions", getattr(model.config, "output_attentions", False)):
            raise ValueError("output_attentions is not supported under context parallelism: "
                             "no method forms the attention probabilities (they would come "
                             "back empty)")
        for layer in model.upipe_cp_layers:
            layer.check_shared()
    except ValueError as e:
        error = str(e)
    _agree(m, error, cu, x)
    return args, kwargs


def _check_labels(m: ContextParallelAttention, kwargs: dict) -> None:
    """Labels need :func:`shard_batch`'s ``shift_labels`` and ``num_items_in_batch`` when the
    sequence is split: the loss would shift this rank's labels by one within its shard (a
    token's target may sit on another rank) and average over this rank's tokens alone, and
    the ranks' sum would not be the batch's mean loss."""
    if m.cp == 1 or kwargs.get("labels") is None:
        return
    missing = [k for k in ("shift_labels", "num_items_in_batch") if kwargs.get(k) is None]
    if missing:
        raise ValueError(f"labels under context parallelism need {' and '.join(missing)}: pass "
                         "the batch hf.shard_batch(model, input_ids, labels) returns (the "
                         "targets shifted before sharding, and the batch's count of targets)")


def _check_positions(m: ContextParallelAttention, pos: torch.Tensor | None, local: int,
                     docs) -> None:
    """``position_ids`` (B, local) or (local,), if given, must be the positions the method
    rotates this rank's tokens at (global, or within their document)."""
    if pos is None:
        return
    want = (m.seq_layout.positions(local, m.rank, m.cp) if docs is None else
            docs.positions(m.seq_layout.segments(local * m.cp, m.rank, m.cp)))
    if tuple(pos.shape[-1:]) != (local,) or not torch.equal(
            pos.reshape(-1, local), want.to(pos.device).expand(pos.numel() // local, -1)):
        raise ValueError("position_ids must be this rank's tokens' own positions (global, or "
                         "within their document given cu_seq_lens_q/_k): packed documents "
                         "go through hf.shard_batch(model, input_ids, labels, "
                         "position_ids=<the full batch's>); model.generate, which passes "
                         "the positions of a whole sequence, is not supported (training only)")


def _check_window(window: int | None, seq_len: int, docs) -> None:
    """A sliding window (a query sees itself and the ``window - 1`` tokens before it) changes
    nothing when it covers the longest span attention sees: the sequence, or with packed
    documents the longest document. Otherwise the model's attention is not what the CP methods
    compute (full causal), so it is refused."""
    if window is None:
        return
    span = seq_len if docs is None else max(b - a for a, b in itertools.pairwise(docs.bounds))
    if window < span:
        raise ValueError(f"sliding_window ({window}) must be None or at least the longest span "
                         f"attention sees ({span} tokens: the "
                         f"{'sequence' if docs is None else 'longest packed document'}): the CP "
                         "methods compute full causal attention, not a sliding window")


def _agree(m: ContextParallelAttention, error: str | None, cu, x: torch.Tensor) -> None:
    """Raise ``error`` on this rank, and a refusal on every other rank of the CP group, before
    any collective of the step; also refuse ranks given different ``cu_seq_lens``.

    One all-reduce (MAX) of three integers per CP mesh axis: the refusal flag and a checksum
    of the documents and its negation (their maxima differ in sign iff two ranks differ).
    Without it, one rank raises while the others enter the first all-to-all and die there
    (gloo: "Connection closed by peer") or wait for it; and ranks given different documents
    would compute wrong attention without an error.
    """
    if m.cp == 1:
        if error is not None:
            raise ValueError(error)
        return
    key = zlib.crc32(repr(None if cu is None else tuple(cu)).encode())
    flags = torch.tensor([int(error is not None), key, -key], dtype=torch.int64, device=x.device)
    for group in [m.group] if m.ring_group is None else [m.group, m.ring_group]:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)  # None: the default group
    refused, high, low = flags.tolist()
    if error is not None:
        raise ValueError(error)
    if refused:
        raise ValueError("another rank of the CP group refused its batch (its error names the "
                         "rule); this rank stops too, so that none waits in a collective")
    if high != -low:
        raise ValueError("the ranks of the CP group were given different cu_seq_lens_q/_k: "
                         "every rank must pass the same global documents (hf.shard_batch gives "
                         "them)")


def _text_config(model: nn.Module):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _rotary(model: nn.Module) -> nn.Module:
    """The model's rotary embedding module (holds ``inv_freq`` and ``attention_scaling``)."""
    found = [m for m in model.modules() if hasattr(m, "inv_freq") and hasattr(m, "rope_type")]
    if len(found) != 1:
        raise ValueError(f"expected one rotary embedding module with inv_freq, found {len(found)}")
    rotary = found[0]
    if rotary.rope_type not in _STATIC_ROPE:
        raise ValueError(f"rope_type {rotary.rope_type!r} is not supported (its frequencies depend "
                         f"on the sequence length); supported: {_STATIC_ROPE}")
    return rotary


def _rope(cfg, rotary: nn.Module, head_dim: int) -> tuple[float, torch.Tensor | None, float]:
    """(theta, inv_freq, scaling) for the methods: inv_freq only when the model's frequencies
    are not plain theta's (rope scaling), so methods without custom-RoPE support still run
    unscaled models."""
    params = getattr(cfg, "rope_parameters", None) or {}
    theta = float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    inv_freq = rotary.inv_freq.detach().float().cpu().clone()
    scaling = float(rotary.attention_scaling)
    if scaling == 1.0 and torch.equal(inv_freq, default_inv_freq(head_dim, theta)):
        return theta, None, 1.0
    return theta, inv_freq, scaling


def _check_causal_lm(model: nn.Module) -> None:
    """The model must be its family's causal LM (or a subclass): its logits and loss are per
    token, which each rank computes for its own tokens. Another head would be wrong without a
    word: a sequence classifier pools each rank's own last token, a token classifier averages
    its loss over each rank's tokens alone."""
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model.config.model_type)
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if cls is None or not isinstance(model, cls):
        raise ValueError(f"model must be a causal LM ({name or '*ForCausalLM'}), got "
                         f"{type(model).__name__}: its per-token logits and loss are what the "
                         "ranks' sequence shards compute")


def _check_layer(attn: nn.Module, cfg, head_dim: int) -> None:
    """Refuse what the CP methods would silently compute differently (named field and rule)."""
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        lin = getattr(attn, name, None)
        # exactly nn.Linear: the method reads .weight (and .bias) row by row, so a subclass's
        # own forward (a LoRA layer's low-rank term, a quantised weight's dequantisation)
        # would never run
        if type(lin) is not nn.Linear:
            raise ValueError(f"{type(attn).__name__}.{name} must be an nn.Linear, got "
                             f"{type(lin).__name__} (the CP method reads its weight and would "
                             "skip a subclass's own forward; adapters such as LoRA and "
                             "quantised layers are not supported: merge them into the "
                             "weights first)")
    if not getattr(attn, "is_causal", True):
        raise ValueError("is_causal must be True: decoder self-attention only")
    scaling = getattr(attn, "scaling", head_dim**-0.5)
    if abs(scaling - head_dim**-0.5) > 1e-12:
        raise ValueError(f"attention scaling ({scaling}) must be head_dim**-0.5")
    if getattr(cfg, "attention_dropout", 0.0):
        raise ValueError(f"attention_dropout ({cfg.attention_dropout}) must be 0")
    if getattr(cfg, "attn_logit_softcapping", None):
        raise ValueError("attn_logit_softcapping is not supported")
    for name in ("q_norm", "k_norm"):
        norm = getattr(attn, name, None)
        if norm is not None and "RMSNorm" not in type(norm).__name__:
            raise ValueError(f"{name} must be an RMSNorm, got {type(norm).__name__}")


def parallelize(
    model: nn.Module, method: str = "upipe", *, group: ProcessGroup | None = None,
    mesh: DeviceMesh | None = None, kernel: str = "auto",
    stack: str | MemoryStack | None = None, **options,
) -> nn.Module:
    """Make ``model`` (a ``transformers`` causal LM) context-parallel in place; returns it.

    Args:
        model: a ``*ForCausalLM`` of a verified family (``hf_families.FAMILIES``, by
            ``model.config.model_type``), on any device; call before FSDP / checkpointing.
        method: any registered CP method (``upipe.available_methods()``); default UPipe.
        group / mesh: the CP process group (default: the default group), or a 2-D
            (``ring``, ``ulysses``) mesh for the hybrids (``usp``, ``upipe``).
        kernel: attention kernel (:data:`upipe.kernels.KERNELS`; ``auto``: the fastest the
            inputs' device runs, ``upipe.kernels.auto_kernel``).
        stack: the long-context memory stack (``upipe.integrations.hf_stack``): None (attention
            only), a level (``"ac"``, ``"offload"``, ``"alst"``) or a ``upipe.stack.MemoryStack``;
            checkpointing needs ``model.train()``; with ``chunked_loss``, ``logits`` is None
            whenever ``labels`` are given.
        **options: the method's own options, e.g. ``heads_per_stage`` for UPipe.

    Every check (head counts against the CP degree, unsupported features) runs before any
    collective. Sets ``use_cache=False`` and the attention implementation ``upipe_cp`` (no mask
    is built).
    """
    family = check_family(model.config)  # first: other checks assume the family's layout
    _check_causal_lm(model)
    stack = check_stack(model, stack)
    cfg = _text_config(model)
    n_heads, dim = cfg.num_attention_heads, cfg.hidden_size
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    head_dim = getattr(cfg, "head_dim", None) or dim // n_heads
    rotary = _rotary(model)
    theta, inv_freq, rope_scaling = _rope(cfg, rotary, head_dim)
    layers = [(parent, parent.self_attn) for parent in model.modules()
              if isinstance(getattr(parent, "self_attn", None), nn.Module)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no decoder layers with a self_attn module")
    methods, windows = [], []
    # every layer checked and its method built before any is converted: a refusal at a later
    # layer leaves the model as it was (a retry was refused as "already context-parallel")
    for _parent, attn in layers:
        if isinstance(attn, CPSelfAttention):
            raise ValueError(f"{type(model).__name__} is already context-parallel "
                             f"({attn.method.registry_name!r}): parallelize it once")
        _check_layer(attn, cfg, head_dim)
        window = layer_window(cfg, family, attn, getattr(attn, "layer_idx", None))
        windows += [] if window is None else [window]
        with torch.device("meta"):  # the method's own projections are replaced right away
            m = build_method(method, dim, n_heads, n_kv, head_dim, group=group, mesh=mesh,
                             causal=True, rope_theta=theta, kernel=kernel, **options)
        m.use_projections(
            attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
            q_norm=getattr(attn, "q_norm", None), k_norm=getattr(attn, "k_norm", None),
            rope_inv_freq=inv_freq, rope_scaling=rope_scaling,
        )
        if any(t.is_meta for t in (*m.parameters(), *m.buffers())):
            raise ValueError(f"method {method!r} keeps state of its own beyond the projections; "
                             "it cannot adopt a pretrained layer")
        methods.append(m)
    for (parent, attn), m in zip(layers, methods, strict=True):
        parent.self_attn = CPSelfAttention(attn, m)
    cfg.use_cache = False
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    # layout, rank and CP degree for shard_batch; not a submodule (its parameters are the layer's)
    object.__setattr__(model, "upipe_cp_method", methods[0])
    # the smallest sliding window of any layer, checked against each call's longest span
    object.__setattr__(model, "upipe_cp_window", min(windows, default=None))
    object.__setattr__(model, "upipe_cp_family", family)  # what a call may not switch on
    # each call checks that these still compute with the modules they were given
    object.__setattr__(model, "upipe_cp_layers", [parent.self_attn for parent, _ in layers])
    model.register_forward_pre_hook(_check_batch, with_kwargs=True)
    _check_direct_decoder_calls(model)
    apply_stack(model, stack, methods[0].cp, methods[0].checkpoint_reentrant)
    return model


def _check_direct_decoder_calls(model: nn.Module) -> None:
    """The base decoder (``model.model``) called directly, as a custom loss does, gets the
    model's checks too (without them its packed ``position_ids`` were ignored, and a padding
    mask on one rank killed the others in a collective). A call through the causal LM is
    checked once: the model's pre-hook marks it checked until its forward returns or raises.
    The decoder's hook holds the model by a weak reference: a strong one would be a cycle that
    keeps the model, and its process group, alive after the user's last reference."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if not isinstance(base, nn.Module) or base is model:
        return
    object.__setattr__(model, "upipe_cp_checked", False)
    model.register_forward_pre_hook(_mark_checked, with_kwargs=True)  # after _check_batch
    model.register_forward_hook(_unmark_checked, with_kwargs=True, always_call=True)
    base.register_forward_pre_hook(functools.partial(_check_direct_call, weakref.ref(model)),
                                   with_kwargs=True)


def _mark_checked(model: nn.Module, args: tuple, kwargs: dict) -> None:
    object.__setattr__(model, "upipe_cp_checked", True)  # _check_batch passed this call


def _unmark_checked(model: nn.Module, args: tuple, kwargs: dict, output) -> None:
    object.__setattr__(model, "upipe_cp_checked", False)


def _check_direct_call(model_ref: weakref.ref, base: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of the base decoder: ``_check_batch`` unless the causal LM's forward,
    which checked the call already, is calling it."""
    model = model_ref()
    if model is None or model.upipe_cp_checked:
        return args, kwargs
    return _check_batch(model, args, kwargs)


def shard_batch(
    model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None, ignore_index: int = -100,
) -> dict:
    """This rank's keyword arguments for ``model(**batch)`` from a full batch (same on every rank).

    Args:
        input_ids: (B, S) full sequences; S must suit the method's layout (e.g. divisible by
            the CP degree, by 2x it for zigzag).
        labels: (B, S) unshifted targets as Hugging Face takes them (default ``input_ids``);
            ``ignore_index`` marks tokens without a loss there.
        position_ids: (S,) or (B, S) positions restarting at 0 in each packed document
            (``DataCollatorWithFlattening``'s); every row must mark the same documents. None:
            one unpacked sequence per row.

    Returns ``input_ids`` (B, S/C) in the method's layout; ``labels`` and ``shift_labels``
    (B, S/C): the globally shifted targets of the same tokens (the loss then skips its own
    shift), with no target across a document boundary (a document's last token has none); a
    token without a target is -100 there whatever ``ignore_index`` was (transformers' default,
    which its losses and the memory stack's chunked loss ignore without being told);
    ``num_items_in_batch``: the whole batch's count of target tokens (a tensor, no host sync),
    so each rank's loss is its sum over that count; with several documents, ``cu_seq_lens_q``
    and ``cu_seq_lens_k``: their global cumulative lengths (a tuple of ints).
    """
    m = getattr(model, "upipe_cp_method", None)
    if m is None:
        raise ValueError("model was not converted: call upipe.integrations.hf.parallelize first")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
    labels = input_ids if labels is None else labels
    if labels.shape != input_ids.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal input_ids shape "
                         f"{tuple(input_ids.shape)}")
    s = input_ids.shape[1]
    m.seq_layout.check(s, m.cp)
    cu = None
    if position_ids is not None:
        if position_ids.shape[-1] != s:
            raise ValueError(f"position_ids must have {s} positions per row (input_ids'), got "
                             f"shape {tuple(position_ids.shape)}")
        cu = cu_seqlens_from_position_ids(position_ids)
    # -100 for "no target" in what the model gets: the loss is called without ignore_index
    if ignore_index != IGNORE_INDEX:
        labels = labels.masked_fill(labels == ignore_index, IGNORE_INDEX)
    shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # token t predicts t + 1
    if cu is not None and len(cu) > 2:
        shifted[:, [end - 1 for end in cu[1:-1]]] = IGNORE_INDEX  # next token: another document
    local = m.shard(shifted, dim=1).contiguous()  # the loss views it flat
    batch = {"input_ids": m.shard(input_ids, dim=1).contiguous(), "labels": local,
             "shift_labels": local, "num_items_in_batch": (shifted != IGNORE_INDEX).sum()}
    if cu is not None and len(cu) > 2:
        batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = tuple(cu)
    return batch


__all__ = ["ATTN_IMPLEMENTATION", "CPSelfAttention", "parallelize", "shard_batch"]
