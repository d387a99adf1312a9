"""Public API: the registry, state_dict compatibility, the function form, no-distributed use."""

from __future__ import annotations

import pytest
import torch

import upipe
from upipe import LlamaAttention, UPipeAttention, build_method, rope_tables, upipe_attention


def test_registry_lists_the_methods_of_this_issue():
    names = upipe.available_methods()
    assert {"upipe", "ulysses", "ds-ulysses"} <= set(names)
    assert upipe.get_method("upipe") is UPipeAttention
    assert upipe.get_method("ulysses").registry_name == "ulysses"


@pytest.mark.parametrize("method", ["upipe", "ulysses"])
def test_same_parameter_names_as_the_reference(method):
    ref = LlamaAttention(32, 4, 2, 8)
    m = build_method(method, 32, 4, 2, 8)
    assert list(m.state_dict()) == list(ref.state_dict()) == [
        "wq.weight", "wk.weight", "wv.weight", "wo.weight"
    ]
    for k, v in ref.state_dict().items():
        assert m.state_dict()[k].shape == v.shape


@pytest.mark.parametrize("method", ["upipe", "ulysses"])
def test_single_process_without_torch_distributed(method):
    """World size 1 without an initialised process group: exactly the reference (fp64)."""
    assert not torch.distributed.is_initialized()
    ref = LlamaAttention(40, 6, 2, 8, causal=True).double()
    m = build_method(method, 40, 6, 2, 8).double()
    m.load_state_dict(ref.state_dict())
    x = torch.randn(2, 23, 40, dtype=torch.float64)
    torch.testing.assert_close(m(x), ref(x), atol=1e-12, rtol=1e-12)
    # an empty batch ran forward and failed in the backward (a reshape of 0 elements)
    with pytest.raises(ValueError, match=r"at least one sequence \(batch > 0\)"):
        m(x[:0])


def test_function_form_with_own_projections():
    """upipe_attention + the caller's own output projection == the module."""
    m = UPipeAttention(48, 8, 2, 16, heads_per_stage=1).double()
    x = torch.randn(1, 19, 48, dtype=torch.float64, requires_grad=True)
    cos, sin = rope_tables(torch.arange(19), 16, m.rope_theta, x.dtype)
    attn = upipe_attention(
        x, m.wq.weight, m.wk.weight, m.wv.weight, cos, sin, n_heads=8, n_kv_heads=2,
        heads_per_stage=1,
    )
    assert attn.shape == (1, 19, 8, 16)
    y = m.wo(attn.flatten(2))
    torch.testing.assert_close(y, m(x), atol=0, rtol=0)
    (gx,) = torch.autograd.grad(y.sum(), x)
    (gx_ref,) = torch.autograd.grad(m(x).sum(), x)
    torch.testing.assert_close(gx, gx_ref, atol=0, rtol=0)
    # fused output projection: the same function given wo
    y_fused = upipe_attention(
        x, m.wq.weight, m.wk.weight, m.wv.weight, cos, sin, m.wo.weight, n_heads=8,
        n_kv_heads=2, heads_per_stage=1,
    )
    torch.testing.assert_close(y_fused, y, atol=1e-12, rtol=1e-12)
    (gx_fused,) = torch.autograd.grad(y_fused.sum(), x)
    torch.testing.assert_close(gx_fused, gx, atol=1e-12, rtol=1e-12)


def test_function_form_refuses_tensors_its_head_counts_do_not_fit():
    """An MHA layer's k/v weights given with n_kv_heads=2 ran GQA on their first two heads
    (their other rows got zero gradients); a longer bias was read in part; an empty shard
    killed the process in the kernel (SIGFPE); overlap='yes' was taken as True."""
    m = UPipeAttention(48, 8, 8, 16).double()  # MHA: 8 K/V heads
    x = torch.randn(1, 19, 48, dtype=torch.float64)
    cos, sin = rope_tables(torch.arange(19), 16, m.rope_theta, x.dtype)
    w = (m.wq.weight, m.wk.weight, m.wv.weight)
    cases = [
        (dict(n_kv_heads=2), r"wk must have shape \(32, 48\) .* got \(128, 48\)"),
        (dict(bq=torch.zeros(256, dtype=x.dtype)), r"bq must have shape \(128,\)"),
        (dict(q_norm=torch.ones(8, dtype=x.dtype)), r"q_norm must have shape \(16,\)"),
        (dict(wo=torch.zeros(48, 64, dtype=x.dtype)), r"wo must be \(dim_out, n_heads \* "),
        (dict(overlap="yes"), "overlap must be True or False, got 'yes'"),
    ]
    for extra, says in cases:
        kw = dict(n_heads=8, n_kv_heads=8) | extra
        with pytest.raises(ValueError, match=says):
            upipe_attention(x, *w, cos, sin, **kw)
    with pytest.raises(ValueError, match=r"cos must have shape \(19, 16\)"):
        upipe_attention(x, *w, cos[:18], sin, n_heads=8, n_kv_heads=8)
    with pytest.raises(ValueError, match="x must be .* no empty dimension"):
        upipe_attention(x[:, :0], *w, cos[:0], sin[:0], n_heads=8, n_kv_heads=8)


def test_upipe_long_context_options_are_checked():
    """chunk_size a positive int; input_norm a norm over dim: refused before any communication."""
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="chunk_size must be a positive number of tokens"):
            build_method("upipe", 32, 4, 2, 8, chunk_size=bad)
    m = build_method("upipe", 32, 4, 2, 8, chunk_size=16)
    assert m.options()["chunk_size"] == 16
    x = torch.randn(1, 8, 32)
    for bad in (torch.nn.LayerNorm(16), torch.nn.Identity()):  # wrong size; no weight or eps
        with pytest.raises(ValueError, match=r"input_norm must be an RMSNorm over dim \(32\)"):
            m(x, input_norm=bad)


def test_upipe_overlap_must_be_a_bool():
    """A truthy string is not silently taken for True: refused before any communication."""
    with pytest.raises(ValueError, match="overlap must be True or False, got 'yes'"):
        build_method("upipe", 32, 4, 2, 8, overlap="yes")
    assert build_method("upipe", 32, 4, 2, 8, overlap=True).options()["overlap"] is True


def test_upipe_keep_last_stage_follows_overlap_unless_given():
    """keep_last_stage: None (default) is overlap's value; True/False as given; else refused."""
    for overlap in (False, True):
        m = build_method("upipe", 32, 4, 2, 8, overlap=overlap)
        assert m.options()["keep_last_stage"] is overlap
        for keep in (False, True):
            m = build_method("upipe", 32, 4, 2, 8, overlap=overlap, keep_last_stage=keep)
            assert m.options()["keep_last_stage"] is keep
    with pytest.raises(ValueError, match="keep_last_stage must be True, False or None, got 1"):
        build_method("upipe", 32, 4, 2, 8, keep_last_stage=1)


def test_the_package_states_its_version_and_rows_carry_it():
    """Every row's ``upipe_version`` was None: the package had no ``__version__``."""
    import importlib.metadata

    from experiments.provenance import provenance

    assert upipe.__version__ == importlib.metadata.version("upipe")
    assert provenance()["upipe_version"] == upipe.__version__
