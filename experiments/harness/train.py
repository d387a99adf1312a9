"""The training step every method is measured on (docs/design.md#the-comparison).

The job is ``dp`` replicas of ``nproc`` CP ranks (``Cell.world`` = dp x nproc ranks, a
("dp", "cp") DeviceMesh with the CP ranks of a replica consecutive). Each replica trains its own
sequence (``replica_tokens``), sharded over its CP group, which is the group the attention
runs on; FSDP2 (``fully_shard``) shards parameters, gradients and optimizer states over all
ranks (a 1-D "fsdp" mesh over the world), one unit per block plus the root; mixed precision as
a ``MixedPrecisionPolicy`` (compute in the cell's dtype, gradient reductions in fp32); AdamW;
batch 1 per replica; the loss is the mean over every labelled token of the replicas'
sequences, with labels shifted on each full sequence before sharding so rank boundaries are
handled as on one device. A packed cell (``Cell.doc_len``) cuts each sequence into documents
(``packed_cu_seqlens``): the attention stays inside them and no label crosses a boundary.

Gradient scaling: each rank's loss is its *partial sum* divided by the step's label count
(dp x (S - D), D documents per sequence, 1 unpacked), so the true gradient (the mean over the
replicas' sequences of equal length, i.e. the average of their per-sequence mean gradients) is
the sum of all ranks' gradients; FSDP2 is told to sum (``set_gradient_divide_factor(1.0)``, as
a plain SUM collective) instead of averaging over the world, which would also divide the CP
partial sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from experiments.config import STACKS, Cell, ModelConfig
from experiments.harness.model import Transformer, global_rope_table, shifted_labels
from upipe.stack import pin_host_memory

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def current_device() -> torch.device:
    """This rank's device: its CUDA device under a CUDA launch, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class TrainState:
    """What one rank holds for a cell: model, optimizer, this rank's tokens and labels."""

    model: Transformer
    optimizer: torch.optim.Optimizer
    tokens: torch.Tensor  # (1, L) int64, this rank's shard of its replica's sequence
    labels: torch.Tensor  # (1, L) int64, next tokens of that full sequence, sharded alike
    n_label_tokens: int  # tokens with a label in the whole step: dp x (S - documents)
    mesh: DeviceMesh | None  # FSDP2's 1-D "fsdp" mesh over every rank; None: one process
    cu_seqlens: list[int] | None = None  # packed documents' global bounds; None: unpacked

    def loss_sum(self) -> torch.Tensor:
        """The forward: this rank's summed token loss (fp32 scalar)."""
        return self.model(self.tokens, self.labels, self.cu_seqlens)

    def track(self, tracker, *states: torch.Tensor) -> None:
        """Count on ``tracker`` (an ``instruments.memory.MemoryTracker``) what exists before
        the step: the model's parameters and gradients, the tokens and labels and ``states``
        (the optimizer's) as ``model``; the paper's RoPE table where the model holds it as
        ``other``: it is no model state, which is how the paper's memory figure splits them."""
        if self.model.rope_table is not None:
            tracker.track(self.model.rope_table, category="other")
        tracker.track(self.model, self.tokens, self.labels, *states, category="model")

    def make_optimizer_states(self) -> list[torch.Tensor]:
        """Make AdamW's states now, without changing the training; returns them.

        AdamW makes its states in its first step, after that step's backward, so a first step
        is no steady-state step: its forward and backward run without the states every later
        step holds, and its peak is lower. With the states made first, the first measured step
        is a steady-state one whatever the warm-up (``--warmup 0`` measured too little without
        this). How: one step on zero gradients at learning rate 0 (the weights stay bitwise:
        decayed by 1 - 0 * wd, moved by 0), then the step count back to 0, so the next step is
        bitwise a fresh optimizer's first (its moments are still zero). States that exist
        already (a step was taken) are returned as they are."""
        if not self.optimizer.state:
            self._make_states()
        return [t for s in self.optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor)]

    def _make_states(self) -> None:
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = 0.0
        self.optimizer.step()
        for g, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            g["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        for s in self.optimizer.state.values():
            s["step"].zero_()

    def step(self) -> torch.Tensor:
        """One forward/backward/AdamW step; returns this rank's summed loss (detached)."""
        loss_sum = self.loss_sum()
        (loss_sum / self.n_label_tokens).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum.detach()


@dataclass(frozen=True)
class Meshes:
    """One rank's meshes for a cell's job of dp x nproc ranks (``make_meshes``)."""

    fsdp: DeviceMesh  # 1-D "fsdp": every rank of the job, what FSDP2 shards over
    cp: DeviceMesh  # 1-D "cp": the CP ranks of this rank's dp replica, the attention's group
    hybrid: DeviceMesh | None  # hybrids: the same CP ranks as a 2-D (ring, ulysses) mesh
    dp_rank: int  # this rank's dp replica: its coordinate on the "dp" axis


# (device type, shape, dim names) -> the mesh made for it over ``_MESHES_WORLD[0]``
_MESHES: dict[tuple, DeviceMesh] = {}
_MESHES_WORLD: list = [None]


def job_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """``init_device_mesh(device_type, shape, mesh_dim_names=names)``, made once per process
    and default group: a later call with the same arguments returns the same mesh.

    Why: every ``init_device_mesh`` makes new process groups, and a group lives as long as
    anything (a mesh, an FSDP module) holds it. A gloo group keeps an event-loop thread that
    wakes every 10 ms (``epoll_wait`` with a 10 ms timeout in gloo's
    ``transport/tcp/loop.cc``), so a process that runs cell after cell (the tests' session
    ranks, a notebook, a user's loop over ``run_cell``) gathered one such thread per group per
    cell: 156 per rank in one test session, which then spent half of its ranks' CPU time
    waking them. A new default group (``destroy_process_group`` then ``init_process_group``)
    starts a new cache. The cache is written only outside ``FakeTensorMode`` (a mesh cannot be
    made under it) and reads no tensor value.
    """
    world = dist.distributed_c10d._get_default_group()
    if _MESHES_WORLD[0] is not world:
        _MESHES.clear()
        _MESHES_WORLD[0] = world
    key = (device_type, tuple(shape), tuple(names))
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
    return _MESHES[key]


def attention_mesh(cell: Cell, device: torch.device) -> DeviceMesh | None:
    """Hybrids (``ring_degree`` > 1): the 2-D (ring, ulysses) mesh of this rank's dp replica,
    else None.

    Sliced from a 3-D (dp, ring, ulysses) mesh over the world. Ulysses is the inner axis, so its
    ranks are consecutive (one node: the all-to-all stays on the fast links) and the ring crosses
    nodes, as the paper's 8 x 2 on 16 GPUs; dp is outermost, so a replica's ranks are together.
    """
    if cell.ring_degree == 1:
        return None
    job = job_mesh(device.type, (cell.dp, cell.ring_degree, cell.nproc // cell.ring_degree),
                   ("dp", "ring", "ulysses"))
    return job["ring", "ulysses"]


def build_model(cell: Cell, cfg: ModelConfig, meshes: Meshes | None,
                device: torch.device) -> Transformer:
    """The model with FSDP2 applied over ``meshes.fsdp`` (None: one process, plain module).

    The attention runs over this replica's CP group (``meshes.cp``), or over its 2-D
    (ring, ulysses) mesh for hybrids; FSDP2 always shards over all dp x cp ranks.

    On CPU the full model is built (seeded) and then sharded, so every degree starts from the
    same weights as a single-device run (the equivalence tests need that). On CUDA it is built
    on the meta device, sharded, then materialised shard by shard: a 70B model never exists
    whole on one GPU; its init is random per shard.
    """
    stack = STACKS[cell.stack]
    group = meshes.cp.get_group("cp") if meshes is not None else None
    hybrid = meshes.hybrid if meshes is not None else None
    torch.manual_seed(cell.seed)
    meta = device.type == "cuda" and meshes is not None
    with torch.device("meta" if meta else device):
        model = Transformer(cfg, cell.method, stack, group=group, mesh=hybrid,
                            kernel=cell.kernel, method_options=dict(cell.options),
                            keep_blocks=cell.keep_blocks)
    if meshes is not None:
        dtype = TORCH_DTYPES[cell.dtype]
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mesh=meshes.fsdp, mp_policy=mp)
        fully_shard(model, mesh=meshes.fsdp, mp_policy=mp)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)  # sum the ranks' partial gradients
                m.set_force_sum_reduction_for_comms(True)  # as plain SUM: gloo has no PREMUL_SUM
    elif cell.dtype != "fp32":
        model.to(TORCH_DTYPES[cell.dtype])
    if meta:
        model.to_empty(device=device)
        with torch.no_grad():
            model.reset_parameters()
    if meshes is not None:
        # FSDP2 initialises at the root's first forward, and there re-pads every unevenly
        # sharded parameter whose storage is not the one it padded: after ``to_empty`` on CUDA,
        # and always on fake tensors (no data pointer to compare). Inside a tracked step that
        # new storage would count as "other", not as model state, and the emulator would
        # differ from a gloo run (whose storages it recognises). Initialised here, before any
        # tracking, every run's parameters are final. Private API (there is no public lazy
        # init; labels.py reaches into the same state), stable from torch 2.5 to 2.13.
        model._get_fsdp_state()._lazy_init()
    model.set_offload(pin_memory=pin_host_memory(cell.seq_len))
    return model


