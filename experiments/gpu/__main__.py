"""``python -m experiments.gpu <check> [flags]``: run one GPU check (``--help`` lists them;
``python -m experiments.gpu <check> --help`` gives its flags). The time model's validation on a
GPU is the CLI's ``upipe-bench validate-time --device cuda``."""

from __future__ import annotations

import sys

from experiments.gpu import gpu_check, gpu_chunk_bench, gpu_costs, kernels_gpu, selective_gpu

# name -> (the check's main(argv) -> exit code, what it checks)
CHECKS = {
    "allocator": (gpu_check.main, "emulated peaks against the CUDA allocator's (gpu_check)"),
    "chunked-backward": (gpu_chunk_bench.main,
                         "UPipe's chunked attention backward against one kernel call "
                         "(gpu_chunk_bench)"),
    "costs": (gpu_costs.main, "what a step's kernels cost on this GPU (gpu_costs)"),
    "kernels": (kernels_gpu.main,
                "a training step with cuDNN attention against the flash kernel (kernels_gpu)"),
    "selective": (selective_gpu.main,
                  "selective recomputation's speed-ups measured beside the emulated ones "
                  "(selective_gpu)"),
}


def usage() -> str:
    lines = ["usage: python -m experiments.gpu <check> [flags]", "", "checks:"]
    lines += [f"  {name:18s}{what}" for name, (_, what) in CHECKS.items()]
    lines += ["", "the time model against measured steps: upipe-bench validate-time --device cuda"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] not in CHECKS:
        print(f"unknown check {argv[0]!r}: one of {', '.join(CHECKS)}\n\n{usage()}",
              file=sys.stderr)
        return 2
    return CHECKS[argv[0]][0](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
