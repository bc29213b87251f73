"""The training loop: steps, and the hooks that are due after each.

The loop only runs steps and runs the hooks that are due (`trainers.hooks`):
metrics, eval, checkpoints and profiling are hooks of the same kind as a
user's, each with its own schedule. Nothing in the loop reads a device
value: metrics stay on the devices until a due hook asks for them, and then
all pending steps' metrics come in one transfer (with the default hooks, one
host sync per `log_every` steps, not per step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from trainers.hooks.hook import Hook, ReadOnlyRows, StepInfo

log = logging.getLogger(__name__)


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
  # What the hooks' `end`s returned for the run's summary, by name.
  summary_entries: dict[str, Any] = dataclasses.field(default_factory=dict)

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
      history=ReadOnlyRows(self.history),
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
  end_phase: Callable[[Hook], contextlib.AbstractContextManager] = lambda hook: (
    contextlib.nullcontext()
  ),
) -> LoopState:
  """Runs steps until `total_steps`, a preemption, or an error.

  `progress(step)` is told after every step and every hook (the watchdog);
  the end (the last fetch, every hook's `end`) runs within `end_phase()`, its
  own time limit: the end of a run is not a step.
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
    with end_phase():
      if ok and any(h.metrics for h in hooks):
        loop.fetch()
      info = loop.info(ok and bool(loop.history))
      for hook in hooks:
        if hook.end is not None:
          entries = hook.end(info, ok)
          if entries:
            loop.summary_entries.update(entries)
  return loop
