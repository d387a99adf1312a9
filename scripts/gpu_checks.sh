#!/usr/bin/env bash
# The GPU checks in one go, for a short GPU slot (docs/gpu.md#the-gpu-checks-in-one-go): each
# part writes under OUT and has its own time limit, so a slow part cannot eat the others' time.
#
#   scripts/gpu_checks.sh OUT [PART ...]     # default: every part, in this order
#
# parts (about how long on one H200):
#   tests      the gpu-marked tests (pytest -m gpu), log in OUT/gpu_tests.log
#   attention  flash and cuDNN attention by heads, length and GQA group (gpu_costs), OUT/attention
#   selective  selective recomputation's speed-ups, measured beside emulated (selective_gpu)
#   validate   the time model against 18 measured steps, quick calibration (validate-time)
#   profile    the profiled step cells op by op (gpu_costs --only-profiled), OUT/steps
#
# Runs with the python3 on PATH from the repository root (the project need not be installed;
# deepspeed and its pydantic/hjson dependencies must be importable for the ds-ulysses cell). Each
# part's exit code is printed; the script's is the first failure's (0 when all passed).
set -uo pipefail

out="${1:?usage: scripts/gpu_checks.sh OUT [tests|attention|selective|validate|profile ...]}"
shift
(($# > 0)) || set -- tests attention selective validate profile
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
mkdir -p "$out"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# the allocator setting ALST runs with (docs/gpu.md#paper-scale-sweeps)
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"

python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; \
print(torch.__version__, torch.cuda.get_device_name())" || exit 2

status=0
part() {  # part NAME LIMIT_S COMMAND...
    local name="$1" limit="$2" t0=$SECONDS rc
    shift 2
    echo "== $name: $*"
    timeout "$limit" "$@"
    rc=$?
    echo "== $name: exit $rc in $((SECONDS - t0)) s"
    ((status == 0 && rc != 0)) && status=$rc
    return 0
}

for p in "$@"; do
    case "$p" in
        tests) part tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests \
            >"$out/gpu_tests.log" 2>&1 ;;
        attention) part attention 90 python3 -m experiments.gpu costs --out "$out/attention" \
            --skip dispatch,memory,matmul,host_copy,steps,calibrate ;;
        selective) part selective 300 python3 -m experiments.gpu selective --out "$out" ;;
        validate) part validate 240 python3 -m experiments.cli validate-time --device cuda \
            --quick --out "$out" --no-progress ;;
        profile) part profile 180 python3 -m experiments.gpu costs --out "$out/steps" \
            --skip dispatch,memory,matmul,attention,host_copy,calibrate --only-profiled ;;
        *) echo "unknown part $p: tests, attention, selective, validate or profile" >&2
           exit 2 ;;
    esac
done
exit "$status"
