"""What is specific to the ``ds-ulysses`` adapter (its numerics are in test_correctness.py).

It is registered, it really runs DeepSpeed's ``DistributedAttention`` on the given group (four
DeepSpeed all-to-alls each way, nothing else on the wire), DeepSpeed's comm layer attaches to
the existing world instead of making one, and a missing DeepSpeed gives an actionable error.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from experiments.instruments.collectives import CollectiveCounter
from upipe import LlamaAttention, available_methods, build_method, get_method


def _through_deepspeed(h: int, hkv: int) -> dict:
    """Per rank: build on a fresh subgroup, count DeepSpeed's and c10d's all-to-alls."""
    import deepspeed.comm as ds_comm
    import deepspeed.sequence.layer as ds_layer

    world = dist.group.WORLD
    group = dist.new_group(list(range(dist.get_world_size())))
    torch.manual_seed(0)
    m = build_method("ds-ulysses", 32, h, hkv, 8, group=group)
    ref = build_method("ulysses", 32, h, hkv, 8, group=group)
    ref.load_state_dict(m.state_dict())

    ds_calls = []
    original = ds_layer.single_all_to_all  # _SeqAllToAll calls it through the module global

    def counted(*args, **kwargs):
        ds_calls.append(1)
        return original(*args, **kwargs)

    ds_layer.single_all_to_all = counted
    try:
        x = torch.randn(2, 6, 32, requires_grad=True)
        with CollectiveCounter() as fwd:
            y = m(x)
        n_ds_fwd = len(ds_calls)
        with CollectiveCounter() as bwd:
            y.sum().backward()
    finally:
        ds_layer.single_all_to_all = original
    x_ref = x.detach().requires_grad_(True)
    y_ref = ref(x_ref)
    y_ref.sum().backward()
    return {
        "is_ds": isinstance(m.dist_attn, ds_layer.DistributedAttention),
        "uses_group": m.dist_attn.spg is group,
        "world_unchanged": dist.group.WORLD is world,
        "ds_world": ds_comm.get_world_size(),
        "ds_calls": (n_ds_fwd, len(ds_calls) - n_ds_fwd),
        "fwd": dict(fwd.counts),
        "bwd": dict(bwd.counts),
        # Same kernel, same inputs: DeepSpeed's all-to-alls are pure data movement like ours.
        "same_as_ulysses": torch.equal(y, y_ref) and torch.equal(x.grad, x_ref.grad),
    }


def test_registered_and_builds():
    from baselines.ds_ulysses import DSUlyssesAttention

    assert "ds-ulysses" in available_methods()
    assert get_method("ds-ulysses") is DSUlyssesAttention
    m = build_method("ds-ulysses", 48, 6, 2, 16, causal=False)
    assert type(m) is DSUlyssesAttention and m.registry_name == "ds-ulysses"
    assert m.state_dict().keys() == LlamaAttention(48, 6, 2, 16).state_dict().keys()


@pytest.mark.parametrize("world,h,hkv", [(2, 4, 1), (2, 8, 8), (4, 8, 2)])
def test_runs_through_deepspeed_on_the_given_group(dist_pool, world, h, hkv):
    for rank, res in enumerate(dist_pool(world).run(_through_deepspeed, h, hkv)):
        assert res["is_ds"] and res["uses_group"], f"rank {rank}: {res}"
        assert res["world_unchanged"] and res["ds_world"] == world, f"rank {rank}: {res}"
        # q, k, v in and out back; backward mirrors them (KV replication adds no collective)
        assert res["ds_calls"] == (4, 4), f"rank {rank}: {res}"
        assert res["fwd"] == res["bwd"] == {"alltoall_base_": 4}, f"rank {rank}: {res}"
        assert res["same_as_ulysses"], f"rank {rank}: output or dx differs from 'ulysses'"


def test_single_process_without_torch_distributed():
    if dist.is_initialized():
        pytest.skip("needs a process without torch.distributed")
    torch.manual_seed(0)
    ref = LlamaAttention(48, 6, 2, 16).double()
    m = build_method("ds-ulysses", 48, 6, 2, 16).double()
    m.load_state_dict(ref.state_dict())
    assert m.dist_attn is None  # C == 1: DeepSpeed's all-to-alls would be identities
    x = torch.randn(2, 13, 48, dtype=torch.float64)
    torch.testing.assert_close(m(x), ref(x), rtol=0, atol=1e-12)  # fp64: only rounding differs


def test_missing_deepspeed_is_a_clear_error(monkeypatch):
    # None in sys.modules makes any import of that name raise ImportError, as if uninstalled.
    for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    with pytest.raises(ImportError, match="ds-ulysses.*pip install deepspeed"):
        build_method("ds-ulysses", 48, 6, 2, 16)


@pytest.mark.slow  # about 1 s on 2 cores (docs/testing.md)
def test_importing_baselines_does_not_import_deepspeed():
    code = "import sys, baselines; assert 'deepspeed' not in sys.modules, 'eager import'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
