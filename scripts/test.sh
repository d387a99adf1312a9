#!/usr/bin/env bash
# The project's test command: bootstrap the venv (scripts/bootstrap.sh), then run pytest.
#
#   ./scripts/test.sh                   # -> python -m pytest -q
#   ./scripts/test.sh -m 'not slow' -x  # any arguments replace the default -q
#
# Exits with pytest's own exit code (5, "no tests collected", stays a failure).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$("$root/scripts/bootstrap.sh")"
export VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH"

# Distributed tests spawn up to 4 rank processes on 2-core machines: one OpenMP thread each
# unless the caller chose otherwise (what torchrun does too).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

cd "$root"
(($# > 0)) || set -- -q
exec python -m pytest "$@"