def make_meshes(cell: Cell, device: torch.device) -> Meshes:
    """This rank's meshes over the launched world of ``cell.world`` ranks: a ("dp", "cp") mesh
    (dp outer: a replica's CP ranks are consecutive, inside a node where they fit), the 1-D
    "fsdp" mesh over all ranks and the hybrids' (ring, ulysses) mesh.

    Made apart from ``build`` because a DeviceMesh cannot be created under FakeTensorMode (it
    reads rank values): the emulator makes them first, then builds the model fake.
    """
    world = dist.get_world_size()
    if world != cell.world:
        raise ValueError(f"dp x nproc ({cell.dp} x {cell.nproc}) must equal the launched world "
                         f"size ({world})")
    job = job_mesh(device.type, (cell.dp, cell.nproc), ("dp", "cp"))
    # FSDP2 over a 1-D mesh shards fully over it (a 2-D one would be HSDP: replicate over dp)
    fsdp = job_mesh(device.type, (world,), ("fsdp",))
    return Meshes(fsdp=fsdp, cp=job["cp"], hybrid=attention_mesh(cell, device),
                  dp_rank=job.get_local_rank("dp"))


def replica_tokens(cell: Cell, vocab_size: int, dp_rank: int) -> torch.Tensor:
    """The full (1, S) int64 sequence dp replica ``dp_rank`` trains on, the same on all of its
    ranks (sharded after). Replica 0 draws what a dp = 1 run draws; replica r > 0 reseeds with
    the r-th 32-bit draw of that stream (the CPU generator keeps 32 bits of a seed, so an
    offset seed would repeat replica 0's tokens)."""
    gen = torch.Generator().manual_seed(cell.seed + 1)
    if dp_rank:
        gen.manual_seed(int(torch.randint(2**32, (dp_rank,), generator=gen)[-1]))
    return torch.randint(0, vocab_size, (1, cell.seq_len), generator=gen)


