"""Eval-only runs and export, end to end, on a tiny run trained on 2 processes x 2 devices.

* `spmd-train --mode=eval` on 2 processes of 1 device: the metrics of the
  training run's own final eval on 2 x 2 (same step, same batches), and the
  training metrics file untouched (1 x 4 and 4 x 1: tests/test_evals_multiprocess.py);
* `--step` names an older step (equal to the run's eval there); a missing
  step is an error naming the directory and the committed steps;
* the whole eval split (`--eval_batches=0`) is each example exactly once;
* `spmd-export`, then a fresh process with one CPU device and no
  `jax.distributed` rebuilds the model from the file and gets the run's
  eval loss from it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multiprocess import ROOT, WORKERS, run_trainer
from tests.session_settings import default_emitters, default_pipeline_env
from tests.shared_runs import copy_of

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(600)]

CONFIG = str(ROOT / "tests" / "configs" / "train_tiny.py")
STEPS = 10  # checkpoints and evals at 5 and 10, where the run stops


@pytest.fixture(scope="module")
def data(training_corpus):
  return training_corpus


def launch(data, args: list[str], processes: int, devices: int, default_pipeline: bool = True):
  """`spmd-train ARGS` as a job (`tests.multiprocess.run_trainer`), on XLA's default pipeline
  unless `default_pipeline` is False (the suite's fast compile, far cheaper to compile).

  Compiled at XLA:CPU's optimization level 0 (the suite's fast compile), the
  whole-split eval on one process of 2 devices hangs in its all-reduce until
  XLA aborts it (tests/session_settings.py).
  """
  return run_trainer(
    args,
    num_processes=processes,
    devices_per_process=devices,
    cache=data["cache"],
    env={"XLA_FLAGS": default_pipeline_env()["XLA_FLAGS"]} if default_pipeline else None,
  )


def evals(workdir: Path) -> dict[int, dict]:
  """The training run's eval rows by step (the last one of a step: the final eval)."""
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: r for r in rows if "eval_loss" in r}


@pytest.fixture(scope="module")
@default_emitters()  # as tests/test_train.py's reference, whose 2 x 2 steps it reuses
def trained(data, tmp_path_factory):
  """train_tiny's own schedule (train.steps=20, part of the compiled step) stopped at STEPS, on
  the suite's fast compile: the 2 x 2 train and eval steps of tests/test_train.py's reference,
  so the pytest run compiles them once. The evals on one process below run on XLA's default
  pipeline (`launch`); their metrics agree with this run's to 1e-5 all the same, as the
  exported model's do."""
  workdir = tmp_path_factory.mktemp("trained") / "run"
  result = run_trainer(
    [
      f"--config={CONFIG}",
      f"--workdir={workdir}",
      f"--config.data.dir={data['dir']}",
      f"--config.data.source={data['source']}",
      f"--config.train.stop_at_step={STEPS}",
      "--config.eval_every=5",
      "--config.checkpoint.every=5",
      "--config.sample_tokens=0",
    ],
    num_processes=2,
    devices_per_process=2,
    cache=data["cache"],
  )
  assert result.ok, result.report()
  return workdir


def spmd_eval(data, workdir: Path, processes: int, devices: int, *extra: str, **launched):
  return launch(
    data, ["--mode=eval", f"--workdir={workdir}", *extra], processes, devices, **launched
  )


def written(workdir: Path, step: int) -> dict:
  return json.loads((workdir / "eval" / f"step_{step}.json").read_text())


METRICS = ("eval_loss", "eval_accuracy", "eval_weight")


def test_eval_on_two_processes_equals_the_runs_final_eval(data, trained, tmp_path):
  trained = copy_of(trained, tmp_path / "run")  # eval writes into its workdir
  training_metrics = (trained / "metrics.jsonl").read_bytes()
  final = evals(trained)[STEPS]
  # On the fast compile, as the run itself: 2 x 1 is not the layout that hangs there.
  result = spmd_eval(data, trained, 2, 1, default_pipeline=False)
  assert result.ok, result.report()
  assert f"eval of checkpoint step {STEPS}" in result.processes[0].output, result.report()
  got = written(trained, STEPS)
  assert got["processes"] == 2
  assert got["eval_batches"] == 2  # the run's config.eval_batches
  for name in METRICS:
    assert got[name] == pytest.approx(final[name], rel=1e-5), name
  assert (trained / "metrics.jsonl").read_bytes() == training_metrics


def test_a_named_step_and_a_missing_one(data, trained, tmp_path):
  trained = copy_of(trained, tmp_path / "run")
  result = spmd_eval(data, trained, 1, 2, "--step=5")
  assert result.ok, result.report()
  got = written(trained, 5)
  assert got["checkpoint"] == str(trained / "checkpoints" / "5")
  for name in METRICS:
    assert got[name] == pytest.approx(evals(trained)[5][name], rel=1e-5), name

  missing = spmd_eval(data, trained, 1, 1, "--step=7")
  assert not missing.ok
  out = missing.processes[0].output
  assert f"--step=7: {trained / 'checkpoints'} has no step 7; committed steps: [5, 10]" in out, out
  assert not (trained / "eval" / "step_7.json").exists()


