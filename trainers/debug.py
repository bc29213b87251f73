"""Fault injection for tests: the `debug` config section, which only test configs carry.

`configs/default.py` has no `debug` section, so no production config or
override can turn any of this on: a config file adds the section (the tiny
test config does, `config.debug = debug.section()`), and overrides of its
keys are then checked like any other (`trainers/config.py`). The trainer
imports this module only for a config with the section, and the production
train step holds no injection code: a poisoned step is the same step built
on a task whose loss gives every gradient the injected value.

  inject_nonfinite_at     steps (0-based) whose gradients are all ...
  inject_nonfinite_value  ... this value: "nan", "inf" or "-inf"
  inject_stall            (process, step): that process hangs in Python there
  inject_bad_batch        (process, step, kind): at that step the process feeds a
                          bad batch: kind "shape" drops a row and "dtype" sends
                          float inputs, at the source (the per-step check must
                          catch them); "step" skips a batch, so the process feeds
                          the next step's batch (the loop's step check must)
  report_param_hash       a hash of the final state (`param_hash`) in the summary

Example (a test config):
  >>> from configs import default
  >>> from trainers import debug
  >>> config = default.get_config()
  >>> config.debug = debug.section()
  >>> config.debug.inject_stall = (1, 6)  # or --config.debug.inject_stall='(1, 6)'
  >>> "debug" in default.get_config()  # the product's config has no such section
  False
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from trainers.tasks import Task

log = logging.getLogger(__name__)

NONFINITE_VALUES = ("nan", "inf", "-inf")
BAD_BATCH_KINDS = ("shape", "dtype", "step")


def section() -> ml_collections.ConfigDict:
  """The `debug` section with everything off: the reference for its keys and types."""
  return ml_collections.ConfigDict(
    {
      "inject_nonfinite_at": (),
      "inject_nonfinite_value": "nan",
      "inject_stall": (),
      "inject_bad_batch": (),
      "report_param_hash": False,
    }
  )


def check(debug: ml_collections.ConfigDict) -> None:
  """Raises `ValueError` naming the first value of the section that cannot be injected."""
  if debug.inject_nonfinite_value not in NONFINITE_VALUES:
    raise ValueError(
      f"debug.inject_nonfinite_value={debug.inject_nonfinite_value!r} must be one of "
      f"{NONFINITE_VALUES}"
    )
  if not all(isinstance(s, int) and s >= 0 for s in debug.inject_nonfinite_at):
    raise ValueError(
      f"debug.inject_nonfinite_at={debug.inject_nonfinite_at!r} must be steps (integers >= 0)"
    )
  stall = tuple(debug.inject_stall)
  if stall and (len(stall) != 2 or not all(isinstance(x, int) for x in stall)):
    raise ValueError(f"debug.inject_stall={stall!r} must be () or (process, step)")
  bad = tuple(debug.inject_bad_batch)
  if bad and (len(bad) != 3 or not all(isinstance(x, int) for x in bad[:2])):
    raise ValueError(f"debug.inject_bad_batch={bad!r} must be () or (process, step, kind)")
  if bad and bad[2] not in BAD_BATCH_KINDS:
    raise ValueError(
      f"debug.inject_bad_batch={bad!r}: kind {bad[2]!r} is not one of {BAD_BATCH_KINDS}"
    )


# Non-finite gradients.


def nonfinite_gradients(task: Task, value: str) -> Task:
  """`task` with a loss whose gradient is `value` ("nan", "inf", "-inf") for every parameter.

  The loss itself is unchanged: each parameter passes through an identity
  whose backward pass gives `value`, so the step sees a finite loss and
  non-finite gradients, summed over micro-batches and devices as they come.
  """
  if value not in NONFINITE_VALUES:
    raise ValueError(f"debug.inject_nonfinite_value={value!r} must be one of {NONFINITE_VALUES}")
  fill = float(value)

  @jax.custom_vjp
  def poison(x):
    return x

  poison.defvjp(lambda x: (x, None), lambda _, g: (jnp.full_like(g, fill),))

  def loss(model, batch, rngs, train):
    nnx.update(model, jax.tree.map(poison, nnx.state(model, nnx.Param)))
    return task.loss(model, batch, rngs, train)

  return dataclasses.replace(task, loss=loss)


class PoisonedSteps:
  """A train step that runs `poisoned` instead of `step` at the steps in `at`.

  The loop calls the step once per step, in order, from `first_step`; the
  choice is made on the host, so every host takes the same one.
  """

  def __init__(self, step: Callable, poisoned: Callable, at, first_step: int = 0):
    self._step, self._poisoned = step, poisoned
    self._at, self._next = frozenset(int(s) for s in at), first_step

  def __call__(self, state, batch):
    fn = self._poisoned if self._next in self._at else self._step
    self._next += 1
    return fn(state, batch)


# Stalls and bad batches.


class _AtStep:
  """Wraps the `(step, batch)` iterator; `act(item, batches)` replaces the item of one step."""

  def __init__(self, batches, step: int, act: Callable):
    self._batches, self._step, self._act = batches, step, act

  def __next__(self):
    item = next(self._batches)
    return self._act(item, self._batches) if item[0] == self._step else item

  def close(self):
    self._batches.close()


def _stall(item, batches):
  log.warning("spmd-train: injected stall at step %d (debug.inject_stall)", item[0])
  threading.Event().wait()  # alive, heartbeating, and never coming back


def _skip(item, batches):
  log.warning("spmd-train: injected skip of the batch of step %d", item[0])
  return next(batches)


def batches_with_faults(
  debug: ml_collections.ConfigDict, train_batches, start: Callable[[], Iterator]
) -> Any:
  """`start()`'s `(step, batch)` iterator, with this process's stall and bad batch."""
  me = jax.process_index()
  stall, bad = tuple(debug.inject_stall), tuple(debug.inject_bad_batch)
  skip_at = None
  if bad and int(bad[0]) == me:
    kind, bad_step = str(bad[2]), int(bad[1])
    if kind == "step":
      skip_at = bad_step
    else:
      host_batch = train_batches.host_batch

      def bad_host_batch(step: int):
        out = host_batch(step)
        if step == bad_step:
          log.warning("spmd-train: injected bad batch %s at step %d", kind, step)
          if kind == "shape":
            out = {k: v[:-1] for k, v in out.items()}
          else:
            out = dict(out, inputs=out["inputs"].astype(np.float32))
        return out

      # Before start(): the iterator's prefetch thread builds batches at once.
      train_batches.host_batch = bad_host_batch
  batches = start()
  if skip_at is not None:
    batches = _AtStep(batches, skip_at, _skip)
  if stall and int(stall[0]) == me:
    batches = _AtStep(batches, int(stall[1]), _stall)
  return batches


# The summary.


def state_hash(state: dict) -> str:
  """SHA-256 of the parameters, model state and optimizer state, gathered to every host."""
  from jax.experimental import multihost_utils

  digest = hashlib.sha256()
  kept = {k: state[k] for k in ("params", "model_state", "opt_state") if k in state}
  for leaf in jax.tree.leaves(kept):
    digest.update(np.asarray(multihost_utils.process_allgather(leaf, tiled=True)).tobytes())
  return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class Injected:
  """What the trainer runs instead: the step, the batches, and the summary's extra entries."""

  train_step: Callable
  batches: Any
  summary: Callable[[dict], dict]


def inject(
  debug: ml_collections.ConfigDict,
  *,
  task: Task,
  train_step: Callable,
  make_step: Callable[[Task], Callable],
  first_step: int,
  train_batches,
  start_batches: Callable[[], Iterator],
) -> Injected:
  """The trainer's step, batches and summary with the faults `debug` asks for.

  `make_step(task)` builds a train step like `train_step` for another task
  (the poisoned one); `start_batches()` opens the `(step, batch)` iterator.
  """
  if debug.inject_nonfinite_at:
    poisoned = make_step(nonfinite_gradients(task, debug.inject_nonfinite_value))
    train_step = PoisonedSteps(train_step, poisoned, debug.inject_nonfinite_at, first_step)
  batches = batches_with_faults(debug, train_batches, start_batches)

  def summary(state: dict) -> dict:
    return {"param_hash": state_hash(state)} if debug.report_param_hash else {}

  return Injected(train_step, batches, summary)
