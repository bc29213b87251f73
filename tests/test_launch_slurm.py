"""spmd-launch slurm: the sbatch script, run through a fake srun, forms a real job."""

import os
import random
import shutil
import subprocess
import sys
import time

import pytest

from launch import launch_cli
from tests.multiprocess import ROOT, WORKERS

pytestmark = pytest.mark.multiprocess


def test_generated_script_runs_a_multi_process_job_through_srun(tmp_path):
  if not shutil.which("bash"):
    pytest.skip("needs bash")
  script_path = tmp_path / "job.sbatch"
  assert (
    launch_cli.main(
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


def test_one_failed_task_ends_the_others_through_kill_on_bad_exit(tmp_path):
  if not shutil.which("bash"):
    pytest.skip("needs bash")
  # Task 1 fails once task 0 is running; task 0 would finish on its own a few seconds later.
  ready = tmp_path / "task-0-running"
  code = (
    "import os, pathlib, sys, time\n"
    f"ready = pathlib.Path({str(ready)!r})\n"
    "if os.environ['SLURM_PROCID'] == '1':\n"
    "  while not ready.exists(): time.sleep(0.05)\n"
    "  print('task 1 fails', flush=True); sys.exit(3)\n"
    "ready.touch(); time.sleep(8); print('task 0 finished', flush=True)\n"
  )
  script_path = tmp_path / "job.sbatch"
  argv = ["slurm", "--nodes", "2", "--script", str(script_path), "--", sys.executable, "-c", code]
  assert launch_cli.main(argv) == 0
  script = script_path.read_text()
  srun = [line for line in script.splitlines() if line.startswith("srun ")]
  assert len(srun) == 1 and " --kill-on-bad-exit=1 " in srun[0], script
  env = dict(os.environ, PATH=f"{ROOT / 'tests' / 'fakes'}{os.pathsep}{os.environ['PATH']}")

  def run(text):
    ready.unlink(missing_ok=True)
    start = time.monotonic()
    done = subprocess.run(
      ["timeout", "-k", "5", "60", "bash", "-c", text], env=env, capture_output=True, text=True
    )
    return done, time.monotonic() - start

  done, took = run(script)
  out = done.stdout + done.stderr
  assert "task 1 fails" in out and "task 0 finished" not in out, out
  assert done.returncode == 128 + 15, out  # srun: the highest status, task 0's SIGTERM
  assert took < 30, out  # a hang bound: task 0 was ended, not waited for
  # The flag is what ends task 0: without it (SLURM's default) task 0 runs to its end.
  done, _ = run(script.replace(" --kill-on-bad-exit=1", ""))
  out = done.stdout + done.stderr
  assert "task 1 fails" in out and "task 0 finished" in out and done.returncode == 3, out
