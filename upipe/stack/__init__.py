"""The long-context memory stack's building blocks (docs/design.md#the-memory-stack).

Shared by the benchmark harness (``experiments.harness.model``) and the Hugging Face integration
(``upipe.integrations.hf``, ``parallelize(..., stack=...)``): activation offload of checkpointed
inputs (``offload``), the chunked linear cross-entropy (``loss``), the tiled MLP and the tiled
residual FFN (``tiled``), and ``MemoryStack``, the levels a model outside the harness switches
on (``config``).
"""

from upipe.stack.config import LEVELS, MemoryStack, memory_stack
from upipe.stack.loss import IGNORE_INDEX, chunked_linear_cross_entropy, loss_chunk_tokens
from upipe.stack.offload import PIN_MAX_TOKENS, offload_saved_inputs, pin_host_memory
from upipe.stack.tiled import tiled, tiled_residual

__all__ = [
    "IGNORE_INDEX", "LEVELS", "PIN_MAX_TOKENS", "MemoryStack", "chunked_linear_cross_entropy",
    "loss_chunk_tokens", "memory_stack", "offload_saved_inputs", "pin_host_memory", "tiled",
    "tiled_residual",
]
