"""One measured cell (docs/design.md#measurement): the model and its memory stack, the training step
(or one attention layer), the launch of its ranks, and what is measured of them.

    model                  the Llama-style decoder and the ALST memory stack (its pieces:
                           ``upipe.stack``, shared with the Hugging Face integration)
    train                  FSDP2, AdamW, the step; meshes for the hybrids
    flops                  the shared model-FLOPs formula and MFU
    stats                  timing, the cross-rank row, the CPU budget
    measure                the ``step`` workload: a training step, measured
    attention_layer        the ``attention`` workload: one attention layer, measured
    launch                 ``run_cell``: a cell's ranks in a fresh process group -> one row

Imports ``experiments.config``, ``experiments.instruments`` and the library only (never
emulation, the runner or reporting).
"""
