"""What observes a step, measured or emulated alike (docs/design.md#measurement,
docs/design.md#emulation).

    memory        MemoryTracker: live tensor bytes at the dispatcher, device and host
    labels        attributing a module's allocations to a category or phase
    collectives   CollectiveCounter: c10d ops and the bytes each rank sends
    op_flops      CountedFlops: FLOPs by torch's per-op formulas

Imports ``experiments.config`` at most; used by the harness and the emulator.
"""
