"""The public Task API in one process on 8 CPU devices: user models, placement, config checks.

A stock, unannotated `nnx.Linear` model trains under both placement rules of
`config.mesh.unannotated` with the same losses; a Flax Linen module trains
through `flax.nnx.bridge`; `nnx.with_partitioning` names are honoured; a
misspelt key in a config file is an error naming it; `config.task` finds
factories by module or by file.
"""

from __future__ import annotations

import importlib.util
import textwrap

import flax.linen as linen
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx
from flax.nnx import bridge

from configs import lm_tiny_bytes, mlp
from spmd.layout import batch_sharding
from spmd.mesh import create_mesh
from trainers import config as config_lib
from trainers.step.state import make_state
from trainers.step.train_step import make_train_step
from trainers.tasks import Task, load_task_factory, make_task, resolve_task_spec

AXES = ("data", "fsdp")


def _loss(model, batch, rngs, train):
  logits = model(batch["inputs"])
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  return jnp.sum(ce * batch["mask"]), jnp.sum(batch["mask"]), {}


def _task(model_fn) -> Task:
  return Task(
    model=model_fn,
    loss=_loss,
    prepare_data=lambda data_dir: "unused",
    record_template={"features": np.zeros(16, np.float32), "label": 0},
    to_example=lambda r: {
      "inputs": np.asarray(r["features"], np.float32),
      "targets": np.int32(r["label"]),
      "mask": np.float32(1),
    },
  )


class StockMLP(nnx.Module):
  """Two stock layers, no sharding names anywhere."""

  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(16, 64, rngs=rngs)
    self.out = nnx.Linear(64, 8, rngs=rngs)

  def __call__(self, x):
    return self.out(jax.nn.relu(self.hidden(x)))


def _config(**mesh):
  config = mlp.get_config()
  config.global_batch = 32
  config.train.warmup_steps = 1
  for key, value in mesh.items():
    config.mesh[key] = value
  return config


def _batch(mesh):
  rng = np.random.default_rng(0)
  sharding = batch_sharding(mesh, AXES)
  x = rng.normal(size=(32, 16)).astype(np.float32)
  y = (x[:, 0] > 0).astype(np.int32) + 2 * (x[:, 1] > 0).astype(np.int32)
  return {
    "inputs": jax.device_put(x, sharding),
    "targets": jax.device_put(y, sharding),
    "mask": jax.device_put(np.ones(32, np.float32), sharding),
  }


def _train(task, config, steps=5):
  mesh = create_mesh(config.mesh.ici)
  setup = make_state(task.model, config, mesh, AXES)
  step = make_train_step(setup, task, config, mesh, AXES)
  state, batch, losses = setup.init(), _batch(mesh), []
  for _ in range(steps):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  return setup, state, losses


def test_stock_unannotated_layers_train_under_both_rules_with_the_same_losses():
  runs = {}
  for rule in ("replicate", "fsdp"):
    setup, state, losses = _train(_task(StockMLP), _config(unannotated=rule))
    runs[rule] = losses
    specs = {path: spec for path, spec, _ in setup.placement}
    if rule == "replicate":
      assert set(specs.values()) == {"P()"}, specs
    else:  # each split along its largest dimension the 8 data-parallel devices divide
      assert specs["hidden/kernel"] == "P(None, 'data')", specs
      assert specs["out/kernel"] == "P('data',)", specs
      assert specs["out/bias"] == "P('data',)", specs  # 8 outputs over 8 devices
      assert state["params"]["hidden"]["kernel"].sharding.spec == jax.sharding.PartitionSpec(
        None, "data"
      )
      # adam's moments follow their parameters
      mu = state["opt_state"][1][0].mu["hidden"]["kernel"]
      assert mu.sharding.spec == jax.sharding.PartitionSpec(None, "data")
  np.testing.assert_allclose(runs["replicate"], runs["fsdp"], rtol=1e-5)
  assert runs["fsdp"][-1] < runs["fsdp"][0]


def test_fsdp_rule_replicates_what_no_dimension_divides():
  class Odd(nnx.Module):
    def __init__(self, rngs):
      self.layer = nnx.Linear(16, 5, rngs=rngs)  # bias [5], kernel [16, 5]

    def __call__(self, x):
      return self.layer(x)

  config = _config(unannotated="fsdp")
  setup = make_state(Odd, config, create_mesh(config.mesh.ici), AXES)
  rows = {path: (spec, why) for path, spec, why in setup.placement}
  assert rows["layer/bias"][0] == "P()" and "no dimension" in rows["layer/bias"][1], rows
  assert rows["layer/kernel"][0] == "P('data',)", rows


