"""Baseline CP attention methods, each behind upipe's common interface
(docs/design.md#one-interface-for-every-method).

Importing this package registers every baseline with ``upipe.registry`` (they are also found
through the ``upipe.methods`` entry points without importing it).
"""

from baselines.ds_fpdt import DSFPDTAttention
from baselines.ds_ulysses import DSUlyssesAttention
from baselines.fpdt import FPDTAttention
from baselines.rfa_zigzag import RFAZigzagAttention
from baselines.ring import RingAttention
from baselines.torch_cp import TorchCPAttention
from baselines.ulysses import UlyssesAttention, ulysses_attention
from baselines.usp import USPAttention
from baselines.usp_ulysses import USPUlyssesAttention
from baselines.zigzag_ring import ZigzagRingAttention

__all__ = [
    "DSFPDTAttention",
    "DSUlyssesAttention",
    "FPDTAttention",
    "RFAZigzagAttention",
    "RingAttention",
    "TorchCPAttention",
    "USPAttention",
    "USPUlyssesAttention",
    "UlyssesAttention",
    "ZigzagRingAttention",
    "ulysses_attention",
]
