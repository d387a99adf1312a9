"""One rank of a P-rank job on fake tensors: paper-scale memory on a CPU (DESIGN.md §8).

    kernel_models   what the CUDA attention kernels allocate (and their FLOPs)
    fake_step       the training step under FakeTensorMode on the fake process group
    fit             exact predictions at paper scale from small exact emulations
    emulate         ``emulate_cell``: a cell's emulated row
    gpu_check       emulated vs the CUDA allocator's peaks, on a GPU

Imports config, instruments and the harness (the same model and step code a real run uses);
never the runner or reporting.
"""
