"""The optimizer from the config: each by name trains, decay spares what the mask excludes,
adafactor's factored state is split under FSDP, and a task's own optimizer is used."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from configs import lm_tiny_bytes
from spmd.layout import batch_sharding
from spmd.mesh import create_mesh
from trainers.config import check_values
from trainers.step import optim
from trainers.step.state import make_state
from trainers.step.train_step import make_train_step
from trainers.tasks import make_task

AXES = ("data", "fsdp")


def _config(ici="data=-1,fsdp=1,tensor=1", **train):
  config = lm_tiny_bytes.get_config()
  config.mesh.ici = ici
  # One layer: the optimizers, the decay mask and the guard treat every layer
  # alike, and each extra one only adds compile time.
  config.model.num_layers = 1
  config.model.d_model, config.model.d_ff, config.model.seq_len = 32, 64, 16
  config.global_batch = 16
  config.train.warmup_steps = 2
  for key, value in train.items():
    config.train[key] = value
  return config


def _batch(mesh):
  spec = batch_sharding(mesh, AXES)
  tokens = np.random.default_rng(0).integers(0, 256, (16, 17), dtype=np.int32)
  return {
    "inputs": jax.device_put(tokens[:, :-1], spec),
    "targets": jax.device_put(tokens[:, 1:], spec),
    "mask": jax.device_put(np.ones((16, 16), np.float32), spec),
    "poison": jax.device_put(np.zeros(16, np.float32), spec),  # NaN: a poisoned step's
  }


def _nan_gradients_where_the_batch_says(task):
  """`task` whose gradients are all NaN at a step whose batch's `poison` rows are NaN.

  As `tests/injection.py`'s `nonfinite_gradients` (the loss unchanged, each
  parameter through an identity whose backward gives NaN), but the batch says
  which steps are poisoned (`poison`: 0, or NaN), so good and poisoned steps
  are one compiled program rather than two.
  """

  @jax.custom_vjp
  def poison(x, fill):
    return x

  poison.defvjp(
    lambda x, fill: (x, fill), lambda fill, g: (g + fill.astype(g.dtype), jnp.zeros_like(fill))
  )

  def loss(model, batch, rngs, train):
    batch = dict(batch)
    # 0 on a good step: the gradients unchanged. (The trainer also traces the loss on the
    # task's own abstract batch, which has no `poison`.)
    fill = jnp.sum(batch.pop("poison", jnp.zeros(())))
    nnx.update(model, jax.tree.map(lambda p: poison(p, fill), nnx.state(model, nnx.Param)))
    return task.loss(model, batch, rngs, train)

  return dataclasses.replace(task, loss=loss)


def _train(config, steps, poison_at=()):
  """`steps` steps on one batch; at the steps in `poison_at` every gradient is NaN."""
  mesh = create_mesh(config.mesh.ici)
  task = _nan_gradients_where_the_batch_says(make_task(config))
  setup = make_state(task.model, config, mesh, AXES, task.optimizer)
  step = make_train_step(setup, task, config, mesh, AXES)
  state, batch, out = setup.init(), _batch(mesh), []
  poisoned = dict(
    batch, poison=jax.device_put(np.full(16, np.nan, np.float32), batch_sharding(mesh, AXES))
  )
  for i in range(steps):
    state, metrics = step(state, poisoned if i in poison_at else batch)
    out.append(jax.device_get(metrics))
  return setup, jax.device_get(state), out


@pytest.mark.slow
@pytest.mark.parametrize(
  "name,lr", [("adamw", 1e-2), ("adafactor", 1e-2), ("lion", 1e-3), ("sgd", 0.5)]
)
def test_each_optimizer_by_name_trains_the_lm_with_accumulation(name, lr):
  config = _config(optimizer=name, learning_rate=lr, micro_batches=2)
  check_values(config)
  _, state, metrics = _train(config, 12, poison_at=(3,))
  losses = [float(m["loss"]) for m in metrics]
  # Step 3's gradients are poisoned: the guard keeps the state, and training goes on.
  assert not np.isfinite(metrics[3]["grad_norm"]) and int(metrics[3]["bad_steps"]) == 1
  assert int(state["step"]) == 12 and int(state["bad_steps"]) == 0
  assert losses[-1] < losses[0] - 0.3, (name, losses)


def test_schedules_warm_up_then_decay_as_named():
  train = ml_collections.ConfigDict(
    dict(learning_rate=1.0, warmup_steps=10, steps=110, end_learning_rate_fraction=0.1)
  )
  at = (0, 5, 10, 60, 110)
  values = {}
  for kind in optim.SCHEDULES:
    train.schedule = kind
    values[kind] = [round(float(optim.learning_rate_schedule(train)(s)), 3) for s in at]
  assert values["cosine"] == [0.0, 0.5, 1.0, 0.55, 0.1]
  assert values["linear"] == [0.0, 0.5, 1.0, 0.55, 0.1]
  assert values["constant"] == [0.0, 0.5, 1.0, 1.0, 1.0]
  assert values["rsqrt"] == [0.0, 0.5, 1.0, round((10 / 60) ** 0.5, 3), round((10 / 110) ** 0.5, 3)]
  train.schedule = "exponential"
  with pytest.raises(ValueError, match="train.schedule='exponential' must be one of"):
    optim.learning_rate_schedule(train)


@pytest.mark.slow
@pytest.mark.parametrize("name", optim.OPTIMIZERS)
def test_decay_spares_norms_biases_and_embeddings(name):
  """With zero gradients only the decay moves a parameter: excluded ones stay put."""
  config = _config(optimizer=name, weight_decay=0.5, grad_clip_norm=0.0, warmup_steps=0)
  mesh = create_mesh(config.mesh.ici)
  setup = make_state(make_task(config).model, config, mesh, AXES)
  state = jax.device_get(setup.init())
  params = state["params"]

  # One jitted update: run eagerly, each of the optimizer's ops compiles on its own.
  @jax.jit
  def decayed(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = setup.tx.update(zeros, setup.tx.init(params), params)
    return optax.apply_updates(params, updates)

  moved = jax.device_get(decayed(params))
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  changed = {
    jax.tree_util.keystr(path, simple=True, separator="/"): not np.array_equal(a, b)
    for (path, a), b in zip(flat, jax.tree.leaves(moved))
  }
  spared = {p for p in changed if "norm" in p or p.endswith("bias") or p.endswith("_embed")}
  assert spared and all(not changed[p] for p in spared), changed
  decayed = set(changed) - spared
  assert "unembed" in decayed and all(changed[p] for p in decayed), changed


def test_the_mask_is_configurable_and_checked():
  config = _config(weight_decay_exclude=("kernel", "[unclosed"))
  with pytest.raises(ValueError, match=r"train.weight_decay_exclude: '\[unclosed' is not a regex"):
    check_values(config)
  mask = optim.decay_mask({"a": {"kernel": 0, "bias": 0}}, exclude=("kernel",))
  assert mask == {"a": {"kernel": False, "bias": True}}


def test_adafactor_state_is_split_under_fsdp():
  """The factored moments are split too: per-device bytes are about 1/8 of the state."""
  config = _config("data=1,fsdp=8,tensor=1", optimizer="adafactor")
  config.model.d_model, config.model.d_ff = 128, 256  # factored: both dimensions >= 128
  mesh = create_mesh(config.mesh.ici)
  setup = make_state(make_task(config).model, config, mesh, AXES)
  factored = [
    (jax.tree_util.keystr(p), leaf.shape, sharding.spec)
    for (p, leaf), sharding in zip(
      jax.tree_util.tree_flatten_with_path(setup.abstract["opt_state"])[0],
      jax.tree.leaves(setup.shardings["opt_state"]),
    )
    if "v_row" in jax.tree_util.keystr(p) or "v_col" in jax.tree_util.keystr(p)
  ]
  big = [f for f in factored if f[1] and max(f[1]) >= 128]
  assert big and all("fsdp" in str(spec) for _, _, spec in big), big
  total = sum(
    np.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(setup.abstract["opt_state"])
  )
  compiled = setup.init.lower().compile()
  per_device = compiled.memory_analysis().output_size_in_bytes
  state_total = sum(np.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(setup.abstract))
  print(f"adafactor on fsdp=8: {per_device} of {state_total} state bytes per device")
  # Everything of any size is split 8 ways; what stays whole is scalars and small vectors.
  assert per_device < state_total / 8 * 1.25, (per_device, state_total, total)


def test_a_task_may_bring_its_own_optimizer():
  config = _config()
  task = make_task(config)
  seen = {}

  def own(train, schedule):
    seen["lr0"] = float(schedule(0))
    return optax.sgd(schedule)

  setup = make_state(task.model, config, create_mesh(config.mesh.ici), AXES, own)
  assert seen == {"lr0": 0.0}
  # Clipping first, then the task's sgd: no adam moments in the state.
  names = {
    type(s).__name__
    for s in jax.tree.leaves(setup.abstract["opt_state"], is_leaf=lambda x: hasattr(x, "_fields"))
  }
  assert "ScaleByAdamState" not in names, names
  with pytest.raises(TypeError, match="Task.optimizer returned dict"):
    optim.make_optimizer(config.train, lambda train, schedule: {})
