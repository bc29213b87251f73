"""Trainer options in one process: profiling, gradient accumulation and bf16, checkpoint policy.

The faults (NaN steps, damaged checkpoints, hosts that disagree) are in tests/faults.
"""

import os

import numpy as np
import pytest

from tests.configs import train_tiny
from trainers.run.train import train_and_evaluate


@pytest.fixture(scope="module")
def data(training_corpus):
  return training_corpus


def tiny(data, **train):
  config = train_tiny.get_config()
  config.data.source, config.data.dir = data["source"], data["dir"]
  config.compilation_cache_dir = data["cache"]
  config.eval_every = 0
  config.sample_tokens = 0
  for key, value in train.items():
    config.train[key] = value
  return config


@pytest.mark.slow
def test_profile_hook_writes_a_trace(data, tmp_path):
  config = tiny(data, stop_at_step=6)
  config.profile.start_step, config.profile.num_steps = 2, 2
  train_and_evaluate(config, str(tmp_path / "run"))
  traces = [f for _, _, files in os.walk(tmp_path / "run" / "profile") for f in files]
  assert any(f.endswith((".xplane.pb", ".trace.json.gz")) for f in traces), traces


@pytest.mark.slow
def test_gradient_accumulation_and_bf16_compute(data, tmp_path):
  # Each micro-batch splits over the batch axes as the batch does
  # (`check_micro_batches`): 4 rows over data=4.
  whole, split = tiny(data, stop_at_step=3), tiny(data, stop_at_step=3, micro_batches=2)
  whole.mesh.ici = split.mesh.ici = "data=4,fsdp=1,tensor=2"
  whole = train_and_evaluate(whole, str(tmp_path / "whole"))
  split = train_and_evaluate(split, str(tmp_path / "split"))
  for (step_a, loss_a), (step_b, loss_b) in zip(whole["loss_history"], split["loss_history"]):
    assert step_a == step_b and loss_b == pytest.approx(loss_a, rel=1e-4)
  config = tiny(data, stop_at_step=5)
  config.train.precision = "bfloat16"
  mixed = train_and_evaluate(config, str(tmp_path / "bf16"))
  losses = [loss for _, loss in mixed["loss_history"]]
  assert all(np.isfinite(losses)) and losses[-1] < losses[0]


@pytest.mark.slow
def test_checkpoints_keep_policy_and_init_from(data, tmp_path):
  run = tmp_path / "run"
  config = tiny(data, stop_at_step=12)
  config.checkpoint.every, config.checkpoint.keep, config.checkpoint.keep_period = 2, 2, 4
  summary = train_and_evaluate(config, str(run))
  kept = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
  assert kept == [4, 8, 10, 12]  # the last 2, plus every 4th
  config = tiny(data, stop_at_step=2)
  config.checkpoint.init_from = str(run / "checkpoints")
  warm = train_and_evaluate(config, str(tmp_path / "warm"))
  assert warm["resumed_from"] == f"init_from {run / 'checkpoints'} step 12"
  assert warm["steps"] == 2  # optimizer, step and data start fresh
  assert warm["loss_history"][0][1] < summary["loss_history"][0][1]  # but the weights learned
