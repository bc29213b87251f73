"""Fault 4: SIGTERM to one process (a preemption notice) mid-run.

Promise: JAX's preemption sync makes every process save at one agreed step
and exit 0; the same command resumes from exactly that step, so no step is
lost or run twice, and the end is bit-identical to an uninterrupted run.
"""

import collections
import json
import os
import re
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
TERMS = injections(1, 4)


def _logged_steps(workdir) -> list[int]:
  path = workdir / "metrics.jsonl"
  rows = [json.loads(line) for line in path.read_text().splitlines() if line]
  return [r["step"] for r in rows if "loss" in r]


def test_sigterm_saves_at_one_agreed_step_and_resume_loses_nothing(
  data, tmp_path, tmp_path_factory, record
):
  workdir = tmp_path / "run"
  detections, saved_steps, lost, problems = [], [], 0, []
  for i, step in enumerate(harness.fault_steps(TERMS, seed=4)):
    process = (1, 0)[i % 2]  # CI: a non-coordinator; full: both kinds in turn
    job = harness.start(data, workdir, *harness.long_run())
    try:
      harness.wait_for(lambda s=step: harness.last_step(workdir) >= s, 300, f"step {step}")
      running = harness.wait_for(
        lambda: len(found := harness.pids(workdir)) == 2 and found, 60, "both processes"
      )
      os.kill(running[process], signal.SIGTERM)
      detections.append(harness.gone_after(list(running.values()), 60))
      code = job.launcher.wait(timeout=60)
    finally:
      job.kill()
    out = job.output
    # Every process says where it saved: one step, the same for all.
    said = dict(re.findall(r"\[p(\d)\] spmd-train: preempted at step (\d+)", out))
    agreed = set(said.values())
    if code != 0 or sorted(said) != ["0", "1"] or len(agreed) != 1:
      problems.append(f"SIGTERM {i + 1} to process {process}: exit {code}, said {said}\n{out}")
      break
    saved = int(agreed.pop())
    saved_steps.append(saved)
    lost += harness.last_step(workdir) - saved  # computed, logged and then not saved
    if saved not in harness.committed_steps(workdir):
      problems.append(f"step {saved} is not a committed checkpoint")
    print(f"SIGTERM to process {process} at step {step}: saved at {saved}", flush=True)
  if not problems:
    job = harness.start(data, workdir, *harness.long_run())
    code = job.wait(600)
    out = job.output
    resumed = re.findall(r"; state from checkpoint step (\d+)", out)
    if code != 0 or resumed != [str(saved_steps[-1])]:
      problems.append(f"the resume did not start at step {saved_steps[-1]}:\n{out}")
    if harness.param_hash(out) != harness.reference_hash(data, tmp_path_factory):
      problems.append(f"the final parameters differ from the uninterrupted run:\n{out}")
    counts = collections.Counter(_logged_steps(workdir))
    repeated = sorted(s for s, n in counts.items() if n > 1)
    missing = sorted(set(range(1, harness.STEPS + 1)) - set(counts))
    if repeated or missing:
      problems.append(f"steps run twice: {repeated}; never run: {missing}")
  promised = TERMS if not problems and max(detections) <= DETECT_S else 0
  record("4. SIGTERM to one process", TERMS, promised, max(detections, default=None), lost)
  assert not problems, "\n".join(problems)
  assert lost == 0 and max(detections) <= DETECT_S, (lost, detections)
