"""The logged learning rate is the one the optimizer used, after skipped non-finite steps.

In one process, on the tiny LM config: gradients are poisoned at two steps
(tests/injection.py), which the step skips. The state's count of applied
updates (`updates`) and the optimizer's own counts stay behind the step by
the skipped steps, and the logged `learning_rate` is the schedule at that
count. A checkpoint saved without the count (as older versions wrote them)
resumes with the count set to its step.
"""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests.configs import train_tiny
from tests.faults import harness
from trainers.checkpoints.manager import make_manager
from trainers.checkpoints.saver import Saver
from trainers.reporting.metrics import read_metrics
from trainers.run.train import train_and_evaluate
from trainers.step import optim

SKIPPED = (3, 6)  # metrics steps (1-based) whose gradients are poisoned
STOP = 8


@pytest.fixture(scope="module")
def data(training_corpus):
  return training_corpus


def tiny(data, stop_at_step: int):
  config = train_tiny.get_config()
  config.data.source, config.data.dir = data["source"], data["dir"]
  config.compilation_cache_dir = data["cache"]
  config.eval_every = 0
  config.sample_tokens = 0
  config.train.stop_at_step = stop_at_step
  config.train.schedule = "linear"  # a different rate at every step
  config.checkpoint.every, config.checkpoint.keep = 4, 5
  config.hook_settings.faults.inject_nonfinite_at = tuple(s - 1 for s in SKIPPED)  # 0-based
  return config


def rates(workdir) -> dict[int, float]:
  return {
    r["step"]: r["learning_rate"] for r in read_metrics(workdir / "metrics.jsonl") if "finite" in r
  }


def optimizer_counts(opt_state) -> list[int]:
  """optax's own counters (adam's, the schedule's) in a saved optimizer state."""
  flat = jax.tree_util.tree_flatten_with_path(opt_state)[0]
  return [int(x) for p, x in flat if jax.tree_util.keystr(p).endswith("['count']")]


@pytest.fixture(scope="module")
def run(data, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("skips") / "run"
  config = tiny(data, STOP)
  train_and_evaluate(config, str(workdir))
  return config, workdir


@pytest.mark.slow
def test_the_logged_rate_is_the_schedule_at_the_applied_updates(run):
  config, workdir = run
  schedule = optim.learning_rate_schedule(config.train)
  logged = rates(workdir)
  assert sorted(logged) == list(range(1, STOP + 1)), logged
  skipped = 0
  for step in range(1, STOP + 1):  # row `step` is the update from state step `step - 1`
    used = float(schedule(step - 1 - skipped))
    assert logged[step] == pytest.approx(used, rel=1e-6, abs=1e-12), (step, logged)
    if skipped:  # the rate at the step count would be another one
      assert abs(logged[step] - float(schedule(step - 1))) > 1e-7, (step, logged)
    skipped += step in SKIPPED
  state = harness.saved_state(workdir, STOP)
  assert int(state["step"]) == STOP and int(state["updates"]) == STOP - len(SKIPPED)
  counts = optimizer_counts(state["opt_state"])
  assert counts and set(counts) == {STOP - len(SKIPPED)}, counts  # the optimizer agrees


def _without_update_count(source_workdir, workdir, step: int) -> None:
  """`workdir` with checkpoint `step` of the source rewritten without `updates`, as older runs saved."""
  state = harness.saved_state(source_workdir, step)
  del state["updates"]
  with ocp.CheckpointManager(
    source_workdir / "checkpoints",
    item_handlers={"data": ocp.JsonCheckpointHandler()},
    options=ocp.CheckpointManagerOptions(read_only=True),
  ) as source:
    data_state = source.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]
  shutil.copytree(source_workdir, workdir, ignore=shutil.ignore_patterns("checkpoints"))
  saver = Saver(make_manager(workdir / "checkpoints", every=1, keep=5))
  saver.save(step, jax.tree.map(jnp.asarray, state), dict(data_state))
  saver.close()


@pytest.mark.slow
def test_a_checkpoint_without_the_count_resumes_with_the_count_at_its_step(run, data, tmp_path):
  config, source = run
  workdir = tmp_path / "legacy"
  _without_update_count(source, workdir, STOP)
  assert "updates" not in harness.saved_state(workdir, STOP)
  config = tiny(data, STOP + 2)
  config.hook_settings.faults.inject_nonfinite_at = ()
  summary = train_and_evaluate(config, str(workdir))
  assert summary["resumed_from"] == f"checkpoint step {STOP}"
  schedule = optim.learning_rate_schedule(config.train)
  logged = rates(workdir)
  # The documented fallback: the count is the step (the skipped steps are unknown).
  for step in (STOP + 1, STOP + 2):
    assert logged[step] == pytest.approx(float(schedule(step - 1)), rel=1e-6), (step, logged)
  state = harness.saved_state(workdir, STOP + 2)
  assert int(state["updates"]) == STOP + 2 and int(state["step"]) == STOP + 2
  # Everything else is the checkpoint's: the optimizer's own counts go on from where they were.
  assert set(optimizer_counts(state["opt_state"])) == {STOP - len(SKIPPED) + 2}
  np.testing.assert_array_equal(int(state["bad_steps"]), 0)
