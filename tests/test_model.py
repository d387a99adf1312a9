"""The Llama-style model and its memory stack on one process: every stack level computes the
same loss and gradients; the chunked loss, tiling and offload do what they claim."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from experiments.config import STACKS, resolve_model
from experiments.harness.model import Transformer, shifted_labels
from experiments.instruments.memory import MemoryTracker
from upipe.stack import (
    IGNORE_INDEX,
    chunked_linear_cross_entropy,
    loss_chunk_tokens,
    offload_saved_inputs,
)

# Small, awkward shapes: 5 layers (3 offloaded), 6 heads over 2 KV heads, 300 tokens.
CFG = resolve_model("tiny", (("n_layers", "5"), ("dim", "96"), ("n_heads", "6"),
                             ("n_kv_heads", "2"), ("head_dim", "16"), ("ffn_dim", "160"),
                             ("vocab_size", "211")))
SEQ = 300


def _loss_and_grads(stack: str, method: str = "ulysses"):
    torch.manual_seed(0)
    model = Transformer(CFG, method, STACKS[stack])
    tokens = torch.randint(0, CFG.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(1))
    loss = model(tokens, shifted_labels(tokens))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_shifted_labels():
    t = torch.tensor([[5, 6, 7, 8]])
    assert shifted_labels(t).tolist() == [[6, 7, 8, IGNORE_INDEX]]


@pytest.mark.parametrize("stack,method", [("ac", "ulysses"), ("offload", "ulysses"),
                                          ("alst", "ulysses"), ("long", "ulysses"),
                                          ("long", "upipe")])
def test_stack_levels_compute_the_same_step(stack, method):
    """Checkpointing and offload are exact (same ops replayed); tiling, the chunked loss and the
    fused input norm (``long`` with UPipe: it normalises tile by tile inside the projections)
    change only fp32 summation order (and UPipe's RoPE rounds once per product, not twice:
    ``upipe.rope.rotate``): errors at fp32 round-off of sums over <= 300 tokens, relative to
    the gradient's scale (an element that cancels to near zero keeps its terms' round-off)."""
    ref_loss, ref_grads = _loss_and_grads("none")
    loss, grads = _loss_and_grads(stack, method)
    exact = not STACKS[stack].tiled
    torch.testing.assert_close(loss, ref_loss, rtol=0 if exact else 1e-6,
                               atol=0 if exact else 1e-4)
    for name, g in grads.items():
        # the CPU embedding backward sums a repeated token's rows in thread order, which varies
        # from run to run: that gradient is exact only to fp32 round-off even without tiling
        bitwise = exact and name != "tok_embeddings.weight"
        scale = max(1.0, ref_grads[name].abs().max().item())
        torch.testing.assert_close(g, ref_grads[name], rtol=0 if bitwise else 1e-4,
                                   atol=0 if bitwise else 1e-6 * scale, msg=name)


def test_upipe_model_matches_reference_attention_model():
    ref_loss, ref_grads = _loss_and_grads("alst", "ulysses")
    loss, grads = _loss_and_grads("alst", "upipe")
    torch.testing.assert_close(loss, ref_loss)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], msg=name)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_cross_entropy_matches_full_logits(chunk):
    n, dim, vocab = 50, 24, 37
    # fp32 like the loss's own arithmetic; reference: full logits through F.cross_entropy
    h = torch.randn(n, dim, requires_grad=True)
    w = torch.randn(vocab, dim, requires_grad=True)
    labels = torch.randint(0, vocab, (n,))
    labels[[3, 17, 49]] = IGNORE_INDEX
    ref = F.cross_entropy(h @ w.t(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    ref.backward(torch.tensor(0.5))
    dh, dw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    out = chunked_linear_cross_entropy(h, w, labels, chunk)
    out.backward(torch.tensor(0.5))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(h.grad, dh)
    torch.testing.assert_close(w.grad, dw)


@pytest.mark.parametrize("chunk,labels,match", [
    (-1, 6, "chunk must be a positive number"),  # was a loss of 0.0 and zero gradients
    (0, 6, "chunk must be a positive number"), (2.5, 6, "chunk must be a positive number"),
    (4, 5, r"labels must be \(N,\) for h of \(N, dim\)")])
def test_chunked_loss_refuses_what_it_would_not_compute(chunk, labels, match):
    h, w = torch.randn(6, 8, requires_grad=True), torch.randn(11, 8)
    with pytest.raises(ValueError, match=match):
        chunked_linear_cross_entropy(h, w, torch.zeros(labels, dtype=torch.long), chunk)


def _loss_peak_over_base(n: int, dim: int, vocab: int, chunk: int) -> int:
    """Peak tracked bytes of the chunked loss's forward and backward over what lives before."""
    h = torch.randn(n, dim, requires_grad=True)
    w = torch.randn(vocab, dim, requires_grad=True)
    labels = torch.randint(0, vocab, (n,))
    with MemoryTracker() as mt:
        mt.track(h, w, labels)
        base = mt.current_device_bytes
        chunked_linear_cross_entropy(h, w, labels, chunk).backward()
    return mt.peak_device_bytes - base


