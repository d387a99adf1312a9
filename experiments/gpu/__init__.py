"""The checks that need a GPU: the emulator and the time model against real hardware
(docs/gpu.md#the-gpu-checks-in-results). One entry point, ``python -m experiments.gpu <check>``
(``--help`` lists them); each module also runs as ``python -m experiments.gpu.<module>``.

    gpu_check            emulated peaks against the CUDA allocator's
    gpu_chunk_bench      UPipe's chunked attention backward against one kernel call
    gpu_costs            what a step's kernels cost on a GPU (the shipped profiles' source)
    kernels_gpu          a training step with PyTorch's cuDNN attention against its flash kernel
    selective_gpu        selective recomputation's speed-ups over full checkpointing, measured
                         beside the emulated ones
    time_validation_gpu  the time model against measured steps (``upipe-bench validate-time
                         --device cuda``)

Imports everything below the runner (config, instruments, harness, timing, emulation) and
reporting's validation tables; imported by the CLI only.
"""
