"""The long-context memory stack for a Hugging Face causal LM: ``parallelize(..., stack=...)``.

The same building blocks as the benchmark harness (``upipe.stack``;
docs/design.md#the-memory-stack), put into a ``transformers`` model in place, each level optional
(``MemoryStack``):

- ``checkpoint``: every decoder layer (a ``GradientCheckpointingLayer``) through non-reentrant
  ``torch.utils.checkpoint``, by transformers' own mechanism: the layer's
  ``gradient_checkpointing`` flag and ``_gradient_checkpointing_func``. Transformers checkpoints
  only in training mode with autograd on, so call ``model.train()`` (a ``from_pretrained`` model
  starts in eval mode); do not call ``gradient_checkpointing_enable`` afterwards (it would replace
  the offloading functions). The layer's forward is checkpointed inside its ``__call__``, so
  FSDP2's hooks stay outside the recomputed region.
- ``offload``: the checkpointed input of every decoder layer but the first and last goes to host
  memory (``offload_saved_inputs`` entered around that layer's checkpoint call); pinned only on
  CUDA and only up to ``PIN_MAX_TOKENS`` tokens of the global sequence (``pin_host_memory``,
  the harness's rule). ``set_offload`` routes those bytes to a memory tracker's host account.
- ``keep_attention`` (levels ``alst-attn``, ``alst-attn-host``; selective recomputation): the
  decoder layer runs without a checkpoint and only its ``mlp`` is checkpointed (offloading its
  saved input in the layers that offload), so the recompute skips the attention and what the
  attention half saves for its backward is kept: on the device, or with ``keep_on_host`` in
  host memory in the layers that offload (their whole forward under ``offload_saved_inputs``).
  The MLP's norm runs outside the checkpoint here (a transformers layer calls it apart from
  the MLP), so each layer keeps its normalised MLP input (the checkpoint's) and the norm's
  input: one (L, hidden) tensor more than the harness's split, which checkpoints norm and MLP
  together from the residual sum.
- ``uncheckpointed_layers`` (layer-wise selective recomputation): the last N decoder layers
  run without a checkpoint or offload, all they save kept on the device.
- ``tiled``: each decoder layer's ``mlp`` runs over ceil(L / hidden) sequence shards
  (``upipe.stack.tiled``, DeepSpeed's ``TiledMLP`` algorithm); dense, per-token MLPs only.
- ``chunked_loss``: with ``labels``, the model's forward runs the base decoder and
  ``chunked_linear_cross_entropy`` over its own ``lm_head.weight`` (the embedding when tied), so
  (L, vocab) logits never exist; it returns ``CausalLMOutputWithPast(loss=..., logits=None)``.
  Without ``labels`` the model's own forward runs (logits returned). The loss is Hugging Face's
  ``ForCausalLMLoss``: ``shift_labels`` when given (``hf.shard_batch`` gives them), else
  ``labels`` shifted by one; the sum over ``num_items_in_batch`` when given, else the mean over
  non-ignored targets. With FSDP2 keep ``lm_head`` in the root unit (its weight is read without
  calling the module, so a unit of its own would not be unsharded).

Parameters, their names and the state dict are unchanged; the tiled MLP and the chunked loss are
per instance (the instance's class is swapped for a subclass with the new ``forward``, as FSDP2
does), so other instances of the class are untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import can_return_tuple

from upipe.stack import (
    IGNORE_INDEX,
    MemoryStack,
    chunked_linear_cross_entropy,
    loss_chunk_tokens,
    memory_stack,
    offload_saved_inputs,
    pin_host_memory,
    tiled,
)

# config fields that change the logits after lm_head (the chunked loss would skip them)
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(getattr(m, "self_attn", None), nn.Module)]


def _text_config(model: nn.Module):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def check_stack(model: nn.Module, stack: str | MemoryStack | None) -> MemoryStack | None:
    """The ``MemoryStack`` for ``stack`` (None, a level name or one), after checking that
    ``model`` supports each of its levels; a ValueError names the level and the rule."""
    if stack is None:
        return None
    stack = memory_stack(stack)
    layers = _decoder_layers(model)
    if stack.checkpoint:
        for layer in layers:
            if not isinstance(layer, GradientCheckpointingLayer):
                raise ValueError(f"MemoryStack.checkpoint needs transformers' "
                                 f"GradientCheckpointingLayer decoder layers; "
                                 f"{type(layer).__name__} is not one")
    if stack.uncheckpointed_layers > len(layers):
        raise ValueError(f"MemoryStack.uncheckpointed_layers must be at most the model's "
                         f"{len(layers)} decoder layers, got {stack.uncheckpointed_layers}")
    for name in ("tiled", "keep_attention"):
        if getattr(stack, name):
            for layer in layers:
                if not isinstance(getattr(layer, "mlp", None), nn.Module):
                    raise ValueError(f"MemoryStack.{name} needs an mlp module in every decoder "
                                     f"layer; {type(layer).__name__} has none")
    if stack.tiled:
        for layer in layers:
            if hasattr(layer.mlp, "experts"):
                # its router takes the whole (B, L, hidden) input (it views and unpacks it, and
                # returns the router logits of all tokens): not a per-token module to tile
                raise ValueError(f"MemoryStack.tiled needs a dense, per-token MLP in every "
                                 f"decoder layer; {type(layer.mlp).__name__} is a mixture of "
                                 "experts (use a level without tiling: 'offload', or "
                                 "MemoryStack(checkpoint=True, offload=True, chunked_loss=True))")
    if stack.chunked_loss:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if not isinstance(head, nn.Linear) or head.bias is not None:
            raise ValueError("MemoryStack.chunked_loss needs a causal LM whose output head "
                             "(lm_head) is a bias-free nn.Linear")
        if not isinstance(getattr(model, getattr(model, "base_model_prefix", ""), None),
                          nn.Module):
            raise ValueError("MemoryStack.chunked_loss needs the base decoder at "
                             "model.<base_model_prefix>")
        cfg = _text_config(model)
        for name in _LOGIT_TRANSFORMS:
            if getattr(cfg, name, None) not in (None, 1, 1.0):
                raise ValueError(f"MemoryStack.chunked_loss: {name} ({getattr(cfg, name)}) is "
                                 "not supported (the loss reads lm_head's raw logits)")
    return stack


class _OffloadedCheckpoint:
    """A decoder layer's checkpoint function whose saved input (the layer's hidden states) is
    offloaded to host memory. Called by transformers as ``fn(layer_forward, hidden_states)``."""

    def __init__(self, cp: int, reentrant: bool):
        self.cp, self.reentrant = cp, reentrant
        # set_offload: where host bytes are accounted, and a fixed pinning choice (None: the rule)
        self.host_context: Callable[[], contextlib.AbstractContextManager] = (
            contextlib.nullcontext
        )
        self.pin_memory: bool | None = None

    def saved_to_host(self, hidden_states: torch.Tensor) -> contextlib.AbstractContextManager:
        """What is saved for backward inside goes to host memory; ``hidden_states`` (B,
        L_local, hidden) gives the pinning rule its length."""
        pin = self.pin_memory
        if pin is None:  # the global sequence is L_local x the CP degree
            pin = pin_host_memory(hidden_states.shape[1] * self.cp)
        return offload_saved_inputs(self.host_context, pin)

    def __call__(self, function, *args, **kwargs):
        with self.saved_to_host(args[0]):
            return checkpoint(function, *args, use_reentrant=self.reentrant, **kwargs)


def _checkpoint(reentrant: bool) -> Callable:
    def plain(function, *args, **kwargs):
        return checkpoint(function, *args, use_reentrant=reentrant, **kwargs)

    return plain


class _TiledMLP:
    """Mixin of an MLP instance's class: its forward over ceil(L / hidden) shards."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tiled(self, x, call=_mlp_forward)