def test_chunked_loss_never_holds_full_logits():
    n, dim, vocab, chunk = 512, 32, 1000, 64
    peak = _loss_peak_over_base(n, dim, vocab, chunk)
    full_logits = n * vocab * 4
    # working set: dh, fp32 dW, a few chunk-sized logits buffers (here 4 x 256 KB)
    assert peak < (n * dim + vocab * dim) * 4 * 2 + 4 * chunk * vocab * 4
    assert peak < full_logits
    assert loss_chunk_tokens(4096, 128256) == 1046 and loss_chunk_tokens(256, 1024) == 256


def test_one_chunks_temporaries_live_at_a_time():
    """Each chunk is one call (upipe/stack/loss.py): its logits and gradient are freed before
    the next chunk's exist. Three more chunks then add only their rows of the gradient dh (which
    autograd hands on as h.grad), where a loop that kept the previous chunk's (n, V) gradient
    alive while making the next one's held one chunk's logits more (here 256 KB)."""
    dim, vocab, chunk = 32, 1000, 64
    one, four = (_loss_peak_over_base(k * chunk, dim, vocab, chunk) for k in (1, 4))
    rows = 3 * chunk * dim * 4  # fp32 rows of dh
    assert four - one == rows, (one, four)


@pytest.mark.parametrize("module", ["mlp", "norm"])
@pytest.mark.parametrize("batch", [1, 2])
def test_tiled_is_deepspeeds_tiled_mlp(module, batch):
    """``tiled`` runs DeepSpeed's ``TiledMLP`` algorithm (upipe/stack/tiled.py): the same
    output, input and parameter gradients, bitwise (the same ops per shard), and the same
    device peaks, forward and step, under the memory tracker; 7 shards of 96 rows, the last
    shorter (L = 620)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    from experiments.harness.model import FeedForward, RMSNorm
    from upipe.stack import tiled

    def run(ours: bool):
        torch.manual_seed(0)
        m = FeedForward(CFG.dim, CFG.ffn_dim) if module == "mlp" else RMSNorm(CFG.dim, 1e-5)
        x = torch.randn(batch, 620, CFG.dim, requires_grad=True)
        dy = torch.randn(batch, 620, CFG.dim)
        with MemoryTracker() as mt:
            mt.track(m, x, dy)
            y = (tiled(m, x) if ours else TiledMLP.apply(
                lambda mod, xs: mod(xs), m, x, 7, list(m.parameters())))
            forward = mt.peak_device_bytes
            y.backward(dy)
        return y.detach(), x.grad, [p.grad for p in m.parameters()], forward, mt.peak_device_bytes

    ours, theirs = run(True), run(False)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    assert all(torch.equal(a, b) for a, b in zip(ours[2], theirs[2], strict=True))
    assert ours[3:] == theirs[3:]


def test_tiled_gives_parameter_gradients_when_only_they_require_grad():
    """An input that needs no gradient (the parameters are the Function's inputs too): the
    shards' backward still reaches the weights, as the untiled module's does."""
    from experiments.harness.model import FeedForward
    from upipe.stack import tiled

    torch.manual_seed(0)
    m, x = FeedForward(CFG.dim, CFG.ffn_dim), torch.randn(2, 620, CFG.dim)
    tiled(m, x).pow(2).sum().backward()
    tiled_grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad(set_to_none=True)
    m(x).pow(2).sum().backward()
    for g, p in zip(tiled_grads, m.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad)  # shard-wise fp32 sums: round-off only


def test_tiled_weight_gradients_go_to_grad_not_to_autograd_grad():
    """What docs/using-upipe.md says of the tiled MLP: its weights' gradients are added into
    ``.grad`` inside the shards' backward, so ``torch.autograd.grad`` over the weights is told
    they were not used, and fills ``.grad`` all the same (the untiled module's would not)."""
    from experiments.harness.model import FeedForward
    from upipe.stack import tiled

    torch.manual_seed(0)
    m, x = FeedForward(CFG.dim, CFG.ffn_dim), torch.randn(1, 620, CFG.dim, requires_grad=True)
    with pytest.raises(RuntimeError, match="not have been used in the graph"):
        torch.autograd.grad(tiled(m, x).sum(), list(m.parameters()))
    assert all(p.grad is not None for p in m.parameters())
    (dx,) = torch.autograd.grad(tiled(m, x).sum(), x)  # the input's gradient is autograd's
    torch.testing.assert_close(dx, torch.autograd.grad(m(x).sum(), x)[0])


def test_tiled_bf16_weight_gradients_round_once_per_shard():
    """What docs/using-upipe.md says of bf16 weights: the shards' gradients are summed in their
    bf16 ``.grad`` (as TiledMLP's), so the error against fp64 grows with the shard count, where
    the untiled module's does not; fp32 weights are summed in fp32. Hidden 32, ffn 128;
    prints the figures the docs quote (``pytest -s``)."""
    import copy

    from upipe.stack import tiled

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 128, bias=False), torch.nn.SiLU(),
                              torch.nn.Linear(128, 32, bias=False)).double()
    errors = {}
    for length in (128, 2048, 8192):  # 4, 64, 256 shards
        x, dout = torch.randn(2, 1, length, 32, dtype=torch.float64)
        ref = copy.deepcopy(mlp)
        ref(x).backward(dout)
        want = ref[0].weight.grad
        for tile in (False, True):
            m = copy.deepcopy(mlp).bfloat16()
            y = tiled(m, x.bfloat16()) if tile else m(x.bfloat16())
            y.backward(dout.bfloat16())
            errors[length, tile] = ((m[0].weight.grad.double() - want).norm()
                                    / want.norm()).item()
    print("\nbf16 first-weight gradient vs fp64 (relative norm), untiled / tiled: "
          + ", ".join(f"{-(-n // 32)} shards {errors[n, False]:.2g} / {errors[n, True]:.2g}"
                      for n in (128, 2048, 8192)))
    assert max(errors[n, False] for n in (128, 2048, 8192)) < 6e-3  # bf16's own rounding
    assert errors[8192, True] > 3 * errors[8192, False]
    assert errors[128, True] < errors[2048, True] < errors[8192, True]


