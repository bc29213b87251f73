"""The eval step: the task's loss in eval mode, its sums over the batch, one `sharded_jit`."""

from __future__ import annotations

from collections.abc import Callable

import jax

import spmd
from spmd.partition import NamedSpec
from trainers.step.loss import batch_specs, loss_fn, specs_of
from trainers.step.state import StateSetup
from trainers.tasks import Task


def eval_inputs(state: dict) -> dict:
  """The part of the train state the eval step reads: parameters and model state."""
  return {k: state[k] for k in ("params", "model_state") if k in state}


def make_eval_step(
  setup: StateSetup, task: Task, mesh: jax.sharding.Mesh, batch_axes: tuple[str, ...]
) -> Callable:
  """`(eval_inputs(state), batch) -> sums`: `loss_sum`, `weight` and the task's metric sums."""
  loss = loss_fn(setup, task, train=False)
  seed_key = jax.random.key(0)  # eval mode draws nothing; a model's own streams need a key

  def eval_step(inputs, batch):
    loss_sum, (weight, sums, _) = loss(inputs["params"], inputs.get("model_state"), batch, seed_key)
    return {"loss_sum": loss_sum, "weight": weight, **sums}

  batch_spec = batch_specs(task, setup.rules, mesh, batch_axes)
  if isinstance(batch_spec, dict) and "mask" not in batch_spec:
    # The mask eval batches add for padding rows, for examples without one.
    batch_spec["mask"] = NamedSpec(batch_axes if batch_axes else None)
  # Global replicated sums, as the train step's metrics: every call takes
  # the fast path, and `jax.device_get` reads them on every process.
  return spmd.sharded_jit(
    eval_step,
    in_parts=(specs_of(eval_inputs(setup.shardings)), batch_spec),
    out_parts=NamedSpec(),
    mesh=mesh,
  )
