"""Faults 1-3: kill -9 a process mid-run, the coordinator, or anyone during a save.

Promise: every process of the attempt is gone within 15 s, the launcher names
the failure, the restarted job resumes from the last committed checkpoint
(never an uncommitted one), and the final parameters are bit-identical to an
uninterrupted run of the same layout.
"""

import os
import random
import signal
import time

import pytest

from tests.faults import harness
from tests.faults.conftest import injections

pytestmark = [pytest.mark.multiprocess, pytest.mark.faults]

DETECT_S = 15
EVERY = 2  # checkpoint interval: at most this many steps are redone after a kill
MOST_KILLS = injections(5, 20)
# One run length for every test here, so one uninterrupted reference serves all:
# room for a kill in each stretch of 5 steps, and a few steps after the last.
STEPS = 4 + 5 * MOST_KILLS + 4


def _overrides(steps: int):
  return (
    f"--config.train.steps={steps}",
    f"--config.checkpoint.every={EVERY}",
    "--config.checkpoint.keep=2",
    "--config.eval_every=0",
  )


_REFERENCES: dict[int, str] = {}


def _reference_hash(data, tmp_path_factory, steps: int) -> str:
  """The final parameter hash of an uninterrupted run of `steps` (2 x 2), computed once."""
  if steps not in _REFERENCES:
    workdir = tmp_path_factory.mktemp("reference") / "run"
    job = harness.start(data, workdir, *_overrides(steps))
    assert job.wait(600) == 0, job.output
    _REFERENCES[steps] = harness.param_hash(job.output)
  return _REFERENCES[steps]


def _kill_repeatedly(data, workdir, process: int, kills: int, seed: int):
  """Kills `process` at `kills` random steps of one job with restarts; returns what it saw."""
  rng = random.Random(seed)
  # One kill per stretch of 5 steps, at a random step in it: after each
  # restart the job has to pass the previous kill before the next.
  stretch = (STEPS - 8) // kills
  kill_steps = [4 + stretch * i + rng.randrange(min(3, stretch - 2)) for i in range(kills)]
  steps = STEPS
  job = harness.start(data, workdir, *_overrides(steps), max_restarts=kills)
  detections, committed = [], []
  try:
    for step in kill_steps:
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
  return steps, code, job.output, detections, committed


@pytest.mark.parametrize(
  "process,fault,ci,full",
  [(1, "1. kill -9 a non-coordinator process", 5, 20), (0, "2. kill -9 the coordinator", 1, 10)],
)
def test_kill_9_at_random_steps_resumes_bit_identical(
  data, tmp_path, tmp_path_factory, record, process, fault, ci, full
):
  kills = injections(ci, full)
  steps, code, out, detections, committed = _kill_repeatedly(
    data, tmp_path / "run", process, kills, seed=process
  )
  resumed = harness.resumed_steps(out)
  lost = sum(max(0, c - r) for c, r in zip(committed, resumed))
  final = harness.param_hash(out)
  reference = _reference_hash(data, tmp_path_factory, steps)
  promised = sum(d <= DETECT_S for d in detections) if final == reference and code == 0 else 0
  record(fault, kills, promised, max(detections), lost)
  assert code == 0, out
  assert out.count("failed first: killed by SIGKILL") == kills, out
  assert len(resumed) == kills and lost == 0, (resumed, committed)
  assert max(detections) <= DETECT_S, detections
  assert final == reference, out


def test_kill_9_during_an_async_save_never_restores_that_step(
  data, tmp_path, tmp_path_factory, record
):
  """The coordinator dies while a save is in flight: that step is never committed or used."""
  workdir = tmp_path / "run"
  steps = STEPS
  job = harness.start(data, workdir, *_overrides(steps), max_restarts=1)
  root = workdir / "checkpoints"
  try:

    def save_in_flight():
      if harness.last_step(workdir) < 6 or not root.exists():
        return None
      tmp = [p.name for p in root.iterdir() if not p.name.isdigit() and "tmp" in p.name]
      return tmp or None

    in_flight = harness.wait_for(save_in_flight, 300, "a save in flight", poll_s=0.001)
    running = harness.pids(workdir)
    os.kill(running[0], signal.SIGKILL)
    killed_at = time.monotonic()
    detected = harness.gone_after(list(running.values()), 60)
    unfinished = int(in_flight[0].split(".", 1)[0])
    left_after_kill = harness.committed_steps(workdir)
    code = job.launcher.wait(timeout=600)
  finally:
    job.kill()
  out = job.output
  resumed = harness.resumed_steps(out)
  reference = _reference_hash(data, tmp_path_factory, steps)
  ok = (
    code == 0
    and unfinished not in left_after_kill
    and resumed
    and resumed[0] < unfinished
    and harness.param_hash(out) == reference
  )
  record("3. kill -9 during an async save", 1, int(ok and detected <= DETECT_S), detected)
  assert unfinished not in left_after_kill, (in_flight, left_after_kill)
  assert code == 0, out
  assert resumed and resumed[0] == max(left_after_kill) < unfinished, (resumed, left_after_kill)
  assert harness.param_hash(out) == reference, out
  assert detected <= DETECT_S and killed_at
