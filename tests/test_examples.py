"""README's "Use UPipe in your model" examples: shown verbatim in the README, and they run.

Each example runs as the README says, under ``torchrun --nproc-per-node 2`` with gloo on CPU
(``python -m torch.distributed.run`` is torchrun).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def _torchrun(script: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_there_are_examples():
    assert {p.name for p in EXAMPLES} >= {"own_module.py", "hf_llama.py"}


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_readme_shows_the_example_verbatim(script):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert script.read_text() in blocks, f"README.md does not show {script.name} verbatim"


def test_own_module_example_runs_on_2_ranks():
    out = _torchrun(ROOT / "examples" / "own_module.py")
    for rank in (0, 1):
        assert f"rank {rank}: UPipe output equals the reference" in out, out


def test_hf_example_trains_on_2_ranks():
    pytest.importorskip("transformers", reason="the hf extra (transformers) is absent")
    out = _torchrun(ROOT / "examples" / "hf_llama.py")
    losses = [float(v) for v in re.findall(r"step \d: loss ([\d.]+)", out)]
    assert len(losses) == 3, out
    assert losses[-1] < losses[0], f"the loss did not go down on a repeated batch: {losses}"
