"""Fault 6: one host feeds a different batch shape, dtype or step, or runs another config.

Promise: a clear error on every host, naming the host and what differs,
before any wrong number is computed. Where it is caught:
  * a different config, or different shapes or dtypes at a new signature:
    the hosts compare before running (`multihost.check_agreement`), and every
    one raises the same `AgreementError`;
  * a batch that changes mid-run: the host's own per-step check (shape and
    dtype against the first batch) or the loop's step check raises, and the
    other hosts' watchdogs relay that error and stop, instead of waiting in
    the collective their peer will never join.
"""

import re
import sys
import time

import pytest

from launch.local import run_local
from tests.faults import harness
from tests.faults.conftest import injections
from tests.multiprocess import ROOT, run_worker

pytestmark = [pytest.mark.multiprocess, pytest.mark.faults]

BOUND_S = 60

FIRST_CALL = {
  "mismatch-shape": "args[0].local_shape: process 0: [8, 8]; process 1: [6, 8]",
  "mismatch-dtype": 'args[0].dtype: process 0: "int32"; process 1: "float32"',
  "mismatch-divisible": (
    "process 1: ValueError: argument args[0]: local shape=(7, 8) "
    "is not divisible by the local parts=(2, 1)"
  ),
}


def test_hosts_passing_different_shapes_or_dtypes_all_raise_before_running(record):
  """sharded_jit's check at a new signature: three disagreements, one after another, one job."""
  started = time.monotonic()
  result = run_worker(
    "sharded_jit_worker", ",".join(FIRST_CALL), num_processes=2, devices_per_process=2
  )
  took = time.monotonic() - started
  caught = sum(
    all("ERROR AgreementError" in p.output and expected in p.output for p in result.processes)
    for expected in FIRST_CALL.values()
  )
  record("6. hosts pass different shapes, dtypes, indivisible rows (first call)", 3, caught)
  assert result.ok, result.report()
  assert caught == 3, result.report()
  assert took < 120, took


def test_a_host_with_another_config_stops_every_host_before_the_first_step(data, tmp_path, record):
  # Process 1 is started with a different learning rate.
  code = (
    "import os, sys\n"
    "if os.environ['SPMD_PROCESS_ID'] == '1':\n"
    "  sys.argv.append('--config.train.learning_rate=0.5')\n"
    "from trainers.run.train_cli import main\n"
    "main()\n"
  )
  workdir = tmp_path / "run"
  started = time.monotonic()
  result = run_local(
    [sys.executable, "-c", code, *harness.train_flags(data, workdir)],
    num_processes=2,
    devices_per_process=2,
    timeout_s=240,
    grace_s=10,
    echo=False,
    cwd=str(ROOT),
    env={
      "PYTHONPATH": str(ROOT),
      "JAX_COMPILATION_CACHE_DIR": data["cache"],
    },
  )
  took = time.monotonic() - started
  ok = not result.ok and all(
    "spmd-train start: processes disagree" in p.output and "config:" in p.output
    for p in result.processes
  )
  no_step = not harness.last_step(workdir)
  record("6. one host started with another config", 1, int(ok and no_step), took)
  assert ok, result.report()
  assert no_step, "a step ran"


# CI leaves out dtype: the same per-step check as shape (and the first-call test covers dtypes).
KINDS = ["shape", "step", "dtype"]
MESSAGES = {
  "shape": r"batch\['inputs'\] at step=(\d+) has local shape \(3, 16\) int32, expected \(4, 16\)",
  "dtype": r"batch\['inputs'\] at step=(\d+) has local shape \(4, 16\) float32, expected \(4, 16\) int32",
  "step": r"the input pipeline gave the batch of step \d+ while the train state is at step (\d+)",
}


@pytest.mark.parametrize("kind", KINDS[: injections(2, 3)])
def test_a_host_whose_batch_changes_mid_run_stops_every_host_naming_it(
  data, tmp_path, record, kind
):
  bad_step = 5
  workdir = tmp_path / "run"
  job = harness.start(
    data,
    workdir,
    *harness.long_run(every=1000),
    f"--config.hook_settings.faults.inject_bad_batch=(1, {bad_step}, '{kind}')",
    timeout_s=BOUND_S + 60,
  )
  code = job.wait(BOUND_S + 90)
  out = job.output
  found = re.search(rf"\[p1\] ValueError: process 1: {MESSAGES[kind]}", out)
  relayed = re.search(
    r"spmd-train: process 0: stopping \(.*\) because process 1 failed: ValueError", out
  )
  # The bad batch is step `bad_step` (0-based): metrics step bad_step + 1 must never appear.
  logged = harness.last_step(workdir)
  raised_at = [t for t, line in job.lines if "[p1] ValueError: process 1" in line]
  detected = job.lines[-1][0] - raised_at[0] if raised_at else None
  ok = (
    code != 0
    and found is not None
    and int(found.group(1)) == bad_step
    and relayed is not None
    and "process 1 failed first" in out
    and logged <= bad_step
  )
  record(f"6. one host's batch has another {kind} mid-run", 1, int(ok), detected)
  assert code != 0, out
  assert found and int(found.group(1)) == bad_step, out
  assert relayed, out  # every host says why
  assert "process 1 failed first" in out, out
  assert logged <= bad_step, f"step {logged} was computed after the bad batch"
