"""`config.train.precision`: bfloat16 compute for a model that never names a dtype.

The model is stock NNX (`nnx.Linear`, `nnx.LayerNorm`) with a variable of
its own, a regression with float targets, no mask and a metric of its own:
nothing the built-in tasks look like. Under "bfloat16" its step's matmuls are bfloat16 (read off the
lowered program, as the compiler is asked; this CPU's compiler may widen
them again), while the train state, the gradients and the sums stay
float32; its losses stay within bfloat16's rounding of the float32 run's.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spmd.layout import batch_sharding
from trainers.checkpoints.saved_run import saved_config
from trainers.config import resolve
from trainers.config.defaults import get_config
from trainers.reporting.peaks import PeakInfo
from trainers.step.loss import abstract_batch
from trainers.step.mesh import build_mesh
from trainers.step.precision import Precision
from trainers.step.state import make_state
from trainers.step.train_step import make_train_step
from trainers.tasks import Task, make_task

FEATURES, HIDDEN, OUTPUTS, ROWS = 12, 24, 3, 16
PEAK = PeakInfo(1e12, "table")


class Seen(nnx.Variable):
  """The model's own state: rows seen in training, a float32 running count."""


class Regressor(nnx.Module):
  """Stock layers; no dtype is named anywhere."""

  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(FEATURES, HIDDEN, rngs=rngs)
    self.norm = nnx.LayerNorm(HIDDEN, rngs=rngs)
    self.out = nnx.Linear(HIDDEN, OUTPUTS, rngs=rngs)
    self.seen = Seen(jnp.zeros((), jnp.float32))
    self.deterministic = False  # nnx's .train() and .eval() set it

  def __call__(self, x):
    if not self.deterministic:
      self.seen[...] = self.seen[...] + x.shape[0]
    return self.out(nnx.relu(self.norm(self.hidden(x))))


def squared_error(model, batch, rngs, train):
  del rngs, train
  error = model(batch["x"]) - batch["y"]  # "y" stays float32: the difference is float32
  rows = jnp.asarray(batch["x"].shape[0], jnp.float32)
  return jnp.sum(error**2), rows, {"abs_error": jnp.sum(jnp.abs(error))}


def regression_task() -> Task:
  template = {"x": np.zeros(FEATURES, np.float32), "y": np.zeros(OUTPUTS, np.float32)}
  return Task(
    model=Regressor,
    loss=squared_error,
    prepare_data=lambda data_dir: "unused",
    record_template=template,
    to_example=dict,
    float32_features=("y",),
  )


def config_for(precision: str, micro_batches: int = 1):
  config = get_config()
  config.global_batch = ROWS
  config.mesh.ici = "data=4,fsdp=2,tensor=1"
  config.mesh.unannotated = "fsdp"
  config.train.precision = precision
  config.train.micro_batches = micro_batches
  config.train.warmup_steps = 0
  config.train.schedule = "constant"
  config.train.learning_rate = 1e-2
  return config


def batch_for(mesh, axes) -> dict:
  rng = np.random.default_rng(0)
  x = rng.standard_normal((ROWS, FEATURES)).astype(np.float32)
  y = (x[:, :OUTPUTS] * 2.0 + 0.5).astype(np.float32)
  return {k: jax.device_put(v, batch_sharding(mesh, axes)) for k, v in {"x": x, "y": y}.items()}


def built(precision: str, micro_batches: int = 1):
  task, config = regression_task(), config_for(precision, micro_batches)
  mesh, axes = build_mesh(config)
  setup = make_state(task.model, config, mesh, axes)
  step = make_train_step(setup, task, config, mesh, axes)
  return task, config, setup, step, batch_for(mesh, axes)


def run(precision: str, steps: int = 6, micro_batches: int = 1):
  _, _, setup, step, batch = built(precision, micro_batches)
  state, losses = setup.init(), []
  for _ in range(steps):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  return state, metrics, losses