def fresh_process(*args: str, timeout_s: float = 240) -> dict:
  """A plain Python process: one CPU device, nothing of a launcher in its environment."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(("SPMD_", "JAX_"))}
  env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  done = subprocess.run(
    [sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s
  )
  assert done.returncode == 0, done.stdout + done.stderr
  return done


def test_export_then_a_fresh_process_gets_the_runs_eval_loss(data, trained, tmp_path, capsys):
  """`spmd-export` in this process (numpy arrays, no mesh: nothing of it needs a process of its
  own); what must be fresh is the process that rebuilds the model from the file."""
  from trainers.checkpoints import export_cli

  trained = copy_of(trained, tmp_path / "run")
  out = tmp_path / "weights.npz"
  capsys.readouterr()
  assert export_cli.main([f"--workdir={trained}", f"--out={out}"]) == 0
  printed = capsys.readouterr().out
  assert f"step {STEPS}," in printed and str(out) in printed, printed

  # One fresh process reads the file for both counts below: the first 16
  # examples and the whole split (0), a JSON line each, in that order; the
  # limit is the two processes' it replaces.
  lines = fresh_process(
    str(WORKERS / "exported_model.py"), str(out), data["dir"], "16,0", timeout_s=480
  )
  first, every = (json.loads(line) for line in lines.stdout.strip().splitlines()[-2:])

  # The run's final eval: its first 2 batches of 8 examples, in order.
  assert first["devices"] == 1 and first["processes"] == 1, first
  assert first["logits_shape"] == [16, 16, 256], first
  assert first["loss"] == pytest.approx(evals(trained)[STEPS]["eval_loss"], rel=1e-5)

  # The whole split, each example once: eval-only on 2 devices (the last
  # batch padded) against every example counted here one by one.
  result = spmd_eval(data, trained, 1, 2, "--eval_batches=0")
  assert result.ok, result.report()
  whole = written(trained, STEPS)
  assert whole["eval_batches"] == whole["eval_batches_in_split"] > 2, whole
  assert whole["eval_weight"] == every["weight"], (whole, every)
  assert whole["eval_loss"] == pytest.approx(every["loss"], rel=1e-5)


def test_unfinished_and_damaged_steps_are_named_never_restored(trained, tmp_path):
  """In this process, as `spmd-export` reads: numpy arrays, no mesh."""
  import numpy as np

  from trainers.checkpoints import saved_run
  from trainers.checkpoints.damage import CheckpointError
  from trainers.checkpoints.export import flatten
  from trainers.checkpoints.step_folders import COMMIT_MARKER

  copy = tmp_path / "run"
  shutil.copytree(trained, copy)
  (copy / "checkpoints" / "10" / COMMIT_MARKER).unlink()
  with pytest.raises(
    CheckpointError, match=r"--step=10: .* no commit marker .* committed steps: \[5\]"
  ):
    saved_run.find_checkpoint(copy, step=10)
  assert saved_run.find_checkpoint(copy).step == 5  # the latest committed, nothing removed
  assert (copy / "checkpoints" / "10").is_dir()

  ref = saved_run.find_checkpoint(copy, str(copy / "checkpoints" / "5"))
  want = flatten(saved_run.restore_weights(ref))
  state = copy / "checkpoints" / "5" / "state"
  files = sorted(
    (p for p in state.rglob("*") if p.is_file() and p.parent.name == "d"),
    key=lambda p: -p.stat().st_size,
  )
  damaged = 0
  for path in files:  # orbax may keep files a restore never reads: those may restore exactly
    original = path.read_bytes()
    path.write_bytes(original[: len(original) // 2])
    try:
      got = flatten(saved_run.restore_weights(ref))
    except CheckpointError as e:
      assert f"checkpoint step 5 in {copy / 'checkpoints'}" in str(e) and "damaged" in str(e), e
      damaged += 1
    else:
      assert all(np.array_equal(got[k], want[k]) for k in want), f"{path}: different values"
    path.write_bytes(original)
  assert damaged >= 1, "no truncation was noticed"


def test_a_file_tasks_saved_config_imports_the_runs_own_copy(tmp_path):
  """The original folder gone, `config.json` still builds the task, from `<workdir>/code/`."""
  import importlib.util

  from trainers.checkpoints import saved_run
  from trainers.config import resolve
  from trainers.tasks import make_task, task_files

  original = tmp_path / "my_cnn"
  shutil.copytree(
    ROOT / "examples" / "cnn_classifier", original, ignore=shutil.ignore_patterns("__pycache__")
  )
  spec = importlib.util.spec_from_file_location("my_cnn_config", original / "config.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = resolve(module.get_config(), original / "config.py")
  unit = make_task(config).unit
  workdir = tmp_path / "run"  # what the run saved when it started (train.save_run_files)
  (workdir / "code").mkdir(parents=True)
  (workdir / "config.json").write_text(config.to_json_best_effort(indent=1, sort_keys=True))
  for path in task_files(config.task):
    shutil.copy(path, workdir / "code" / path.name)
  shutil.rmtree(original)

  loaded = saved_run.saved_config(workdir)
  assert loaded.task == f"{workdir / 'code' / 'task.py'}:make_task", loaded.task
  assert loaded.model.features == (16, 32, 64)  # JSON's list, back as the config's tuple
  assert {**loaded.to_dict(), "task": config.task} == config.to_dict()
  assert make_task(loaded).unit == unit
