"""Fault injection for tests, through the trainer's public extension point.

A test config names `faults` among its hooks (`config.hooks`) and sets its
section, `config.hook_settings.faults` (`section()`); overrides then reach it
like any other key (`--config.hook_settings.faults.inject_stall='(1, 6)'`).
Nothing here ships in the package: the trainer only offers `Wrapper`s and
`Hook`s (`trainers.hooks`), which this module builds.

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
  >>> config = default.get_config()
  >>> config.hooks = (HOOK_SPEC,)
  >>> config.hook_settings.faults = section()
  >>> config.hook_settings.faults.inject_stall = (1, 6)
  >>> config.hook_settings.faults.report_param_hash = True
  >>> [type(h).__name__ for h in faults(config)]
  ['Wrapper', 'Hook']
  >>> "faults" in default.get_config().hook_settings  # the product's config has none
  False
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from trainers.hooks import Hook, StepContext, StepInfo, Wrapper
from trainers.tasks import Task

log = logging.getLogger(__name__)

HOOK_SPEC = f"{Path(__file__).resolve()}:faults"  # for `config.hooks`, from any folder
SECTION = "faults"  # config.hook_settings.faults
NONFINITE_VALUES = ("nan", "inf", "-inf")
BAD_BATCH_KINDS = ("shape", "dtype", "step")


def section() -> ml_collections.ConfigDict:
  """The `faults` section with everything off: the reference for its keys and types."""
  return ml_collections.ConfigDict(
    {
      "inject_nonfinite_at": (),
      "inject_nonfinite_value": "nan",
      "inject_stall": (),
      "inject_bad_batch": (),
      "report_param_hash": False,
    }
  )


def add_to(config: ml_collections.ConfigDict, **settings) -> ml_collections.ConfigDict:
  """`config` with the fault hooks registered and their section set (the rest off)."""
  config.hooks = (*[h for h in config.hooks if h != HOOK_SPEC], HOOK_SPEC)
  config.hook_settings[SECTION] = section()
  config.hook_settings[SECTION].update(settings)
  return config


def check(faults: ml_collections.ConfigDict) -> None:
  """Raises `ValueError` naming the first key or value of the section that cannot be injected."""
  reference = section()
  for key, value in faults.items():
    path = f"config.hook_settings.{SECTION}.{key}"
    if key not in reference:
      near = difflib.get_close_matches(key, list(reference), n=1)
      hint = f" (did you mean {near[0]!r}?)" if near else ""
      raise ValueError(f"{path} is not a setting{hint}")
    default = reference[key]
    same = isinstance(value, bool) if isinstance(default, bool) else isinstance(value, list | tuple)
    if isinstance(default, str):
      same = isinstance(value, str)
    if not same:
      raise ValueError(
        f"{path}={value!r} is a {type(value).__name__}, not a {type(default).__name__}"
      )
  faults = ml_collections.ConfigDict(dict(reference.items(), **dict(faults.items())))
  if faults.inject_nonfinite_value not in NONFINITE_VALUES:
    raise ValueError(
      f"inject_nonfinite_value={faults.inject_nonfinite_value!r} must be one of {NONFINITE_VALUES}"
    )
  if not all(isinstance(s, int) and s >= 0 for s in faults.inject_nonfinite_at):
    raise ValueError(
      f"inject_nonfinite_at={faults.inject_nonfinite_at!r} must be steps (integers >= 0)"
    )
  stall = tuple(faults.inject_stall)
  if stall and (len(stall) != 2 or not all(isinstance(x, int) for x in stall)):
    raise ValueError(f"inject_stall={stall!r} must be () or (process, step)")
  bad = tuple(faults.inject_bad_batch)
  if bad and (len(bad) != 3 or not all(isinstance(x, int) for x in bad[:2])):
    raise ValueError(f"inject_bad_batch={bad!r} must be () or (process, step, kind)")
  if bad and bad[2] not in BAD_BATCH_KINDS:
    raise ValueError(f"inject_bad_batch={bad!r}: kind {bad[2]!r} is not one of {BAD_BATCH_KINDS}")


def faults(config: ml_collections.ConfigDict) -> list[Wrapper | Hook]:
  """The `config.hooks` factory: a wrapper injecting the section's faults, and the hash hook.

  Keys the section leaves out are off (`section()`).
  """
  given = config.hook_settings.get(SECTION, ml_collections.ConfigDict())
  check(given)
  settings = section()
  settings.update(dict(given.items()))
  wrapper = Wrapper(
    host_rows=_bad_rows(settings),
    batches=_bad_stream(settings),
    train_step=_poisoned_steps(settings),
    name="faults",
  )
  hooks: list[Wrapper | Hook] = [wrapper]
  if settings.report_param_hash:
    hooks.append(Hook(lambda info: None, end=_hash_summary, name="param_hash"))
  return hooks


# Non-finite gradients.


def nonfinite_gradients(task: Task, value: str) -> Task:
  """`task` with a loss whose gradient is `value` ("nan", "inf", "-inf") for every parameter.

  The loss itself is unchanged: each parameter passes through an identity
  whose backward pass gives `value`, so the step sees a finite loss and
  non-finite gradients, summed over micro-batches and devices as they come.
  """
  if value not in NONFINITE_VALUES:
    raise ValueError(f"inject_nonfinite_value={value!r} must be one of {NONFINITE_VALUES}")
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


def _poisoned_steps(settings) -> Callable | None:
  if not settings.inject_nonfinite_at:
    return None

  def wrap(step: Callable, context: StepContext) -> Callable:
    poisoned = context.build(nonfinite_gradients(context.task, settings.inject_nonfinite_value))
    return PoisonedSteps(step, poisoned, settings.inject_nonfinite_at, context.first_step)

  return wrap


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
  log.warning("spmd-train: injected stall at step %d (inject_stall)", item[0])
  threading.Event().wait()  # alive, heartbeating, and never coming back


def _skip(item, batches):
  log.warning("spmd-train: injected skip of the batch of step %d", item[0])
  return next(batches)


# The process index is read when the run calls a wrapper, not when the factory
# runs: the config is resolved before the distributed runtime starts.


def _bad_rows(settings) -> Callable | None:
  """This process's rows with a dropped row or float inputs at one step, at the source."""
  bad = tuple(settings.inject_bad_batch)
  if not bad or bad[2] == "step":
    return None
  process, bad_step, kind = int(bad[0]), int(bad[1]), str(bad[2])

  def rows(step: int, out: dict) -> dict:
    if step != bad_step or jax.process_index() != process:
      return out
    log.warning("spmd-train: injected bad batch %s at step %d", kind, step)
    if kind == "shape":
      return {k: v[:-1] for k, v in out.items()}
    return dict(out, inputs=out["inputs"].astype(np.float32))

  return rows


