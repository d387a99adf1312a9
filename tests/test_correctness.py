"""Every CP method against the single-device reference
(docs/conventions.md#the-reference-comparison-recipe), on 1, 2 and 4 ranks.

The hybrids (usp, upipe on a mesh) run on (ring x ulysses) meshes; FPDT's matrix (chunk sizes)
is in test_fpdt.py with the same recipe and tolerance. DeepSpeed's FPDT (``ds-fpdt``) runs here
on CPU through its flash-attn stand-in (baselines/ds_fpdt_portable.py), causal only, in whole
chunks of an awkward size (FPDT_CASES).

Tolerance (Flash-Attention's rule, tests/test_flash_attn.py there): against an fp64 ground truth,
a method's error may be at most twice the error of the plain-PyTorch reference computed in the
same dtype, plus a floor of a few ulps of the quantity's magnitude for the case where the
reference happens to be (near-)exact. Quantities: output, dx and all four weight gradients
(summed over ranks in fp32, as FSDP reduces them), max over every rank.
"""

from __future__ import annotations

import pytest
from cases import Case, compare_with_reference

METHODS = ("upipe", "ulysses", "usp-ulysses", "ds-ulysses", "ring", "zigzag-ring", "torch-cp")
ZIGZAG = ("zigzag-ring", "torch-cp")  # global length must split into 2W chunks
QUANTITIES = ("y", "dx", "wq.weight", "wk.weight", "wv.weight", "wo.weight")
# ulps-of-magnitude floor: 2^-23 (fp32) and 2^-8 (bf16) mantissa steps, times a small factor
FLOOR = {"fp32": 8 * 2.0**-23, "bf16": 2 * 2.0**-8}

# (world, n_heads, n_kv_heads, seq): MHA, GQA, KV heads fewer than ranks, odd lengths
# (15 and 11 tokens per rank), 12 heads (not a power of two).
HEADS = [
    (1, 8, 8, 37), (1, 8, 2, 37), (1, 12, 4, 37),
    (2, 8, 8, 30), (2, 8, 2, 30), (2, 16, 4, 30), (2, 12, 4, 30), (2, 4, 1, 30),
    (4, 8, 8, 44), (4, 8, 2, 44), (4, 16, 4, 44),
]


# ds-fpdt: (world, n_heads, n_kv_heads, seq, chunk_size). FPDT needs whole chunks (seq a multiple
# of chunk_size) and chunk_size a multiple of the world; 7, 10 and 12 give 7, 5 and 3 tokens per
# rank and chunk (odd, not powers of two), 3 to 5 chunks, so the offloading path and its LSE merge
# over several K/V chunks run; one case per world keeps its chunk on the device (offload off).
FPDT_CASES = [
    (1, 8, 2, 35, 7), (1, 12, 4, 35, 7),
    (2, 8, 2, 30, 10), (2, 4, 1, 30, 10), (2, 12, 4, 30, 10),
    (4, 8, 2, 36, 12), (4, 16, 4, 36, 12),
]


def _fpdt_cases() -> list:
    out = []
    for world, h, hkv, seq, chunk in FPDT_CASES:
        for offload in (True, False):
            if not offload and (h, hkv) != (8, 2):
                continue
            o = {"chunk_size": chunk, "offload": offload}
            for dtype in ("fp32", "bf16"):
                case = Case("ds-fpdt", h, hkv, seq, dtype=dtype, options=o)
                cid = (f"ds-fpdt-c{chunk}{'' if offload else '-on-device'}-w{world}-h{h}kv{hkv}"
                       f"-s{seq}-causal-{dtype}")
                out.append(pytest.param(world, case, id=cid, marks=_dtype_marks(dtype)))
    return out


def _stage_options(world: int, n_heads: int, n_kv_heads: int) -> list[dict]:
    """UPipe's U values for a head count: C (default), 2C and H when valid and distinct, each
    with overlapped stages (which keep the last stage for the backward by default), and U = C
    with the default (the paper's blocking schedule). On one rank there is no all-to-all to
    overlap: the default only. With MHA (a KV block per stage: the backward's walk in reverse
    starts in the last block) also the kept last stage without overlap, and overlap without it."""
    us = sorted({u for u in (world, 2 * world, n_heads) if n_heads % u == 0})
    keep = [{"heads_per_stage": world, "keep_last_stage": True}] if n_heads == n_kv_heads else []
    if world == 1:
        return [{"heads_per_stage": u} for u in us] + keep
    if keep:
        keep.append({"heads_per_stage": world, "overlap": True, "keep_last_stage": False})
    return ([{"heads_per_stage": world}] + [{"heads_per_stage": u, "overlap": True} for u in us]
            + keep)