def _mlp_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The MLP's own forward (its class's, behind the mixin), as ``tiled`` calls it per shard."""
    return super(_TiledMLP, mlp).forward(x)


class _CheckpointedMLP:
    """Mixin of an MLP instance's class (selective recomputation): its forward checkpointed by
    the instance's ``upipe_checkpoint`` (plain, or offloading its saved input)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.upipe_checkpoint(super().forward, x)


class _KeptOnHost:
    """Mixin of a decoder layer instance's class (selective recomputation in host memory):
    everything its forward saves for backward (the norms' inputs, what the attention keeps,
    the checkpointed MLP's input) goes to host memory via the instance's ``upipe_offload``."""

    def forward(self, *args, **kwargs):
        hidden_states = args[0] if args else kwargs["hidden_states"]
        with self.upipe_offload.saved_to_host(hidden_states):
            return super().forward(*args, **kwargs)


class _ChunkedLoss:
    """Mixin of a causal LM instance's class: the chunked loss (no logits) with labels."""

    @can_return_tuple
    def forward(self, input_ids: torch.Tensor | None = None, **kwargs):
        return _chunked_loss_forward(self, input_ids, **kwargs)


def _with_mixin(module: nn.Module, mixin: type) -> None:
    """Give this one instance the behaviour of ``mixin`` by swapping its class for a subclass
    (as FSDP2's ``fully_shard`` does): parameters, names and the state dict stay, other
    instances are untouched, and no bound method on the instance makes a reference cycle that
    would keep the model (and its process group) alive after its last reference is dropped."""
    cls = type(module)
    if not issubclass(cls, mixin):
        key = (cls, mixin)
        if key not in _SUBCLASSES:
            # the class's own name: transformers' save_pretrained writes it as the config's
            # architectures (a "ChunkedLossLlamaForCausalLM" there named no class a loader has)
            _SUBCLASSES[key] = type(cls.__name__, (mixin, cls),
                                    {"__module__": cls.__module__,
                                     "__qualname__": cls.__qualname__})
        module.__class__ = _SUBCLASSES[key]


