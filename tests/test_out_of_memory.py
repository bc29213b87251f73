"""A train step its devices cannot hold is one line from `spmd-train`, with what would make it fit.

A CPU never refuses a step for memory, so these feed the guard the chip's
own refusal (`benchmarks/tpu_runs/`: the check Llama at 12 rows on a v5e);
`tests/tpu/test_train_on_chip.py` runs the step itself into the chip's HBM.
"""

from __future__ import annotations

import json
import os

import jax
import pytest

from configs import llama_tpu_check
from spmd import errors
from tests.multiprocess import ROOT
from trainers.run.out_of_memory import step_must_fit
from trainers.step.mesh import build_mesh
from trainers.step.state import make_state
from trainers.tasks import make_task

# What libtpu said when the chip was asked to compile the check Llama's step at 12 rows.
CHIP_RUN = os.path.join(ROOT, "benchmarks", "tpu_runs", "2026-12-06", "tpu_check.json")


def _chip_refusal() -> str:
  with open(CHIP_RUN) as f:
    return json.load(f)["rows"]["12"]["device"]["refusal"]


def _check_llama_on_one_device(rows: int):
  config = llama_tpu_check.get_config()
  config.global_batch = rows
  mesh, axes = build_mesh(config, jax.devices()[:1])
  task = make_task(config)
  return config, task, make_state(task.model, config, mesh, axes, task.optimizer), mesh, axes


def test_the_chips_refusal_of_a_step_is_one_line_naming_rows_bytes_and_advice(capsys):
  config, task, setup, mesh, axes = _check_llama_on_one_device(12)

  def train():
    with step_must_fit(config, task, setup, mesh, axes):
      raise jax.errors.JaxRuntimeError(_chip_refusal())

  assert errors.run("spmd-train", train) == errors.EXIT_USER_ERROR
  [line] = capsys.readouterr().err.splitlines()
  assert line.startswith(
    "spmd-train: the step does not fit in device memory: 12 rows per device"
  ), line
  assert "need 19.14 GiB of the 15.75 GiB a device has" in line, line
  # The plan's advice for the same figures: fewer rows at once.
  assert "--config.train.micro_batches=2" in line, line


def test_other_resource_errors_pass_through_unchanged():
  config, task, setup, mesh, axes = _check_llama_on_one_device(8)
  quota = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: too many open files")
  with pytest.raises(jax.errors.JaxRuntimeError, match="too many open files"):
    with step_must_fit(config, task, setup, mesh, axes):
      raise quota
