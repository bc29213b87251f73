"""The train and eval steps: one `sharded_jit` each, shardings from the mesh and rules.

The step calls the task's loss (`Task.loss`) on the model rebuilt from the
state: in train mode with keys derived from (seed, step), in eval mode for
eval. The train step is donated (the old state's buffers are reused) and
decides inside itself whether the update is finite, so every host takes the
same decision: a non-finite loss or gradient norm keeps the old parameters,
model state and optimizer state and counts a bad step; the loop stops after
`train.max_bad_steps` in a row.

The logged `learning_rate` is the schedule at the state's count of applied
updates (`updates`), not at its step: a skipped step advances the step but
neither that count nor the optimizer's own schedule counter, so after N
skipped steps the rate logged at step s is the one the optimizer used,
`schedule(s - N)`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import optax

import spmd
from spmd.partition import NamedSpec
from trainers.step import trainable
from trainers.step.gradient_reduction import (
  flat_gradient_reduction,
  per_device_blocker,
  summed_as_one_vector,
)
from trainers.step.loss import batch_specs, loss_fn, specs_of, step_key
from trainers.step.state import StateSetup
from trainers.tasks import Task


def branch_on_nonfinite(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> bool:
  """Whether a non-finite step keeps the old state through `lax.cond` (else a select).

  A select (`jnp.where(finite, new, old)` over every leaf) makes XLA:CPU copy
  each donated optimizer moment before updating it in place, since the
  parameter update still reads the old moment; a branch needs no copies and
  also skips a bad step's update. But XLA:GPU runs a conditional by copying
  its predicate to the host and blocking the host until the stream is done,
  every step, which stops the host from queueing the next step ahead; and on
  a TPU the conditional keeps the update apart from the gradients' division
  and norm, while a select fuses with them and updates in place. So "auto"
  branches on CPU only. `train.nonfinite_guard` ("auto", "branch", "select")
  overrides.

  Example:
    >>> from types import SimpleNamespace
    >>> import numpy as np
    >>> from configs import lm_tiny
    >>> on = lambda p: SimpleNamespace(devices=np.array([SimpleNamespace(platform=p)]))
    >>> [branch_on_nonfinite(lm_tiny.get_config(), on(p)) for p in ("cpu", "tpu", "gpu")]
    [True, False, False]
  """
  mode = config.train.get("nonfinite_guard", "auto")
  if mode not in ("auto", "branch", "select"):
    raise ValueError(f"train.nonfinite_guard={mode!r} must be 'auto', 'branch' or 'select'")
  if mode == "auto":
    return mesh.devices.flat[0].platform == "cpu"
  return mode == "branch"


def check_micro_batches(
  config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, batch_axes: tuple[str, ...]
) -> None:
  """Raises `ValueError` when a micro-batch does not split over the batch axes' devices.

  Each micro-batch is laid out like the batch, rows split over the batch
  axes: the models' activation constraints and the embedding lookup need its
  rows to divide, as the global batch must.

  Example:
    >>> from configs import lm_tiny
    >>> from spmd.mesh import create_mesh
    >>> config = lm_tiny.get_config()
    >>> config.global_batch, config.train.micro_batches = 8, 2
    >>> check_micro_batches(config, create_mesh("data=8"), ("data",))
    Traceback (most recent call last):
    ...
    ValueError: train.micro_batches=2 leaves 4 rows per micro-batch, which do not split over the 8 devices of the batch axes ('data',); use fewer micro-batches or a global_batch that is a multiple of 16
  """
  micro = int(config.train.get("micro_batches", 1))
  devices = math.prod(mesh.shape[a] for a in batch_axes)
  rows = config.global_batch // micro
  if micro > 1 and rows % devices:
    raise ValueError(
      f"train.micro_batches={micro} leaves {rows} rows per micro-batch, which do not split "
      f"over the {devices} devices of the batch axes {tuple(batch_axes)}; use fewer "
      f"micro-batches or a global_batch that is a multiple of {micro * devices}"
    )


def make_train_step(
  setup: StateSetup,
  task: Task,
  config: ml_collections.ConfigDict,
  mesh: jax.sharding.Mesh,
  batch_axes: tuple[str, ...],
  flat_reduce: bool | None = None,
) -> Callable:
  """`(state, batch) -> (state, metrics)`, jitted over the mesh, state donated.

  `flat_reduce` says whether gradients are summed as one flat vector
  (`flat_gradient_reduction`); None decides it here. Batch axes the mesh
  lacks have size 1 and are left out (as `build_mesh` reads them).
  """
  batch_axes = tuple(a for a in batch_axes if a in mesh.shape)
  check_micro_batches(config, mesh, batch_axes)
  # With `config.lora`, gradients of the adapters only (`trainers.step.trainable`).
  value_and_grad = trainable.value_and_grad(loss_fn(setup, task, train=True), setup.trainable_paths)
  branch = branch_on_nonfinite(config, mesh)
  if flat_reduce is None:
    blocker = per_device_blocker(setup, task, config.global_batch)
    flat_reduce = flat_gradient_reduction(setup, config, batch_axes, blocker)
  sums_and_grads = _batch_sums_and_grads(value_and_grad, task, config.train.micro_batches)
  if flat_reduce:
    sums_and_grads = summed_as_one_vector(sums_and_grads, mesh, batch_axes)
  update_if_finite = _update_if_finite(setup.tx, branch, setup.trainable_paths)

  def train_step(state, batch):
    params, opt_state = state["params"], state["opt_state"]
    key = step_key(config.seed, state["step"])
    loss_sum, weight, sums, model_state, grads = sums_and_grads(
      params, state.get("model_state"), batch, key
    )
    count = jnp.maximum(weight, 1e-9)
    grads = jax.tree.map(lambda g: g / count, grads)
    loss = loss_sum / count
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    new_params, new_opt, new_model_state = update_if_finite(
      finite, grads, opt_state, params, model_state, state.get("model_state")
    )
    new_state = {
      "params": new_params,
      "opt_state": new_opt,
      "step": state["step"] + 1,
      "updates": state["updates"] + finite.astype(state["updates"].dtype),
      "bad_steps": jnp.where(finite, 0, state["bad_steps"] + 1).astype(jnp.int32),
    }
    if setup.has_model_state:
      new_state["model_state"] = new_model_state
    metrics = {
      "loss": loss,
      "grad_norm": grad_norm,
      # The rate this update used (or would have): the optimizer's schedule
      # counts applied updates, which a skipped step does not advance.
      "learning_rate": setup.schedule(state["updates"]),
      "finite": finite,
      "bad_steps": new_state["bad_steps"],
      "weight": weight,
      "units": sums.pop("units"),  # a sum, not a mean: taken out before the division
      **{name: value / count for name, value in sums.items()},
    }
    return new_state, metrics

  state_specs = specs_of(setup.shardings)
  batch_spec = batch_specs(task, setup.rules, mesh, batch_axes)
  return spmd.sharded_jit(
    train_step,
    in_parts=(state_specs, batch_spec),
    # Metrics come out as global, replicated arrays (every process can read
    # them), not as local copies: with every input and output global, a call
    # across processes goes straight to the compiled jax.jit, with no
    # per-step conversion of the metrics or walk over the state's leaves.
    out_parts=(state_specs, NamedSpec()),
    mesh=mesh,
    donate_argnums=0,
  )


def _batch_sums_and_grads(value_and_grad: Callable, task: Task, micro: int) -> Callable:
  """`(params, model_state, batch, key) -> (loss_sum, weight, metric_sums, model_state, grads)`.

  Sums over the whole batch, in `micro` micro-batches when it is above 1; the
  units the batch holds are one more metric sum (`units`).
  """

  def sums_and_grads(params, model_state, batch, key):
    units = task.units(batch)
    if micro == 1:
      (loss_sum, (weight, sums, model_state)), grads = value_and_grad(
        params, model_state, batch, key
      )
      return loss_sum, weight, dict(sums, units=units), model_state, grads
    loss_sum, weight, sums, model_state, grads = _accumulated(
      value_and_grad, micro, params, model_state, batch, key
    )
    return loss_sum, weight, dict(sums, units=units), model_state, grads

  return sums_and_grads


def _accumulated(value_and_grad: Callable, micro: int, params, model_state, batch, key) -> tuple:
  """Gradient accumulation: `(loss_sum, weight, metric_sums, model_state, grads)`.

  Adds up the summed-loss gradients of the micro-batches, so the result
  equals one big batch (up to addition order). Model state (batch
  statistics) passes from one micro-batch to the next.
  """
  split = jax.tree.map(lambda x: x.reshape(micro, x.shape[0] // micro, *x.shape[1:]), batch)

  def body(carry, xs):
    totals, model_state = carry
    mb, index = xs
    (loss_sum, (weight, sums, model_state)), grads = value_and_grad(
      params, model_state, mb, jax.random.fold_in(key, index)
    )
    return (jax.tree.map(jnp.add, totals, (loss_sum, weight, sums, grads)), model_state), None

  first = jax.tree.map(lambda x: x[0], split)
  shapes = jax.eval_shape(value_and_grad, params, model_state, first, key)
  (loss_shape, (weight_shape, sums_shape, _)), grads_shape = shapes
  zeros = jax.tree.map(
    lambda s: jnp.zeros(s.shape, s.dtype), (loss_shape, weight_shape, sums_shape, grads_shape)
  )
  (totals, model_state), _ = jax.lax.scan(
    body, (zeros, model_state), (split, jnp.arange(micro, dtype=jnp.uint32))
  )
  loss_sum, weight, sums, grads = totals
  return loss_sum, weight, sums, model_state, grads


def _update_if_finite(
  tx: optax.GradientTransformation, branch: bool, paths: frozenset | None = None
) -> Callable:
  """`(finite, grads, opt_state, params, new_model_state, old_model_state) -> (params, opt_state, model_state)`.

  The optimizer's update when `finite`, else the old parameters, optimizer
  state and model state: through `lax.cond` when `branch`, else a select
  over every leaf (see `branch_on_nonfinite`). Only the parameters at
  `paths` (None: all) are updated; the rest pass through as they are.
  """

  def update(operands):
    grads, opt_state, params, new_model_state, _ = operands
    train, frozen = trainable.split(params, paths)
    updates, new_opt = tx.update(grads, opt_state, train)
    return trainable.join(optax.apply_updates(train, updates), frozen), new_opt, new_model_state

  def keep(operands):
    _, opt_state, params, _, old_model_state = operands
    return params, opt_state, old_model_state

  def update_if_finite(finite, grads, opt_state, params, new_model_state, old_model_state):
    operands = (grads, opt_state, params, new_model_state, old_model_state)
    if branch:
      return jax.lax.cond(finite, update, keep, operands)
    new = update(operands)
    old = (params, opt_state, old_model_state)
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)

  return update_if_finite
