"""What observes a step, measured or emulated alike (DESIGN.md §7, §8).

    memory        MemoryTracker: live tensor bytes at the dispatcher, device and host
    labels        attributing a module's allocations to a category or phase
    collectives   CollectiveCounter: c10d ops and the bytes each rank sends
    op_flops      CountedFlops: FLOPs by torch's per-op formulas

Imports ``experiments.config`` at most; used by the harness and the emulator.
"""
