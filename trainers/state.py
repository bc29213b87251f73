"""The train state, created directly sharded on the global mesh.

The state is a plain dict of arrays (what orbax saves and restores):
  params     the model's parameters (a nested dict, from the NNX model)
  opt_state  the optax state (adamw moments follow the parameters' shardings)
  step       int32, the number of updates applied
  bad_steps  int32, consecutive steps whose loss or gradients were not finite

Initialisation runs inside `jax.jit` with output shardings, so no host ever
holds the full state, and JAX's partitionable threefry makes the values the
same for any mesh and any number of processes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from spmd import rules as rules_lib


@dataclasses.dataclass
class StateSetup:
  """Everything about the state except its values."""

  graphdef: Any  # the NNX graph definition (structure, no arrays)
  abstract_params: Any  # nnx.State of ShapeDtypeStruct, for rebuilding the model
  abstract: Any  # the state dict as ShapeDtypeStructs
  shardings: Any  # the state dict as NamedShardings
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  init: Callable[[], Any]  # jitted: returns the sharded initial state


def learning_rate_schedule(train: ml_collections.ConfigDict) -> optax.Schedule:
  """Linear warmup to the peak, then cosine decay to a fraction of it."""
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=train.learning_rate,
    warmup_steps=train.warmup_steps,
    decay_steps=max(train.steps, train.warmup_steps + 1),
    end_value=train.learning_rate * train.end_learning_rate_fraction,
  )


def make_optimizer(
  train: ml_collections.ConfigDict,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """adamw with the schedule, after global-norm clipping (if set)."""
  schedule = learning_rate_schedule(train)
  parts = []
  if train.grad_clip_norm:
    parts.append(optax.clip_by_global_norm(train.grad_clip_norm))
  parts.append(optax.adamw(schedule, b1=train.b1, b2=train.b2, weight_decay=train.weight_decay))
  return optax.chain(*parts), schedule


def make_state(
  model_fn: Callable[[nnx.Rngs], nnx.Module],
  logical_axes_fn: Callable,
  config: ml_collections.ConfigDict,
  mesh: jax.sharding.Mesh,
) -> StateSetup:
  """Shapes, shardings and a jitted sharded initialiser for the train state."""
  tx, schedule = make_optimizer(config.train)
  rules = rules_lib.preset(config.mesh.rules)
  abstract_model = nnx.eval_shape(lambda: model_fn(nnx.Rngs(config.seed)))
  graphdef, abstract_params = nnx.split(abstract_model, nnx.Param)
  param_shapes = nnx.to_pure_dict(abstract_params)
  logical = logical_axes_fn(abstract_params)
  if isinstance(logical, nnx.State):  # same nesting as the pure-dict params
    logical = nnx.to_pure_dict(logical)
  param_shardings = rules_lib.logical_to_sharding(logical, mesh, rules, shapes=param_shapes)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def init_values():
    model = model_fn(nnx.Rngs(config.seed))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return {
      "params": params,
      "opt_state": tx.init(params),
      "step": jnp.zeros((), jnp.int32),
      "bad_steps": jnp.zeros((), jnp.int32),
    }

  abstract = jax.eval_shape(init_values)
  # Optimizer moments are shaped like the parameters and split the same way;
  # scalars (counts) are replicated.
  opt_shardings = optax.tree_map_params(
    tx,
    lambda _, sharding: sharding,
    abstract["opt_state"],
    param_shardings,
    transform_non_params=lambda _: replicated,
  )
  shardings = {
    "params": param_shardings,
    "opt_state": opt_shardings,
    "step": replicated,
    "bad_steps": replicated,
  }
  init = jax.jit(init_values, out_shardings=shardings)
  return StateSetup(graphdef, abstract_params, abstract, shardings, tx, schedule, init)


def model_from_params(setup: StateSetup, params: Any) -> nnx.Module:
  """The NNX model with these parameters (inside or outside jit)."""
  state = jax.tree.map(lambda x: x, setup.abstract_params)
  nnx.replace_by_pure_dict(state, params)
  return nnx.merge(setup.graphdef, state)
