#!/usr/bin/env bash
# Main job: reproduce the paper's artefacts into results/ (tables, plots, provenance).
#
#   ./run_all.sh                          without GPUs (the default): the CPU-scale counterpart
#                                         of every artefact (gloo, 4 ranks; ~40 min on 2 cores)
#                                         and the emulated twin of every paper-scale sweep
#                                         (paper shapes and lengths through the emulator on the
#                                         paper's 8x H100 80 GB nodes: memory, max context and
#                                         emulated time), then the time model's CPU validation
#   NPROC_PER_NODE=8 ./run_all.sh         the paper-scale sweeps of 8 GPUs on this node's GPUs
#                                         (NCCL; the 16-GPU ones are left out: multi-node)
#   SCALE=emulated ./run_all.sh           only the emulated twins
#   torchrun --nnodes 2 --nproc-per-node 8 ... -m experiments.cli sweep <name>
#                                         multi-node: the sweep itself under torchrun
#
# Environment:
#   ONLY=<sweep>[,<sweep>]  run only these sweeps, of any scale (names: upipe-bench list sweeps)
#   DRY_RUN=1               expand and validate every cell, run nothing (0 or 1)
#   OUT=<dir>               results root (default results/; relative to the caller's directory)
#   SCALE=<scale>[,<scale>] which sweeps: cpu, paper, emulated (default: paper when
#                           NPROC_PER_NODE is set, else cpu,emulated)
#   RETRY_FAILED=1          re-run cells whose row is an error or a timeout (others resume; 0 or 1)
#   UPIPE_VENV and the rest: see scripts/bootstrap.sh
# Extra arguments go to `upipe-bench sweep` (e.g. --timeout 600).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# OUT as the caller means it (relative to the directory run_all.sh is called from), written
# relative to the repository when inside it: "results", "./results" and "$PWD/results" are
# one directory, the committed one
OUT="$(realpath -m --relative-base="$root" "${OUT:-$root/results}")"
cd "$root"

DRY_RUN="${DRY_RUN:-0}"
for flag in DRY_RUN RETRY_FAILED; do
    case "${!flag:-0}" in 0|1) ;;
        *) echo "run_all.sh: $flag must be 0 or 1, got ${!flag}" >&2; exit 2;;
    esac
done
if [[ -n "${NPROC_PER_NODE:-}" && ! "$NPROC_PER_NODE" =~ ^[1-9][0-9]*$ ]]; then
    echo "run_all.sh: NPROC_PER_NODE must be a positive integer (this node's GPUs), got $NPROC_PER_NODE" >&2
    exit 2
fi
if [[ -n "${NPROC_PER_NODE:-}" ]]; then SCALE="${SCALE:-paper}"; else SCALE="${SCALE:-cpu,emulated}"; fi
IFS=',' read -r -a scales <<< "$SCALE"
for scale in "${scales[@]}"; do
    case "$scale" in cpu|paper|emulated) ;;
        *) echo "run_all.sh: SCALE must be cpu, paper, emulated or a comma-separated list of them, got $SCALE" >&2; exit 2;;
    esac
done

# Ranks share the CPU cores: one OpenMP thread each unless the caller chose otherwise.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# ALST's allocator setting (docs/design.md#the-memory-stack); ignored without CUDA.
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"

venv="$("$root/scripts/bootstrap.sh")"
export VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH"

# "<scale> <sweep>" lines: ONLY's sweeps at their own scale, else every sweep of each SCALE;
# with NPROC_PER_NODE, the paper-scale sweeps of another GPU count are left out, with a word
# (their folders name their GPUs; 16 ranks run on two nodes, under torchrun)
plan="$(python - "$SCALE" "${ONLY:-}" "${NPROC_PER_NODE:-}" <<'EOF'
import sys
from experiments.sweeps import SWEEPS, get_sweep
scales, only = sys.argv[1].split(","), [n for n in sys.argv[2].split(",") if n]
gpus = int(sys.argv[3]) if sys.argv[3] else None
try:
    chosen = [get_sweep(n) for n in only] or [s for s in SWEEPS.values() if s.scale in scales]
