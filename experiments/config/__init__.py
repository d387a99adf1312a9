"""Every configuration type of the harness, in one place
(docs/design.md#layout-and-dependency-direction).

    from experiments.config import Cell, ModelConfig, Hardware, SearchSpec, Sweep, Status

- ``Cell`` (``cell.py``): one measured or emulated run, frozen and self-validating;
- ``ModelConfig`` and the presets (``model.py``), or a Hugging Face ``config.json``'s shape as
  preset overrides (``hf_config.py``); ``StackConfig`` and the stack levels
  (``stack.py``);
- ``Hardware`` (``hardware.py``): the emulated cluster;
- ``SearchSpec`` (``search.py``): how a max-context search probes;
- ``Sweep`` (``sweep.py``): a paper artefact's cells, searches and plots, as data;
- ``Status`` (``status.py``): what happened to a cell; shared limits (``limits.py``); token and
  byte sizes (``sizes.py``).

This layer imports nothing else from ``experiments`` (only ``upipe``'s registry and kernel
names, for validation).
"""

from experiments.config.cell import WORKLOADS, Cell
from experiments.config.hardware import DEFAULT_RESERVE_GIB, METHOD_RESERVE_GIB, Hardware
from experiments.config.hf_config import SUPPORTED_MODEL_TYPES, hf_overrides, model_from_hf_config
from experiments.config.limits import DEFAULT_TIMEOUT_S, ERROR_TAIL_CHARS, PROCESS_GROUP_TIMEOUT_S
from experiments.config.model import PRESETS, ModelConfig, parse_overrides, resolve_model
from experiments.config.search import (
    EMULATED_GRANULARITY,
    EMULATED_LIMIT,
    EMULATED_START,
    SearchSpec,
)
from experiments.config.sizes import GiB, KiB, MiB, format_size, parse_size
from experiments.config.stack import DTYPES, STACKS, StackConfig, paper_stack
from experiments.config.status import Status
from experiments.config.sweep import PLOTS, SCALES, THROUGHPUT_PLOTS, Sweep

__all__ = [
    "DEFAULT_RESERVE_GIB", "METHOD_RESERVE_GIB", "DEFAULT_TIMEOUT_S", "DTYPES",
    "EMULATED_GRANULARITY", "EMULATED_LIMIT", "EMULATED_START", "ERROR_TAIL_CHARS", "GiB",
    "Hardware", "KiB",
    "MiB", "ModelConfig", "PLOTS", "PRESETS", "PROCESS_GROUP_TIMEOUT_S",
    "SCALES", "STACKS", "SUPPORTED_MODEL_TYPES", "SearchSpec", "StackConfig", "Status", "Sweep",
    "THROUGHPUT_PLOTS", "WORKLOADS", "Cell", "format_size", "hf_overrides",
    "model_from_hf_config", "paper_stack", "parse_overrides", "parse_size", "resolve_model",
]
