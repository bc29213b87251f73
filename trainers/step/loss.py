"""The task's loss as the steps call it: on the model rebuilt from the state, with the step's key.

Example:
  >>> step_key(0, 3).dtype == jax.random.key(0).dtype
  True
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import jax
from flax import nnx

from spmd import context
from spmd import rules as rules_lib
from spmd.partition import NamedSpec
from trainers.models import lora
from trainers.step.precision import Precision
from trainers.step.state import StateSetup, build_model
from trainers.step.task_metrics import check_names
from trainers.tasks import Task


def specs_of(shardings: Any) -> Any:
  """Each sharding's `PartitionSpec`, for `sharded_jit`'s parts."""
  return jax.tree.map(lambda s: s.spec, shardings)


def step_key(seed: int, step: jax.Array) -> jax.Array:
  """The key of a train step's randomness: the same on every host and for any mesh."""
  return jax.random.fold_in(jax.random.key(seed), step)


def model_weights(setup: StateSetup, policy: Precision, params: Any) -> Any:
  """The parameters the model is built with (`build_model(..., merged=True)`) under `policy`.

  A model that casts its own weights gets them in float32: its products
  return their gradients in float32 (`trainers.models.matmul`), which a
  cast here would round to bfloat16 after the sums across devices. Adapters
  (`config.lora`) are merged into their weights first, in float32, then
  cast as the weight is, unless the model adds their products itself: the
  train step, the eval step and the evals' scorer all see the same weights.
  """
  weights = lora.merged(params, setup.adapters) if setup.merges_adapters else params
  return weights if setup.casts_own_weights else policy.cast_params(weights)


def loss_fn(setup: StateSetup, task: Task, train: bool) -> Callable:
  """`(params, model_state, batch, key) -> (loss_sum, (weight, metric_sums, model_state))`."""

  policy = Precision(setup.precision, task.float32_features)

  def loss(params, model_state, batch, key):
    # The casts sit inside the differentiated function, so the gradients
    # come back in the parameters' own (float32) dtype (`step.precision`).
    model = build_model(setup, model_weights(setup, policy, params), model_state, key, merged=True)
    policy.reach_modules(model)  # stock layers compute in the policy's dtype too
    batch = policy.cast_batch(batch)
    if train:
      model.train()
    else:
      model.eval()
    # The model's activation constraints (spmd.rules.constrain) take the
    # mesh and rules of the state; without a mesh they do nothing.
    active = rules_lib.activation_rules(setup.rules, setup.mesh) if setup.mesh else nullcontext()
    batch, order = balanced(task, batch, setup)
    with active, order:
      sums = task.loss(model, batch, nnx.Rngs(key), train)
    # Added up over micro-batches and eval batches in float32, whatever the
    # task computed them in.
    loss_sum, weight, metric_sums = policy.to_float32(sums)
    check_names(metric_sums, task.unit)  # names the trainer writes itself (task_metrics.py)
    new_state = None
    if setup.has_model_state:
      new_state = nnx.to_pure_dict(nnx.split(model, nnx.Param, nnx.RngState, ...)[3])
      new_state = policy.like(new_state, model_state)  # as stored, whatever it was computed in
    return loss_sum, (weight, metric_sums, new_state)

  return loss


def balanced(task: Task, batch: dict, setup: StateSetup) -> tuple[dict, Any]:
  """`batch` with `task.sequence_features` in the load-balanced order, and the order's context.

  When the rules split the sequence over `context` devices (`spmd.context`);
  otherwise the batch as it is and a context that does nothing. The order
  is never undone: the loss sums over tokens.
  """
  shards = context.shards_of(setup.rules, setup.mesh) if setup.mesh else 1
  if shards == 1 or not task.sequence_features:
    return batch, nullcontext()
  reordered = {
    name: context.to_balanced(value, shards) if name in task.sequence_features else value
    for name, value in batch.items()
  }
  return reordered, context.order(shards)


def batch_specs(
  task: Task, rules: rules_lib.Rules, mesh: jax.sharding.Mesh, batch_axes: tuple[str, ...]
) -> NamedSpec | dict[str, NamedSpec]:
  """How the step takes its batch: rows over `batch_axes`, and with the sequence split over
  `context` (by `rules` on `mesh`) the task's `sequence_features` along it too.

  One spec for every feature (a prefix) when the sequence is whole, else a
  dict by feature: each host then places only its devices' slices of its
  rows' sequences (`jax.make_array_from_process_local_data` cuts them).

  Example:
    >>> from configs import llama_tiny
    >>> from spmd.mesh import create_mesh
    >>> from trainers.tasks import make_task
    >>> task = make_task(llama_tiny.get_config())
    >>> batch_specs(task, rules_lib.FSDP_TP, create_mesh("data=-1"), ("data",))
    P('data',)
    >>> batch_specs(task, rules_lib.FSDP_TP, create_mesh("data=2,context=4"), ("data",))["inputs"]
    P('data', 'context')
  """
  rows = NamedSpec(batch_axes if batch_axes else None)
  length = rules_lib.logical_to_spec(("length",), rules, mesh)
  if not task.sequence_features or not len(length) or length[0] is None:
    return rows
  along = NamedSpec(batch_axes if batch_axes else None, length[0])
  return {name: along if name in task.sequence_features else rows for name in task.example_shapes()}


def batch_shardings(
  task: Task, rules: rules_lib.Rules, mesh: jax.sharding.Mesh, batch_axes: tuple[str, ...]
) -> dict[str, jax.sharding.NamedSharding]:
  """`batch_specs` as a `NamedSharding` for each of the task's features."""
  specs = batch_specs(task, rules, mesh, batch_axes)
  return {
    name: jax.sharding.NamedSharding(mesh, specs[name] if isinstance(specs, dict) else specs)
    for name in task.example_shapes()
  }


def abstract_batch(task: Task, global_batch: int, sharding=None) -> dict[str, jax.ShapeDtypeStruct]:
  """The global batch's shapes and dtypes, from the task's own example function.

  `sharding`: one for every feature, or a dict by feature (`batch_shardings`).
  """
  return {
    k: jax.ShapeDtypeStruct(
      (global_batch, *shape),
      dtype,
      sharding=sharding[k] if isinstance(sharding, dict) else sharding,
    )
    for k, (shape, dtype) in task.example_shapes().items()
  }
