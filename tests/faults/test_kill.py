"""Faults 1-3: kill -9 a process mid-run, the coordinator, or anyone during a save.

Promise: every process of the attempt is gone within 15 s, the launcher names
the failure, the restarted job resumes from the last committed checkpoint
(never an uncommitted one), and the final parameters are bit-identical to an
uninterrupted run of the same layout.
"""

import os
import signal

import pytest

from tests.faults import harness
from tests.faults.conftest import injections

# The full counts run past pytest's default limit (pyproject.toml: 300 s a test).
pytestmark = [
  pytest.mark.multiprocess,
  pytest.mark.faults,
  pytest.mark.timeout(injections(300, 1500)),
]

DETECT_S = 15


def _kill_repeatedly(data, workdir, process: int, kills: int, seed: int):
  """Kills `process` at `kills` random steps of one job with restarts; returns what it saw."""
  job = harness.start(data, workdir, *harness.long_run(), max_restarts=kills)
  detections, committed = [], []
  try:
    for step in harness.fault_steps(kills, seed):
      harness.wait_for(lambda s=step: harness.last_step(workdir) >= s, 300, f"step {step}")
      try:
        running = harness.wait_for(
          lambda: (found := harness.pids(workdir)) and process in found and found,
          60,
          f"process {process} of the job",
        )
      except TimeoutError as e:
        raise AssertionError(job.output) from e
      committed.append(max(harness.committed_steps(workdir), default=0))
      print(f"step {harness.last_step(workdir)}: killing {running}", flush=True)
      os.kill(running[process], signal.SIGKILL)
      detections.append(harness.gone_after(list(running.values()), 60))
    code = job.launcher.wait(timeout=600)
  finally:
    job.kill()
  return code, job.output, detections, committed


@pytest.mark.parametrize(
  "process,fault,ci,full",
  [(1, "1. kill -9 a non-coordinator process", 2, 20), (0, "2. kill -9 the coordinator", 1, 10)],
)
def test_kill_9_at_random_steps_resumes_bit_identical(
  data, tmp_path, tmp_path_factory, record, process, fault, ci, full
):
  kills = injections(ci, full)
  code, out, detections, committed = _kill_repeatedly(
    data, tmp_path / "run", process, kills, seed=process
  )
  resumed = harness.resumed_steps(out)
  lost = sum(max(0, c - r) for c, r in zip(committed, resumed))
  final = harness.param_hash(out)
  reference = harness.reference_hash(data, tmp_path_factory)
  promised = sum(d <= DETECT_S for d in detections) if final == reference and code == 0 else 0
  record(fault, kills, promised, max(detections), lost)
  assert code == 0, out
  assert out.count("failed first: killed by SIGKILL") == kills, out
  assert len(resumed) == kills and lost == 0, (resumed, committed)
  assert max(detections) <= DETECT_S, detections
  assert final == reference, out


def _stop(pids, sig):
  for pid in pids:
    try:
      os.kill(pid, sig)
    except ProcessLookupError:
      pass


def test_kill_9_during_an_async_save_never_restores_that_step(
  data, tmp_path, tmp_path_factory, record
):
  """The coordinator dies while a save is in flight: that step is never committed or used.

  A tiny save commits within milliseconds of its temporary directory
  appearing, so the test freezes both processes (SIGSTOP) as soon as it sees
  one, checks the save is still uncommitted (else lets them go on to the
  next save), and only then kills the coordinator.
  """
  workdir = tmp_path / "run"
  root = workdir / "checkpoints"
  job = harness.start(data, workdir, *harness.long_run(), max_restarts=1)
  try:
    harness.wait_for(lambda: harness.last_step(workdir) >= 6, 300, "step 6")
    running = harness.wait_for(
      lambda: len(found := harness.pids(workdir)) == 2 and found, 60, "both processes"
    )

    def save_in_flight():
      tmp = [p.name for p in root.iterdir() if not p.name.isdigit() and "tmp" in p.name]
      return tmp or None

    for _ in range(10):
      in_flight = harness.wait_for(save_in_flight, 120, "a save in flight", poll_s=0.001)
      _stop(running.values(), signal.SIGSTOP)
      unfinished = int(in_flight[0].split(".", 1)[0])
      if (root / in_flight[0]).exists() and unfinished not in harness.committed_steps(workdir):
        break  # frozen mid-save
      _stop(running.values(), signal.SIGCONT)
    else:
      raise AssertionError("no save was caught before it committed in 10 tries")
    os.kill(running[0], signal.SIGKILL)
    _stop(running.values(), signal.SIGCONT)
    detected = harness.gone_after(list(running.values()), 60)
    left_after_kill = harness.committed_steps(workdir)
    code = job.launcher.wait(timeout=600)
  finally:
    job.kill()
  out = job.output
  resumed = harness.resumed_steps(out)
  reference = harness.reference_hash(data, tmp_path_factory)
  ok = (
    code == 0
    and unfinished not in left_after_kill
    and resumed
    and resumed[0] == max(left_after_kill, default=0) < unfinished
    and harness.param_hash(out) == reference
  )
  lost = max(0, max(left_after_kill, default=0) - resumed[0]) if resumed else None
  record("3. kill -9 during an async save", 1, int(ok and detected <= DETECT_S), detected, lost)
  assert unfinished not in left_after_kill, (in_flight, left_after_kill)
  assert code == 0, out
  assert resumed and resumed[0] == max(left_after_kill, default=0) < unfinished, (
    resumed,
    left_after_kill,
  )
  assert harness.param_hash(out) == reference, out
  assert detected <= DETECT_S, detected
