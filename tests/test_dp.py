"""The data-parallel axis: ``dp`` replicas of ``nproc`` CP ranks, each replica on its own
sequence, FSDP2 over all dp x nproc ranks.

1. Config: ``dp`` validates (the field and the rule named), enters the cell id only when it is
   not 1 (committed ids unchanged), and the derived world is dp x nproc everywhere a row or the
   command line says it.
2. A real 4-rank gloo step of dp 2 x cp 2: the gradient is the average of the two replicas'
   single-device gradients, each replica on its own tokens.
3. Emulation: a dp 2 cell emulated on ``device="cpu"`` allocates what the real run tracks, and
   (cp 1, dp 8) holds the model states of (cp 8, dp 1) (both shard over 8 ranks) with other
   activation and attention bytes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from cell_runs import KEYS, _real_run

from experiments.cli import parser
from experiments.cli_args import cell_from_args, world_from_args
from experiments.config import Cell, Hardware, Sweep
from experiments.emulation.emulate import emulate_cell
from experiments.harness.launch import describe, run_cell
from experiments.harness.model import shifted_labels
from experiments.harness.train import build, replica_tokens
from experiments.runner.plan_spec import PlanSpec, configurations

# -- config --------------------------------------------------------------------------------------


def test_dp_validates_and_derives_the_world():
    with pytest.raises(ValueError, match=r"dp must be >= 1, got 0"):
        Cell("ulysses", dp=0).validate()
    with pytest.raises(ValueError, match=r"dp must be 1 for the 'attention' workload"):
        Cell("ulysses", workload="attention", dp=2).validate()
    cell = Cell("ulysses", nproc=2, dp=4)
    cell.validate()
    assert cell.world == 8 and Cell("ulysses").world == 4
    row = describe(cell, None)
    assert (row["dp"], row["nproc"], row["world_size"]) == (4, 2, 8)
    # an invalid dp is a row, before anything launches
    bad = run_cell(Cell("ulysses", dp=-1))
    assert bad["status"] == "invalid" and "dp must be >= 1" in bad["error"]


def test_dp_keeps_committed_ids_and_shows_when_not_one():
    old = Cell("ulysses", "tiny", seq_len=2048, nproc=4, stack="alst", dtype="fp32", warmup=1,
               iters=2)
    assert old.cell_id() == "ulysses-tiny-2K-p4-alst-fp32-473210fc"  # from results/
    assert dataclasses.replace(old, dp=1).cell_id() == old.cell_id()
    two = dataclasses.replace(old, dp=2)
    assert two.cell_id().startswith("ulysses-tiny-2K-p4-D2-alst-fp32-")
    assert two.cell_id() != old.cell_id()
    assert Cell.from_dict(two.to_dict()) == two
    assert Cell.from_dict({k: v for k, v in old.to_dict().items() if k != "dp"}) == old


@pytest.mark.parametrize("argv, want", [
    (["--dp", "8"], (1, 8)),  # the paper's FSDP-only setting on its one node
    (["--dp", "2", "--world", "8"], (4, 2)),
    (["--dp", "2", "--nproc", "2"], (2, 2)),
    (["--dp", "2", "--mesh", "2x2", "--world", "8"], (4, 2)),
])
def test_cli_dp_sets_the_replicas_and_world_over_them(argv, want):
    a = parser().parse_args(["emulate", "--method", "usp", *argv])
    cell = cell_from_args(a, emulated=True)
    assert (cell.nproc, cell.dp) == want


@pytest.mark.parametrize("argv, words", [
    (["--dp", "3", "--world", "8"], ["--world", "--dp"]),
    (["--dp", "2", "--world", "8", "--nproc", "2"], ["--world", "--dp", "--nproc"]),
    (["--dp", "3"], ["--dp (3) must divide the default world size (8)"]),
])
def test_cli_dp_that_disagrees_is_named(argv, words):
    a = parser().parse_args(["emulate", "--method", "ulysses", *argv])
    with pytest.raises(ValueError) as e:
        world_from_args(a, 8)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_sweeps_pass_dp_through_to_their_cells():
    sweep = Sweep("dp", "dp in base and on an axis", "cpu",
                  base={"method": "ulysses", "nproc": 2, "seq_len": "4K"},
                  axes={"dp": [1, 2], "variant": [{}, {"method": "usp", "ring_degree": 2}]})
    cells = sweep.cells()
    assert sorted((c.method, c.dp, c.world) for c in cells) == [
        ("ulysses", 1, 2), ("ulysses", 2, 4), ("usp", 1, 2), ("usp", 2, 4)]
    assert not sweep.validate()


def test_plan_splits_the_gpus_into_replicas():
    cells, _ = configurations(PlanSpec("tiny", 8, 4096, methods=("ulysses", "usp"), dp=4))
    assert cells and all((c.nproc, c.dp, c.world) == (2, 4, 8) for c in cells)
    with pytest.raises(ValueError, match=r"dp must be >= 1 and divide gpus \(8\), got 3"):
        PlanSpec("tiny", 8, 4096, dp=3).validate()


# -- a real dp x cp step -------------------------------------------------------------------------

# 2 layers, 4 heads over 2 KV heads, 64 tokens per sequence: small enough for 4 gloo ranks.
OVERRIDES = (("n_layers", "2"), ("dim", "32"), ("n_heads", "4"), ("n_kv_heads", "2"),
             ("head_dim", "8"), ("ffn_dim", "48"), ("vocab_size", "64"))
STEP = Cell("ulysses", "tiny", seq_len=64, nproc=2, dp=2, stack="alst", overrides=OVERRIDES,
            warmup=0, iters=0)


def _dp_gradients(cell_dict: dict) -> dict:
    """One forward/backward on this rank; the full gradients (gathered from the FSDP2 shards)
    and this rank's replica tokens."""
    cell = Cell.from_dict(cell_dict)
    state = build(cell, cell.validate())
    loss_sum = state.model(state.tokens, state.labels)
    (loss_sum / state.n_label_tokens).backward()
    grads = {n: p.grad.full_tensor() for n, p in state.model.named_parameters()}
    return {"grads": grads, "tokens": state.tokens, "rank": dist.get_rank()}


