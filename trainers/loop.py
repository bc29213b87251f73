"""The training loop and the built-in hooks.

The loop only runs steps and runs the hooks that are due (`trainers.hooks`):
metrics, eval, checkpoints and profiling are hooks of the same kind as a
user's, each with its own schedule. Nothing in the loop reads a device
value: metrics stay on the devices until a due hook asks for them, and then
all pending steps' metrics come in one transfer (with the default hooks, one
host sync per `log_every` steps, not per step).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from trainers.hooks import Hook, StepInfo, _Rows

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
  """Too many consecutive steps with a non-finite loss or gradient.

  Decided from the step's global metrics, so every host raises it at the
  same step (`every_host`).
  """

  every_host = True


class Preempted(Exception):
  """Raised by the preemption hook after its checkpoint is saved."""


@dataclasses.dataclass
class LoopState:
  """The loop's own bookkeeping; hooks see a `StepInfo`, not this."""

  state: Any  # the train state (device arrays)
  step: int  # steps completed
  total_steps: int
  mesh: Any = None
  workdir: Any = None
  model: Callable[[Any], Any] = lambda state: None  # state -> the NNX model (eval mode)
  # Adds derived values (throughput, MFU) to each fetched row.
  annotate: Callable[[dict], None] = lambda row: None
  pending: list[tuple[int, dict]] = dataclasses.field(default_factory=list)
  history: list[dict] = dataclasses.field(default_factory=list)  # fetched metrics
  last_fetch: float = dataclasses.field(default_factory=time.perf_counter)
  last_fetch_step: int = 0

  def fetch(self) -> None:
    """Moves the pending steps' metrics to `history`: one transfer for all of them."""
    if not self.pending:
      return
    fetched = jax.device_get([m for _, m in self.pending])
    now = time.perf_counter()
    steps = self.step - self.last_fetch_step
    step_time = max(now - self.last_fetch, 1e-9) / max(steps, 1)
    for (step, _), values in zip(self.pending, fetched):
      row = {k: float(np.asarray(v)) for k, v in values.items()}
      row["step_time_s"] = step_time
      self.annotate(row)
      self.history.append({"step": step + 1, **row})
    self.pending.clear()
    self.last_fetch, self.last_fetch_step = now, self.step

  def info(self, fetched: bool) -> StepInfo:
    """The read-only view hooks get; `metrics` only when this step's were fetched."""
    current = self.history[-1] if fetched and self.history else None
    state = self.state
    return StepInfo(
      step=self.step,
      total_steps=self.total_steps,
      state=types.MappingProxyType(state),
      mesh=self.mesh,
      workdir=self.workdir,
      metrics=types.MappingProxyType(current) if current is not None else None,
      history=_Rows(self.history),
      model=lambda: self.model(state),
    )


def _run_due(loop: LoopState, hooks: list[Hook], progress: Callable[[int], None]) -> None:
  due = [h for h in hooks if h.due(loop.step, loop.total_steps)]
  if not due:
    return
  fetched = any(h.metrics for h in due)
  if fetched:
    loop.fetch()
  info = loop.info(fetched)
  for hook in due:
    hook.fn(info)
    progress(loop.step)


def train_loop(
  loop: LoopState,
  train_step: Callable,
  batches: Iterator,
  hooks: list[Hook],
  preempted: Callable[[int], bool],
  progress: Callable[[int], None] = lambda step: None,
) -> LoopState:
  """Runs steps until `total_steps`, a preemption, or an error.

  `progress(step)` is told after every step and every hook (the watchdog).
  At the end each hook's `end(info, ok)` runs, after a last fetch of the
  pending metrics when the loop ended cleanly (a preemption included).
  """
  ok = False
  try:
    while loop.step < loop.total_steps:
      data_step, batch = next(batches)
      if data_step != loop.step:  # data and state move together, on every host
        raise ValueError(
          f"process {jax.process_index()}: the input pipeline gave the batch of step "
          f"{data_step} while the train state is at step {loop.step}; stopping before the step"
        )
      loop.state, metrics = train_step(loop.state, batch)
      loop.pending.append((loop.step, metrics))
      loop.step += 1
      progress(loop.step)
      _run_due(loop, hooks, progress)
      if preempted(loop.step):
        ok = True
        raise Preempted(f"preempted at step {loop.step}")
    ok = True
  finally:
    if ok and any(h.metrics for h in hooks):
      loop.fetch()
    info = loop.info(ok and bool(loop.history))
    for hook in hooks:
      if hook.end is not None:
        hook.end(info, ok)
  return loop


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
  a step not after the last saved (`checkpoint.Saver`), so the end of a run
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
  """Evaluates the state when due and writes the result at that step."""

  def __init__(self, evaluate: Callable[[Any], dict], write: Callable[[int, dict], None]):
    self._evaluate, self._write = evaluate, write
    self.results: dict[int, dict] = {}

  def __call__(self, info: StepInfo) -> None:
    result = self._evaluate(dict(info.state))
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