def lowered_dots(step, state, batch) -> list[tuple[str, str, str]]:
  """(result, lhs, rhs) dtypes of the step's dots, as lowered (before the compiler rewrites them).

  A bfloat16 weight against a float32 input lowers as a float32 dot of a
  widened weight, so the operands are what shows what the matmul runs in.
  """
  text = step.lower(state, batch).as_text(dialect="hlo")
  types = dict(re.findall(r"^\s*(?:ROOT )?([\w.\-]+) = (\w+)\[", text, re.M))
  found = [
    (m.group(1), types[m.group(2)], types[m.group(3)])
    for m in re.finditer(r"= (\w+)\[[^\]]*\]\S* dot\(([\w.\-]+), ([\w.\-]+)\)", text)
  ]
  assert found, text[:2000]
  return found


def lowered_dot_dtypes(step, state, batch) -> set[str]:
  names = {"f32": "float32", "bf16": "bfloat16"}
  return {names.get(d, d) for dot in lowered_dots(step, state, batch) for d in dot}


@pytest.mark.parametrize(
  "precision, expected", [("float32", {"float32"}), ("bfloat16", {"bfloat16"})]
)
def test_a_stock_model_computes_in_the_precision_it_is_given(precision, expected):
  *_, setup, step, batch = built(precision)
  state = setup.init()
  assert lowered_dot_dtypes(step, state, batch) == expected
  # The state is float32 whatever the step computes in: parameters,
  # optimizer moments and the batch statistics.
  floating = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
  assert floating and {str(x.dtype) for x in floating} == {"float32"}
  new_state, metrics = step(state, batch)
  assert jax.tree.map(lambda x: x.dtype, new_state) == jax.tree.map(lambda x: x.dtype, state)
  assert float(new_state["model_state"]["seen"]) == ROWS  # its own variable, carried in float32
  assert {str(metrics[k].dtype) for k in ("loss", "grad_norm", "abs_error")} == {"float32"}


def test_bfloat16_losses_stay_within_rounding_of_float32():
  *_, f32 = run("float32")
  *_, bf16 = run("bfloat16")
  assert f32[-1] < f32[0]  # it learns
  np.testing.assert_allclose(bf16, f32, rtol=3e-2)
  assert bf16 != f32  # the casts took effect


def test_micro_batches_add_up_in_float32():
  """A loss the task sums in bfloat16 is added up in float32 across micro-batches."""
  _, one, _ = run("bfloat16", steps=1)
  _, two, _ = run("bfloat16", steps=1, micro_batches=2)
  assert str(two["loss"].dtype) == "float32"
  # BatchNorm's statistics are per micro-batch, so the losses differ a little.
  np.testing.assert_allclose(float(two["loss"]), float(one["loss"]), rtol=0.2)


def test_the_policy_casts_floating_features_but_the_kept_ones():
  policy = Precision("bfloat16", ("y", "mask"))
  batch = {
    "x": jnp.ones(2),
    "y": jnp.ones(2),
    "mask": jnp.ones(2),
    "ids": jnp.ones(2, jnp.int32),
    "half": jnp.ones(2, jnp.float16),  # another low precision is the user's choice
  }
  cast = {k: str(v.dtype) for k, v in policy.cast_batch(batch).items()}
  assert cast == {
    "x": "bfloat16",
    "y": "float32",
    "mask": "float32",
    "ids": "int32",
    "half": "float16",
  }
  assert Precision("float32").cast_batch(batch) is batch


