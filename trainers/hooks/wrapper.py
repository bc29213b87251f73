"""Wrappers: what the loop feeds and runs, wrapped by your code, on every process.

A `Wrapper` comes from where hooks come from (`Task.hooks`, or a
`config.hooks` factory, which may return `Hook`s and `Wrapper`s together). It
may wrap three things, each optional:

  host_rows(step, rows) -> rows   this process's rows of a step (numpy, before
                                  they are placed on the devices): check your
                                  own data, or change it. It runs on the input
                                  thread, ahead of the step; an exception stops
                                  the run, naming the step.
  batches(stream) -> stream       the `(step, global batch)` iterator the loop
                                  reads; the loop checks each step it yields.
  train_step(step_fn, context)    the compiled train step the loop calls,
        -> step_fn                `(state, batch) -> (state, metrics)`;
                                  `context.build(task)` compiles the same step
                                  for another task (same state and mesh).

Every process must wrap alike where a wrapper changes what runs (the step, or
the batches' shapes): the hosts run one program. A wrapper that only reads
(a data check) may do what it likes on its own process.

Example, a data check that names the step and row of a token id out of range:

  >>> import numpy as np
  >>> def token_ids_below(vocab: int) -> Wrapper:
  ...   def check(step, rows):
  ...     bad = np.argwhere(rows["inputs"] >= vocab)
  ...     if len(bad):
  ...       raise ValueError(f"step {step}: row {bad[0][0]} holds token id {rows['inputs'][tuple(bad[0])]}")
  ...     return rows
  ...   return Wrapper(host_rows=check, name="token_ids_below")
  >>> wrapper = token_ids_below(256)
  >>> wrapper.host_rows(0, {"inputs": np.array([[1, 2], [3, 300]])})
  Traceback (most recent call last):
  ...
  ValueError: step 0: row 1 holds token id 300
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

Rows = Mapping[str, np.ndarray]
TrainStep = Callable[[Any, Any], tuple[Any, Any]]


@dataclasses.dataclass(frozen=True)
class StepContext:
  """What a `Wrapper.train_step` may use besides the step it wraps.

  Attributes:
    task: the run's task.
    build: `task -> step`: the train step compiled for another task, with the
      same state, mesh, config and gradient reduction (e.g. a loss that logs
      more, or one that injects a fault in a test).
    first_step: the step the loop starts at (after a resume, not 0).
  """

  task: Any
  build: Callable[[Any], TrainStep]
  first_step: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Wrapper:
  """Optional wrappers of this process's rows, the batch stream and the train step.

  Attributes:
    host_rows: `(step, rows) -> rows`, this process's rows of `step` before
      they are placed (see the module docstring).
    batches: `iterator -> iterator` of `(step, batch)`; the result must have
      a `close()` when the input does (the run closes it at the end).
    train_step: `(step_fn, StepContext) -> step_fn`.
    name: for logs and errors.
  """

  host_rows: Callable[[int, Rows], Rows] | None = None
  batches: Callable[[Iterator], Iterator] | None = None
  train_step: Callable[[TrainStep, StepContext], TrainStep] | None = None
  name: str = "wrapper"

  def __post_init__(self):
    for field in ("host_rows", "batches", "train_step"):
      value = getattr(self, field)
      if value is not None and not callable(value):
        raise TypeError(f"Wrapper {self.name}: {field}={value!r} is not callable")


def wrap_batches(batches: Iterator, wrappers: list[Wrapper]) -> Iterator:
  """The `(step, batch)` stream with each wrapper's `batches` applied, in order."""
  for w in wrappers:
    if w.batches is not None:
      batches = w.batches(batches)
  return batches


def wrap_train_step(step: TrainStep, context: StepContext, wrappers: list[Wrapper]) -> TrainStep:
  """The train step with each wrapper's `train_step` applied, in order."""
  for w in wrappers:
    if w.train_step is not None:
      step = w.train_step(step, context)
  return step
