"""How the train step sums its gradients across hosts: GSPMD's reductions, or one flat vector.

On CPU across processes, with replicated parameters, each device's sums are
raveled into one vector and reduced by one `psum` (`flat_gradient_reduction`);
elsewhere GSPMD's reductions stay.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import ml_collections
from jax.flatten_util import ravel_pytree

from trainers.step.loss import abstract_batch, loss_fn
from trainers.step.state import StateSetup
from trainers.tasks import Task


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
  loss = loss_fn(setup, task, train=True)
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
    # Per device over whole rows: a sequence split over `context` would not be.
    and mesh.shape.get("context", 1) == 1
    and all(s.is_fully_replicated for s in shardings)
    and config.global_batch % (shards * config.train.micro_batches) == 0
  )
  if mode == "on" and not possible:
    raise ValueError(
      "train.flat_grad_reduce='on' needs replicated parameters, batch axes, no context axis, "
      f"and a global_batch={config.global_batch} divisible by {shards} batch shards x "
      f"train.micro_batches={config.train.micro_batches}"
    )
  if mode == "on" and blocker:
    raise ValueError(f"train.flat_grad_reduce='on' computes the loss per device, but {blocker}")
  if mode == "auto":
    cpu = mesh.devices.flat[0].platform == "cpu"
    return possible and cpu and jax.process_count() > 1 and not blocker
  return mode == "on"


def summed_as_one_vector(
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
