"""The interface every CP attention method shares (docs/design.md#one-interface-for-every-method).

``ContextParallelAttention`` owns what is common: the constructor signature and its validation,
the reference parameter names (``wq``, ``wk``, ``wv``, ``wo``; bias-free), the CP group, the
sequence layout with its shard/unshard helpers, and RoPE tables for this rank's global positions.
Subclasses implement ``forward(x_local, cu_seqlens=None) -> y_local`` with x_local (batch,
seq_local, dim) and ``cu_seqlens`` the packed documents' global cumulative lengths
(``upipe.documents``); :meth:`ContextParallelAttention.documents` validates them.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from upipe.comm import group_rank, group_size
from upipe.documents import Documents, RingDocuments, documents
from upipe.kernels import check_kernel
from upipe.layout import SeqLayout, unshard_sequence
from upipe.norm import norm_params
from upipe.options import MethodOption
from upipe.reference import resolve_head_dim
from upipe.rope import apply_rope, rope_tables

#: What :meth:`ContextParallelAttention.use_projections` may bring beyond a bias-free Llama
#: attention: q/k/v biases (Qwen2), an output bias, per-head q/k RMSNorm (Qwen3), and RoPE
#: inverse frequencies other than theta's (Llama 3.1's "llama3" scaling, linear, yarn).
PROJECTION_FEATURES = frozenset({"qkv_bias", "out_bias", "qk_norm", "rope_inv_freq"})


def check_ulysses_heads(n_heads: int, n_kv_heads: int, cp: int) -> None:
    """Head rules of the all-to-all methods, raised before any collective.

    Query heads split evenly over the CP ranks; KV heads either split evenly too or, when there
    are fewer KV heads than ranks, are replicated, which needs ``cp % n_kv_heads == 0``.
    """
    if n_kv_heads <= 0 or n_heads % n_kv_heads:
        raise ValueError(
            f"n_heads ({n_heads}) must be a positive multiple of n_kv_heads ({n_kv_heads})"
        )
    if n_heads % cp:
        raise ValueError(f"n_heads ({n_heads}) must be divisible by the CP degree ({cp})")
    if n_kv_heads % cp and cp % n_kv_heads:
        raise ValueError(
            f"n_kv_heads ({n_kv_heads}) must divide or be divisible by the CP degree ({cp})"
        )


def replicate_kv_heads(t: torch.Tensor, cp: int) -> torch.Tensor:
    """(B, L, Hkv, D) -> (B, L, cp, D) when Hkv < cp, else ``t`` unchanged.

    Each KV head is repeated cp/Hkv times, so after the sequence->head all-to-all rank r holds KV
    head r // (cp/Hkv) -- the one its query heads h // (H/Hkv) use. Under autograd the copies'
    gradients are summed back.
    """
    n_kv = t.shape[2]
    return t.repeat_interleave(cp // n_kv, dim=2) if n_kv < cp else t


MESH_DIMS = ("ring", "ulysses")


def mesh_groups(mesh: DeviceMesh) -> tuple[ProcessGroup, ProcessGroup]:
    """(ulysses group, ring group) of a 2-D CP mesh with named axes ``ring`` and ``ulysses``.

    The ``ulysses`` axis should be the inner (last) one so its ranks are neighbours (one node,
    the fast all-to-all); the ring's P2P crosses nodes (the paper's 8 x 2 on 16 GPUs).
    """
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2 or sorted(names) != sorted(MESH_DIMS):
        raise ValueError(
            f"mesh must be 2-D with dims named {MESH_DIMS}, got ndim={mesh.ndim} names={names}"
        )
    return mesh.get_group("ulysses"), mesh.get_group("ring")


class ContextParallelAttention(nn.Module):
    """Base class: common constructor, parameters, layout and RoPE for CP attention methods.

    Args:
        dim: model width.
        n_heads, n_kv_heads: query and KV head counts (GQA when they differ).
        head_dim: per-head width, default ``dim // n_heads``.
        group: the CP process group (None: the default group, or a single process when
            torch.distributed is not initialised).
        causal: causal masking.
        rope_theta: RoPE base.
        kernel: attention kernel name (:data:`upipe.kernels.KERNELS`).
        mesh: hybrid methods only (``supports_mesh``): a 2-D DeviceMesh with axes ``ring``
            (outer) and ``ulysses`` (inner), instead of ``group``. The Ulysses all-to-all runs
            over ``ulysses`` and ring attention over ``ring``; the CP degree is their product.

    Attributes: ``group`` (the all-to-all group, or the ring of single-axis ring methods),
    ``ring_group`` (hybrids only, else None), ``cp`` (total CP degree), ``rank`` (rank among
    the CP ranks: ring_rank * ulysses_size + ulysses_rank), ``seq_layout``.
    """

    registry_name: ClassVar[str] = ""
    #: the constructor's own keyword options a configuration may set from outside Python (a
    #: benchmark cell, its flags, its row), in the order names and tables show them
    #: (``upipe.options``); what :meth:`options` reports and ``check_config`` checks
    declared_options: ClassVar[tuple[MethodOption, ...]] = ()
    layout: ClassVar[str] = "contiguous"
    supports_mesh: ClassVar[bool] = False
    #: the subset of :data:`PROJECTION_FEATURES` this method computes; the all-heads methods
    #: (``project_qkv`` + ``self.wo``) support every one.
    projection_features: ClassVar[frozenset[str]] = PROJECTION_FEATURES
    #: True for methods that keep activations outside ``save_for_backward`` (on ``ctx``
    #: attributes): non-reentrant checkpointing frees saved tensors only, so a model
    #: checkpointing such a layer must do it reentrantly (forward under no_grad) for the
    #: activations not to live until backward (DeepSpeed's FPDT, baselines/ds_fpdt.py).
    checkpoint_reentrant: ClassVar[bool] = False
    #: why this method cannot keep attention inside packed documents (``cu_seqlens``), or None
    #: when it can; :meth:`documents` raises it, before any collective.
    documents_unsupported: ClassVar[str | None] = None
    #: methods that call an attention library themselves instead of upipe's kernel dispatch:
    #: (the kernel they run on CUDA, as :data:`upipe.kernels.KERNELS` names it; why) -- what
    #: a row records as the kernel that ran, and why ``kernel="cudnn"`` is refused; None:
    #: ``kernel=`` is honoured
    own_kernel: ClassVar[tuple[str, str] | None] = None
    #: how this method moves K/V between CP ranks by point-to-point sends (a ring), or None:
    #: a launch whose backend carries no P2P on the device's tensors (gloo on CUDA tensors,
    #: the harness's ``--shared-gpu``) refuses it with this reason. A hybrid's ring axis
    #: (``ring_degree`` > 1) sends by P2P whatever the method
    p2p_exchange: ClassVar[str | None] = None
    #: kernels such a method runs instead of its own where a cell names them (DeepSpeed's FPDT:
    #: ``fa3``, as the paper's patched FPDT calls FlashAttention-3)
    own_kernel_choices: ClassVar[frozenset[str]] = frozenset()
    #: methods with sequence chunks (a ``chunk_size`` option): the fewest chunks from which
    #: each further chunk adds the same memory and work (the chunk loop's steady state), where
    #: the emulator's fit starts sampling. 3 for a loop that prefetches the next chunk: with 2,
    #: the last chunk's prefetch is the first's.
    steady_chunks: ClassVar[int] = 3

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int | None = None,
        *,
        group: ProcessGroup | None = None,
        causal: bool = True,
        rope_theta: float = 500000.0,
        kernel: str = "auto",
        mesh: DeviceMesh | None = None,
    ):
        super().__init__()
        self.head_dim = resolve_head_dim(dim, n_heads, head_dim)
        self.kernel = check_kernel(kernel)
        self.dim, self.n_heads, self.n_kv_heads = dim, n_heads, n_kv_heads
        self.causal, self.rope_theta = causal, rope_theta
        self.ring_group: ProcessGroup | None = None
        if mesh is not None:
            if not self.supports_mesh:
                raise ValueError(
                    f"mesh applies to hybrid methods (usp, upipe) only, not {self.registry_name!r}"
                )
            if group is not None:
                raise ValueError("give either group or mesh, not both")
            group, self.ring_group = mesh_groups(mesh)
        self.group = group
        self.ulysses_degree = group_size(group)
        # group=None means the default group, so the ring axis is read only when there is one
        hybrid = self.ring_group is not None
        self.ring_degree = group_size(self.ring_group) if hybrid else 1
        ring_rank = group_rank(self.ring_group) if hybrid else 0
        self.cp = self.ulysses_degree * self.ring_degree
        self.rank = ring_rank * self.ulysses_degree + group_rank(group)
        opts = self.options()
        self.check_heads(n_heads, n_kv_heads, self.ulysses_degree, **opts)
        self.seq_layout = self.layout_for(
            hybrid=self.ring_group is not None, ulysses_degree=self.ulysses_degree, **opts
        )
        d = self.head_dim
        self.wq = nn.Linear(dim, n_heads * d, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * d, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * d, bias=False)
        self.wo = nn.Linear(n_heads * d, dim, bias=False)
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        self.rope_inv_freq: torch.Tensor | None = None
        self.rope_scaling = 1.0

    def use_projections(
        self, wq: nn.Linear, wk: nn.Linear, wv: nn.Linear, wo: nn.Linear, *,
        q_norm: nn.Module | None = None, k_norm: nn.Module | None = None,
        rope_inv_freq: torch.Tensor | None = None, rope_scaling: float = 1.0,
    ) -> None:
        """Compute with existing modules, e.g. a pretrained layer's own (``upipe.integrations``).

        The modules are shared, not copied: their parameters (and FSDP2's swaps of them) are
        what this method trains. ``wq`` (dim -> H*D), ``wk``/``wv`` (dim -> Hkv*D) and ``wo``
        (H*D -> dim) are ``nn.Linear`` with head-major rows, biases allowed; ``q_norm``/``k_norm``
        per-head RMSNorms over D applied before RoPE; ``rope_inv_freq`` (D/2,) and
        ``rope_scaling`` replace theta's RoPE frequencies (``upipe.rope.rope_tables``).
        Raises ValueError, before any collective, on a shape mismatch or a feature this method
        does not compute (``projection_features``).
        """
        d = self.head_dim
        shapes = {"wq": (wq, self.n_heads * d, self.dim), "wk": (wk, self.n_kv_heads * d, self.dim),
                  "wv": (wv, self.n_kv_heads * d, self.dim), "wo": (wo, self.dim, self.n_heads * d)}
        for name, (lin, out_f, in_f) in shapes.items():
            shape = (lin.out_features, lin.in_features) if isinstance(lin, nn.Linear) else None
            if shape != (out_f, in_f):
                raise ValueError(f"{name} must be an nn.Linear({in_f} -> {out_f}), got {lin!r}")
        for name, norm in (("q_norm", q_norm), ("k_norm", k_norm)):
            if norm is not None:
                norm_params(norm, d, name)
        if rope_inv_freq is not None and tuple(rope_inv_freq.shape) != (d // 2,):
            raise ValueError(f"rope_inv_freq must have shape ({d // 2},), "
                             f"got {tuple(rope_inv_freq.shape)}")
        needed = {
            "qkv_bias": any(m.bias is not None for m in (wq, wk, wv)),
            "out_bias": wo.bias is not None,
            "qk_norm": q_norm is not None or k_norm is not None,
            "rope_inv_freq": rope_inv_freq is not None or rope_scaling != 1.0,
        }
        missing = sorted(f for f, used in needed.items() if used
                         and f not in self.projection_features)
        if missing:
            raise ValueError(f"method {self.registry_name!r} does not support {missing} "
                             f"(it supports {sorted(self.projection_features) or 'none'})")
        self.wq, self.wk, self.wv, self.wo = wq, wk, wv, wo
        self.q_norm, self.k_norm = q_norm, k_norm
        self.rope_inv_freq, self.rope_scaling = rope_inv_freq, float(rope_scaling)

    # -- configuration rules (class-level, so the harness checks a cell without building it) --

    def options(self) -> dict:
        """This instance's method-specific constructor options, as the class-level checks take."""
        return {}

    @classmethod
    def check_heads(cls, n_heads: int, n_kv_heads: int, ulysses_degree: int, **options) -> None:
        """Head rules; the all-to-all rules over the all-to-all group by default."""
        check_ulysses_heads(n_heads, n_kv_heads, ulysses_degree)

    @classmethod
    def layout_for(cls, *, hybrid: bool, ulysses_degree: int, **options) -> SeqLayout:
        """The sequence layout: ``layout``, or zigzag over the ring axis for a hybrid mesh."""
        if hybrid:
            return SeqLayout("zigzag", inner=ulysses_degree)
        return SeqLayout(cls.layout)

    @classmethod
    def critical_rank(cls, cp: int, ring_degree: int = 1) -> int:
        """The rank with the most work per causal step (the one a step waits for), as its index
        in the CP group. Without a ring axis any rank: an all-to-all group balances its work.
        With one (a hybrid: zigzag over the ring axis, ranks ring-major), the last position of
        the ring: each of its ring steps is (all queries, first KV half)
        (``upipe.ring.block_plan``), so its merges and dQ sums cover all its queries, twice
        those of ring position 0."""
        return (ring_degree - 1) * (cp // ring_degree)

    @classmethod
    def memory_ranks(cls, cp: int, ring_degree: int = 1) -> tuple[int, ...]:
        """Ranks of its group besides ``critical_rank`` whose peak memory may be higher, which
        the emulator plays too, memory only (a row's memory is its fullest rank's). None by
        default: an all-to-all group's ranks allocate alike, and so do upipe's own rings' ranks
        where the last one is played (tests/test_emulate.py: its emulation equals the real run,
        whose memory is the max over ranks)."""
        return ()

    @classmethod
    def check_config(
        cls, n_heads: int, n_kv_heads: int, *, cp: int, ring_degree: int = 1,
        seq_len: int | None = None, **options,
    ) -> None:
        """Every rule of this method for a configuration, without building it (dry runs).

        ``cp`` is the total CP degree; ``ring_degree`` > 1 asks for the 2-D (ring x ulysses)
        mesh of hybrid methods. Raises ValueError naming the field and the rule.
        """
        if ring_degree < 1 or cp % ring_degree:
            raise ValueError(f"ring_degree ({ring_degree}) must divide the CP degree ({cp})")
        if ring_degree > 1 and not cls.supports_mesh:
            raise ValueError(
                f"ring_degree > 1 applies to hybrid methods (usp, upipe) only, not "
                f"{cls.registry_name!r}"
            )
        cls.check_heads(n_heads, n_kv_heads, cp // ring_degree, **options)
        layout = cls.layout_for(hybrid=ring_degree > 1, ulysses_degree=cp // ring_degree,
                                **options)
        if seq_len is not None:
            layout.check(seq_len, cp)

    @classmethod
    def unavailable_reason(cls, device_type: str) -> str | None:
        """Why this method cannot run on ``device_type`` ("cpu"/"cuda") here, or None.

        Adapters over GPU-only libraries override it; the harness turns a reason into a
        ``skipped`` row and tests into a skip, instead of a crash inside a collective.
        """
        return None

    # -- layout -------------------------------------------------------------------------------

    def shard(self, x_full: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of a full-sequence tensor (inputs, labels, output gradients)."""
        return self.seq_layout.shard(x_full, self.rank, self.cp, dim)

    def unshard(self, x_local: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The full sequence gathered from every rank's part (a collective)."""
        return unshard_sequence(x_local, self.group, self.seq_layout, dim, self.ring_group)

    # -- helpers for subclasses ---------------------------------------------------------------

    def check_input(self, x: torch.Tensor) -> None:
        """Shape rules for ``x_local``; raised before any collective.

        What one rank can check alone is checked here. The rule it cannot check alone: every
        rank of the group calls the module with the same batch size and the same local length
        (its shard of one sequence all ranks share) and the same options; ranks that disagree
        fail inside the collectives (gloo: "Received data size doesn't match"), since telling
        them apart would cost a collective of its own on every call.
        """
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(
                f"x_local must have shape (batch, seq_local, dim={self.dim}), got {tuple(x.shape)}"
            )
        if x.shape[1] == 0:
            raise ValueError("x_local must hold at least one token (seq_local > 0)")
        if x.shape[0] == 0:  # the forward ran, and the backward failed reshaping it
            raise ValueError("x_local must hold at least one sequence (batch > 0)")
        self.seq_layout.check_local(x.shape[1], self.cp)

    def documents(self, cu_seqlens, x: torch.Tensor) -> Documents | None:
        """The packed documents of ``forward(x, cu_seqlens)``, validated before any collective.

        None when there is nothing to mask (no ``cu_seqlens``, or one document: the unpacked
        path, bit for bit). ValueError naming the rule otherwise (``upipe.documents.documents``)
        or when this method cannot keep attention inside documents (``documents_unsupported``).
        """
        docs = documents(cu_seqlens, x.shape[1] * self.cp)
        if docs is not None and self.documents_unsupported:
            raise ValueError(f"method {self.registry_name!r} does not support cu_seqlens "
                             f"(packed documents): {self.documents_unsupported}")
        return docs

    def ring_documents(self, docs: Documents | None) -> RingDocuments | None:
        """What a ring over this method's CP ranks needs to know of ``docs``: the global tokens
        each ring rank holds (a hybrid's ring axis: its whole zigzag pair, after the all-to-all
        over the ulysses axis)."""
        if docs is None:
            return None
        if self.ring_group is not None:
            return RingDocuments(docs, SeqLayout("zigzag"), self.ring_degree)
        return RingDocuments(docs, self.seq_layout, self.cp)

    def project_qkv(
        self, x: torch.Tensor, docs: Documents | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """All heads' projections of x (B, L, dim), the way every all-heads method starts.

        Returns q (B, L, H, D) and k (B, L, Hkv, D) rotated at this rank's global positions
        (positions within their document when ``docs``), and v (B, L, Hkv, D).
        """
        b, l, _ = x.shape
        d = self.head_dim
        cos, sin = self.rope(l, x, docs)
        q = self.wq(x).view(b, l, self.n_heads, d)
        k = self.wk(x).view(b, l, self.n_kv_heads, d)
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), self.wv(x).view(b, l, -1, d)

    def rope(self, seq_local: int, x: torch.Tensor,
             docs: Documents | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables (seq_local, head_dim) for this rank's global token positions, or their
        positions within their document when ``docs``."""
        if docs is None:
            pos = self.seq_layout.positions(seq_local, self.rank, self.cp, device=x.device)
        else:
            segs = self.seq_layout.segments(seq_local * self.cp, self.rank, self.cp)
            pos = docs.positions(segs, device=x.device)
        return rope_tables(pos, self.head_dim, self.rope_theta, x.dtype,
                           self.rope_inv_freq, self.rope_scaling)

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
            f"head_dim={self.head_dim}, cp={self.cp}, causal={self.causal}, kernel={self.kernel}"
        )
