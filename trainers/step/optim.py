"""The optimizer from the config: optax by name, a schedule, clipping and a decay mask.

  config.train.optimizer      "adamw", "adafactor", "lion" or "sgd" (with momentum)
  config.train.schedule       after a linear warmup: "cosine", "linear", "constant", "rsqrt"
  config.train.weight_decay   decoupled (adamw, lion, adafactor) or L2 (sgd), masked:
  config.train.weight_decay_exclude
                              regexes searched in each parameter's path ("blocks/0/mlp/wi");
                              the default spares norms, biases and embeddings

A task may bring its own: `Task.optimizer(train_config, schedule)` returns an
optax transformation, which replaces the named one (clipping still comes
first, and the schedule is still the one logged as `learning_rate`).

The optimizer's state is placed by `opt_state_shardings`, from its own
leaves' shapes: a moment shaped like its parameter follows the parameter;
anything else (adafactor's factored rows and columns, a task's own state)
is split over the axes its parameter uses, along its largest dimension they
divide, or replicated when nothing divides.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax

from spmd.partition import NamedSpec

OPTIMIZERS = ("adamw", "adafactor", "lion", "sgd")
SCHEDULES = ("cosine", "linear", "constant", "rsqrt")
# Norm scales and biases, any variable under a module named "*norm*", and
# embedding tables (not an output projection called "unembed").
DEFAULT_DECAY_EXCLUDE = (
  r"(^|/)bias$",
  r"(^|/)scale$",
  r"norm",
  r"(^|/)(token_|pos_|position_|word_)?(embed|embedding|embeddings)(/|$)",
)


def learning_rate_schedule(train: ml_collections.ConfigDict) -> optax.Schedule:
  """Linear warmup from 0 to `train.learning_rate`, then `train.schedule` until `train.steps`.

  The decay ends at `learning_rate * end_learning_rate_fraction` (cosine,
  linear); "rsqrt" decays as `sqrt(warmup / step)`, "constant" stays.

  Example:
    >>> train = ml_collections.ConfigDict(dict(learning_rate=1.0, warmup_steps=10,
    ...   steps=110, end_learning_rate_fraction=0.0, schedule="linear"))
    >>> [round(float(learning_rate_schedule(train)(s)), 2) for s in (0, 5, 10, 60, 110)]
    [0.0, 0.5, 1.0, 0.5, 0.0]
  """
  kind = train.get("schedule", "cosine")
  peak, warmup = train.learning_rate, train.warmup_steps
  end = peak * train.end_learning_rate_fraction
  if kind == "cosine":
    return optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=peak,
      warmup_steps=warmup,
      decay_steps=max(train.steps, warmup + 1),
      end_value=end,
    )
  decay_steps = max(train.steps - warmup, 1)
  if kind == "linear":
    decay = optax.linear_schedule(peak, end, decay_steps)
  elif kind == "constant":
    decay = optax.constant_schedule(peak)
  elif kind == "rsqrt":
    offset = max(warmup, 1)
    # join_schedules also evaluates this before the warmup ends (negative steps).
    decay = lambda step: peak * jnp.sqrt(offset / (jnp.maximum(step, 0) + offset))  # noqa: E731
  else:
    raise ValueError(f"train.schedule={kind!r} must be one of {SCHEDULES}")
  if not warmup:
    return decay
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


def decay_mask(params: Any, exclude: Sequence[str] = DEFAULT_DECAY_EXCLUDE) -> Any:
  """True for the parameters weight decay applies to: those no `exclude` regex matches.

  Paths join the parameter tree's keys with "/" ("blocks/0/attn_norm/scale").

  Example:
    >>> mask = decay_mask({"dense": {"kernel": 0, "bias": 0}, "norm": {"scale": 0},
    ...                    "token_embed": 0, "unembed": 0})
    >>> mask["dense"], mask["norm"], mask["token_embed"], mask["unembed"]
    ({'bias': False, 'kernel': True}, {'scale': False}, False, True)
  """
  patterns = [re.compile(p) for p in exclude]

  def decayed(path, _):
    name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
    return not any(p.search(name) for p in patterns)

  return jax.tree_util.tree_map_with_path(decayed, params)


def named_optimizer(
  train: ml_collections.ConfigDict, schedule: optax.Schedule
) -> optax.GradientTransformation:
  """`train.optimizer` with the schedule and the masked weight decay (no clipping).

  Example:
    >>> from configs import default
    >>> train = default.get_config().train
    >>> train.optimizer = "lion"
    >>> tx = named_optimizer(train, learning_rate_schedule(train))
    >>> params = {"w": jnp.ones((2, 2)), "bias": jnp.ones(2)}
    >>> updates, _ = tx.update(params, tx.init(params), params)
    >>> sorted(updates)
    ['bias', 'w']
  """
  name = train.get("optimizer", "adamw")
  exclude = tuple(train.get("weight_decay_exclude", DEFAULT_DECAY_EXCLUDE))
  wd = train.weight_decay
  mask = (lambda params: decay_mask(params, exclude)) if wd else None
  if name == "adamw":
    return optax.adamw(schedule, b1=train.b1, b2=train.b2, weight_decay=wd, mask=mask)
  if name == "lion":
    return optax.lion(schedule, b1=train.b1, b2=train.b2, weight_decay=wd, mask=mask)
  if name == "adafactor":
    # Factored second moments and no first moment: the memory-light choice for
    # large models (T5, PaLM). Decay is decoupled and scaled by the schedule,
    # as adamw's is (optax.adafactor's own decay is not scaled).
    parts = [optax.scale_by_factored_rms()]
    if wd:
      parts.append(optax.add_decayed_weights(wd, mask))
    parts.append(optax.scale_by_learning_rate(schedule))
    return optax.chain(*parts)
  if name == "sgd":
    parts = [optax.add_decayed_weights(wd, mask)] if wd else []
    parts.append(optax.sgd(schedule, momentum=train.momentum or None, nesterov=train.nesterov))
    return optax.chain(*parts)
  raise ValueError(f"train.optimizer={name!r} must be one of {OPTIMIZERS}")


def make_optimizer(
  train: ml_collections.ConfigDict,
  task_optimizer: Callable[[ml_collections.ConfigDict, optax.Schedule], Any] | None = None,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """(global-norm clipping then the task's or the named optimizer, the schedule).

  Example:
    >>> from configs import default
    >>> tx, schedule = make_optimizer(default.get_config().train)
    >>> float(schedule(0))
    0.0
  """
  schedule = learning_rate_schedule(train)
  tx = (task_optimizer or named_optimizer)(train, schedule)
  if not isinstance(tx, optax.GradientTransformation):
    raise TypeError(
      f"Task.optimizer returned {type(tx).__name__}, not an optax.GradientTransformation"
    )
  if train.grad_clip_norm:
    tx = optax.chain(optax.clip_by_global_norm(train.grad_clip_norm), tx)
  return tx, schedule


def _path_key(path) -> tuple[str, ...]:
  return tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def _split_largest(shape, axes: tuple[str, ...], mesh: jax.sharding.Mesh) -> NamedSpec:
  parts = math.prod(mesh.shape[a] for a in axes)
  if not axes or parts == 1:
    return NamedSpec()
  for dim in sorted(range(len(shape)), key=lambda d: (-shape[d], d)):
    if shape[dim] % parts == 0:
      return NamedSpec(*([None] * dim), axes[0] if len(axes) == 1 else axes)
  return NamedSpec()


def _spec_axes(spec) -> tuple[str, ...]:
  axes: list[str] = []
  for entry in spec:
    for axis in () if entry is None else (entry,) if isinstance(entry, str) else entry:
      if axis not in axes:
        axes.append(axis)
  return tuple(axes)


def opt_state_shardings(
  abstract_opt_state: Any,
  abstract_params: Any,
  param_shardings: Any,
  mesh: jax.sharding.Mesh,
  batch_axes: Sequence[str],
) -> Any:
  """A `NamedSharding` for each optimizer-state leaf, from its own shape.

  A leaf is matched to the parameter whose path ends its own (optax keeps
  parameter-shaped trees inside its states). Shaped like that parameter: the
  parameter's sharding. Otherwise (factored moments, a task's own state):
  split over the mesh axes its parameter uses, or over `batch_axes` when no
  parameter matches and the parameters are split at all, along the largest
  dimension they divide; scalars and the rest are replicated.

  Example:
    >>> from spmd.mesh import create_mesh
    >>> mesh = create_mesh("data=-1")
    >>> params = {"w": jax.ShapeDtypeStruct((16, 32), jnp.float32)}
    >>> shardings = {"w": jax.sharding.NamedSharding(mesh, NamedSpec("data"))}
    >>> tx = optax.adafactor(1e-3, min_dim_size_to_factor=8)
    >>> opt = jax.eval_shape(tx.init, params)
    >>> out = opt_state_shardings(opt, params, shardings, mesh, ("data",))
    >>> [s.spec for s in jax.tree.leaves(out)][:3]  # count, v_row (16,), v_col (32,)
    [P(), P('data',), P('data',)]
  """
  replicated = jax.sharding.NamedSharding(mesh, NamedSpec())
  by_path = {}
  for (path, leaf), sharding in zip(
    jax.tree_util.tree_flatten_with_path(abstract_params)[0], jax.tree.leaves(param_shardings)
  ):
    by_path[_path_key(path)] = (tuple(leaf.shape), sharding)
  any_split = any(_spec_axes(s.spec) for _, s in by_path.values())
  longest = max((len(k) for k in by_path), default=0)

  def place(path, leaf):
    shape = tuple(leaf.shape)
    if not shape:
      return replicated
    key = _path_key(path)
    for n in range(min(len(key), longest), 0, -1):
      match = by_path.get(key[-n:])
      if match is not None:
        param_shape, sharding = match
        if shape == param_shape:
          return sharding
        axes = _spec_axes(sharding.spec)
        break
    else:
      axes = tuple(a for a in batch_axes if mesh.shape.get(a, 1) > 1) if any_split else ()
    return jax.sharding.NamedSharding(mesh, _split_largest(shape, axes, mesh))

  return jax.tree_util.tree_map_with_path(place, abstract_opt_state)
