"""The adapters over other libraries: ``torch-cp`` (PyTorch native CP), ``rfa-zigzag``
(ring-flash-attn) and ``ds-fpdt`` (DeepSpeed FPDT).

On CPU (always run): each is registered; for those that cannot run on CPU here (``GATED``) its
``unavailable_reason("cpu")`` names what is missing, and building or calling it on 2 gloo ranks
fails on every rank with that message and no collective (a hang would be a DistPool timeout);
its layout is the one its library uses (checked against torch's head-tail load balancer and
DeepSpeed's ``FPDT_InputConstruct``); torch-cp's ring options are scoped to its calls (its CPU
runs: tests/test_torch_cp.py and the shared matrix); and ds-fpdt matches the reference with a
math stand-in for flash-attn's private kernels, which checks the adapter's weight, RoPE, layout
and KV-replication mapping.

On a GPU (marked ``gpu``): every adapter against the single-device reference with the shared
recipe (tests/cases.py). DistPool runs gloo, so ranks exchange CUDA tensors through gloo; a
world of W needs W GPUs (one per rank). ring-flash-attn at W=1 sends dK/dV to itself, which gloo
cannot do (seen on CPU: "Pair is not connected"), so that case waits for an NCCL pool.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import types
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from cases import Case, compare_on_gpu, compare_with_reference
from test_correctness import assert_close_to_reference

# importing registers them (until pyproject's upipe.methods entry points list them)
import baselines.ds_fpdt
import baselines.rfa_zigzag
import baselines.torch_cp
from experiments.instruments.collectives import CollectiveCounter
from upipe import LlamaAttention, build_method, get_method
from upipe.layout import SeqLayout

ADAPTERS = {
    "torch-cp": baselines.torch_cp.TorchCPAttention,
    "rfa-zigzag": baselines.rfa_zigzag.RFAZigzagAttention,
    "ds-fpdt": baselines.ds_fpdt.DSFPDTAttention,
}
# What each reason must name on CPU (the device) and which packages it needs (named when absent)
NEEDS = {
    "torch-cp": {},
    "rfa-zigzag": {"flash_attn": "flash-attn", "ring_flash_attn": "ring-flash-attn"},
    "ds-fpdt": {"flash_attn": "flash-attn"},
}


# -- CPU: registry, reasons, fail-fast ------------------------------------------------------------


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_registered(name):
    assert get_method(name) is ADAPTERS[name] and ADAPTERS[name].registry_name == name


# the adapters that cannot run on this machine's CPU (torch-cp runs on CPU: test_torch_cp.py)
GATED = [n for n, cls in ADAPTERS.items() if cls.unavailable_reason("cpu") is not None]


@pytest.mark.parametrize("name", GATED)
def test_cpu_reason_names_what_is_missing(name):
    reason = ADAPTERS[name].unavailable_reason("cpu")
    assert isinstance(reason, str) and "CUDA" in reason and name in reason
    for module, pkg in NEEDS[name].items():
        if baselines.rfa_zigzag.import_problem(module) is not None:
            assert pkg in reason and "pip install 'upipe[flash]'" in reason


def _build_and_call(name: str) -> dict:
    """Per rank: build ``name``, then call it on CPU; where it failed, how, and the collectives
    that ran in the failing step (a build that succeeds may attach a comm layer: not counted)."""
    import baselines.ds_fpdt  # noqa: F401  (register in this worker)
    import baselines.rfa_zigzag  # noqa: F401
    import baselines.torch_cp  # noqa: F401

    def failure(stage, err, cc):
        return {"stage": stage, "type": type(err).__name__, "msg": str(err), "comms": cc.total}

    with CollectiveCounter() as cc:
        try:
            m = build_method(name, 48, 6, 2, 16, group=dist.group.WORLD).to(torch.bfloat16)
        except Exception as e:  # the point: which exception, and its message
            return failure("build", e, cc)
    with CollectiveCounter() as cc:
        try:
            m(torch.randn(2, 8, 48, dtype=torch.bfloat16))
        except Exception as e:
            return failure("forward", e, cc)
    return {"stage": "returned", "comms": cc.total}


@pytest.mark.slow  # about 2 s on 2 cores (docs/testing.md)
@pytest.mark.parametrize("name", GATED)
def test_cpu_call_fails_on_every_rank_before_any_collective(dist_pool, name):
    reason = ADAPTERS[name].unavailable_reason("cpu")
    for rank, res in enumerate(dist_pool(2).run(_build_and_call, name)):
        assert res["comms"] == 0, f"rank {rank}: a collective ran before the error: {res}"
        if res["stage"] == "build":  # a package is missing: the constructor says which
            assert res["type"] == "ImportError" and "pip install" in res["msg"], f"rank {rank}"
            for module, pkg in NEEDS[name].items():
                if baselines.rfa_zigzag.import_problem(module) is not None:
                    assert pkg in res["msg"] and pkg in reason, f"rank {rank}: {res}"
        else:
            assert res["stage"] == "forward", f"rank {rank}: ran on CPU: {res}"
            assert res["type"] == "RuntimeError" and res["msg"] == reason, f"rank {rank}: {res}"


def test_torch_cp_builds_on_cpu_with_the_reference_parameters():
    m = build_method("torch-cp", 48, 6, 2, 16, rotate_method="alltoall")
    assert m.state_dict().keys() == LlamaAttention(48, 6, 2, 16).state_dict().keys()
    assert m.seq_layout == SeqLayout("zigzag") and m.options() == {"rotate_method": "alltoall"}
    with pytest.raises(ValueError, match="rotate_method"):
        build_method("torch-cp", 48, 6, 2, 16, rotate_method="ring")


@pytest.mark.parametrize("name", ["rfa-zigzag", "ds-fpdt"])
def test_causal_only_is_a_value_error(name):
    with pytest.raises(ValueError, match="causal must be True"):
        build_method(name, 48, 6, 2, 16, causal=False)


def test_config_rules_without_building():
    get_method("torch-cp").check_config(5, 5, cp=4, seq_len=16)  # ring: no head rule
    with pytest.raises(ValueError, match="2 x the CP degree"):
        get_method("rfa-zigzag").check_config(8, 2, cp=4, seq_len=20)
    fpdt = get_method("ds-fpdt")
    fpdt.check_config(8, 2, cp=2, seq_len=64, chunk_size=16)
    fpdt.check_config(8, 2, cp=2, seq_len=64, chunk_size=64)  # one chunk
    with pytest.raises(ValueError, match="positive multiple of chunk_size"):
        fpdt.check_config(8, 2, cp=2, seq_len=64)  # the 64K default: no whole chunk
    with pytest.raises(ValueError, match="multiple of chunk_size"):
        fpdt.check_config(8, 2, cp=2, seq_len=40, chunk_size=16)
    with pytest.raises(ValueError, match="n_heads"):
        fpdt.check_config(6, 2, cp=4, seq_len=64)  # Ulysses head rule


def test_torch_cp_options_are_scoped_to_the_call():
    from baselines.torch_cp import _attention_module, torch_cp_options

    att = _attention_module()
    opts = att._cp_options
    before = (opts.enable_load_balance, opts.rotate_method)
    with torch_cp_options(False, "alltoall"):
        assert not opts.enable_load_balance and opts.rotate_method == att._RotateMethod.ALL_TO_ALL
    assert (opts.enable_load_balance, opts.rotate_method) == before
    with pytest.raises(RuntimeError), torch_cp_options(True, "allgather"):
        assert opts.enable_load_balance and opts.rotate_method == att._RotateMethod.ALL_GATHER
        raise RuntimeError  # restored on the way out of an error too
    assert (opts.enable_load_balance, opts.rotate_method) == before


# -- CPU: the layouts are the libraries' own ------------------------------------------------------


@pytest.mark.parametrize("seq,world", [(16, 2), (24, 4), (8, 1)])
def test_zigzag_is_torch_head_tail_order(seq, world):
    from torch.distributed.tensor.experimental._context_parallel import _HeadTailLoadBalancer

    order = _HeadTailLoadBalancer(seq, world, "cpu")._generate_indices()[0].long()
    ours = torch.cat([SeqLayout("zigzag").shard(torch.arange(seq), r, world, 0)
                      for r in range(world)])
    assert torch.equal(ours, order)  # pure index movement: exact


@pytest.mark.slow  # about 2 s on 2 cores (docs/testing.md)
@pytest.mark.parametrize("seq,world,chunk", [(32, 2, 8), (48, 4, 16), (16, 2, 16)])
def test_chunked_is_fpdt_input_construct(seq, world, chunk):
    from deepspeed.sequence.fpdt_layer import FPDT_InputConstruct

    tokens = torch.arange(seq)[None]
    args = types.SimpleNamespace(ds_sequence_parallel_fpdt_chunk_size=chunk)
    layout = get_method("ds-fpdt").layout_for(hybrid=False, ulysses_degree=world, chunk_size=chunk)
    for r in range(world):
        construct = FPDT_InputConstruct(tokens, None, None, None, None, args, world, r)
        assert torch.equal(layout.shard(tokens, r, world), construct.generate()[0]), f"rank {r}"


# -- CPU: ds-fpdt's mapping, with a math stand-in for flash-attn's private kernels ----------------


def _stand_in_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left=-1,
                      window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False):
    """flash-attn >= 2.7 ``_flash_attn_forward``: (out, softmax_lse, S_dmask, rng_state)."""
    from upipe.kernels import attention_forward

    out, lse = attention_forward(q, k, v, causal=causal, scale=softmax_scale, kernel="math")
    return out, lse, None, None


def _stand_in_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                       causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                       alibi_slopes=None, deterministic=False, rng_state=None):
    """flash-attn >= 2.7 ``_flash_attn_backward``: writes dq, dk, dv in place."""
    from upipe.kernels import attention_backward

    grads = attention_backward(dout, q, k, v, out, softmax_lse, causal=causal,
                               scale=softmax_scale, kernel="math")
    for buf, g in zip((dq, dk, dv), grads, strict=True):
        buf.copy_(g)


@contextlib.contextmanager
def _flash_attn_stand_in():
    """flash-attn's private kernels as upipe's math kernel, and the CPU gate of ds-fpdt off.

    All undone on exit (``mock.patch``): DistPool workers serve later tests, which must see no
    flash-attn. FPDT bound the kernels at import, so its module globals are patched too.
    """
    import deepspeed.sequence.fpdt_layer as fpdt
    from packaging import version

    fa = types.ModuleType("flash_attn")
    fa.__version__ = "2.7.4"
    fa.flash_attn_interface = types.SimpleNamespace(
        _flash_attn_forward=_stand_in_forward, _flash_attn_backward=_stand_in_backward)
    kernels = vars(fa.flash_attn_interface) | {"flash_attn_version": version.parse("2.7.4")}
    gate = classmethod(lambda cls, device_type: None)
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(sys.modules, {
            "flash_attn": fa, "flash_attn.flash_attn_interface": fa.flash_attn_interface}))
        for name, value in kernels.items():  # flash_attn_version exists only after a real import
            stack.enter_context(mock.patch.object(fpdt, name, value, create=True))
        stack.enter_context(mock.patch.object(baselines.ds_fpdt.DSFPDTAttention,
                                              "unavailable_reason", gate))
        yield


def _fpdt_with_stand_in(case: Case) -> dict:
    with _flash_attn_stand_in():
        return compare_with_reference(case)


# FPDT's offloading path needs CUDA streams, so several chunks run with offload off; one chunk
# (S <= chunk_size) takes FPDT's on-device path whatever the flag says.
def _fpdt_case(world, h, hkv, seq, cid, **options):
    return pytest.param(world, Case("ds-fpdt", h, hkv, seq, dtype="bf16", options=options), id=cid)


FPDT_CPU_CASES = [  # (world, case)
    _fpdt_case(2, 8, 2, 32, "w2-gqa-4chunks", chunk_size=8, offload=False),
    _fpdt_case(2, 4, 1, 24, "w2-kv1-3chunks", chunk_size=8, offload=False),
    _fpdt_case(2, 6, 6, 20, "w2-mha-1chunk-offload-flag", chunk_size=20),  # S == chunk_size
    # KV heads 2 -> 4 replicas: each head's copies must sit next to each other (interleaved)
    _fpdt_case(4, 8, 2, 32, "w4-kv2-4chunks", chunk_size=8, offload=False),
]


@pytest.mark.slow  # about 9 s on 2 cores (docs/testing.md)
@pytest.mark.parametrize("world,case", FPDT_CPU_CASES)
def test_fpdt_mapping_matches_reference_with_math_kernels(dist_pool, world, case):
    assert_close_to_reference(dist_pool(world).run(_fpdt_with_stand_in, case), case)


# -- GPU: the real libraries against the reference ------------------------------------------------


GPU_HEADS = [(8, 8), (8, 2), (12, 4), (4, 1)]


def _gpu_cases() -> list:
    out = []
    for world, name, (h, hkv) in itertools.product((1, 2), ADAPTERS, GPU_HEADS):
        if name == "ds-fpdt" and hkv % world and world % hkv:
            continue  # FPDT's Ulysses head rule
        full = name == "torch-cp"  # the flash-attn adapters: causal, half precision only
        opts = {"chunk_size": 8 * world} if name == "ds-fpdt" else {}  # 3 chunks of 24*W tokens
        for causal, dt in itertools.product((True, False) if full else (True,),
                                            ("fp32", "bf16") if full else ("bf16",)):
            case = Case(name, h, hkv, 24 * world, causal=causal, dtype=dt, options=opts)
            cid = f"{name}-w{world}-h{h}kv{hkv}-{'causal' if causal else 'full'}-{dt}"
            out.append(pytest.param(world, case, id=cid))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("world,case", _gpu_cases())
def test_matches_reference_on_gpu(dist_pool, world, case):
    reason = ADAPTERS[case.method].unavailable_reason("cuda")
    if reason is not None:
        pytest.skip(reason)
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs (one per gloo rank), found {torch.cuda.device_count()}")
    if case.method == "rfa-zigzag" and world == 1:
        pytest.skip("ring-flash-attn sends dK/dV to itself at W=1, which gloo cannot; needs NCCL")
    assert_close_to_reference(dist_pool(world).run(compare_on_gpu, case), case)
