#!/usr/bin/env bash
# Main job: bootstrap the venv (scripts/bootstrap.sh), then run the benchmark(s) into results/.
# Today that is the attention benchmark (python -m experiments.bench_attention); the sweep
# harness replaces it later. Thin on purpose: environment defaults, then the Python runner.
#
# Environment (defaults are the small CPU reproduction):
#   SEQ_LENS   comma-separated sequence lengths, K/M suffixes allowed   (default 16K,64K)
#   NPROC      ranks (processes) per run                                (default 4)
#   WARMUP     untimed iterations per cell                              (default 0)
#   ITERS      timed iterations per cell                                (default 1)
#              (one 64K-token step takes ~10 minutes per method on 2 CPU cores)
#   OUT        output directory for the result rows                     (default results/bench_attention)
#   DRY_RUN=1  print what would run and exit 0 (installs nothing)
#   ONLY       reserved for selecting one sweep once the harness lands; refused until then
#   UPIPE_VENV and the rest: see scripts/bootstrap.sh
# Extra arguments are passed on to the Python runner: ./run_all.sh --help
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$root"

SEQ_LENS="${SEQ_LENS:-16K,64K}"
NPROC="${NPROC:-4}"
WARMUP="${WARMUP:-0}"
ITERS="${ITERS:-1}"
OUT="${OUT:-results/bench_attention}"
DRY_RUN="${DRY_RUN:-0}"
out_abs="$OUT"
[[ "$OUT" == /* ]] || out_abs="$root/$OUT"

if [[ -n "${ONLY:-}" ]]; then
    echo "run_all.sh: ONLY=$ONLY is reserved for the sweep harness and not supported yet" >&2
    exit 2
fi

# Ranks share the CPU cores: one OpenMP thread each unless the caller chose otherwise.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

cmd=(python -m experiments.bench_attention --seq-lens "$SEQ_LENS" --nproc "$NPROC" --warmup "$WARMUP" --iters "$ITERS"
     --out "$OUT" "$@")

if [[ "$DRY_RUN" == 1 ]]; then
    echo "run_all.sh (dry run) would run, in $root:"
    echo "  scripts/bootstrap.sh   # venv ${UPIPE_VENV:-.venv}"
    line="  OMP_NUM_THREADS=$OMP_NUM_THREADS"
    for arg in "${cmd[@]}"; do  # quote only what a shell would need quoted
        if [[ "$arg" =~ ^[A-Za-z0-9_./,:=+@%-]+$ ]]; then line+=" $arg"; else line+=" $(printf %q "$arg")"; fi
    done
    echo "$line"
    echo "  results -> $out_abs/"
    exit 0
fi

venv="$("$root/scripts/bootstrap.sh")"
export VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH"

echo "run_all.sh: ${cmd[*]}"
"${cmd[@]}"
echo "run_all.sh: done; results in $out_abs/ (see results/README.md)"