except ValueError as e:
    sys.exit(f"run_all.sh: ONLY: {e}")
for s in chosen:
    if s.scale == "paper" and gpus is not None and s.base["nproc"] != gpus:
        print(f"run_all.sh: {s.name} left out: its cells run on {s.base['nproc']} GPUs and "
              f"NPROC_PER_NODE is {gpus} (torchrun --nnodes N --nproc-per-node {gpus} ... "
              f"-m experiments.cli sweep {s.name}, N x {gpus} = {s.base['nproc']})",
              file=sys.stderr)
        continue
    print(s.scale, s.name)
EOF
)" || exit 2

args=(--out "$OUT")
[[ "$DRY_RUN" == 1 ]] && args+=(--dry-run)
[[ "${RETRY_FAILED:-0}" == 1 ]] && args+=(--retry-failed)

sweeps=()
start=$SECONDS
for scale in cpu paper emulated; do  # one CLI call per scale: --nproc is for the GPU sweeps
    mapfile -t group < <(awk -v s="$scale" '$1 == s {print $2}' <<< "$plan")
    (( ${#group[@]} )) || continue
    sweeps+=("${group[@]}")
    extra=()
    [[ "$scale" == paper && -n "${NPROC_PER_NODE:-}" ]] && extra+=(--nproc "$NPROC_PER_NODE")
    echo "run_all.sh: $scale scale, ${#group[@]} sweep(s): ${group[*]}" >&2
    python -m experiments.cli sweep "${group[@]}" "${args[@]}" "${extra[@]}" "$@"
done
[[ "$DRY_RUN" == 1 ]] && exit 0
# The time model against the CPU step times just measured
# (docs/emulation.md#emulated-time-and-the-planner): predictions on the directory's calibrated
# profile (calibrated first if missing).
if [[ " ${sweeps[*]} " == *" time_validation_cpu "* ]]; then
    python -m experiments.cli validate-time --out "$OUT" --no-progress
fi
# The ladder to 8M tokens on one node (and Qwen3-32B's on 16 GPUs), with the emulated twins
# and without ONLY: a rung whose record stands is kept, as a sweep resumes its cells.
if [[ -z "${ONLY:-}" && ",$SCALE," == *",emulated,"* ]]; then
    ladder=(--results "$OUT")
    [[ "${RETRY_FAILED:-0}" == 1 ]] && ladder+=(--retry-failed)
    python -m experiments.runner.long_ladder "${ladder[@]}"
    python -m experiments.runner.long_ladder "${ladder[@]}" --model qwen3-32b --gpus 16 \
        --seq-len 6M
fi
# The emulated Table 3/4 outcomes, memory wall and two-node figure beside the paper's, when
# one of the sweeps the report reads ran.
for s in table3_llama3_8b_h100x8-emulated table4_qwen3_32b_h100x16-emulated \
         memory_wall_llama3_8b_h100x8-emulated two_node_llama3_8b_h100x16-emulated; do
    if [[ " ${sweeps[*]} " == *" $s "* ]]; then
        python -m experiments.reporting.paper_grid --results "$OUT"
        break
    fi
done
# The provenance index in $OUT/README.md, rewritten from the tables just written.
python -m experiments.reporting.results_index --results "$OUT"
# The README's headline table and docs/results.md's selective-recomputation, UPipe-speed and
# ladder tables, rewritten from the same tables (when they are the committed ones).
if [[ "$OUT" == results ]]; then
    python -m experiments.reporting.readme_headline
    python -m experiments.reporting.selective_table
    python -m experiments.reporting.speed_table
    python -m experiments.reporting.ladder_table
fi

echo "run_all.sh: done in $((SECONDS - start)) s. Tables and plots:"
for s in "${sweeps[@]}"; do
    echo "  $OUT/$s/  (rows.csv$( [[ -f "$OUT/$s/max_context.csv" ]] && echo ', max_context.csv'), $(ls "$OUT/$s"/*.png 2>/dev/null | wc -l) plots)"
done
echo "Provenance: each sweep's env.json and runs/*/row.json; see $OUT/README.md"
