"""Baseline CP attention methods, each behind upipe's common interface (DESIGN.md §4).

Importing this package registers every baseline with ``upipe.registry`` (they are also found
through the ``upipe.methods`` entry points without importing it).
"""

from baselines.ds_ulysses import DSUlyssesAttention
from baselines.ulysses import UlyssesAttention, ulysses_attention

__all__ = ["DSUlyssesAttention", "UlyssesAttention", "ulysses_attention"]
