"""Memory emulation: one rank of a P-rank job on fake tensors, its peak memory at paper scale
on a CPU (docs/design.md#emulation).

    kernel_models   what the CUDA attention kernels allocate (and their FLOPs)
    fake_step       the training step under FakeTensorMode on the fake process group
    replay          calls of metadata-pure functions run once per signature, then replayed
    fit             exact predictions at paper scale from small exact emulations
    emulate         ``emulate_cell``: a cell's emulated row (memory, and time from
                    ``experiments.timing``)

Imports config, instruments, the harness (the same model and step code a real run uses) and
the time model (``experiments.timing``: the fake step also sorts its ops into work); never the
runner, reporting or the GPU checks.
"""