def _replica_gradient(cell: Cell, replica: int) -> dict[str, torch.Tensor]:
    """Single-device reference (no process group): the mean-token-loss gradient of one
    replica's sequence (any method's single-device attention is the reference's; same seed,
    same weights)."""
    one = dataclasses.replace(cell, method="ulysses", ring_degree=1, nproc=1, dp=1)
    cfg = one.validate()
    state = build(one, cfg, distributed=False)
    full = replica_tokens(cell, cfg.vocab_size, replica)
    (state.model(full, shifted_labels(full)) / (cell.seq_len - 1)).backward()
    return {n: p.grad for n, p in state.model.named_parameters()}


# Ulysses; a hybrid, whose (ring, ulysses) mesh is sliced per replica; a zigzag ring; DeepSpeed's
# all-to-all on the replica's group
DP_METHODS = [{}, {"method": "usp", "ring_degree": 2}, {"method": "torch-cp"},
              {"method": "ds-ulysses"}]


@pytest.mark.slow  # about 2 s on 2 cores (docs/testing.md)
@pytest.mark.parametrize("options", DP_METHODS, ids=["ulysses", "usp-R2", "torch-cp", "ds-ulysses"])
def test_dp_gradient_is_the_average_of_the_replicas(dist_pool, options):
    cell = dataclasses.replace(STEP, **options)
    ranks = dist_pool(cell.world).run(_dp_gradients, cell.to_dict())
    # ranks 0, 1 are replica 0 and ranks 2, 3 replica 1 (dp is the outer mesh axis): the two CP
    # ranks of a replica hold different shards, the replicas different sequences
    shard = {r["rank"]: r["tokens"] for r in ranks}
    for rank in (0, 1):
        assert not torch.equal(shard[rank], shard[rank + 2])
    refs = [_replica_gradient(cell, r) for r in range(cell.dp)]
    want = {n: (refs[0][n] + refs[1][n]) / 2 for n in refs[0]}
    for name, g in want.items():
        # fp32; the run sums 4 ranks' partial gradients (FSDP2 reduce-scatter) where the
        # reference sums per token and averages two: the round-off seen is at most 6e-7 of the
        # tensor's largest entry, so 1e-5 relative with a floor of 1e-5 of that entry (for
        # entries near zero) is ~16x above it and far below the gap to one replica's gradient
        # (checked below)
        floor = 1e-5 * g.abs().max().item()
        for r in ranks:
            torch.testing.assert_close(r["grads"][name], g, rtol=1e-5, atol=floor, msg=name)
    # not one replica's gradient: each replica contributes
    w = want["tok_embeddings.weight"]
    assert (refs[0]["tok_embeddings.weight"] - w).abs().max() > 1e-2 * w.abs().max()


