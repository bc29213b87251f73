"""Preemption: SIGTERM means "save at a step every host agrees on, then exit 0".

Across processes JAX's preemption sync manager catches SIGTERM (TPU
maintenance events and schedulers send it), tells every host, and
`reached_preemption_sync_point(step)` turns True on all of them at the same
step. A single process has no such service, so it catches SIGTERM itself.
"""

from __future__ import annotations

import logging
import signal
import threading

from jax.experimental import multihost_utils

from spmd import compat

log = logging.getLogger(__name__)


class PreemptionWatch:
  """Call `reached(step)` once per step on every host, in the same order."""

  def __init__(self):
    self._distributed = compat.preemption_service_running()
    self._flag = threading.Event()
    self._previous = None
    if not self._distributed and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

  def _on_sigterm(self, signum, frame):
    log.warning("SIGTERM: saving a checkpoint at the next step, then exiting")
    self._flag.set()

  def reached(self, step: int) -> bool:
    """True at the step where every host should save and stop."""
    if self._distributed:
      return multihost_utils.reached_preemption_sync_point(step)
    return self._flag.is_set()

  def close(self) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None