# Hybrids on a (ring, ulysses) mesh: 2x2 on 4 ranks (the paper's 8x2 in small), and the
# degenerate 2x1 (pure zigzag ring through the hybrid path) and 1x2 (pure Ulysses) on 2 ranks.
# Lengths split into 2 x ring chunks of odd size; 4 heads / 1 KV head replicates KV over ulysses.
MESH_CASES = [
    (4, (2, 2), 8, 2, 40), (4, (2, 2), 16, 4, 40), (4, (2, 2), 4, 1, 40), (4, (2, 2), 6, 6, 40),
    (2, (2, 1), 8, 2, 28), (2, (1, 2), 8, 2, 28),
]


# UPipe's long-context options (issue 17): the chunked attention backward (chunks of an odd
# size that does not divide the sequence: the last chunk is shorter) and the fused input norm,
# alone and together, with overlap on meshes of 2 and 4; (world, heads, kv heads, seq, chunk).
# The fused norm works in tiles of dim (48) rows of B x L: 74 rows on one rank and 110 on two
# give two and three tiles (the last shorter).
LONG_CASES = [(1, 8, 2, 37, 7), (2, 8, 2, 30, 7), (2, 4, 1, 110, 23), (4, 16, 4, 44, 12)]


def _long_cases() -> list:
    out = []
    for world, h, hkv, seq, chunk in LONG_CASES:
        ov = {"overlap": True} if world > 1 else {}
        for o, norm in (({"chunk_size": chunk}, False), ({}, True),
                        ({"chunk_size": chunk} | ov, True)):
            out += _params(world, "upipe", h, hkv, seq, [{"heads_per_stage": world} | o], "",
                           input_norm=norm)
    return out


def _params(world, method, h, hkv, seq, options, tag, input_norm=False):
    out = []
    for o in options:
        for causal in (True, False):
            for dtype in ("fp32", "bf16"):
                case = Case(method, h, hkv, seq, causal=causal, dtype=dtype, options=o,
                            input_norm=input_norm)
                u = f"-U{o['heads_per_stage']}" if "heads_per_stage" in o else ""
                u += f"-{o['rotate_method']}" if "rotate_method" in o else ""
                u += "-overlap" if o.get("overlap") else ""
                u += {True: "-keep", False: "-nokeep", None: ""}[o.get("keep_last_stage")]
                u += f"-chunk{o['chunk_size']}" if "chunk_size" in o else ""
                u += "-input-norm" if input_norm else ""
                cid = f"{method}{u}{tag}-w{world}-h{h}kv{hkv}-s{seq}-" + (
                    "causal" if causal else "full") + f"-{dtype}"
                out.append(pytest.param(world, case, id=cid, marks=_dtype_marks(dtype)))
    return out


def _dtype_marks(dtype: str) -> tuple:
    """The bf16 twin of every case is ``slow``: the inner loop (-m 'not slow') runs each case in
    fp32, the same code on the same shapes, and the full suite (CI) runs both."""
    return (pytest.mark.slow,) if dtype == "bf16" else ()


def _cases() -> list:
    out = []
    for world, h, hkv, seq in HEADS:
        for method in METHODS:
            opts = (_stage_options(world, h, hkv) if method == "upipe"
                    else [{}, {"rotate_method": "allgather"}] if method == "torch-cp" else [{}])
            s = seq - seq % (2 * world) if method in ZIGZAG else seq
            out += _params(world, method, h, hkv, s, opts, "")
    for world, (ring, uly), h, hkv, seq in MESH_CASES:
        mesh = {"mesh": (ring, uly)}
        tag = f"-mesh{ring}x{uly}"
        out += _params(world, "usp", h, hkv, seq, [mesh], tag)
        stages = [mesh | o for o in _stage_options(uly, h, hkv)]
        out += _params(world, "upipe", h, hkv, seq, stages, tag)
    return out + _long_cases() + _fpdt_cases()


def assert_close_to_reference(results: list[dict], case: Case) -> None:
    failures = []
    for q in QUANTITIES + (("norm.weight",) if case.input_norm else ()):
        err = max(r[q] for r in results)
        ref = max(r["ref_" + q] for r in results)
        tol = 2 * ref + FLOOR[case.dtype] * max(r["scale_" + q] for r in results)
        if not err <= tol:
            failures.append(f"{q}: error {err:.3e} > tol {tol:.3e} (reference's own {ref:.3e})")
    assert not failures, "; ".join(failures)


@pytest.mark.parametrize("world,case", _cases())
def test_matches_reference(dist_pool, world, case):
    results = dist_pool(world).run(compare_with_reference, case)
    assert len(results) == world
    assert_close_to_reference(results, case)
