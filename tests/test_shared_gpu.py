"""Several ranks on one GPU (``--shared-gpu``): gloo carries the collectives on CUDA tensors, so
the multi-rank GPU path runs without a multi-GPU machine (docs/gpu.md#several-ranks-on-one-gpu).

On CPU: the launcher's refusals (a method that sends K/V by P2P, a hybrid's ring axis, no GPU),
each a ``skipped`` row before any process starts. On a GPU (marked ``gpu``): every method that
can run there against the single-device reference on 2 and 4 ranks sharing the GPU (the tolerance
rule of tests/test_correctness.py), UPipe with overlapped stages and packed documents, and FSDP2
training steps on the ALST stack whose losses equal one device's.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import pytest
import torch
import torch.distributed as dist
from cases import Case, compare_on_gpu
from test_correctness import assert_close_to_reference
from test_packed import DOCS
from test_train import BASE as TRAIN_BASE
from test_train import STEPS

from experiments.config import Cell, Status
from experiments.harness.launch import run_cell, shared_gpu_refusal
from experiments.harness.train import build
from experiments.runner.sweep_runner import sweep_executor
from experiments.sweeps import get_sweep
from upipe.registry import available_methods

P2P_METHODS = {"ring", "zigzag-ring", "torch-cp", "rfa-zigzag"}


# ---------------------------------------------------------------------------------------------
# refusals (CPU)


@pytest.mark.parametrize("method", sorted(available_methods()))
def test_only_methods_sending_by_p2p_are_refused_for_their_exchange(method):
    """The ring family is refused for its P2P (gloo has none on CUDA tensors); every other
    method passes that rule (on a machine without a GPU it is refused for that instead)."""
    why = shared_gpu_refusal(Cell(method, "tiny", seq_len=256, nproc=2))
    if method in P2P_METHODS:
        assert why is not None and "gloo carries no P2P on CUDA tensors" in why
        assert f"method {method!r}" in why
    elif torch.cuda.is_available():
        assert why is None
    else:
        assert why is not None and "torch sees none" in why


@pytest.mark.parametrize("method", ["usp", "upipe"])
def test_a_hybrids_ring_axis_is_refused(method):
    cell = Cell(method, "tiny", seq_len=256, nproc=4, ring_degree=2)
    why = shared_gpu_refusal(cell)
    assert why is not None and "ring degree 2" in why and "batch_isend_irecv" in why
    assert shared_gpu_refusal(dataclasses.replace(cell, ring_degree=1)) in (
        None, shared_gpu_refusal(Cell("ulysses", "tiny", seq_len=256, nproc=4)))


def test_a_refused_cell_is_a_skipped_row_before_any_process_starts():
    t0 = time.monotonic()
    row = run_cell(Cell("zigzag-ring", "tiny", seq_len=256, nproc=2), shared_gpu=True)
    assert row["status"] == Status.SKIPPED and "no P2P" in row["error"]
    assert row["shared_gpu"] is True and time.monotonic() - t0 < 5  # nothing was spawned


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_without_a_gpu_shared_gpu_is_refused_with_the_reason():
    row = run_cell(Cell("ulysses", "tiny", seq_len=256, nproc=2), shared_gpu=True)
    assert row["status"] == Status.SKIPPED and row["shared_gpu"] is True
    assert "torch sees none" in row["error"]


def test_an_emulated_sweep_refuses_shared_gpu():
    with pytest.raises(ValueError, match="--shared-gpu: sweep .* is emulated"):
        sweep_executor(get_sweep("table3_llama3_8b_h100x8-emulated"), shared_gpu=True)


# ---------------------------------------------------------------------------------------------
# on one GPU (gpu-marked: skipped without CUDA)


def _gpu_cases() -> list:
    out = []
    methods = [("ulysses", {}), ("upipe", {}), ("upipe", {"overlap": True}),
               ("usp-ulysses", {}), ("ds-ulysses", {})]
    for world in (2, 4):
        methods_w = methods + [("fpdt", {"chunk_size": 8 * world})]
        for (method, options), dtype in ((m, d) for m in methods_w for d in ("fp32", "bf16")):
            case = Case(method, 8, 2, 24 * world, dtype=dtype, options=options)
            tag = "".join(f"-{k}{v}" for k, v in options.items())
            out.append(pytest.param(world, case, id=f"{method}{tag}-w{world}-{dtype}"))
        for method in ("upipe", "ulysses"):  # packed documents (test_packed.py's layouts)
            seq = {2: 30, 4: 44}[world]
            for dtype in ("fp32", "bf16"):
                case = Case(method, 8, 2, seq, dtype=dtype, docs=DOCS[world, seq])
                out.append(pytest.param(world, case, id=f"{method}-packed-w{world}-{dtype}"))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("world,case", _gpu_cases())
def test_methods_match_the_reference_on_ranks_sharing_one_gpu(dist_pool, world, case):
    results = dist_pool(world).run(functools.partial(compare_on_gpu, device=0), case)
    assert len(results) == world
    assert_close_to_reference(results, case)


# FSDP2 + ALST training steps: test_train.py's model and steps, fp32, on the GPU
BASE = dataclasses.replace(TRAIN_BASE, stack="alst")


def _gpu_losses(cell: Cell) -> list[float]:
    torch.cuda.set_device(0)
    state = build(cell, cell.validate(), distributed=dist.is_initialized(),
                  device=torch.device("cuda", 0))
    sums = torch.stack([state.step() for _ in range(STEPS)])
    if dist.is_initialized():
        dist.all_reduce(sums)
    return (sums / state.n_label_tokens).tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("method", ["ulysses", "upipe"])
def test_fsdp2_alst_steps_on_one_shared_gpu_train_like_one_device(dist_pool, world, method):
    """Three AdamW steps with FSDP2's collectives on gloo and ALST's pinned offload, every rank
    on the same GPU: the losses of one device on that GPU (fp32; rtol 1e-4, the GPU's own
    reduction orders differing between one and several ranks)."""
    reference = _gpu_losses(dataclasses.replace(BASE, method=method))
    cell = dataclasses.replace(BASE, method=method, nproc=world)
    for rank_losses in dist_pool(world).run(_gpu_losses, cell):
        torch.testing.assert_close(rank_losses, reference, rtol=1e-4, atol=0)
    assert reference[2] < reference[0]  # it trains


@pytest.mark.gpu
def test_a_launched_cell_on_one_shared_gpu_is_an_ok_row_saying_so():
    row = run_cell(Cell("upipe", "tiny", seq_len=512, nproc=2, stack="alst", iters=1),
                   shared_gpu=True)
    assert row["status"] == Status.OK, row.get("error")
    assert row["shared_gpu"] is True and row["launcher"] == "spawn"
