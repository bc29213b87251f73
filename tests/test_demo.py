"""`make demo`, the README's main command, run through make with fewer steps.

The same target a user runs (the launcher, 2 processes x 2 CPU devices, the
tokenizer and the packing of the corpus on first use, training, eval,
checkpoint, sample), with `DEMO_FLAGS` shortening the run and `DEMO_WORKDIR`
a temporary folder, so the data is prepared from nothing as on a first run.
Checked as a user sees it: make exits 0, the loss falls, the sample is
printed and the last step's checkpoint is committed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multiprocess import ROOT
from tests.session_settings import default_pipeline_env
from trainers.checkpoints.step_folders import COMMIT_MARKER

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(660)]

STEPS = 30
# A tenth of the run warms up, as in the full demo, so the loss has steps to fall.
DEMO_FLAGS = f"--config.train.steps={STEPS} --config.train.warmup_steps={STEPS // 10}"
HARD_TIMEOUT_S = 600


def run_make_demo(workdir: Path) -> subprocess.CompletedProcess:
  """`make demo` with this interpreter's venv; the whole process group is killed on timeout."""
  venv = Path(sys.executable).parent.parent
  command = [
    "make",
    # This test runs inside the installed venv, so its install step is done;
    # without this make would reinstall whenever the venv's stamp is older
    # than the checkout's setup.py (a venv shared between checkouts).
    f"--old-file={venv}/bin/.installed",
    "demo",
    f"VENV={venv}",
    f"DEMO_WORKDIR={workdir}",
    f"DEMO_FLAGS={DEMO_FLAGS}",
  ]
  # The checkout's own modules, whatever the venv's editable install points at;
  # XLA's default pipeline and the demo's own compilation cache, as a user has them.
  env = dict(default_pipeline_env(), PYTHONPATH=str(ROOT))
  env.pop("JAX_COMPILATION_CACHE_DIR")
  process = subprocess.Popen(
    command,
    cwd=ROOT,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    start_new_session=True,  # its own process group: make, the launcher, the trainers
  )
  try:
    output, _ = process.communicate(timeout=HARD_TIMEOUT_S)
  except subprocess.TimeoutExpired:
    os.killpg(process.pid, signal.SIGKILL)
    output, _ = process.communicate()
    pytest.fail(f"make demo ran past {HARD_TIMEOUT_S} s:\n{output[-6000:]}")
  return subprocess.CompletedProcess(command, process.returncode, output)


def test_make_demo_trains_samples_and_checkpoints(tmp_path):
  venv_bin = Path(sys.executable).parent
  if shutil.which("make") is None or not (venv_bin / "spmd-launch").exists():
    pytest.skip("needs make and a venv with the package installed (as `make test` builds)")
  workdir = tmp_path / "lm_tiny"
  done = run_make_demo(workdir)
  tail = done.stdout[-6000:]
  assert done.returncode == 0, tail
  assert "spmd-launch: all 2 processes exited 0" in done.stdout, tail

  # The loss falls: the run's last train loss, as its summary prints it,
  # against the first step's.
  [summary_line] = [x for x in done.stdout.splitlines() if "final train loss" in x]
  final_loss = float(summary_line.split(":")[-1])
  with open(workdir / "metrics.jsonl") as f:
    first = json.loads(f.readline())
  assert first["step"] == 1, first
  assert final_loss < 0.9 * first["loss"], (first["loss"], final_loss)

  # The sample: its header, then text that starts with the prompt.
  lines = done.stdout.splitlines()
  [header] = [i for i, x in enumerate(lines) if "sample (greedy, prompt 'import'" in x]
  assert lines[header + 1].startswith("[p0] import"), lines[header : header + 3]

  # The last step's checkpoint is committed: orbax wrote its marker last.
  assert (workdir / "checkpoints" / str(STEPS) / COMMIT_MARKER).exists(), tail
