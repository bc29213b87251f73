"""`spmd-train` with a slow store: every checkpoint write first sleeps SPMD_TEST_SAVE_DELAY_S.

A deliberately slow save (a slow object store) for the fault suite, kept out of
the product: it patches the saver's worker in this process, then runs the
real entry point. SPMD_TEST_STEP_DELAY_S (optional) also sleeps after each
step, so a test's signal lands mid-run even when the steps themselves are
faster than the test can react.
"""

import os
import time

from trainers.checkpoints.saver import Saver
from trainers.run import train, train_cli

_DELAY_S = float(os.environ["SPMD_TEST_SAVE_DELAY_S"])
_STEP_DELAY_S = float(os.environ.get("SPMD_TEST_STEP_DELAY_S", "0"))
_write = Saver._orbax_save
_loop = train.train_loop


def _slow_write(self, *args, **kwargs):
  time.sleep(_DELAY_S)
  return _write(self, *args, **kwargs)


def _slow_loop(loop, train_step, batches, hooks, preempted, progress=lambda step: None, **kwargs):
  def slow_progress(step):
    time.sleep(_STEP_DELAY_S)
    progress(step)

  return _loop(loop, train_step, batches, hooks, preempted, slow_progress, **kwargs)


Saver._orbax_save = _slow_write
if _STEP_DELAY_S:
  train.train_loop = _slow_loop

if __name__ == "__main__":
  train_cli.main()
