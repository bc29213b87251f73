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
from contextlib import nullcontext
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx
from jax.flatten_util import ravel_pytree

import spmd
from spmd import rules as rules_lib
from spmd.partition import NamedSpec
from trainers.step.state import StateSetup, build_model
from trainers.step.task_metrics import check_names
from trainers.tasks import Task


def _specs(shardings: Any) -> Any:
  return jax.tree.map(lambda s: s.spec, shardings)


def step_key(seed: int, step: jax.Array) -> jax.Array:
  """The key of a train step's randomness: the same on every host and for any mesh."""
  return jax.random.fold_in(jax.random.key(seed), step)


def _loss_fn(setup: StateSetup, task: Task, train: bool) -> Callable:
  """`(params, model_state, batch, key) -> (loss_sum, (weight, metric_sums, model_state))`."""

  def loss(params, model_state, batch, key):
    model = build_model(setup, params, model_state, key)
    if train:
      model.train()
    else:
      model.eval()
    # The model's activation constraints (spmd.rules.constrain) take the
    # mesh and rules of the state; without a mesh they do nothing.
    active = rules_lib.activation_rules(setup.rules, setup.mesh) if setup.mesh else nullcontext()
    with active:
      loss_sum, weight, metric_sums = task.loss(model, batch, nnx.Rngs(key), train)
    check_names(metric_sums, task.unit)  # names the trainer writes itself (task_metrics.py)
    new_state = None
    if setup.has_model_state:
      new_state = nnx.to_pure_dict(nnx.split(model, nnx.Param, nnx.RngState, ...)[3])
    return loss_sum, (weight, metric_sums, new_state)

  return loss


def abstract_batch(task: Task, global_batch: int, sharding=None) -> dict[str, jax.ShapeDtypeStruct]:
  """The global batch's shapes and dtypes, from the task's own example function."""
  return {
    k: jax.ShapeDtypeStruct((global_batch, *shape), dtype, sharding=sharding)
    for k, (shape, dtype) in task.example_shapes().items()
  }


def per_device_blocker(setup: StateSetup, task: Task, global_batch: int) -> str | None:
  """Why the loss must not be computed per device, or None when it may be.

  Summing per-device sums equals the global sums only for a loss that is a
  sum over rows: batch statistics are computed over the whole batch, and
  random numbers drawn per device differ from those drawn for the global
  batch. So models with non-parameter variables or their own RNG streams,
  and losses that draw from the step's key, take the global path.
  """
  if setup.has_model_state:
    return "the model has non-parameter variables (e.g. batch statistics)"
  if jax.tree.leaves(setup.abstract_rng_state):
    return "the model keeps its own random streams"
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), setup.abstract["params"])
  loss = _loss_fn(setup, task, train=True)
  jaxpr = jax.make_jaxpr(lambda k, p, b: loss(p, None, b, k))(
    key, params, abstract_batch(task, global_batch)
  ).jaxpr
  key_var = jaxpr.invars[0]
  if key_var in jaxpr.outvars or any(key_var in eqn.invars for eqn in jaxpr.eqns):
    return "the loss draws random numbers (e.g. dropout)"
  return None


def flat_gradient_reduction(
  setup: StateSetup,
  config: ml_collections.ConfigDict,
  batch_axes: tuple[str, ...],
  blocker: str | None = None,
) -> bool:
  """Whether the train step sums its gradients across hosts as one flat buffer.

  XLA combines the gradient reductions into all-reduce instructions of many
  operands, and XLA:CPU runs one gloo collective per operand, each with its
  own fixed cost; a step with many gradient arrays pays that cost many times
  over. So on CPU across processes, with parameters replicated (pure data
  parallelism), each device's gradient sums are raveled into one vector and
  reduced by one `psum`, as PyTorch DDP's buckets do. Elsewhere GSPMD's
  reductions stay: on TPU and GPU XLA overlaps each layer's all-reduce with
  the backward pass. `train.flat_grad_reduce` ("auto", "on", "off") overrides.

  Each device then computes the loss over its own rows, which equals the
  global computation only for a loss that is a plain sum over rows;
  `blocker` (from `per_device_blocker`) says why it is not, and then "auto"
  stays off and "on" is an error.
  """
  mode = config.train.get("flat_grad_reduce", "auto")
  if mode not in ("auto", "on", "off"):
    raise ValueError(f"train.flat_grad_reduce={mode!r} must be 'auto', 'on' or 'off'")
  shardings = jax.tree.leaves(setup.shardings["params"])
  mesh = shardings[0].mesh
  shards = math.prod(mesh.shape[axis] for axis in batch_axes)
  possible = (
    bool(batch_axes)
    and all(s.is_fully_replicated for s in shardings)
    and config.global_batch % (shards * config.train.micro_batches) == 0
  )
  if mode == "on" and not possible:
    raise ValueError(
      "train.flat_grad_reduce='on' needs replicated parameters, batch axes, and a "
      f"global_batch={config.global_batch} divisible by {shards} batch shards x "
      f"train.micro_batches={config.train.micro_batches}"
    )
  if mode == "on" and blocker:
    raise ValueError(f"train.flat_grad_reduce='on' computes the loss per device, but {blocker}")
  if mode == "auto":
    cpu = mesh.devices.flat[0].platform == "cpu"
    return possible and cpu and jax.process_count() > 1 and not blocker
  return mode == "on"


