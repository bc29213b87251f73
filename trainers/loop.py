"""The training loop and its hooks.

The loop only runs steps and asks each hook whether it is due. Periodic work
(metrics, eval, checkpoints, profiling, preemption) lives in hooks with their
own schedules. Nothing in the loop reads a device value: metrics stay on the
devices until the metrics hook fetches the pending ones together, every
`log_every` steps (one host sync per `log_every` steps, not per step).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

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
  """What hooks may read and change."""

  state: Any  # the train state (device arrays)
  step: int  # steps completed
  total_steps: int
  pending: list[tuple[int, dict]] = dataclasses.field(default_factory=list)
  history: list[dict] = dataclasses.field(default_factory=list)  # fetched metrics
  last_fetch: float = dataclasses.field(default_factory=time.perf_counter)
  last_fetch_step: int = 0


class Hook:
  """Periodic work: `run` is called after steps where `due(step)` holds."""

  every = 0

  def due(self, step: int, total: int) -> bool:
    return self.every > 0 and (step % self.every == 0 or step == total)

  def run(self, loop: LoopState) -> None:
    raise NotImplementedError

  def close(self, loop: LoopState, ok: bool) -> None:
    """Called once at the end; `ok` is False after an error (not a preemption)."""


class MetricsHook(Hook):
  """Fetches pending metrics, writes them, updates progress, checks finiteness."""

  def __init__(
    self,
    every: int,
    write: Callable[[int, dict], None],
    progress: Callable[[int, dict], None],
    max_bad_steps: int,
    flops_per_step: float = 0.0,
    peak_flops_total: float = 0.0,
    unit: str = "tokens",
    flops_metric: str = "mfu",
  ):
    """`flops_metric` names the FLOPs ratio: "mfu" (model FLOPs) or "hfu" (compiled)."""
    self.every = every
    self._write, self._progress = write, progress
    self._rate = f"{unit}_per_s"
    self._max_bad = max_bad_steps
    self._flops_per_step, self._peak = flops_per_step, peak_flops_total
    self._flops_metric = flops_metric

  def run(self, loop: LoopState) -> None:
    if not loop.pending:
      return
    fetched = jax.device_get([m for _, m in loop.pending])  # the one sync point
    now = time.perf_counter()
    steps = loop.step - loop.last_fetch_step
    seconds = max(now - loop.last_fetch, 1e-9)
    step_time = seconds / max(steps, 1)
    for (step, _), values in zip(loop.pending, fetched):
      row = {k: float(np.asarray(v)) for k, v in values.items()}
      row["step_time_s"] = step_time
      row[self._rate] = row.get("units", 0.0) / step_time  # real units, padding excluded
      if self._flops_per_step and self._peak:
        row[self._flops_metric] = self._flops_per_step / step_time / self._peak
      loop.history.append({"step": step + 1, **row})
      self._write(step + 1, row)
      if row["bad_steps"] >= self._max_bad:
        raise NonFiniteError(
          f"{int(row['bad_steps'])} consecutive steps with a non-finite loss or gradient "
          f"(last at step {step + 1}, loss={row['loss']}, grad_norm={row['grad_norm']}); "
          f"train.max_bad_steps={self._max_bad}. Lower the learning rate or check the data."
        )
    self._progress(loop.step, loop.history[-1])
    loop.pending.clear()
    loop.last_fetch, loop.last_fetch_step = now, loop.step

  def close(self, loop: LoopState, ok: bool) -> None:
    if ok:
      self.run(loop)


class CheckpointHook(Hook):
  """Starts an asynchronous save every `every` steps and at the end; waits at the end.

  `save(step, state)` starts a save and returns whether it began. It refuses
  a step not after the last saved (`checkpoint.Saver`), so the end of a run
  resumed at its last step, or just saved, saves nothing twice.
  """

  def __init__(self, every: int, save: Callable[[int, Any], bool], wait: Callable[[], None]):
    self.every = every
    self._save, self._wait = save, wait
    self.final_save_s = 0.0  # how long the end's save (and the wait for it) took

  def run(self, loop: LoopState) -> None:
    self._save(loop.step, loop.state)

  def close(self, loop: LoopState, ok: bool) -> None:
    # After an error another host may be gone: saving (a collective) or
    # waiting for a save could then hang, so only a clean end saves.
    if not ok:
      return
    started = time.perf_counter()
    if loop.step > 0:
      self._save(loop.step, loop.state)
    self._wait()
    self.final_save_s = time.perf_counter() - started


class EvalHook(Hook):
  def __init__(
    self, every: int, evaluate: Callable[[Any], dict], write: Callable[[int, dict], None]
  ):
    self.every = every
    self._evaluate, self._write = evaluate, write
    self.results: dict[int, dict] = {}

  def run(self, loop: LoopState) -> None:
    result = self._evaluate(loop.state)
    self.results[loop.step] = result
    self._write(loop.step, result)


class ProfileHook(Hook):
  """Writes a JAX profiler trace for steps [start, start + num)."""

  def __init__(self, start_step: int, num_steps: int, directory: str):
    self._start, self._stop = start_step, start_step + num_steps
    self._dir = directory
    self._active = False

  def due(self, step: int, total: int) -> bool:
    return self._start >= 0 and step in (self._start, self._stop)

  def run(self, loop: LoopState) -> None:
    if loop.step == self._start and not self._active:
      jax.profiler.start_trace(self._dir)
      self._active = True
    elif self._active:
      jax.block_until_ready(loop.state)
      jax.profiler.stop_trace()
      self._active = False
      log.info("profiler trace written to %s", self._dir)

  def close(self, loop: LoopState, ok: bool) -> None:
    if self._active:
      jax.profiler.stop_trace()
      self._active = False


def train_loop(
  loop: LoopState,
  train_step: Callable,
  batches: Iterator,
  hooks: list[Hook],
  preempted: Callable[[int], bool],
  progress: Callable[[int], None] = lambda step: None,
) -> LoopState:
  """Runs steps until `total_steps`, a preemption, or an error.

  `progress(step)` is told after every step and its hooks (the watchdog).
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
      for hook in hooks:
        if hook.due(loop.step, loop.total_steps):
          hook.run(loop)
          progress(loop.step)
      if preempted(loop.step):
        ok = True
        raise Preempted(f"preempted at step {loop.step}")
    ok = True
  finally:
    for hook in hooks:
      hook.close(loop, ok)
  return loop
