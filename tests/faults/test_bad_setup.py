"""Fault 10: bad configs and command lines end every process with an error naming the field.

Each case starts a real 2-process job through `spmd-launch local`; the promise
is a non-zero exit within a bound, never a hang, and a message with the
offending field and value, raised before any process waits on another for
long.
"""

import socket
import sys
import time

import pytest

from launch.local import run_local
from tests.faults import harness
from tests.multiprocess import ROOT

pytestmark = [pytest.mark.multiprocess, pytest.mark.faults]

BOUND_S = 90  # JAX start-up and data preparation on 2 busy cores included

CASES = [
  ("unknown key", ["--config.train.stepz=5"], "stepz"),
  ("wrong type", ["--config.train.steps=many"], "many"),
  ("negative size", ["--config.global_batch=-8"], "global_batch=-8 must be a positive"),
  ("mesh sizes do not multiply to the devices", ["--config.mesh.ici=data=3"], "{'data': 3}"),
  ("batch not divisible by data parallelism", ["--config.global_batch=6"], "global_batch=6"),
]


@pytest.mark.parametrize("name,overrides,named", CASES, ids=[c[0] for c in CASES])
def test_a_bad_setting_is_a_clear_error_on_every_process(
  data, tmp_path, record, name, overrides, named
):
  started = time.monotonic()
  job = harness.start(data, tmp_path / "run", *overrides, timeout_s=BOUND_S + 30)
  code = job.wait(BOUND_S + 60)
  took = time.monotonic() - started
  out = job.output
  ok = code != 0 and named in out and took < BOUND_S
  record(f"10. {name}", 1, int(ok), took)
  assert code != 0, out
  assert named in out, out
  assert took < BOUND_S, out


def test_a_workdir_that_cannot_be_written_is_named(data, tmp_path, record):
  # A path under a regular file: not writable even for root (these machines run as root).
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  workdir = blocker / "run"
  started = time.monotonic()
  job = harness.start(data, workdir, timeout_s=BOUND_S + 30)
  code = job.wait(BOUND_S + 60)
  took = time.monotonic() - started
  out = job.output
  ok = code != 0 and str(workdir) in out and took < BOUND_S
  record("10. workdir not writable", 1, int(ok), took)
  assert code != 0 and str(workdir) in out, out
  assert took < BOUND_S, out


def test_a_coordinator_address_in_use_is_named_before_anyone_waits(data, tmp_path, record):
  """Process 0 finds its coordinator port taken: it says so at once, not after a timeout."""
  with socket.socket() as busy:
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    address = f"127.0.0.1:{busy.getsockname()[1]}"
    code = (
      "import os\n"
      f"os.environ['SPMD_COORDINATOR_ADDRESS'] = {address!r}\n"
      f"os.environ['SPMD_COORDINATOR_BIND_ADDRESS'] = {address!r}\n"
      "from trainers.run.train_cli import main\n"
      "main()\n"
    )
    started = time.monotonic()
    result = run_local(
      [sys.executable, "-c", code, *harness.train_flags(data, tmp_path / "run")],
      num_processes=2,
      devices_per_process=2,
      timeout_s=BOUND_S + 30,
      grace_s=2,  # process 1 waits for the coordinator that never starts: not for long
      echo=False,
      cwd=str(ROOT),
      env={"PYTHONPATH": str(ROOT)},
    )
    took = time.monotonic() - started
  named = f"coordinator address '{address}' is already in use"
  ok = not result.ok and result.first_failure == 0 and named in result.processes[0].output
  record("10. coordinator address already in use", 1, int(ok and took < BOUND_S), took)
  assert ok, result.report()
  assert took < BOUND_S, took
