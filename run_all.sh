#!/usr/bin/env bash
# Main job: reproduce the paper's artefacts into results/ (tables, plots, provenance).
#
#   ./run_all.sh                          CPU-scale counterpart of every artefact (gloo, 4 ranks;
#                                         ~25 min on 2 cores), the default without GPUs
#   NPROC_PER_NODE=8 ./run_all.sh         paper-scale sweeps on this node's GPUs (NCCL)
#   torchrun --nnodes 2 --nproc-per-node 8 ... -m experiments.cli sweep <name>
#                                         multi-node: the sweep itself under torchrun
#
# Environment:
#   ONLY=<sweep>[,<sweep>]  run only these sweeps (names: upipe-bench list sweeps)
#   DRY_RUN=1               expand and validate every cell, run nothing
#   OUT=<dir>               results root (default results/)
#   SCALE=cpu|paper         which sweeps (default: paper when NPROC_PER_NODE is set, else cpu)
#   RETRY_FAILED=1          re-run cells whose row is an error or a timeout (others resume)
#   UPIPE_VENV and the rest: see scripts/bootstrap.sh
# Extra arguments go to `upipe-bench sweep` (e.g. --timeout 600).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$root"

OUT="${OUT:-results}"
DRY_RUN="${DRY_RUN:-0}"
if [[ -n "${NPROC_PER_NODE:-}" ]]; then SCALE="${SCALE:-paper}"; else SCALE="${SCALE:-cpu}"; fi
case "$SCALE" in cpu|paper) ;; *) echo "run_all.sh: SCALE must be cpu or paper, got $SCALE" >&2; exit 2;; esac

# Ranks share the CPU cores: one OpenMP thread each unless the caller chose otherwise.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# ALST's allocator setting (DESIGN.md §6); ignored without CUDA.
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"

venv="$("$root/scripts/bootstrap.sh")"
export VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH"

if [[ -n "${ONLY:-}" ]]; then
    IFS=',' read -r -a sweeps <<< "$ONLY"
else
    mapfile -t sweeps < <(python -c "
from experiments.sweeps import cpu_sweeps, paper_sweeps
for s in ($SCALE""_sweeps()): print(s.name)")
fi

args=(--out "$OUT")
[[ "$DRY_RUN" == 1 ]] && args+=(--dry-run)
[[ "${RETRY_FAILED:-0}" == 1 ]] && args+=(--retry-failed)
[[ "$SCALE" == paper && -n "${NPROC_PER_NODE:-}" ]] && args+=(--nproc "$NPROC_PER_NODE")

echo "run_all.sh: $SCALE scale, ${#sweeps[@]} sweep(s): ${sweeps[*]}" >&2
start=$SECONDS
python -m experiments.cli sweep "${sweeps[@]}" "${args[@]}" "$@"
[[ "$DRY_RUN" == 1 ]] && exit 0

echo "run_all.sh: done in $((SECONDS - start)) s. Tables and plots:"
for s in "${sweeps[@]}"; do
    echo "  $OUT/$s/  (rows.csv$( [[ -f "$OUT/$s/max_context.csv" ]] && echo ', max_context.csv'), $(ls "$OUT/$s"/*.png 2>/dev/null | wc -l) plots)"
done
echo "Provenance: each sweep's env.json and runs/*/row.json; see $OUT/README.md"
