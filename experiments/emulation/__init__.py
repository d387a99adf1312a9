"""One rank of a P-rank job on fake tensors: paper-scale memory and time on a CPU
(docs/design.md#emulation, docs/design.md#the-time-model).

    kernel_models   what the CUDA attention kernels allocate (and their FLOPs)
    op_costs        the step's work per window: FLOPs, bytes, launches, collectives, copies
    fake_step       the training step under FakeTensorMode on the fake process group
    replay          calls of metadata-pure functions run once per signature, then replayed
    work_fit        the work at paper scale from the fit's samples
    fit             exact predictions at paper scale from small exact emulations
    profile         hardware profiles: rates as data, each with its source (profiles/*.json)
    time_model      the work priced on a profile and overlapped as the code runs it
    calibrate       a profile measured on this machine (``upipe-bench calibrate``)
    emulate         ``emulate_cell``: a cell's emulated row
    gpu_check       emulated vs the CUDA allocator's peaks, on a GPU

Imports config, instruments and the harness (the same model and step code a real run uses);
never the runner or reporting.
"""
