"""DeepSpeed's FPDT (``ds-fpdt``) off CUDA: its stand-ins (baselines/ds_fpdt_portable.py), its
host bytes, and its activation-checkpointing behaviour in the model.

Correctness against the single-device reference is in tests/test_correctness.py (FPDT_CASES);
emulated == measured memory in tests/test_emulate.py; training in tests/test_train.py.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from cell_runs import emulated_on_cpu, equality_cell, real_run

import baselines.ds_fpdt  # noqa: F401  registers "ds-fpdt" in this process
from baselines.ds_fpdt import DSFPDTAttention
from experiments.config import Cell, Hardware
from experiments.emulation.fake_step import measure_fake
from experiments.instruments.memory import MemoryTracker
from upipe import build_method


def test_runs_on_cpu_and_asks_for_reentrant_checkpointing():
    assert DSFPDTAttention.unavailable_reason("cpu") is None
    assert DSFPDTAttention.checkpoint_reentrant
    assert "CUDA" in DSFPDTAttention.unavailable_reason("cuda") or torch.cuda.is_available()


def _fpdt_globals() -> dict:
    from deepspeed.sequence import fpdt_layer

    names = ("_flash_attn_forward", "_flash_attn_backward", "get_accelerator", "torch",
             "_FPDTGPUAttentionImpl_", "_FPDTGPUOffloadingAttentionImpl_")
    return {n: getattr(fpdt_layer, n) for n in names} | {
        "has_version": hasattr(fpdt_layer, "flash_attn_version")}


# B, L (local tokens), dim, H, Hkv, D, chunk (global tokens): 3 chunks on one gloo rank (C = 1,
# so no KV head is replicated)
B, L, DIM, H, HKV, D, CHUNK = 2, 24, 48, 8, 2, 16, 8


def _host_bytes_and_scope() -> dict:
    """One rank: forward and backward of ds-fpdt with offload, the tracker's host bytes after
    forward, and fpdt_layer's globals before, after forward and after backward."""
    before = _fpdt_globals()
    m = build_method("ds-fpdt", DIM, H, HKV, D, group=dist.group.WORLD, chunk_size=CHUNK)
    x = torch.randn(B, L, DIM, requires_grad=True)
    with MemoryTracker() as mt:
        m.host_context = mt.host
        y = m(x)
        host_after_forward = mt.current_host_bytes
        after_forward = _fpdt_globals()
        y.sum().backward()
    return {"host": host_after_forward, "peak_host": mt.peak_host_bytes,
            "same_after_forward": after_forward == before,
            "same_after_backward": _fpdt_globals() == before,
            "grads": all(p.grad is not None for p in m.parameters()) and x.grad is not None}


def test_host_bytes_are_fpdts_chunks_and_the_patches_are_scoped(dist_pool):
    """FPDT's offloading forward keeps every chunk's layer input, q, k, v (head layout), output
    and fp32 LSE in host memory (fpdt_layer.py, ``_FPDTGPUOffloadingAttentionImpl_.forward``:
    one ``SequenceChunk`` each): B*L*(dim + 2*H*D + 2*Hkv*D)*4 + B*L*H*4 bytes in fp32, to the
    byte. Every fpdt_layer global is restored after the forward and after the backward."""
    res = dist_pool(1).run(_host_bytes_and_scope)[0]
    assert res["host"] == B * L * (DIM + 2 * H * D + 2 * HKV * D) * 4 + B * L * H * 4
    assert res["same_after_forward"] and res["same_after_backward"] and res["grads"]


# -- activation checkpointing: the leak ----------------------------------------------------------

KEYS = ("tracked_peak_device_bytes", "peak_host_bytes")


def _cell(method: str, n_layers: int) -> Cell:
    """tests/test_emulate.py's cell of ``method`` on the paper's stack (2 ranks, 512 tokens
    each; DeepSpeed's FPDT in four 256-token chunks) with ``n_layers`` layers."""
    return equality_cell(method, "alst", {"chunk_size": 256} if method == "ds-fpdt" else {}, 2,
                         n_layers)