def packed_cu_seqlens(seq_len: int, doc_len: int | None) -> list[int] | None:
    """The global cumulative document lengths of a packed cell: ``seq_len // doc_len``
    documents of ``doc_len`` tokens, the last one holding the remainder, e.g. (10, 4) ->
    [0, 4, 10]. None (unpacked) for ``doc_len`` None."""
    if doc_len is None:
        return None
    if not 1 <= doc_len <= seq_len:
        raise ValueError(f"doc_len must be between 1 and seq_len ({seq_len}), got {doc_len}")
    n = seq_len // doc_len
    return [i * doc_len for i in range(n)] + [seq_len]


def build(cell: Cell, cfg: ModelConfig, distributed: bool = True,
          meshes: Meshes | None = None, device: torch.device | None = None) -> TrainState:
    """Everything a rank needs for ``cell``; under torch.distributed the world is the cell's
    dp x nproc ranks (``meshes``: from ``make_meshes``, made here when not given; ``device``:
    default ``current_device()``, the emulator's is the CPU even where CUDA is present)."""
    device = device or current_device()
    if not distributed:
        if cell.world != 1:
            raise ValueError(f"dp x nproc must be 1 without torch.distributed, got "
                             f"{cell.dp} x {cell.nproc}")
        meshes = None
    elif meshes is None:
        meshes = make_meshes(cell, device)
    model = build_model(cell, cfg, meshes, device)
    if cell.global_rope_table:
        model.rope_table = global_rope_table(cfg, cell.seq_len, device)
    # AdamW as in Llama 3 pre-training (betas 0.9/0.95, weight decay 0.1); foreach on both
    # devices so CPU and GPU run the same update.
    optimizer = torch.optim.AdamW(model.parameters(), lr=cell.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1, foreach=True)
    full = replica_tokens(cell, cfg.vocab_size, meshes.dp_rank if meshes is not None else 0)
    cu_seqlens = packed_cu_seqlens(cell.seq_len, cell.doc_len)
    tokens = model.shard(full).to(device)
    labels = model.shard(shifted_labels(full, cu_seqlens)).to(device)
    n_docs = 1 if cu_seqlens is None else len(cu_seqlens) - 1  # none empty: doc_len >= 1
    return TrainState(model, optimizer, tokens, labels, cell.dp * (cell.seq_len - n_docs),
                      None if meshes is None else meshes.fsdp, cu_seqlens)
