"""Running cells: one executor (measured | emulated), sweeps, max-context searches, the CI guard.

    executor            ``Launcher`` and ``Emulator``: ``unavailable(cell)``, ``run(cell)``
    search              the max-context search, and ``run_search`` on an executor
    lock                one sweep at a time per results directory
    sweep_runner        ``SweepRunner``: a declared sweep into results/<sweep>/
    max_context_guard   the maximum-context baseline CI guards (results/baselines/)

Imports config, the harness, the emulator and reporting (tables and plots after a sweep).
"""
