"""spmd-launch slurm: the sbatch script, run through a fake srun, forms a real job."""

import os
import random
import shutil
import subprocess
import sys

import pytest

from launch import main
from tests.multiprocess import ROOT, WORKERS

pytestmark = pytest.mark.multiprocess


def test_generated_script_runs_a_multi_process_job_through_srun(tmp_path):
  if not shutil.which("bash"):
    pytest.skip("needs bash")
  script_path = tmp_path / "job.sbatch"
  assert (
    main.main(
      [
        "slurm",
        "--nodes",
        "2",
        "--tasks-per-node",
        "1",
        "--script",
        str(script_path),
        "--",
        sys.executable,
        str(WORKERS / "init_worker.py"),
        "slurm",
      ]
    )
    == 0
  )
  env = dict(
    os.environ,
    PATH=f"{ROOT / 'tests' / 'fakes'}{os.pathsep}{os.environ['PATH']}",
    PYTHONPATH=str(ROOT),
    JAX_PLATFORMS="cpu",
    SPMD_CPU_DEVICES="2",
    SPMD_HEARTBEAT_TIMEOUT_S="5",
    SPMD_SHUTDOWN_TIMEOUT_S="5",
    FAKE_SLURM_JOB_ID=str(random.randint(1, 4000)),
  )
  for name in ("SPMD_COORDINATOR_ADDRESS", "SPMD_NUM_PROCESSES", "SPMD_PROCESS_ID"):
    env.pop(name, None)
  done = subprocess.run(
    ["timeout", "-k", "5", "120", "bash", str(script_path)], env=env, capture_output=True, text=True
  )
  assert done.returncode == 0, done.stdout + done.stderr
  assert done.stdout.count("devices 4 local 2 processes 2") == 2, done.stdout + done.stderr
