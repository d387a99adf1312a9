"""Provenance stored with every result (docs/design.md#measurement,
docs/conventions.md#provenance-travels-with-results)."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import socket
import subprocess
from pathlib import Path

import torch

import upipe


def _git(*args: str) -> str | None:
    r = subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent)
    return r.stdout.strip() if r.returncode == 0 else None


def git_revision() -> str:
    """HEAD's hash, ``+dirty`` when tracked files differ from it; ``uncommitted`` outside git."""
    # UPIPE_GIT_REV: the revision of a copy made without .git (a container, a remote machine)
    rev = _git("rev-parse", "HEAD") or os.environ.get("UPIPE_GIT_REV") or "uncommitted"
    # outputs under results/ do not make the code dirty (a sweep rewrites them as it runs)
    if rev != "uncommitted" and _git("status", "--porcelain", "--untracked-files=no", "--",
                                     ":/", ":(exclude,top)results"):
        rev += "+dirty"
    return rev


def _cpu_model() -> str:
    cpu = platform.processor()
    if Path("/proc/cpuinfo").exists():
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f
                        if ln.startswith("model name")), cpu)
    return cpu


def provenance() -> dict:
    """Versions, git revision, host, devices and date of the process calling it."""
    try:  # from the package metadata: importing deepspeed costs seconds and probes devices
        ds_version = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        ds_version = None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {
        "torch_version": torch.__version__, "deepspeed_version": ds_version,
        "upipe_version": getattr(upipe, "__version__", None), "git_rev": git_revision(),
        "hostname": socket.gethostname(), "cpu_model": _cpu_model(), "cpu_count": os.cpu_count(),
        "gpu_name": gpu, "cuda_version": torch.version.cuda, "python": platform.python_version(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
