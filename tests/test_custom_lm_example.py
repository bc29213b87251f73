"""`examples/custom_lm`, copied outside the checkout, trained on two hosts as a user would.

One short run through the real launcher and entry point, from the copy's own
folder with no PYTHONPATH and implicit transfers forbidden, checks what the
example shows: its own loss (cross-entropy plus a `z_loss` metric), its own
optimizer, its hook (the parameter norm, on every process at exactly the
steps it was scheduled for), and the run keeping a copy of its files. A
quick in-process test checks the optimizer, its mask and the z-loss sums.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tests.faults import harness
from tests.multiprocess import ROOT
from tests.session_settings import compilation_cache_dir
from trainers.step import optim

EXAMPLE = ROOT / "examples" / "custom_lm"

STEPS = 10
NORM_EVERY = 4
OVERRIDES = (
  f"--config.train.steps={STEPS}",
  "--config.train.warmup_steps=2",
  "--config.model.seq_len=64",
  "--config.model.d_model=64",
  "--config.model.d_ff=192",
  "--config.model.num_layers=2",
  f"--config.model.norm_every={NORM_EVERY}",
  "--config.log_every=1",
  "--config.eval_every=0",
  "--config.eval_batches=2",
  "--config.checkpoint.every=0",
  "--config.transfer_guard=disallow",  # the hook's fetch must be explicit
)


@pytest.fixture
def example():
  """The example's modules, imported by plain name from its folder, as config.task would."""
  names = ("config", "model", "task")
  previous = {name: sys.modules.pop(name, None) for name in names}
  sys.path.insert(0, str(EXAMPLE))
  try:
    yield tuple(importlib.import_module(name) for name in names)
  finally:
    sys.path.remove(str(EXAMPLE))
    for name, module in previous.items():
      sys.modules.pop(name, None)
      if module is not None:
        sys.modules[name] = module


@pytest.mark.slow
def test_the_task_brings_lion_with_its_own_mask_and_a_z_loss(example):
  config, model, task = example
  cfg = config.get_config()
  made = task.make_task(cfg)
  assert made.optimizer is task.lion_optimizer
  assert [h.every for h in made.hooks] == [cfg.model.norm_every]

  lm = model.DecoderLM(256, 32, 1, 2, 64, rngs=nnx.Rngs(0))
  params = nnx.to_pure_dict(nnx.state(lm, nnx.Param))
  mask = optim.decay_mask(params, task.NO_DECAY)
  assert mask["embed"]["embedding"] and mask["blocks"][0]["mlp"]["gate"]["kernel"]
  assert not mask["final_norm"]["scale"] and not mask["blocks"][0]["attn_norm"]["scale"]
  tx = made.optimizer(cfg.train, optax.constant_schedule(1e-3))
  updates, _ = tx.update(params, tx.init(params), params)
  # lion's update is a sign: every decay-free entry moves by exactly the learning rate.
  assert np.allclose(np.abs(updates["final_norm"]["scale"]), 1e-3)

  tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
  batch = {"inputs": tokens, "targets": tokens, "mask": jnp.ones((2, 8)).at[1, 4:].set(0)}
  plain, weight, _ = task.z_loss_sums(0.0)(lm, batch, None, True)
  total, _, sums = task.z_loss_sums(0.5)(lm, batch, None, True)
  log_z = jax.nn.logsumexp(lm(tokens), axis=-1)
  assert float(weight) == 12
  assert np.isclose(sums["z_loss"], 0.5 * jnp.sum(jnp.square(log_z) * batch["mask"]), rtol=1e-5)
  assert np.isclose(total, plain + sums["z_loss"], rtol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_copy_trains_with_its_loss_optimizer_and_hook(tmp_path):
  copy = tmp_path / "elsewhere" / "my_lm"
  shutil.copytree(EXAMPLE, copy, ignore=shutil.ignore_patterns("__pycache__"))
  workdir = tmp_path / "run"
  train = [
    "trainers.run.train_cli",
    f"--config={copy / 'config.py'}",
    f"--workdir={workdir}",
    f"--config.data.dir={tmp_path / 'data'}",
    *OVERRIDES,
  ]
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the copy needs none
  env["JAX_COMPILATION_CACHE_DIR"] = compilation_cache_dir()
  job = harness.launch(train, workdir, 2, 2, 0, 240, env, copy)
  assert job.wait(260) == 0, job.output
  out = job.output

  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  train_rows = {r["step"]: r for r in rows if "loss" in r}
  assert sorted(train_rows) == list(range(1, STEPS + 1)), sorted(train_rows)
  first, last = train_rows[1], train_rows[STEPS]
  assert last["loss"] < first["loss"], (first["loss"], last["loss"])
  # The task's own metric, a small positive part of the loss.
  assert all(0 < r["z_loss"] < r["loss"] for r in train_rows.values()), train_rows

  # The hook ran on both processes, at the steps `Hook(every=4)` promises, and agreed.
  want = [s for s in range(1, STEPS + 1) if s % NORM_EVERY == 0 or s == STEPS]
  logged = re.findall(r"param_norm process=(\d) step=(\d+) norm=([\d.]+)", out)
  for process in (0, 1):
    steps = [int(step) for p, step, _ in logged if int(p) == process]
    assert steps == want, (process, steps, out)
  norms = {}
  for _, step, norm in logged:
    norms.setdefault(int(step), set()).add(norm)
  assert all(len(both) == 1 for both in norms.values()), norms
  written = [json.loads(line) for line in (workdir / "param_norm.jsonl").read_text().splitlines()]
  assert [r["step"] for r in written] == want, written  # process 0 only: no duplicates

  saved = json.loads((workdir / "config.json").read_text())
  assert saved["task"].endswith("my_lm/task.py:make_task"), saved["task"]
  assert {p.name for p in (workdir / "code").iterdir()} >= {"config.py", "task.py", "model.py"}