class LinenMLP(linen.Module):
  @linen.compact
  def __call__(self, x):
    x = linen.relu(linen.Dense(32)(x))
    return linen.Dense(8)(x)


def test_a_linen_module_trains_through_the_nnx_bridge():
  def model(rngs):
    return bridge.lazy_init(bridge.ToNNX(LinenMLP(), rngs=rngs), jnp.zeros((1, 16)))

  _, state, losses = _train(_task(model), _config(), steps=12)
  assert losses[-1] < 0.85 * losses[0], losses
  assert jax.tree.leaves(state["params"]), "no parameters"


class Partitioned(nnx.Module):
  """Names as Flax documents `nnx.with_partitioning`: mesh axes or logical names."""

  def __init__(self, rngs):
    init = nnx.initializers.lecun_normal()
    self.a = nnx.Linear(
      16, 64, kernel_init=nnx.with_partitioning(init, (None, "tensor")), rngs=rngs
    )
    self.b = nnx.Linear(64, 8, kernel_init=nnx.with_partitioning(init, ("mlp", None)), rngs=rngs)

  def __call__(self, x):
    return self.b(jax.nn.relu(self.a(x)))


def test_with_partitioning_names_are_mesh_axes_or_logical_names():
  config = _config(ici="data=-1,fsdp=1,tensor=2", rules="fsdp_tp")
  setup, state, losses = _train(_task(Partitioned), config, steps=3)
  specs = {path: spec for path, spec, _ in setup.placement}
  assert specs["a/kernel"] == "P(None, 'tensor')", specs  # a mesh axis, as it is
  assert specs["b/kernel"] == "P('tensor',)", specs  # logical "mlp" -> tensor (fsdp_tp)
  assert state["params"]["a"]["kernel"].sharding.spec == jax.sharding.PartitionSpec(None, "tensor")
  assert np.isfinite(losses).all()


def test_a_misspelt_key_in_a_config_file_is_an_error_naming_it(tmp_path):
  path = tmp_path / "config.py"
  path.write_text(
    textwrap.dedent(
      """
      from configs import lm_tiny_bytes, mlp

      def get_config():
        c = mlp.get_config()
        c.train.warmup_step = 10
        return c
      """
    )
  )
  spec = importlib.util.spec_from_file_location("typo_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  loaded = module.get_config()
  with pytest.raises(
    ValueError, match=r"config\.train\.warmup_step .*'config\.train\.warmup_steps'"
  ):
    config_lib.resolve(loaded, path)


def test_config_values_and_the_task_section_are_checked_up_front():
  config = mlp.get_config()
  config.train.steps = 0
  with pytest.raises(ValueError, match=r"train\.steps=0 must be a positive integer"):
    config_lib.resolve(config)
  config = mlp.get_config()
  config.data = ml_collections.ConfigDict(dict(config.data.to_dict(), prefetch="two"))
  with pytest.raises(ValueError, match=r"config\.data\.prefetch='two' is a str"):
    config_lib.resolve(config)
  config = mlp.get_config()
  config.mesh.unannotated = "shard"
  with pytest.raises(ValueError, match="mesh.unannotated='shard'"):
    config_lib.resolve(config)
  config = mlp.get_config()
  config.model.hidden_size = (8,)  # the task's section: the task names the key
  with pytest.raises(ValueError, match=r"config\.model\.hidden_size .*'hidden_sizes'"):
    config_lib.resolve(config)


def test_the_mlp_config_has_only_its_own_model_section():
  assert "seq_len" not in mlp.get_config().model


def test_task_specs_resolve_by_name_module_and_file(tmp_path):
  assert make_task(mlp.get_config()).unit == "examples"
  (tmp_path / "helper_mod_for_test.py").write_text("SCALE = 3\n")
  (tmp_path / "my_task.py").write_text(
    "import helper_mod_for_test\n\ndef make(config):\n  return helper_mod_for_test.SCALE\n"
  )
  spec = resolve_task_spec("my_task.py:make", tmp_path)
  assert spec == f"{tmp_path / 'my_task.py'}:make"
  assert load_task_factory(spec)(None) == 3  # its sibling module imported by plain name
  with pytest.raises(FileNotFoundError, match="missing.py"):
    load_task_factory(resolve_task_spec("missing.py:make", tmp_path))
  with pytest.raises(ValueError, match="has no function 'nope'"):
    load_task_factory("trainers.tasks.lm:nope")
  config = lm_tiny_bytes.get_config()
  config.task = "trainers.tasks.lm:transformer_config"
  with pytest.raises(TypeError, match="returned TransformerConfig, not a Task"):
    make_task(config)
