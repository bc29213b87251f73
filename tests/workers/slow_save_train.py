"""`spmd-train` whose every checkpoint write first sleeps SPMD_TEST_SAVE_DELAY_S seconds.

A deliberately slow save (a slow object store) for the fault suite, kept out of
the product: it patches the saver's worker in this process, then runs the
real entry point.
"""

import os
import time

from trainers import checkpoint, main

_DELAY_S = float(os.environ["SPMD_TEST_SAVE_DELAY_S"])
_write = checkpoint.Saver._orbax_save


def _slow_write(self, *args, **kwargs):
  time.sleep(_DELAY_S)
  return _write(self, *args, **kwargs)


checkpoint.Saver._orbax_save = _slow_write

if __name__ == "__main__":
  main.main()
