"""The train state, created directly sharded on the global mesh.

The state is a plain dict of arrays (what orbax saves and restores):
  params       the model's `nnx.Param`s (a nested dict, from the NNX model)
  model_state  its other variables (`nnx.BatchStat`, user `nnx.Variable`s);
               present only for models that have some
  opt_state    the optax state (moments follow the parameters' shardings)
  step         int32, the number of steps taken (skipped ones included): the
               data position and the step's random keys follow it
  updates      int32, the number of updates applied (steps not skipped for a
               non-finite loss or gradient): the schedule's step, the one the
               optimizer's own count follows and the logged `learning_rate`
               is read at (a task's optimizer need not expose a count)
  bad_steps    int32, consecutive steps whose loss or gradients were not finite

A model's own random streams (`nnx.Rngs` kept in its modules) are not state:
the step reseeds them from the seed and the step (`build_model`), so a
resume draws the same keys.

Initialisation runs inside `jax.jit` with output shardings, so no host ever
holds the full state, and JAX's partitionable threefry makes the values the
same for any mesh and any number of processes.

Where each variable goes (`variable_shardings`): names in its `out_sharding`
metadata (our `trainers.models.param`, or `nnx.with_partitioning`) are
logical names mapped by `config.mesh.rules`, or mesh axis names used as
they are. A variable without names follows `config.mesh.unannotated`:
"replicate" (every device holds it), or "fsdp" (split over the batch axes
along its largest dimension they divide, as FSDP/ZeRO-3 does).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from spmd import rules as rules_lib
from spmd.partition import NamedSpec
from trainers.models import lora
from trainers.step import optim, trainable
from trainers.step.precision import Precision, check_precision

log = logging.getLogger(__name__)

UNANNOTATED_RULES = ("replicate", "fsdp")


@dataclasses.dataclass
class StateSetup:
  """Everything about the state except its values."""

  graphdef: Any  # the NNX graph definition (structure, no arrays)
  abstract_params: Any  # nnx.State of the parameters (abstract), for rebuilding the model
  abstract_model_state: Any  # nnx.State of the other variables (abstract; may be empty)
  abstract_rng_state: Any  # nnx.State of the model's own RNG streams (abstract; may be empty)
  abstract: Any  # the state dict as ShapeDtypeStructs
  shardings: Any  # the state dict as NamedShardings
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  init: Callable[[], Any]  # jitted: returns the sharded initial state
  placement: list[tuple[str, str, str]]  # (variable path, spec, why) for the log
  # What the steps trace under (`spmd.rules.activation_rules`), so a model's
  # activation constraints (`spmd.rules.constrain`) follow `config.mesh.rules`.
  mesh: jax.sharding.Mesh | None = None
  rules: rules_lib.Rules = ()
  # Jitted: the initial state around given weights (a warm start): the
  # optimizer initialised from them, nothing else of the model initialised.
  init_with_weights: Callable[[dict[str, Any]], Any] | None = None
  # `config.train.precision`: the dtype the step computes in (`trainers.step.precision`).
  precision: str = "float32"
  # Whether the model casts its own float32 weights to the compute dtype
  # (`casts_own_weights`, the built-in models): the policy then hands it
  # float32 parameters, so their gradients never pass through bfloat16.
  casts_own_weights: bool = False
  # `config.lora`: the adapters (`trainers.models.lora`), and the paths of the
  # parameters that train (their A and B); None: every parameter trains.
  adapters: tuple[lora.Adapter, ...] = ()
  trainable_paths: frozenset[tuple[str, ...]] | None = None
  # The model adds its adapters' products itself (`applies_lora`, the built-in
  # Llama); else the step hands it each target weight as `W + s A B`.
  applies_lora: bool = False

  @property
  def merges_adapters(self) -> bool:
    """Whether the model is built with its target weights merged (`lora.merged`)."""
    return bool(self.adapters) and not self.applies_lora

  @property
  def has_model_state(self) -> bool:
    return "model_state" in self.abstract


def _names(var: nnx.Variable) -> tuple | None:
  names = var.get_metadata("out_sharding", None)
  if names is None:
    return None
  if isinstance(names, jax.sharding.PartitionSpec):
    names = tuple(names)
  return tuple(names)


def _fsdp_spec(
  shape: tuple[int, ...], mesh: jax.sharding.Mesh, batch_axes: Sequence[str]
) -> tuple[NamedSpec, str]:
  axes = tuple(a for a in batch_axes if mesh.shape.get(a, 1) > 1)
  parts = math.prod(mesh.shape[a] for a in axes)
  if not axes:
    return NamedSpec(), "replicated (no names; the batch axes have one device)"
  for dim in sorted(range(len(shape)), key=lambda d: (-shape[d], d)):
    if shape[dim] % parts == 0:
      entry = axes[0] if len(axes) == 1 else axes
      return NamedSpec(*([None] * dim), entry), f"fsdp (no names; dimension {dim} over {axes})"
  return NamedSpec(), f"replicated (no names; no dimension of {shape} divisible by {parts})"


def variable_shardings(
  variables: Any,
  mesh: jax.sharding.Mesh,
  rules: rules_lib.Rules,
  unannotated: str = "replicate",
  batch_axes: Sequence[str] = ("data", "fsdp"),
) -> tuple[Any, list[tuple[str, str, str]]]:
  """A `NamedSharding` for every variable of an `nnx.State`, and why it got it.

  Args:
    variables: an `nnx.State` (abstract or concrete) of `nnx.Variable`s.
    mesh: the mesh.
    rules: logical names -> mesh axes (a preset of `spmd.rules`).
    unannotated: "replicate" or "fsdp", for variables without names.
    batch_axes: the mesh axes "fsdp" splits over.

  Returns:
    (a pure dict of `NamedSharding`s shaped like `nnx.to_pure_dict(variables)`,
    a list of `(path, spec, why)` rows).

  Example:
    >>> from spmd.mesh import create_mesh
    >>> model = nnx.eval_shape(lambda: nnx.Linear(16, 6, rngs=nnx.Rngs(0)))
    >>> shardings, rows = variable_shardings(
    ...   nnx.state(model), create_mesh("data=-1"), rules_lib.FSDP, unannotated="fsdp")
    >>> shardings["kernel"].spec, shardings["bias"].spec
    (P('data',), P())
    >>> rows[1]
    ('kernel', "P('data',)", "fsdp (no names; dimension 0 over ('data',))")
  """
  if unannotated not in UNANNOTATED_RULES:
    raise ValueError(f"mesh.unannotated={unannotated!r} must be one of {UNANNOTATED_RULES}")
  rows: list[tuple[str, str, str]] = []

  def place(path, var):
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    shape = tuple(var.get_value().shape)
    names = _names(var)
    if names is None:
      if unannotated == "fsdp":
        spec, why = _fsdp_spec(shape, mesh, batch_axes)
      else:
        spec, why = NamedSpec(), "replicated (no names)"
    else:
      if len(names) != len(shape):
        raise ValueError(f"{name}: sharding names {names} do not match its {shape=}")
      try:
        spec = rules_lib.annotation_to_spec(names, rules, mesh)
      except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
      why = f"names {names}"
    rules_lib.check_divisible(name, shape, spec, mesh)
    rows.append((name, str(spec), why))
    return jax.sharding.NamedSharding(mesh, spec)

  pure = nnx.to_pure_dict(variables)
  flat = jax.tree_util.tree_flatten_with_path(
    variables, is_leaf=lambda x: isinstance(x, nnx.Variable)
  )[0]
  placed = [place(path, var) for path, var in flat]
  treedef = jax.tree.structure(pure)
  return jax.tree.unflatten(treedef, placed), rows


def _rules_for_flax(rules: rules_lib.Rules, mesh: jax.sharding.Mesh) -> tuple:
  # Flax turns sharding names into shardings when a variable is created under
  # a mesh (`nnx.with_partitioning`); logical names need these rules, limited
  # to the mesh's own axes.
  out = []
  for name, axes in rules:
    kept = tuple(
      a
      for a in (() if axes is None else (axes,) if isinstance(axes, str) else axes)
      if a in mesh.axis_names
    )
    out.append((name, None if not kept else kept[0] if len(kept) == 1 else kept))
  return tuple(out)


def make_state(
  model_fn: Callable[[nnx.Rngs], nnx.Module],
  config: ml_collections.ConfigDict,
  mesh: jax.sharding.Mesh,
  batch_axes: Sequence[str] | None = None,
  task_optimizer: Callable[[ml_collections.ConfigDict, optax.Schedule], Any] | None = None,
) -> StateSetup:
  """Shapes, shardings and a jitted sharded initialiser for the train state.

  Example:
    >>> from configs import mlp
    >>> from spmd.mesh import create_mesh
    >>> from trainers.tasks import make_task
    >>> config = mlp.get_config()
    >>> setup = make_state(make_task(config).model, config, create_mesh("data=-1"))
    >>> sorted(setup.abstract), setup.has_model_state
    (['bad_steps', 'opt_state', 'params', 'step', 'updates'], False)
  """
  tx, schedule = optim.make_optimizer(config.train, task_optimizer)
  rules = rules_lib.preset(config.mesh.rules)
  unannotated = config.mesh.get("unannotated", "replicate")
  # Axes the mesh lacks have size 1 (as `build_mesh` reads them): a mesh built
  # without `expert` or `context` still takes the default batch axes.
  batch_axes = tuple(
    a for a in (config.mesh.batch_axes if batch_axes is None else batch_axes) if a in mesh.shape
  )

  def in_context(fn: Callable) -> Callable:
    # The model is built under the mesh and the rules (outside any trace, as
    # `jax.set_mesh` requires), so `nnx.with_partitioning` works as Flax documents it.
    def run(*args):
      with jax.set_mesh(mesh), nnx.logical_axis_rules(_rules_for_flax(rules, mesh)):
        return fn(*args)

    return run

  precision = check_precision(config.train.get("precision", "float32"))
  settings = lora.settings_from_config(config.get("lora"))
  adapters: tuple[lora.Adapter, ...] = ()
  paths = None
  if settings is not None:
    plain = in_context(nnx.eval_shape)(lambda: model_fn(nnx.Rngs(config.seed)))
    adapters = tuple(lora.find_adapters(plain, settings))
    lora.check_dropout(settings, plain)
    paths = lora.adapter_paths(adapters)
    base_fn = model_fn

    def model_fn(rngs):
      return lora.add_adapters(base_fn(rngs), adapters, config.seed)

  def frozen_in_compute_dtype(params):
    # Frozen weights are only read: held in the compute dtype, they cost its bytes.
    if paths is None:
      return params
    train, frozen = trainable.split(params, paths)
    return trainable.join(train, Precision(precision).cast_params(frozen))

  abstract_model = in_context(nnx.eval_shape)(lambda: model_fn(nnx.Rngs(config.seed)))
  graphdef, abstract_params, abstract_rng, abstract_rest = nnx.split(
    abstract_model, nnx.Param, nnx.RngState, ...
  )
  param_shardings, rows = variable_shardings(abstract_params, mesh, rules, unannotated, batch_axes)
  rest_shardings, rest_rows = variable_shardings(
    abstract_rest, mesh, rules, unannotated, batch_axes
  )
  has_rest = bool(jax.tree.leaves(abstract_rest))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def around(weights):
    params = frozen_in_compute_dtype(lora.with_adapters(weights["params"], adapters, config.seed))
    state = {
      "params": params,
      "opt_state": tx.init(trainable.split(params, paths)[0]),
      "step": jnp.zeros((), jnp.int32),
      "updates": jnp.zeros((), jnp.int32),
      "bad_steps": jnp.zeros((), jnp.int32),
    }
    if has_rest:
      state["model_state"] = weights["model_state"]
    return state

  def init_values():
    model = model_fn(nnx.Rngs(config.seed))
    _, params, _, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
    weights = {"params": nnx.to_pure_dict(params)}
    if has_rest:
      weights["model_state"] = nnx.to_pure_dict(rest)
    return around(weights)

  abstract = in_context(jax.eval_shape)(init_values)
  # From each leaf's own shape: moments follow their parameters, factored ones
  # and a task's own state are split too (trainers/step/optim.py).
  opt_shardings = optim.opt_state_shardings(
    abstract["opt_state"],
    trainable.split(abstract["params"], paths)[0],
    trainable.split(param_shardings, paths)[0],
    mesh,
    batch_axes,
  )
  shardings = {
    "params": param_shardings,
    "opt_state": opt_shardings,
    "step": replicated,
    "updates": replicated,
    "bad_steps": replicated,
  }
  if has_rest:
    shardings["model_state"] = rest_shardings
  jitted = jax.jit(init_values, out_shardings=shardings)
  init = in_context(jitted)
  init.lower = in_context(jitted.lower)  # for memory analysis (what each device holds)
  weight_shardings = {k: shardings[k] for k in ("params", "model_state") if k in shardings}
  # A warm start's weights are the base model's: a LoRA run's adapters start fresh.
  if paths is not None:
    weight_shardings["params"] = trainable.split(param_shardings, paths)[1]
  # The weights are donated: the state's parameters are their buffers, not copies.
  init_with_weights = in_context(
    jax.jit(around, in_shardings=(weight_shardings,), out_shardings=shardings, donate_argnums=0)
  )
  if paths is not None:
    # Or the base's weights with the adapters' own (`lora.init_from`, a peft folder).
    with_adapters = in_context(
      jax.jit(
        around,
        in_shardings=(dict(weight_shardings, params=param_shardings),),
        out_shardings=shardings,
        donate_argnums=0,
      )
    )
    base_only = init_with_weights

    def init_with_weights(weights):
      has_adapters = trainable.split(weights["params"], paths)[0]
      return (with_adapters if has_adapters else base_only)(weights)

  return StateSetup(
    graphdef=graphdef,
    abstract_params=abstract_params,
    abstract_model_state=abstract_rest,
    abstract_rng_state=abstract_rng,
    abstract=abstract,
    shardings=shardings,
    tx=tx,
    schedule=schedule,
    init=init,
    init_with_weights=init_with_weights,
    placement=rows + [(f"model_state/{p}", s, w) for p, s, w in rest_rows],
    mesh=mesh,
    rules=rules,
    precision=precision,
    casts_own_weights=bool(getattr(abstract_model, "casts_own_weights", False)),
    adapters=adapters,
    trainable_paths=paths,
    applies_lora=bool(getattr(abstract_model, "applies_lora", False)),
  )


def _rng_values(abstract_rng: Any, key: jax.Array) -> Any:
  """Fresh values for a model's own RNG streams: each key folded from `key` by its path.

  An array of keys (a stack of layers' streams) gets one key each, split
  from its path's: the same key in every layer would draw the same masks.
  """

  def fresh(path, var):
    name = jax.tree_util.keystr(path)
    if isinstance(var, nnx.RngKey):
      value = jax.random.fold_in(key, zlib.crc32(name.encode()))
      shape = var.get_value().shape
      value = jax.random.split(value, shape) if shape else value
    else:  # nnx.RngCount
      value = jnp.zeros(var.get_value().shape, var.get_value().dtype)
    return var.replace(value)

  return jax.tree_util.tree_map_with_path(
    fresh, abstract_rng, is_leaf=lambda x: isinstance(x, nnx.Variable)
  )


def build_model(
  setup: StateSetup,
  params: Any,
  model_state: Any = None,
  key: jax.Array | None = None,
  merged: bool = False,
) -> nnx.Module:
  """The NNX model with these values (inside or outside jit).

  `key` seeds the model's own RNG streams, if it has any (default: key 0).
  With adapters (`config.lora`) each target weight becomes `W + s A B`,
  unless `merged` says `params` already hold it (`lora.merged`) or the
  model applies its adapters itself (`StateSetup.applies_lora`).
  """
  if setup.merges_adapters and not merged:
    params = lora.merged(params, setup.adapters)
  states = [jax.tree.map(lambda x: x, setup.abstract_params)]
  nnx.replace_by_pure_dict(states[0], params)
  if jax.tree.leaves(setup.abstract_rng_state):
    key = jax.random.key(0) if key is None else key
    states.append(_rng_values(setup.abstract_rng_state, key))
  if model_state is not None:
    rest = jax.tree.map(lambda x: x, setup.abstract_model_state)
    nnx.replace_by_pure_dict(rest, model_state)
    states.append(rest)
  return nnx.merge(setup.graphdef, *states)


def model_from_params(setup: StateSetup, params: Any) -> nnx.Module:
  """The NNX model with these parameters and no other variables (inside or outside jit)."""
  return build_model(setup, params)