def _bad_stream(settings) -> Callable | None:
  """The stream with this process's skipped batch or stall."""
  stall, bad = tuple(settings.inject_stall), tuple(settings.inject_bad_batch)
  if not stall and not (bad and bad[2] == "step"):
    return None

  def stream(batches):
    me = jax.process_index()
    skip_at = int(bad[1]) if bad and int(bad[0]) == me and bad[2] == "step" else None
    stall_at = int(stall[1]) if stall and int(stall[0]) == me else None
    if skip_at is not None:
      batches = _AtStep(batches, skip_at, _skip)
    if stall_at is not None:
      batches = _AtStep(batches, stall_at, _stall)
    return batches

  return stream


# The summary.


def state_hash(state) -> str:
  """SHA-256 of the parameters, model state and optimizer state, gathered to every host."""
  digest = hashlib.sha256()
  kept = {k: state[k] for k in ("params", "model_state", "opt_state") if k in state}
  for leaf in jax.tree.leaves(kept):
    digest.update(np.asarray(multihost_utils.process_allgather(leaf, tiled=True)).tobytes())
  return digest.hexdigest()


def _hash_summary(info: StepInfo, ok: bool) -> dict | None:
  # A collective: only after a clean end, when every host is there.
  return {"param_hash": state_hash(info.state)} if ok else None