# -- emulation ------------------------------------------------------------------------------------


@pytest.mark.slow  # about 8 s on 2 cores (docs/testing.md)
def test_dp_emulation_equals_the_real_run(dist_pool):
    """As tests/test_emulate.py's exactness check, with dp 2 x cp 2: the emulator plays rank 0
    (replica 0's critical rank) of the 4-rank world, FSDP2's shards over all 4."""
    cell = Cell("ulysses", "tiny", seq_len=2048, nproc=2, dp=2, stack="alst", dtype="fp32",
                warmup=1, iters=0)
    real = dist_pool(cell.world).run(_real_run, cell.to_dict())[0]
    emulated = emulate_cell(cell, Hardware(device="cpu"), exact=True, count=False)
    assert emulated["status"] == "ok", emulated["error"]
    assert emulated["world_size"] == 4
    assert {k: emulated[k] for k in KEYS} == real


@pytest.mark.slow  # about 2 s on 2 cores (docs/testing.md)
def test_fsdp_only_holds_the_model_states_of_cp_over_as_many_ranks():
    """(cp 1, dp 8), the paper's "FSDP only", and (cp 8, dp 1) shard the model over 8 ranks
    alike, so each rank holds the same model-state bytes at its peak; the rank's sequence is
    8x longer without CP, so its activation and attention bytes are larger."""
    cp = Cell("ulysses", "tiny", seq_len=1024, nproc=8, stack="alst", dtype="fp32", warmup=1,
              iters=0)
    fsdp_only = dataclasses.replace(cp, nproc=1, dp=8)
    hw = Hardware(device="cpu")
    a, b = (emulate_cell(c, hw, exact=True, count=False) for c in (cp, fsdp_only))
    assert a["status"] == b["status"] == "ok"
    assert a["world_size"] == b["world_size"] == 8
    assert a["peak_model_bytes"] == b["peak_model_bytes"]
    assert b["peak_attention_bytes"] > a["peak_attention_bytes"]
    assert b["peak_other_bytes"] > a["peak_other_bytes"]
    # and the model states do shard: one rank alone holds 7/8 more of its fp32 parameters and
    # two AdamW states (12 B a parameter) and of whatever gradients exist at the peak (up to 4
    # B more); the gathered parameters of the unit in use, which both hold, are model states
    # too (experiments/instruments/labels.py)
    alone = emulate_cell(dataclasses.replace(cp, nproc=1), hw, exact=True, count=False)
    cfg = cp.validate()
    n_params = (cfg.vocab_size * cfg.dim * (1 if cfg.tie_embeddings else 2) + cfg.dim
                + cfg.n_layers * (cfg.dim * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
                                  + 3 * cfg.dim * cfg.ffn_dim + 2 * cfg.dim))
    sharded = alone["peak_model_bytes"] - a["peak_model_bytes"]
    assert 12 * n_params * 7 / 8 <= sharded <= 16 * n_params * 7 / 8
