"""The training step every method is measured on (DESIGN.md §6).

FSDP2 (``fully_shard``) over the CP ranks, one unit per block plus the root; mixed precision as
a ``MixedPrecisionPolicy`` (compute in the cell's dtype, gradient reductions in fp32); AdamW;
batch 1; the loss is the mean over every token of the global sequence, with labels shifted on
the full sequence before sharding so rank boundaries are handled as on one device.

Gradient scaling: each rank's loss is its *partial sum* divided by the global token count, so
the true gradient is the sum of the ranks' gradients; FSDP2 is told to sum
(``set_gradient_divide_factor(1.0)``, as a plain SUM collective) instead of averaging over
what it takes for data-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from experiments.config import STACKS, Cell, ModelConfig
from experiments.harness.model import Transformer, shifted_labels
from experiments.harness.offload import PIN_MAX_TOKENS

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
    tokens: torch.Tensor  # (1, L) int64, this rank's shard
    labels: torch.Tensor  # (1, L) int64, next tokens of the full sequence, sharded alike
    n_label_tokens: int  # tokens with a label in the whole sequence: S - 1
    mesh: DeviceMesh | None

    def step(self) -> torch.Tensor:
        """One forward/backward/AdamW step; returns this rank's summed loss (detached)."""
        loss_sum = self.model(self.tokens, self.labels)
        (loss_sum / self.n_label_tokens).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum.detach()


def attention_mesh(cell: Cell, device: torch.device) -> DeviceMesh | None:
    """Hybrids (``ring_degree`` > 1): the 2-D (ring, ulysses) mesh over all ranks, else None.

    Ulysses is the inner axis, so its ranks are consecutive (one node: the all-to-all stays on
    the fast links) and the ring crosses nodes, as the paper's 8 x 2 on 16 GPUs.
    """
    if cell.ring_degree == 1:
        return None
    return init_device_mesh(device.type, (cell.ring_degree, cell.nproc // cell.ring_degree),
                            mesh_dim_names=("ring", "ulysses"))


def build_model(cell: Cell, cfg: ModelConfig, mesh: DeviceMesh | None,
                device: torch.device, hybrid: DeviceMesh | None = None) -> Transformer:
    """The model with FSDP2 applied over ``mesh`` (None: one process, plain module).

    The attention runs over the same 1-D "cp" mesh, or over a 2-D (ring, ulysses) mesh of the
    same ranks for hybrids (``hybrid``, by default ``attention_mesh``); FSDP2 always shards over
    all ranks.

    On CPU the full model is built (seeded) and then sharded, so every CP degree starts from the
    same weights as a single-device run (the equivalence test needs that). On CUDA it is built
    on the meta device, sharded, then materialised shard by shard: a 70B model never exists
    whole on one GPU; its init is random per shard.
    """
    stack = STACKS[cell.stack]
    group = mesh.get_group("cp") if mesh is not None else None
    if hybrid is None and mesh is not None:
        hybrid = attention_mesh(cell, device)
    torch.manual_seed(cell.seed)
    meta = device.type == "cuda" and mesh is not None
    with torch.device("meta" if meta else device):
        model = Transformer(cfg, cell.method, stack, group=group, mesh=hybrid,
                            kernel=cell.kernel, method_options=cell.method_options())
    if mesh is not None:
        dtype = TORCH_DTYPES[cell.dtype]
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
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
    model.set_offload(pin_memory=cell.seq_len <= PIN_MAX_TOKENS)
    return model


def make_meshes(cell: Cell, device: torch.device) -> tuple[DeviceMesh, DeviceMesh | None]:
    """The 1-D "cp" mesh over the launched world and the hybrids' (ring, ulysses) mesh.

    Made apart from ``build`` because a DeviceMesh cannot be created under FakeTensorMode (it
    reads rank values): the emulator makes them first, then builds the model fake.
    """
    world = dist.get_world_size()
    if world != cell.nproc:
        raise ValueError(f"nproc ({cell.nproc}) must equal the launched world size ({world})")
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))
    return mesh, attention_mesh(cell, device)


def build(cell: Cell, cfg: ModelConfig, distributed: bool = True,
          meshes: tuple[DeviceMesh, DeviceMesh | None] | None = None,
          device: torch.device | None = None) -> TrainState:
    """Everything a rank needs for ``cell``; under torch.distributed the world is the CP group
    (``meshes``: from ``make_meshes``, made here when not given; ``device``: default
    ``current_device()``, the emulator's is the CPU even where CUDA is present)."""
    device = device or current_device()
    mesh = hybrid = None
    if distributed:
        mesh, hybrid = meshes if meshes is not None else make_meshes(cell, device)
    elif cell.nproc != 1:
        raise ValueError(f"nproc must be 1 without torch.distributed, got {cell.nproc}")
    model = build_model(cell, cfg, mesh, device, hybrid)
    # AdamW as in Llama 3 pre-training (betas 0.9/0.95, weight decay 0.1); foreach on both
    # devices so CPU and GPU run the same update.
    optimizer = torch.optim.AdamW(model.parameters(), lr=cell.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1, foreach=True)
    gen = torch.Generator().manual_seed(cell.seed + 1)  # same tokens on every rank
    full = torch.randint(0, cfg.vocab_size, (1, cell.seq_len), generator=gen)
    tokens = model.shard(full).to(device)
    labels = model.shard(shifted_labels(full)).to(device)
    return TrainState(model, optimizer, tokens, labels, cell.seq_len - 1, mesh)
