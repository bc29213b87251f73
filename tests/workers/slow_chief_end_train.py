"""`spmd-train` whose process 0 is slow at the end of the run: its loss curve first sleeps.

Process 0 alone draws the loss curve and writes summary.json after the last
collective; on a busy machine that takes seconds of CPU while the other
processes are already done. SPMD_TEST_END_DELAY_S makes it take that long
here (or until the file SPMD_TEST_END_RELEASE_FILE names exists, where
set), kept out of the product: it patches the loss curve in this process,
then runs the real entry point.
"""

import os
import time

import jax

from trainers.reporting import loss_curve
from trainers.run import train_cli

_DELAY_S = float(os.environ["SPMD_TEST_END_DELAY_S"])
# Where set, the test's word that it is done with the pause: a file it creates.
_RELEASE = os.environ.get("SPMD_TEST_END_RELEASE_FILE")
_plot = loss_curve.plot_loss_curve


def _slow_plot(*args, **kwargs):
  if jax.process_index() == 0:
    held_until = time.monotonic() + _DELAY_S
    while time.monotonic() < held_until and not (_RELEASE and os.path.exists(_RELEASE)):
      time.sleep(0.05)
  return _plot(*args, **kwargs)


loss_curve.plot_loss_curve = _slow_plot

if __name__ == "__main__":
  train_cli.main()