_SUBCLASSES: dict[tuple[type, type], type] = {}


def _chunked_loss_forward(self: nn.Module, input_ids: torch.Tensor | None = None, **kwargs):
    """A causal LM's forward with the chunked loss (no logits) when labels are given."""
    if kwargs.get("labels") is None:  # no loss asked for: the model's own forward, with logits
        return super(_ChunkedLoss, self).forward(input_ids, **kwargs)
    labels = kwargs.pop("labels")
    shift_labels = kwargs.pop("shift_labels", None)
    num_items = kwargs.pop("num_items_in_batch", None)
    ignore_index = kwargs.pop("ignore_index", IGNORE_INDEX)
    if kwargs.pop("logits_to_keep", 0) != 0:
        raise ValueError("logits_to_keep must be 0 with MemoryStack.chunked_loss and labels")
    out = getattr(self, self.base_model_prefix)(input_ids=input_ids, **kwargs)
    h = out.last_hidden_state  # (B, L, hidden), after the final norm
    if shift_labels is None:  # as transformers' ForCausalLMLoss: token t predicts t + 1
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1).to(h.device)
    if ignore_index != IGNORE_INDEX:
        targets = torch.where(targets == ignore_index, IGNORE_INDEX, targets)
    cfg = _text_config(self)
    total = chunked_linear_cross_entropy(h.reshape(-1, h.shape[-1]),
                                         self.get_output_embeddings().weight, targets,
                                         loss_chunk_tokens(cfg.hidden_size, cfg.vocab_size))
    count = (targets != IGNORE_INDEX).sum() if num_items is None else num_items
    loss = total / (count.to(total.device) if torch.is_tensor(count) else count)
    return CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=out.hidden_states,
                                  attentions=out.attentions)


def apply_stack(model: nn.Module, stack: MemoryStack | None, cp: int,
                reentrant: bool = False) -> None:
    """Switch on ``stack``'s levels in ``model`` (checked by ``check_stack``) in place.

    ``cp``: the CP degree (the pinning rule counts global tokens); ``reentrant``: the attention
    method needs reentrant checkpointing (``checkpoint_reentrant``).
    """
    if stack is None:
        return
    layers = _decoder_layers(model)
    if stack.tiled:
        for layer in layers:
            _with_mixin(layer.mlp, _TiledMLP)
    if stack.checkpoint:
        # the last ``uncheckpointed_layers`` run as they are: no checkpoint, no offload
        for i, layer in enumerate(layers[:len(layers) - stack.uncheckpointed_layers]):
            offload = stack.offload and 0 < i < len(layers) - 1  # ALST: not the first and last
            fn = _OffloadedCheckpoint(cp, reentrant) if offload else _checkpoint(reentrant)
            if not stack.keep_attention:
                layer._gradient_checkpointing_func = fn
                layer.gradient_checkpointing = True
                continue
            # Selective recomputation: the layer runs without a checkpoint, its MLP with one (after
            # the tiling, which then runs inside the checkpoint). Not a selective-checkpoint
            # policy: the attention's custom autograd Functions and collectives cannot be
            # replayed from saved op outputs (docs/design.md#the-memory-stack).
            object.__setattr__(layer.mlp, "upipe_checkpoint", fn)
            _with_mixin(layer.mlp, _CheckpointedMLP)
            if stack.keep_on_host and offload:
                object.__setattr__(layer, "upipe_offload", fn)
                _with_mixin(layer, _KeptOnHost)
    if stack.chunked_loss:
        _with_mixin(model, _ChunkedLoss)
    object.__setattr__(model, "upipe_memory_stack", stack)


def set_offload(model: nn.Module, *,
                host_context: Callable[[], contextlib.AbstractContextManager] | None = None,
                pin_memory: bool | None = None) -> None:
    """Where the offloaded layer inputs are accounted (e.g. a ``MemoryTracker``'s ``host``) and
    whether they are pinned (default: ``pin_host_memory`` of the global sequence length)."""
    for layer in _decoder_layers(model):
        for fn in (getattr(layer, "_gradient_checkpointing_func", None),
                   getattr(layer, "upipe_offload", None),
                   getattr(getattr(layer, "mlp", None), "upipe_checkpoint", None)):
            if isinstance(fn, _OffloadedCheckpoint):
                if host_context is not None:
                    fn.host_context = host_context
                fn.pin_memory = pin_memory


__all__ = ["apply_stack", "check_stack", "set_offload"]
