"""The time model against real runs (docs/design.md#the-time-model): CPU cells whose step times are
measured, then predicted by the emulator on this machine's calibrated profile
(``upipe-bench validate-time``).

Seven methods at CPU scale (``METHODS``: every CPU-capable one but ``ds-fpdt``, ``torch-cp`` and
``usp-ulysses``, which are not in it; tiny and tiny-wide, 2K to 8K tokens, 2 gloo ranks on 2
cores, the paper's ALST stack), and every other stack level for Ulysses and UPipe at 4K: the
cells whose measured step times the prediction must match (median |error| <= 15%, worst <= 35%,
issue 14). No paper artefact: a validation of the emulator's time axis.
"""

from experiments.config import Sweep

METHODS = [
    {"method": "ulysses"}, {"method": "upipe"}, {"method": "ds-ulysses"}, {"method": "ring"},
    {"method": "zigzag-ring"}, {"method": "usp", "ring_degree": 2},
    {"method": "fpdt", "chunk_size": "1K"},
]
MODELS = ["tiny", "tiny-wide"]
LENGTHS = ["2K", "4K", "8K"]
STACK_CELLS = [  # the other stack levels, for the two methods the paper compares most
    {"method": m, "stack": s, "seq_len": "4K"}
    for m in ("ulysses", "upipe") for s in ("none", "ac", "offload", "native")
]

SWEEPS = [
    Sweep(
        name="time_validation_cpu",
        description="CPU step times to validate the emulated time model: seven methods "
                    "(not ds-fpdt, torch-cp, usp-ulysses), tiny and tiny-wide, 2K-8K tokens, "
                    "2 gloo ranks",
        scale="cpu",
        base={"nproc": 2, "stack": "alst", "dtype": "fp32", "warmup": 1, "iters": 3},
        axes={"model": MODELS,
              "cell": [m | {"seq_len": n} for m in METHODS for n in LENGTHS] + STACK_CELLS},
        timeout_s=600,
    ),
]