def test_a_built_in_model_takes_its_compute_dtype_from_the_policy():
  from configs import lm_tiny_bytes

  config = lm_tiny_bytes.get_config()
  config.train.precision = "bfloat16"
  task = make_task(config)
  mesh, axes = build_mesh(config)
  setup = make_state(task.model, config, mesh, axes)
  step = make_train_step(setup, task, config, mesh, axes)
  batch = abstract_batch(task, config.global_batch, batch_sharding(mesh, axes))
  found = lowered_dots(step, setup.abstract, batch)
  bf16 = [d for d in found if d[1:] == ("bf16", "bf16")]
  # Every weight matmul, forward and backward, is bfloat16. The exceptions
  # are the gradients of the two products the model accumulates in float32
  # (attention scores, logits): JAX transposes those in the float32 of
  # their cotangents (2 per layer and 2 for the logits here).
  f32 = [d for d in found if "f32" in d[1:]]
  assert len(bf16) >= 0.85 * len(found) and len(f32) <= 2 * config.model.num_layers + 2, found
  config.model.dtype = "bfloat16"
  with pytest.raises(
    ValueError, match=r"config.model.dtype='bfloat16' is not a setting.*train.precision"
  ):
    make_task(config)


def test_an_unknown_precision_is_an_error_naming_the_setting():
  from trainers.config.checks import check_values

  config = config_for("bf16")
  with pytest.raises(
    ValueError, match=r"train.precision='bf16' must be one of \('float32', 'bfloat16'\)"
  ):
    check_values(config)


@pytest.mark.parametrize("meant", ["bfloat16", "float32"])
def test_a_config_json_from_before_the_policy_opens_as_the_precision_it_meant(tmp_path, meant):
  """A run saved before `train.precision` existed wrote `model.dtype` and no precision."""
  from configs import lm_tiny_bytes

  old = json.loads(resolve(lm_tiny_bytes.get_config()).to_json())  # as a run writes it
  del old["train"]["precision"]
  old["model"].update(dtype=meant, d_model=48, num_heads=3)
  (tmp_path / "config.json").write_text(json.dumps(old))
  config = saved_config(tmp_path)
  assert config.train.precision == meant
  assert "dtype" not in config.model
  assert make_task(config) is not None


def lowered_matmuls(step, state, batch) -> list[tuple[str, str, str]]:
  """(op, lhs, rhs dtype) of the step's dots and convolutions, as lowered."""
  text = step.lower(state, batch).as_text(dialect="hlo")
  types = dict(re.findall(r"^\s*(?:ROOT )?([\w.\-]+) = (\w+)\[", text, re.M))
  pattern = r"= \w+\[[^\]]*\]\S* (dot|convolution)\(([\w.\-]+), ([\w.\-]+)\)"
  return [(op, types[a], types[b]) for op, a, b in re.findall(pattern, text)]


def cnn_example_step(precision: str, **model):
  """examples/cnn_classifier's task, config and step, on the 8 CPU devices."""
  from pathlib import Path

  spec = importlib.util.spec_from_file_location(
    "cnn_example_config", Path(__file__).parents[1] / "examples/cnn_classifier/config.py"
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  config.global_batch, config.train.precision = 16, precision
  config.model.update(model)
  config = resolve(config, spec.origin)
  task = make_task(config)
  mesh, axes = build_mesh(config)
  setup = make_state(task.model, config, mesh, axes)
  step = make_train_step(setup, task, config, mesh, axes)
  return task, config, setup, step, mesh, axes


def test_the_cnn_example_convolves_in_bfloat16_under_the_policy():
  """A stock NNX CNN with BatchNorm that casts its own images to float32."""
  _, config, setup, step, _, _ = cnn_example_step("bfloat16")
  batch = abstract_batch(make_task(config), config.global_batch, None)
  found = lowered_matmuls(step, setup.abstract, batch)
  convolutions = [f for f in found if f[0] == "convolution"]
  # 3 convolutions forward, 3 kernel gradients, 2 input gradients; the head's dots.
  assert len(convolutions) == 8, found
  assert all(f[1:] == ("bf16", "bf16") for f in found), found


class NormedRegressor(nnx.Module):
  """Linear -> BatchNorm -> Linear: BatchNorm alone would hand the second dot float32."""

  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(FEATURES, HIDDEN, rngs=rngs)
    self.norm = nnx.BatchNorm(HIDDEN, rngs=rngs)
    self.out = nnx.Linear(HIDDEN, OUTPUTS, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.norm(self.hidden(x))))


