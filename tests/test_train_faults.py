"""Trainer behaviour under bad steps and bad set-ups, in one process and across hosts."""

import os
import sys

import numpy as np
import pytest

from launch.local import run_local
from tests.configs import train_tiny
from tests.data_fixtures import training_data
from tests.multiprocess import ROOT
from trainers.loop import NonFiniteError
from trainers.metrics import read_metrics
from trainers.train import train_and_evaluate


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  return training_data(tmp_path_factory.mktemp("fault_data"))


def tiny(data, **train):
  config = train_tiny.get_config()
  config.data.source, config.data.dir = data["source"], data["dir"]
  config.compilation_cache_dir = data["cache"]
  config.eval_every = 0
  config.sample_tokens = 0
  for key, value in train.items():
    config.train[key] = value
  return config


def test_a_nonfinite_step_is_skipped_and_leaves_the_state_unchanged(data, tmp_path):
  skipped = train_and_evaluate(
    tiny(data, inject_nonfinite_at=(5,), stop_at_step=6), str(tmp_path / "skipped")
  )
  # The same program (an injection that never fires), so results are bitwise comparable.
  clean = train_and_evaluate(
    tiny(data, inject_nonfinite_at=(999,), stop_at_step=5), str(tmp_path / "clean")
  )
  # Steps 0..4 then a skipped step 5 == steps 0..4: parameters and optimizer state.
  assert skipped["param_hash"] == clean["param_hash"]
  rows = {
    r["step"]: r for r in read_metrics(tmp_path / "skipped" / "metrics.jsonl") if "finite" in r
  }
  assert rows[6]["finite"] == 0.0 and rows[6]["bad_steps"] == 1.0
  assert rows[5]["finite"] == 1.0 and rows[5]["bad_steps"] == 0.0


def test_too_many_nonfinite_steps_in_a_row_stop_with_a_clear_error(data, tmp_path):
  config = tiny(data, inject_nonfinite_at=(2, 3, 4), max_bad_steps=3, stop_at_step=10)
  with pytest.raises(
    NonFiniteError,
    match="3 consecutive steps with a non-finite loss or gradient .*train.max_bad_steps=3",
  ):
    train_and_evaluate(config, str(tmp_path / "run"))


def test_profile_hook_writes_a_trace(data, tmp_path):
  config = tiny(data, stop_at_step=6)
  config.profile.start_step, config.profile.num_steps = 2, 2
  train_and_evaluate(config, str(tmp_path / "run"))
  traces = [f for _, _, files in os.walk(tmp_path / "run" / "profile") for f in files]
  assert any(f.endswith((".xplane.pb", ".trace.json.gz")) for f in traces), traces


def test_hosts_with_different_configs_stop_before_the_first_step(data, tmp_path):
  # Process 1 is started with a different learning rate.
  code = (
    "import os, sys\n"
    "if os.environ['SPMD_PROCESS_ID'] == '1':\n"
    "  sys.argv.append('--config.train.learning_rate=0.5')\n"
    "from trainers.main import main\n"
    "main()\n"
  )
  command = [
    sys.executable,
    "-c",
    code,
    f"--config={ROOT / 'tests/configs/train_tiny.py'}",
    f"--workdir={tmp_path / 'run'}",
    f"--config.data.dir={data['dir']}",
    f"--config.data.source={data['source']}",
  ]
  result = run_local(
    command,
    num_processes=2,
    devices_per_process=2,
    timeout_s=240,
    grace_s=10,
    echo=False,
    cwd=str(ROOT),
    env={"PYTHONPATH": str(ROOT), "JAX_COMPILATION_CACHE_DIR": data["cache"]},
  )
  assert not result.ok
  for p in result.processes:
    assert "spmd-train start: processes disagree" in p.output, result.report()
    assert "config:" in p.output
  assert (
    not os.path.exists(tmp_path / "run" / "metrics.jsonl")
    or not open(tmp_path / "run" / "metrics.jsonl").read().strip()
  )


def test_gradient_accumulation_and_bf16_compute(data, tmp_path):
  whole = train_and_evaluate(tiny(data, stop_at_step=3), str(tmp_path / "whole"))
  split = train_and_evaluate(tiny(data, stop_at_step=3, micro_batches=2), str(tmp_path / "split"))
  for (step_a, loss_a), (step_b, loss_b) in zip(whole["loss_history"], split["loss_history"]):
    assert step_a == step_b and loss_b == pytest.approx(loss_a, rel=1e-4)
  config = tiny(data, stop_at_step=5)
  config.model.dtype = "bfloat16"
  mixed = train_and_evaluate(config, str(tmp_path / "bf16"))
  losses = [loss for _, loss in mixed["loss_history"]]
  assert all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_checkpoints_keep_policy_temp_dirs_and_init_from(data, tmp_path):
  run = tmp_path / "run"
  leftover = run / "checkpoints" / "7.orbax-checkpoint-tmp-1234567"
  leftover.mkdir(parents=True)
  (leftover / "half_written").write_text("x")
  config = tiny(data, stop_at_step=12)
  config.checkpoint.every, config.checkpoint.keep, config.checkpoint.keep_period = 2, 2, 4
  summary = train_and_evaluate(config, str(run))
  assert summary["resumed_from"] == "fresh init"  # the leftover was never a checkpoint
  kept = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
  assert kept == [4, 8, 10, 12]  # the last 2, plus every 4th
  assert not leftover.exists()
  config = tiny(data, stop_at_step=2)
  config.checkpoint.init_from = str(run / "checkpoints")
  warm = train_and_evaluate(config, str(tmp_path / "warm"))
  assert warm["resumed_from"] == f"init_from {run / 'checkpoints'} step 12"
  assert warm["steps"] == 2  # optimizer, step and data start fresh
  assert warm["loss_history"][0][1] < summary["loss_history"][0][1]  # but the weights learned
