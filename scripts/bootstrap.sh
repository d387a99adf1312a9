#!/usr/bin/env bash
# Create or reuse the project's virtual environment and install upipe into it (editable, with
# the dev extra). Run it (do not source it); on success the only thing it writes to stdout is
# the venv's absolute path, so callers do:
#
#     venv="$(scripts/bootstrap.sh)"; export VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH"
#
# Environment:
#   UPIPE_VENV         venv directory (default .venv; a relative path is taken from the repo
#                      root). Always this venv, never an already-activated one: to use your
#                      own environment, point UPIPE_VENV at it (UPIPE_VENV="$VIRTUAL_ENV").
#   UPIPE_PYTHON       interpreter that creates a new venv (default python3; needs >= 3.10).
#   UPIPE_TORCH_SPEC   what to install when the venv has no importable torch
#                      (default torch==2.13.0, the pinned CPU build).
#
# torch is installed only when `import torch` fails in the venv, so a CUDA torch installed
# there beforehand is kept (pyproject.toml only asks for torch>=2.5). The editable install is
# skipped when a stamp inside the venv matches the hash of pyproject.toml and the repo path,
# so a second run costs well under a second.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${UPIPE_VENV:-.venv}"
[[ "$venv" == /* ]] || venv="$root/$venv"
torch_spec="${UPIPE_TORCH_SPEC:-torch==2.13.0}"
py="$venv/bin/python"
stamp="$venv/.upipe-bootstrap-stamp"

log() { echo "bootstrap: $*" >&2; }

if [[ ! -x "$py" ]]; then
    base_py="${UPIPE_PYTHON:-python3}"
    if ! "$base_py" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
        log "$base_py is missing or older than 3.10; set UPIPE_PYTHON to a Python >= 3.10"
        exit 1
    fi
    log "creating venv $venv ($("$base_py" --version 2>&1))"
    "$base_py" -m venv "$venv"
fi

# Only one bootstrap installs into a venv at a time (two entry points started together).
if command -v flock >/dev/null 2>&1; then
    exec 9>"$venv/.upipe-bootstrap.lock"
    flock 9
fi

# Key of the installed state: the project metadata and where the editable install points.
key="$("$py" -I -c '
import hashlib, sys
print(hashlib.sha256(open(sys.argv[1], "rb").read() + sys.argv[2].encode()).hexdigest())
' "$root/pyproject.toml" "$root")"

# Fast path: stamp matches and both distributions are still there (no `import torch`: ~5 s).
if [[ -f "$stamp" && "$(<"$stamp")" == "$key" ]] && "$py" -I -c '
import importlib.metadata as md, importlib.util as u, sys
md.distribution("upipe")
sys.exit(u.find_spec("torch") is None)
' 2>/dev/null; then
    echo "$venv"
    exit 0
fi

cd "$root"
if ! "$py" -c 'import torch' >/dev/null 2>&1; then
    log "no importable torch in $venv: installing $torch_spec"
    "$py" -m pip install -q "$torch_spec" >&2
fi
log "installing upipe (pip install -e '.[dev]'; minutes in a fresh venv)"
"$py" -m pip install -q -e '.[dev]' >&2
echo "$key" >"$stamp"
log "ready: $venv (torch $("$py" -c 'import torch; print(torch.__version__)'))"
echo "$venv"
