"""Fault 5: a process stuck in Python, or stopped with SIGSTOP, ends the job within a bound.

JAX's heartbeat does not notice a process that is alive but stuck; the
step-progress watchdog (trainers/run/watchdog.py) does, and says which process
fell behind.
"""

import os
import re
import signal
import time

import pytest

from tests.faults import harness

pytestmark = [pytest.mark.multiprocess, pytest.mark.faults]

TIMEOUT_S = 4  # the watchdog's limit between steps, for these tests
BOUND_S = TIMEOUT_S + 15  # watchdog + a tick + the launcher's grace and kill


def _overrides(*extra):
  return (
    *harness.long_run(every=1000),
    f"--config.train.step_timeout_s={TIMEOUT_S}",
    *extra,
  )


def test_a_process_stuck_in_python_ends_the_job_naming_it(data, tmp_path, record):
  job = harness.start(
    data, tmp_path / "run", *_overrides("--config.hook_settings.faults.inject_stall=(1, 6)")
  )
  try:
    harness.wait_for(lambda: harness.last_step(tmp_path / "run") >= 5, 240, "step 5")
    stalled_at = time.monotonic()
    code = job.launcher.wait(timeout=BOUND_S + 30)
    detected = time.monotonic() - stalled_at
  finally:
    job.kill()
  out = job.output
  assert code != 0, out
  assert "process 1 is furthest behind" in out, out
  assert f"exit code {86}" in out, out  # the watchdog's exit status, named by the launcher
  record("5. process stuck in Python", 1, int(detected < BOUND_S), detected)
  assert detected < BOUND_S, out


def test_a_stopped_process_ends_the_job_naming_it(data, tmp_path, record):
  job = harness.start(data, tmp_path / "run", *_overrides())
  try:
    harness.wait_for(lambda: harness.last_step(tmp_path / "run") >= 5, 240, "step 5")
    pid = harness.pids(tmp_path / "run")[1]
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    code = job.launcher.wait(timeout=BOUND_S + 30)
    detected = time.monotonic() - stopped_at
  finally:
    job.kill()
  out = job.output
  assert code != 0, out
  # Named either by JAX's heartbeat check (task 1) or by the watchdog (process 1).
  named = r"process 1 is furthest behind|stopped sending heartbeats\):\s*\n(\[p\d\] )?1\n"
  assert re.search(named, out), out
  record("5. process stopped (SIGSTOP)", 1, int(detected < BOUND_S), detected)
  assert detected < BOUND_S, out


def test_a_coordinator_slow_at_the_end_of_the_run_ends_the_job_cleanly(data, tmp_path, record):
  """Process 0's own end of the run (the loss curve, summary.json: seconds of CPU on a busy
  machine, where a reference run once aborted) lasts past JAX's shutdown barrier (the local
  launcher's is 5 s): the other process, done sooner, waits for it instead of timing the
  barrier out and aborting a finished run. Trains its own run: the delay is patched into
  its processes (tests/workers/slow_chief_end_train.py)."""
  workdir = tmp_path / "run"
  job = harness.start(
    data,
    workdir,
    *harness.long_run(every=1000),
    "--config.loss_curve=True",  # the slow end is the loss curve's
    entry="tests.workers.slow_chief_end_train",
    env={"SPMD_TEST_END_DELAY_S": "12"},
  )
  code = job.wait(600)
  out = job.output
  ok = code == 0 and (workdir / "summary.json").exists()
  record("5. coordinator slow at the end of the run (past the shutdown barrier)", 1, int(ok))
  assert code == 0, out
  assert (workdir / "summary.json").exists() and (workdir / "loss.png").exists(), out