def branch_on_nonfinite(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> bool:
  """Whether a non-finite step keeps the old state through `lax.cond` (else a select).

  A select (`jnp.where(finite, new, old)` over every leaf) makes XLA:CPU copy
  each donated optimizer moment before updating it in place, since the
  parameter update still reads the old moment; a branch needs no copies and
  also skips a bad step's update. But XLA:GPU runs a conditional by copying
  its predicate to the host and blocking the host until the stream is done,
  every step, which stops the host from queueing the next step ahead; so on
  GPU the select stays. TPUs branch on the device. `train.nonfinite_guard`
  ("auto", "branch", "select") overrides.
  """
  mode = config.train.get("nonfinite_guard", "auto")
  if mode not in ("auto", "branch", "select"):
    raise ValueError(f"train.nonfinite_guard={mode!r} must be 'auto', 'branch' or 'select'")
  if mode == "auto":
    return mesh.devices.flat[0].platform != "gpu"
  return mode == "branch"


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
  (`flat_gradient_reduction`); None decides it here.
  """
  value_and_grad = jax.value_and_grad(_loss_fn(setup, task, train=True), has_aux=True)
  branch = branch_on_nonfinite(config, mesh)
  if flat_reduce is None:
    blocker = per_device_blocker(setup, task, config.global_batch)
    flat_reduce = flat_gradient_reduction(setup, config, batch_axes, blocker)
  sums_and_grads = _batch_sums_and_grads(value_and_grad, task, config.train.micro_batches)
  if flat_reduce:
    sums_and_grads = _summed_as_one_vector(sums_and_grads, mesh, batch_axes)
  update_if_finite = _update_if_finite(setup.tx, branch)

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

  state_specs = _specs(setup.shardings)
  batch_spec = NamedSpec(batch_axes if batch_axes else None)
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


def _summed_as_one_vector(
  device_sums_and_grads: Callable, mesh: jax.sharding.Mesh, batch_axes: tuple[str, ...]
) -> Callable:
  """`device_sums_and_grads` over each device's rows, then one all-reduce of one vector.

  The flat reduction of `flat_gradient_reduction`: inside `shard_map` each
  device sums over its own rows; the sums and gradients are raveled and
  reduced by one `psum`. The model has no state here (`per_device_blocker`),
  so the one passed in comes back unchanged.
  """

  def local_sums(params, batch, key):
    loss_sum, weight, sums, _, grads = device_sums_and_grads(params, None, batch, key)
    flat, unravel = ravel_pytree((loss_sum, weight, sums, grads))
    return unravel(jax.lax.psum(flat, batch_axes))

  replicated, rows = jax.sharding.PartitionSpec(), jax.sharding.PartitionSpec(batch_axes)
  flat_sums = jax.shard_map(
    local_sums,
    mesh=mesh,
    in_specs=(replicated, rows, replicated),
    out_specs=replicated,
    axis_names=set(batch_axes),
    check_vma=False,
  )

  def sums_and_grads(params, model_state, batch, key):
    loss_sum, weight, sums, grads = flat_sums(params, batch, key)
    return loss_sum, weight, sums, model_state, grads

  return sums_and_grads


def _update_if_finite(tx: optax.GradientTransformation, branch: bool) -> Callable:
  """`(finite, grads, opt_state, params, new_model_state, old_model_state) -> (params, opt_state, model_state)`.

  The optimizer's update when `finite`, else the old parameters, optimizer
  state and model state: through `lax.cond` when `branch`, else a select
  over every leaf (see `branch_on_nonfinite`).
  """

  def update(operands):
    grads, opt_state, params, new_model_state, _ = operands
    updates, new_opt = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_opt, new_model_state

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


def eval_inputs(state: dict) -> dict:
  """The part of the train state the eval step reads: parameters and model state."""
  return {k: state[k] for k in ("params", "model_state") if k in state}


def make_eval_step(
  setup: StateSetup, task: Task, mesh: jax.sharding.Mesh, batch_axes: tuple[str, ...]
) -> Callable:
  """`(eval_inputs(state), batch) -> sums`: `loss_sum`, `weight` and the task's metric sums."""
  loss = _loss_fn(setup, task, train=False)
  seed_key = jax.random.key(0)  # eval mode draws nothing; a model's own streams need a key

  def eval_step(inputs, batch):
    loss_sum, (weight, sums, _) = loss(inputs["params"], inputs.get("model_state"), batch, seed_key)
    return {"loss_sum": loss_sum, "weight": weight, **sums}

  batch_spec = NamedSpec(batch_axes if batch_axes else None)
  # Global replicated sums, as the train step's metrics: every call takes
  # the fast path, and `jax.device_get` reads them on every process.
  return spmd.sharded_jit(
    eval_step,
    in_parts=(_specs(eval_inputs(setup.shardings)), batch_spec),
    out_parts=NamedSpec(),
    mesh=mesh,
  )
