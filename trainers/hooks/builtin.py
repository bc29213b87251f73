"""The trainer's own hooks: metrics, eval, checkpoints and a profile, each on its schedule.

They are `Hook`s like a user's (`trainers.hooks.hook`); the run builds them
from its config (`trainers.run.train`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import jax

from trainers.hooks.hook import Hook, StepInfo

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
  """Too many consecutive steps with a non-finite loss or gradient.

  Decided from the step's global metrics, so every host raises it at the
  same step (`every_host`).
  """

  every_host = True


class MetricsHook:
  """Writes fetched metrics, updates progress, and stops after too many bad steps.

  Registered with `metrics=True` every `log_every` steps; it writes every row
  fetched since its last run (another hook's fetch included).
  """

  def __init__(
    self,
    write: Callable[[int, dict], None],
    progress: Callable[[int, dict], None],
    max_bad_steps: int,
  ):
    self._write, self._progress, self._max_bad = write, progress, max_bad_steps
    self._written = 0

  def __call__(self, info: StepInfo) -> None:
    rows = info.history[self._written :]
    self._written = len(info.history)
    for row in rows:
      values = {k: v for k, v in row.items() if k != "step"}
      self._write(row["step"], values)
      if row["bad_steps"] >= self._max_bad:
        raise NonFiniteError(
          f"{int(row['bad_steps'])} consecutive steps with a non-finite loss or gradient "
          f"(last at step {row['step']}, loss={row['loss']}, grad_norm={row['grad_norm']}); "
          f"train.max_bad_steps={self._max_bad}. Lower the learning rate or check the data."
        )
    if rows:
      self._progress(info.step, rows[-1])

  def end(self, info: StepInfo, ok: bool) -> None:
    if ok:
      self(info)


class CheckpointSaves:
  """Starts an asynchronous save when due and at the end; waits at the end.

  `save(step, state)` starts a save and returns whether it began. It refuses
  a step not after the last saved (`trainers.checkpoints.saver.Saver`), so the end of a run
  resumed at its last step, or just saved, saves nothing twice.
  """

  def __init__(self, save: Callable[[int, Any], bool], wait: Callable[[], None]):
    self._save, self._wait = save, wait
    self.final_save_s = 0.0  # how long the end's save (and the wait for it) took

  def __call__(self, info: StepInfo) -> None:
    self._save(info.step, dict(info.state))

  def end(self, info: StepInfo, ok: bool) -> None:
    # After an error another host may be gone: saving (a collective) or
    # waiting for a save could then hang, so only a clean end saves.
    if not ok:
      return
    started = time.perf_counter()
    if info.step > 0:
      self._save(info.step, dict(info.state))
    self._wait()
    self.final_save_s = time.perf_counter() - started


class Evaluations:
  """Evaluates the state when due (`evaluate(state, step)`) and writes the result at that step."""

  def __init__(self, evaluate: Callable[[Any, int], dict], write: Callable[[int, dict], None]):
    self._evaluate, self._write = evaluate, write
    self.results: dict[int, dict] = {}

  def __call__(self, info: StepInfo) -> None:
    result = self._evaluate(dict(info.state), info.step)
    self.results[info.step] = result
    self._write(info.step, result)


class Profile:
  """A JAX profiler trace of steps [start, start + num), into `directory`."""

  def __init__(self, start_step: int, num_steps: int, directory: str):
    self.start, self.stop = start_step, start_step + num_steps
    self._dir = directory
    self._active = False

  def hook(self) -> Hook:
    steps = (self.start, self.stop) if self.start >= 0 else ()
    return Hook(self, at=steps, end=self.end, name="profile")

  def __call__(self, info: StepInfo) -> None:
    if info.step == self.start and not self._active:
      jax.profiler.start_trace(self._dir)
      self._active = True
    elif self._active:
      jax.block_until_ready(dict(info.state))
      jax.profiler.stop_trace()
      self._active = False
      log.info("profiler trace written to %s", self._dir)

  def end(self, info: StepInfo, ok: bool) -> None:
    if self._active:
      jax.profiler.stop_trace()
      self._active = False
