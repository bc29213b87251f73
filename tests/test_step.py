"""The train step: its flat gradient reduction (one psum of one vector) against GSPMD's,
and its two ways of keeping the old state on a non-finite step."""

import re

import jax
import numpy as np
import pytest

from configs import lm_tiny_bytes
from spmd.layout import batch_sharding
from spmd.mesh import create_mesh
from tests import injection
from trainers.step.gradient_reduction import flat_gradient_reduction
from trainers.step.state import make_state
from trainers.step.train_step import branch_on_nonfinite, make_train_step
from trainers.tasks import make_task


def _setup(ici="data=-1,fsdp=1,tensor=1", **train):
  config = lm_tiny_bytes.get_config()
  config.mesh.ici = ici
  # One layer: the reduction and the guard treat every layer's arrays alike (one layer still
  # has over ten gradient arrays for GSPMD's reduction), and each extra one only adds compile time.
  config.model.num_layers = 1
  config.model.d_model, config.model.d_ff, config.model.seq_len = 32, 64, 16
  config.global_batch = 16
  for key, value in train.items():
    config.train[key] = value
  mesh = create_mesh(config.mesh.ici)  # data=8 on the 8 CPU test devices
  task = make_task(config)
  return config, mesh, make_state(task.model, config, mesh), task


def _batch(mesh, axes):
  spec = batch_sharding(mesh, axes)
  tokens = np.random.default_rng(0).integers(0, 256, (16, 17), dtype=np.int32)
  return {
    "inputs": jax.device_put(tokens[:, :-1], spec),
    "targets": jax.device_put(tokens[:, 1:], spec),
    "mask": jax.device_put(np.ones((16, 16), np.float32), spec),
  }


def _all_reduce_operands(step, state, batch) -> list[int]:
  text = step.lower(state, batch).compile().as_text()
  lines = [line for line in text.splitlines() if re.search(r" all-reduce(-start)?\(", line)]
  return [line.split(" all-reduce")[0].count("[") for line in lines]


@pytest.mark.slow
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_flat_reduction_trains_like_gspmd(micro_batches):
  runs = {}
  for mode in ("on", "off"):
    config, mesh, setup, task = _setup(flat_grad_reduce=mode, micro_batches=micro_batches)
    axes = ("data", "fsdp")
    batch = _batch(mesh, axes)
    step = make_train_step(setup, task, config, mesh, axes)
    state = setup.init()
    runs[mode] = {"operands": _all_reduce_operands(step, state, batch)}
    for _ in range(3):
      state, metrics = step(state, batch)
    runs[mode].update(state=jax.device_get(state), metrics=jax.device_get(metrics))
  # One all-reduce of one flat vector instead of one operand per gradient array.
  assert runs["on"]["operands"] == [1], runs["on"]["operands"]
  assert sum(runs["off"]["operands"]) > 10, runs["off"]["operands"]
  for a, b in zip(jax.tree.leaves(runs["on"]["state"]), jax.tree.leaves(runs["off"]["state"])):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)
  for key in ("loss", "grad_norm", "weight", "units", "accuracy"):
    np.testing.assert_allclose(runs["on"]["metrics"][key], runs["off"]["metrics"][key], rtol=1e-5)


def test_auto_is_off_in_one_process_and_on_needs_replicated_parameters():
  config, _, setup, _ = _setup()
  assert not flat_gradient_reduction(setup, config, ("data", "fsdp"))  # auto, one process
  config.train.flat_grad_reduce = "sideways"
  with pytest.raises(ValueError, match="flat_grad_reduce='sideways' must be"):
    flat_gradient_reduction(setup, config, ("data", "fsdp"))
  config, _, sharded, _ = _setup("data=2,fsdp=4,tensor=1", flat_grad_reduce="on")
  with pytest.raises(ValueError, match="needs replicated parameters"):
    flat_gradient_reduction(sharded, config, ("data", "fsdp"))


@pytest.mark.slow
def test_branch_and_select_keep_the_old_state_on_a_nonfinite_step_and_agree_otherwise():
  runs = {}
  for guard in ("branch", "select"):
    config, mesh, setup, task = _setup(nonfinite_guard=guard)
    axes = ("data", "fsdp")
    batch = _batch(mesh, axes)
    step = make_train_step(setup, task, config, mesh, axes)
    poisoned = make_train_step(
      setup, injection.nonfinite_gradients(task, "nan"), config, mesh, axes
    )
    state = setup.init()
    text = step.lower(state, batch).compile().as_text()
    # The select copies every donated parameter and optimizer moment first.
    entry = text[text.index("ENTRY") :]
    copies = len(re.findall(r"= f32\[[\d,]+\]\S* copy\(", entry))
    runs[guard] = {"conditional": " conditional(" in text, "copies": copies, "states": []}
    run = injection.PoisonedSteps(step, poisoned, at=(1,))
    for _ in range(3):  # step 0 good, step 1 poisoned, step 2 good
      state, _ = run(state, batch)
      runs[guard]["states"].append(jax.device_get(state))
  assert runs["branch"]["conditional"] and not runs["select"]["conditional"]
  assert runs["branch"]["copies"] == 0 < runs["select"]["copies"], runs
  for guard, run in runs.items():
    after_good, after_bad, _ = run["states"]
    for a, b in zip(jax.tree.leaves(after_good["params"]), jax.tree.leaves(after_bad["params"])):
      np.testing.assert_array_equal(a, b, err_msg=guard)
    for a, b in zip(
      jax.tree.leaves(after_good["opt_state"]), jax.tree.leaves(after_bad["opt_state"])
    ):
      np.testing.assert_array_equal(a, b, err_msg=guard)
    assert (after_bad["step"], after_bad["bad_steps"]) == (2, 1), guard
  last = [run["states"][-1] for run in runs.values()]
  for a, b in zip(jax.tree.leaves(last[0]), jax.tree.leaves(last[1])):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_the_guard_branches_except_on_gpu_unless_told():
  config, mesh, _, _ = _setup()
  assert branch_on_nonfinite(config, mesh)  # auto, CPU
  config.train.nonfinite_guard = "select"
  assert not branch_on_nonfinite(config, mesh)
  config.train.nonfinite_guard = "maybe"
  with pytest.raises(ValueError, match="nonfinite_guard='maybe' must be"):
    branch_on_nonfinite(config, mesh)
