"""The benchmark harness (``upipe-bench``), in packages with one purpose each
(docs/design.md#layout-and-dependency-direction):

    config        every configuration type: Cell, presets, stacks, Hardware, SearchSpec, Sweep,
                  Status, limits, sizes
    store         result files: atomic writes, validated reads; provenance: versions, git rev
    instruments   what observes a step: memory tracker, labels, collective counter, FLOPs
    harness       one measured cell: model, memory stack, step, launch, statistics
    emulation     one rank of a P-rank job on fake tensors: fake step, fit, kernel models
    runner        one executor (measured | emulated), sweeps, max-context search, CI guard
    sweeps        declarations only, one file per paper artefact
    reporting     tables, plots, notebook helpers, results index (reads result files only)
    cli           ``upipe-bench`` (cli_args: its flags)

Imports point one way: config <- instruments <- harness <- emulation <- runner <- cli, with
reporting beside them, imported by the runner and the CLI only (tests/test_import_layers.py).
"""