def test_tiled_residual_gives_parameter_gradients_when_only_they_require_grad():
    """``h + mlp(norm(h))`` shard by shard: the same output and parameter gradients as the
    untiled modules' when h needs none (the parameters are the Function's inputs); a function
    instead of the modules is refused by name."""
    from experiments.harness.model import FeedForward, RMSNorm
    from upipe.stack import tiled_residual

    torch.manual_seed(0)
    norm, mlp = RMSNorm(CFG.dim, CFG.norm_eps), FeedForward(CFG.dim, CFG.ffn_dim)
    h = torch.randn(2, 620, CFG.dim)
    out = tiled_residual((norm, mlp), h)
    out.pow(2).sum().backward()
    grads = [p.grad.clone() for m in (norm, mlp) for p in m.parameters()]
    for m in (norm, mlp):
        m.zero_grad(set_to_none=True)
    ref = h + mlp(norm(h))
    ref.pow(2).sum().backward()
    torch.testing.assert_close(out, ref)
    for g, p in zip(grads, [p for m in (norm, mlp) for p in m.parameters()], strict=True):
        # shard-wise fp32 sums over 620 tokens: round-off of the gradient's scale only (as
        # test_stack_levels_compute_the_same_step allows)
        scale = max(1.0, p.grad.abs().max().item())
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6 * scale)
    with pytest.raises(TypeError, match="modules must be a non-empty tuple of nn.Module"):
        tiled_residual(lambda x: mlp(norm(x)), h)


def test_offload_moves_saved_input_to_host_and_back():
    lin = torch.nn.Linear(64, 64)
    x = torch.randn(128, 64, requires_grad=True)
    with MemoryTracker() as mt:
        with offload_saved_inputs(mt.host):
            y = torch.utils.checkpoint.checkpoint(lin, x * 2, use_reentrant=False)
        host_after_forward = mt.current_host_bytes
        y.sum().backward()
    assert host_after_forward == 128 * 64 * 4  # the checkpointed input, on host
    assert mt.current_host_bytes == 0  # freed once backward used it
    x2 = x.detach().clone().requires_grad_()  # same gradient as without offload
    lin(x2 * 2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)


@pytest.mark.parametrize("stack,method,offloaded", [("offload", "ulysses", 3),
                                                    ("long", "upipe", 4)])
def test_offloaded_model_holds_host_bytes_for_middle_blocks(stack, method, offloaded):
    """Blocks 1..3 of 5 offload their (1, SEQ, dim) fp32 input, the first and last stay on the
    device; ``offload_first`` (the ``long`` level) moves the first block's input (the embedding
    output) to host too."""
    model = Transformer(CFG, method, STACKS[stack])
    tokens = torch.randint(0, CFG.vocab_size, (1, SEQ))
    with MemoryTracker() as mt:
        model.set_offload(host_context=mt.host)
        loss = model(tokens, shifted_labels(tokens))
        host = mt.current_host_bytes
        loss.backward()
    assert host == mt.peak_host_bytes == offloaded * SEQ * CFG.dim * 4


def test_set_offload_reaches_attention_that_offloads_itself():
    """FPDT moves its chunks to host inside the attention; set_offload hands it the tracker's
    host context as it does the blocks, so those bytes are host bytes (stack ``ac``: the blocks
    offload nothing). It computes the same step as the reference attention."""
    pytest.importorskip("baselines.fpdt", reason="baselines/fpdt.py not there yet")
    ref_loss, _ = _loss_and_grads("ac")
    torch.manual_seed(0)
    model = Transformer(CFG, "fpdt", STACKS["ac"], method_options={"chunk_size": 100})
    tokens = torch.randint(0, CFG.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(1))
    with MemoryTracker() as mt:
        model.set_offload(host_context=mt.host, pin_memory=False)
        assert all(m.host_context == mt.host and not m.pin_memory
                   for m in model.attention_modules)
        loss = model(tokens, shifted_labels(tokens))
        loss.backward()
    assert mt.peak_host_bytes > 0
    torch.testing.assert_close(loss.detach(), ref_loss)
