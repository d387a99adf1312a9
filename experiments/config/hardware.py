"""The emulated cluster (docs/design.md#emulation): device and host memory per rank, and the
headroom."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from experiments.config.cell import Cell
from experiments.config.sizes import GiB, MiB

# Device memory of the paper's GPU: an "80 GB" H100 SXM shows 81559 MiB = 79.65 GiB to CUDA
# (nvidia-smi; the source in experiments/timing/profiles/h100-sxm.json)
H100_MEM_GIB = 79.65

# Headroom kept off the device budget: what the caching allocator holds beyond the tensors it
# hands out. Measured on an H100 (results/emulate_vs_allocator/rows.csv, torch 2.11,
# expandable_segments:True): reserved minus allocated at the peak is 5.16-6.52 GiB for every
# method but fpdt (eight rows: upipe, ulysses, zigzag-ring, usp at 32K-256K tokens), median
# 6.30 GiB, and 9.98 GiB for fpdt, whose chunk buffers on a side stream fragment the cache.
# The default is that median; a method with its own measurement gets its own
# (``METHOD_RESERVE_GIB``); tests/test_reserve.py recomputes both from the CSV. Not included,
# because not measured: the CUDA context and NCCL's buffers, which sit outside the allocator.
DEFAULT_RESERVE_GIB = 6.3
METHOD_RESERVE_GIB: dict[str, float] = {"fpdt": 10.0}
RESERVE_SOURCE = "results/emulate_vs_allocator/rows.csv"

DEVICES = ("cuda", "cpu")


@dataclass(frozen=True)
class Hardware:
    """The emulated cluster, per rank: device memory, host memory, headroom."""

    gpu_mem_gib: float = H100_MEM_GIB
    """device memory per GPU visible to CUDA (H100 80 GB: 79.65 GiB)"""
    host_mem_gib: float = 2048.0
    """host RAM per node (DGX H100: 2 TB), shared by the node's ranks"""
    gpus_per_node: int = 8
    """ranks per node (the host budget of a rank is host_mem / ranks on its node)"""
    reserve_gib: float | None = None
    """device memory kept off the tensors' budget (the allocator's cache beyond its tensors);
    None: the measured default for the cell's method (``reserve_for``), none on cpu"""
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
            value = getattr(self, name)
            # inf and nan pass "<= 0" and fail later, deep in a budget's int() (OverflowError)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite positive number, got {value}")
        # a method's own measured reserve is checked where it is resolved (reserve_for; the
        # plan checks every planned method's up front); here the given one, or else the
        # default, which every method without a measured reserve gets
        given = self.reserve_gib is not None
        self._check_reserve(self.reserve_gib if given else self.measured_reserve(""), "")
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

    def reserve_for(self, method: str) -> float:
        """The reserve in GiB for a cell of ``method``: ``reserve_gib`` if set, else
        ``measured_reserve(method)``, checked against ``gpu_mem_gib``."""
        if self.reserve_gib is not None:
            return self.reserve_gib
        reserve = self.measured_reserve(method)
        self._check_reserve(reserve, method)
        return reserve

    def measured_reserve(self, method: str) -> float:
        """The reserve a cell of ``method`` gets when ``reserve_gib`` is not set: none on an
        emulated cpu device (a gloo run's tracker counts live tensors, with no caching
        allocator to hold more), else the method's measured one, else the measured default."""
        if self.device == "cpu":
            return 0.0
        return METHOD_RESERVE_GIB.get(method, DEFAULT_RESERVE_GIB)

    def _check_reserve(self, reserve: float, method: str) -> None:
        """Raise unless ``reserve`` leaves the device some budget. The message blames the field
        that was set: ``reserve_gib`` when given, else ``gpu_mem_gib`` against the measured
        reserve of ``method`` ("": the default)."""
        if 0 <= reserve < self.gpu_mem_gib:
            return
        if self.reserve_gib is not None:
            raise ValueError(f"reserve_gib must be >= 0 and below gpu_mem_gib "
                             f"({self.gpu_mem_gib}), got {reserve}")
        whose = f"the measured reserve of {method!r}" if method else "the default reserve"
        raise ValueError(f"gpu_mem_gib must be above the reserve kept off the device budget "
                         f"unless reserve_gib (not given) sets a smaller one, got "
                         f"{self.gpu_mem_gib} GiB against {reserve} GiB ({whose}), see "
                         f"{RESERVE_SOURCE}")

    def columns(self, method: str) -> dict:
        """The hardware as a row's ``hw_*`` columns, the reserve resolved for ``method``."""
        return {f"hw_{k}": v for k, v in dataclasses.asdict(self).items()} | {
            "hw_reserve_gib": self.reserve_for(method)}

    def device_budget(self, cell: Cell) -> int:
        """Bytes of tensors one rank may hold: the cell's ``budget_mib`` if set, else the GPU's
        memory minus the reserve."""
        if cell.budget_mib is not None:
            return int(cell.budget_mib * MiB)
        return int((self.gpu_mem_gib - self.reserve_for(cell.method)) * GiB)

    def host_budget(self, world: int) -> int:
        """Host bytes per rank: the node's RAM over the ranks on the node."""
        return int(self.host_mem_gib * GiB / min(self.gpus_per_node, world))
