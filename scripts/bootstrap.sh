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

# The project's own sources, byte-compiled next to them (__pycache__, git-ignored) at every
# bootstrap: the editable install compiles nothing of them, and where PYTHONDONTWRITEBYTECODE is
# set (this project's machines set it) every process compiled them at import, again: about 0.9
# of the 5.5 CPU-seconds one process spends importing the CLI, the harness and the Hugging Face
# integration (measured on 2 cores), in each of the suite's ranks, launches and notebook
# kernels. Up to date it costs about 0.15 s; a source edited later no longer matches the mtime
# and size its .pyc records, and Python then ignores that .pyc.
compile_sources() {
    "$py" -m compileall -q -j 0 "$root/upipe" "$root/experiments" "$root/tests" >/dev/null \
        2>&1 || true
}

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
    compile_sources
    echo "$venv"
    exit 0
fi

cd "$root"
site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if ! "$py" -c 'import torch' >/dev/null 2>&1; then
    log "no importable torch in $venv: installing $torch_spec"
    # pip, since it reads the machine's own configuration (a local wheel of the pinned build);
    # byte-compiled (with what it needs) on every core instead of by pip on one; as pip does,
    # a file this Python cannot compile is left as it is (torch ships a py3.12-only test file)
    "$py" -m pip install -q --no-compile "$torch_spec" >&2
    "$py" -m compileall -q -j 0 "$site" >/dev/null || true
fi
log "installing upipe with its dev extra (editable; about a minute in a fresh venv)"
# uv resolves, fetches and byte-compiles in parallel: the same distributions as pip's in about a
# third of pip's time (measured: 21 s against 60 s on 2 cores). Byte-compiled either way: where
# PYTHONDONTWRITEBYTECODE is set, every process would otherwise compile what it imports.
# pip when uv cannot be installed or fails (an index only pip is configured for).
if "$py" -m pip install -q uv >&2 && "$venv/bin/uv" pip install -q --python "$py" \
        --compile-bytecode -e '.[dev]' >&2; then
    :
else
    log "uv unavailable or failed: installing with pip"
    "$py" -m pip install -q -e '.[dev]' >&2
fi
echo "$key" >"$stamp"
compile_sources
log "ready: $venv (torch $("$py" -c 'import torch; print(torch.__version__)'))"
echo "$venv"