def _growth(dist_pool, method: str) -> dict[str, int]:
    """Peak bytes at 6 layers less at 3, emulated (CPU device); at 3 layers also the real run
    (gloo, rank 0), which must agree to the byte. Both 3-layer cells are cells of
    tests/test_emulate.py too (run once per session, ``cell_runs``), where every method's
    emulation equals its real run; real runs at 6 layers would add two multi-rank runs to check
    that equality once more."""
    out = {}
    for n in (3, 6):
        cell = _cell(method, n)
        emulated = emulated_on_cpu(cell)
        assert emulated["status"] == "ok", emulated["error"]
        got = {k: emulated[k] for k in KEYS}
        if n == 3:
            real = real_run(dist_pool, cell)
            assert got == {k: real[k] for k in KEYS}, method
        out = {k: got[k] - out.get(k, 0) for k in KEYS}
    return out


@pytest.mark.slow  # 2 real 2-rank runs (shared with tests/test_emulate.py) and 4 emulations
def test_checkpointed_peak_grows_by_at_most_one_layers_attention_state(dist_pool):
    """Three more layers add their model states and checkpointed inputs, as for a method that
    keeps nothing outside ``save_for_backward`` (ulysses, same stack and model); ds-fpdt may
    exceed that by at most one layer's FPDT state (the layer being recomputed), device and host.

    Non-reentrant checkpointing kept every layer's FPDT chunks (ctx attributes) alive until its
    backward: more layers added all their chunks (at 4096 tokens, 4 more layers: +14.9 MB host,
    +5.8 MB device over ulysses, against a bound of 3.7 MB).
    """
    tiny_l, dim, h, hkv, d = 512, 256, 16, 4, 16  # tiny: 512 tokens a rank
    # one layer's FPDT state per rank (fp32): input, q, k, v, output, fp32 LSE per token
    one_layer = tiny_l * ((dim + 2 * h * d + 2 * hkv * d) * 4 + h * 4)
    fpdt, ref = _growth(dist_pool, "ds-fpdt"), _growth(dist_pool, "ulysses")
    for k in KEYS:
        assert fpdt[k] - ref[k] <= one_layer, (k, fpdt[k], ref[k], one_layer)


@pytest.mark.slow  # about 2 s on 2 cores (docs/testing.md)
def test_emulated_fpdt_runs_fa3_and_its_host_copies_run_beside_the_compute():
    """The paper's FPDT calls FlashAttention-3 (kernel="fa3": every attention op the emulated
    step prices is fa3's) and issues every host copy of its offloading path on its side streams
    (``ds_fpdt_portable.on_side_stream``): priced as side copies. What is left on the compute
    stream is the stack's --checkpoint-in-cpu block inputs: one (L, dim) bf16 copy per layer
    each way, to the byte. FPDT's own copies are of pinned buffers at every length (its
    SequenceChunk pins them), the block inputs' pinned by the harness's rule only."""
    cell = Cell(method="ds-fpdt", model="tiny", nproc=4, seq_len=4096, options={"chunk_size": 1024},
                stack="megatron-ds", dtype="bf16", kernel="fa3")
    cfg = cell.validate()
    work, pinned = Counter(), set()
    for _, counts in measure_fake(cell, cfg, Hardware()).work:
        for key, v in counts.items():
            if key[0] in ("copy", "attention"):
                work[key[:3]] += v
            if key[0] == "copy":
                pinned.add((key[1], key[-1] == "pinned"))
    assert pinned == {("side", True), ("sync", False)}
    block_inputs = cfg.n_layers * (cell.seq_len // cell.nproc) * cfg.dim * 2
    assert work["copy", "sync", "d2h"] == work["copy", "sync", "h2d"] == block_inputs
    assert work["copy", "side", "d2h"] > 0 and work["copy", "side", "h2d"] > 0
    assert {k[1] for k in work if k[0] == "attention"} == {"fa3"}


def test_a_sequence_of_no_whole_chunk_is_refused():
    """DeepSpeed's FPDT splits S into S // chunk_size chunks: below one chunk it divides by zero
    (the adapter used to run it as one chunk of S tokens under a row naming chunk_size); a
    sequence of whole chunks, one included, runs."""
    from baselines.ds_fpdt import check_whole_chunks

    for s in (1024, 4096):
        check_whole_chunks(s, 1024)
    for s in (512, 1500):
        with pytest.raises(ValueError, match=rf"seq_len \({s}\) must be a positive multiple of "
                                             r"chunk_size \(1024\)"):
            check_whole_chunks(s, 1024)
    cell = Cell(method="ds-fpdt", model="tiny", nproc=2, seq_len=2048)  # default 64K chunks
    with pytest.raises(ValueError, match="must be a positive multiple of chunk_size"):
        cell.validate()
