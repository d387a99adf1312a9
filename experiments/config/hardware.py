"""The emulated cluster (DESIGN.md §8): device and host memory per rank, and the headroom."""

from __future__ import annotations

from dataclasses import dataclass

from experiments.config.cell import Cell
from experiments.config.sizes import GiB, MiB

# Headroom kept off the device budget: an "80 GB" H100 shows 81559 MiB (79.6 GiB) in nvidia-smi;
# the CUDA context, cuBLAS workspaces and NCCL's buffers take about 1.5-2.5 GiB of it outside
# the allocator's tensor bytes, and the rest absorbs fragmentation (small with
# expandable_segments). 4 GiB leaves 76 GiB of tensors on an 80 GiB device.
DEFAULT_RESERVE_GIB = 4.0

DEVICES = ("cuda", "cpu")


@dataclass(frozen=True)
class Hardware:
    """The emulated cluster, per rank: device memory, host memory, headroom."""

    gpu_mem_gib: float = 80.0
    """device memory per GPU (H100: 80)"""
    host_mem_gib: float = 2048.0
    """host RAM per node (DGX H100: 2 TB), shared by the node's ranks"""
    gpus_per_node: int = 8
    """ranks per node (the host budget of a rank is host_mem / ranks on its node)"""
    reserve_gib: float = DEFAULT_RESERVE_GIB
    """device memory outside tensor bytes: CUDA context, library workspaces, fragmentation"""
    device: str = "cuda"
    """kernel paths and allocator emulated: "cuda", or "cpu" (exactly a gloo run's tracking)"""
    profile: str | None = None
    """the time model's hardware profile: a shipped profile's name (``h100-sxm``, ``h200``,
    ``a100-80gb``) or the path of one from ``upipe-bench calibrate``; None: ``h100-sxm`` on an
    emulated cuda device, no emulated time on cpu"""

    def validate(self, world: int | None = None) -> None:
        """Raise ValueError naming the field and the rule; with ``world`` (the emulated ranks)
        also that the ranks fill whole nodes (or one node, partly)."""
        for name in ("gpu_mem_gib", "host_mem_gib", "gpus_per_node"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.reserve_gib < self.gpu_mem_gib:
            raise ValueError(f"reserve_gib must be >= 0 and below gpu_mem_gib "
                             f"({self.gpu_mem_gib}), got {self.reserve_gib}")
        if self.profile is not None and not (isinstance(self.profile, str) and self.profile):
            raise ValueError(f"profile must be a profile name or a .json path, got "
                             f"{self.profile!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {list(DEVICES)}, got {self.device!r}")
        if world is not None and world > self.gpus_per_node and world % self.gpus_per_node:
            # a rank's host budget is its node's RAM over the ranks on the node: uneven nodes
            # would give ranks different budgets, which one emulated rank cannot stand for
            raise ValueError(f"gpus_per_node ({self.gpus_per_node}) must divide the world size "
                             f"({world}) when the world spans several nodes")

    def device_budget(self, cell: Cell) -> int:
        """Bytes of tensors one rank may hold: the cell's ``budget_mib`` if set, else the GPU's
        memory minus the reserve."""
        if cell.budget_mib is not None:
            return int(cell.budget_mib * MiB)
        return int((self.gpu_mem_gib - self.reserve_gib) * GiB)

    def host_budget(self, world: int) -> int:
        """Host bytes per rank: the node's RAM over the ranks on the node."""
        return int(self.host_mem_gib * GiB / min(self.gpus_per_node, world))
