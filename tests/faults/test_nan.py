"""Fault 8: Inf or NaN gradients injected at chosen steps of a 2 x 2 job.

Promise: the update is skipped inside the step (parameters and optimizer
state unchanged; decided from global values, so every host agrees), and
`train.max_bad_steps` non-finite steps in a row stop every host with a clear
error.

One job, a checkpoint after every step: step 5 is poisoned and skipped (the
state saved after it equals the state saved before it, bit for bit), steps
6-7 train, and the poisoned steps 8-10 end it on every host.
"""

import re

import jax
import numpy as np
import pytest

from tests.faults import harness
from tests.faults.conftest import injections
from trainers.reporting.metrics import read_metrics

pytestmark = [pytest.mark.multiprocess, pytest.mark.faults]

STOPPED = "3 consecutive steps with a non-finite loss or gradient (last at step 10"


def _same(a, b) -> bool:
  return jax.tree.structure(a) == jax.tree.structure(b) and all(
    np.array_equal(x, y, equal_nan=True) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )


@pytest.mark.parametrize("value", ["inf", "nan"][: injections(1, 2)])
def test_nonfinite_steps_are_skipped_on_every_host_and_too_many_stop_every_host(
  data, tmp_path, record, value
):
  workdir = tmp_path / "run"
  job = harness.start(
    data,
    workdir,
    *harness.long_run(every=1),
    "--config.checkpoint.keep=20",
    "--config.hook_settings.faults.inject_nonfinite_at=(4, 7, 8, 9)",  # 0-based: metrics steps 5, 8, 9, 10
    f"--config.hook_settings.faults.inject_nonfinite_value={value}",
    "--config.train.max_bad_steps=3",
  )
  code = job.wait(300)
  out = job.output
  rows = {r["step"]: r for r in read_metrics(workdir / "metrics.jsonl") if "finite" in r}
  finite = [int(rows[s]["finite"]) for s in sorted(rows)]
  before, after = (harness.saved_state(workdir, s) for s in (4, 5))
  unchanged = all(_same(before[k], after[k]) for k in ("params", "opt_state"))
  said = {
    p: STOPPED in "".join(line for _, line in job.lines if line.startswith(f"[p{p}]"))
    for p in (0, 1)
  }
  raised = [t for t, line in job.lines if STOPPED in line]
  detected = job.lines[-1][0] - raised[0] if raised else None
  skipped_ok = unchanged and after["step"] == 5 and finite[:6] == [1, 1, 1, 1, 0, 1]
  clean = "SIGABRT" not in out and re.findall(r"process \d: exit code (\d+)", out) == ["1", "1"]
  stopped_ok = code != 0 and all(said.values()) and finite[6:] == [1, 0, 0, 0] and clean
  record(f"8. {value} gradients at a step: update skipped, state unchanged", 1, int(skipped_ok))
  record(f"8. {value} gradients 3 steps in a row: every host stops", 1, int(stopped_ok), detected)
  assert unchanged, "the skipped step changed the parameters or the optimizer state"
  assert finite == [1, 1, 1, 1, 0, 1, 1, 0, 0, 0], finite  # skipped, went on, then stopped
  assert code != 0, out
  assert all(said.values()), (said, out)  # every host stops, saying why
  # An agreed stop: every host exits alike, none aborted by the coordinator leaving first.
  assert "SIGABRT" not in out, out
  assert re.findall(r"process \d: exit code (\d+)", out) == ["1", "1"], out