def test_a_batch_norm_model_computes_in_bfloat16_and_keeps_its_statistics_in_float32():
  task = dataclasses.replace(regression_task(), model=NormedRegressor)
  config = config_for("bfloat16")
  mesh, axes = build_mesh(config)
  setup = make_state(task.model, config, mesh, axes)
  step = make_train_step(setup, task, config, mesh, axes)
  batch = batch_for(mesh, axes)
  assert {f[1:] for f in lowered_matmuls(step, setup.abstract, batch)} == {("bf16", "bf16")}
  state = setup.init()
  new_state, _ = step(state, batch)
  stats = jax.tree.leaves(new_state["model_state"])
  assert stats and {str(s.dtype) for s in stats} == {"float32"}
  assert not np.allclose(new_state["model_state"]["norm"]["mean"], 0.0)  # updated


@pytest.mark.slow
def test_the_cnn_examples_bfloat16_losses_stay_near_its_float32_losses():
  losses = {}
  for precision in ("float32", "bfloat16"):
    task, config, setup, step, mesh, axes = cnn_example_step(precision, features=(8, 16))
    rng = np.random.default_rng(0)
    shapes = task.example_shapes()
    batch = {
      "image": rng.uniform(0, 1, (16, *shapes["image"][0])).astype(np.float32),
      "label": rng.integers(0, config.model.num_classes, 16).astype(np.int32),
      "mask": np.ones(16, np.float32),
    }
    batch = {k: jax.device_put(v, batch_sharding(mesh, axes)) for k, v in batch.items()}
    state, losses[precision] = setup.init(), []
    for _ in range(3):
      state, metrics = step(state, batch)
      losses[precision].append(float(metrics["loss"]))
  np.testing.assert_allclose(losses["bfloat16"], losses["float32"], rtol=3e-2)
  assert losses["float32"][-1] < losses["float32"][0]  # it learns, in either


class Float32Regressor(nnx.Module):
  """A model that insists on float32: its layers name their dtype, which the policy leaves."""

  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(FEATURES, HIDDEN, dtype=jnp.float32, rngs=rngs)
    self.out = nnx.Linear(HIDDEN, OUTPUTS, dtype=jnp.float32, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x)))


def test_a_bfloat16_step_with_no_bfloat16_matmul_says_so_once_and_takes_the_float32_peak(
  caplog, monkeypatch
):
  from trainers.reporting import throughput

  monkeypatch.setattr(throughput, "_said", set())  # what this process has said before
  config = config_for("bfloat16")
  mesh, axes = build_mesh(config)
  batch = batch_for(mesh, axes)
  texts = {}
  for name, model in (("widened", Float32Regressor), ("reached", NormedRegressor)):
    task = dataclasses.replace(regression_task(), model=model)
    setup = make_state(task.model, config, mesh, axes)
    step = make_train_step(setup, task, config, mesh, axes)
    texts[name] = step.lower(setup.abstract, batch).as_text(dialect="hlo")
  with caplog.at_level("WARNING", logger=throughput.__name__):
    assert throughput.step_compute_dtype("bfloat16", texts["reached"]) == "bfloat16"
    for _ in range(2):
      assert throughput.step_compute_dtype("bfloat16", texts["widened"]) == "float32"
  said = [r.getMessage() for r in caplog.records if "bfloat16 x bfloat16" in r.getMessage()]
  assert len(said) == 1 and "float32 peak" in said[0], said
  # The run's MFU takes the peak of what the compiled step multiplies in:
  # this CPU's compiler widens every bfloat16 product, so float32 here.
  asked = []
  monkeypatch.setattr(
    throughput.peaks, "peak_flops", lambda device, dtype, cache_dir: asked.append(dtype) or PEAK
  )
  throughput.measure_throughput(step, setup, task, config, mesh, axes, "")
  assert asked == ["float32"]
