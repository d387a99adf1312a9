"""How a maximum-context search probes lengths (``experiments.runner.search`` runs it)."""

from __future__ import annotations

from dataclasses import dataclass

# Emulated searches (``max-context --emulate``, the emulated sweeps, the CI guard): 64K global
# tokens between the last passing and the first failing length, the resolution of the paper's
# max-context figures, from 1M tokens up to 16M (past every method's limit on the paper's GPUs).
EMULATED_GRANULARITY = 2**16
EMULATED_START = 2**20
EMULATED_LIMIT = 2**24


@dataclass(frozen=True)
class SearchSpec:
    """How to search: first length, bisection block, upper limit (all global tokens)."""

    start: int
    """first probed length"""
    block: int = 1024
    """bisection stops at nproc * block tokens between passing and failing"""
    limit: int = EMULATED_LIMIT
    """largest length probed; reaching it passing reports first_failing_seq_len None"""
    growth: int = 2
    """factor between grow-phase probes"""

    def validate(self, nproc: int) -> None:
        """Raise ValueError naming the field (``search.<name>``) and the rule."""
        for name in ("start", "block", "limit"):
            if getattr(self, name) <= 0:
                raise ValueError(f"search.{name} must be positive, got {getattr(self, name)}")
        if self.growth < 2:
            raise ValueError(f"search.growth must be >= 2, got {self.growth}")
        if self.start % (nproc * self.block):
            raise ValueError(f"search.start ({self.start}) must be a multiple of the "
                             f"granularity, nproc * block ({nproc} * {self.block} = "
                             f"{nproc * self.block})")
        if self.start > self.limit:
            raise ValueError(f"search.start ({self.start}) must not exceed search.limit "
                             f"({self.limit})")

    def granularity(self, nproc: int) -> int:
        """Global tokens between the last passing and the first failing length."""
        return nproc * self.block
