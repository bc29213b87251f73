"""The trainer end to end: the real entry point, on 1, 2 and 4 processes.

One 2-process x 2-device run of 20 steps is the reference; the other runs
must match it: 1 process x 4 devices from a fresh start to step 10 (losses to
1e-5), and a copy of the reference's step-10 checkpoint resumed to the end on
4 processes x 1 device, bit-identical (this model's step is the same to the
last bit on 2 x 2 and 4 x 1): resume exactness, a resume on another process
count and the third process count in one job. Runs that later tests read are
module fixtures, and tests change only copies of them.
Preemption, kills and other faults are in tests/faults.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.multiprocess import ROOT, run_trainer
from tests.session_settings import default_emitters
from tests.shared_runs import copy_of

pytestmark = pytest.mark.multiprocess  # every test trains as real processes

CONFIG = str(ROOT / "tests" / "configs" / "train_tiny.py")


@pytest.fixture(scope="module")
def data(training_corpus):
  return training_corpus


def flags(data, workdir, *overrides, config=CONFIG):
  source = [f"--config.data.source={data['source']}"] if config == CONFIG else []
  return [
    f"--config={config}",
    f"--workdir={workdir}",
    f"--config.data.dir={data['dir']}",
    *source,
    *overrides,
  ]


def spmd_train(data, workdir, num_processes, devices, *overrides, timeout_s=240, config=CONFIG):
  # One compilation cache for every run here: each layout compiles once.
  return run_trainer(
    flags(data, workdir, *overrides, config=config),
    num_processes=num_processes,
    devices_per_process=devices,
    cache=data["cache"],
    timeout_s=timeout_s,
  )


def losses(workdir):
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


def param_hash(result):
  line = next(li for li in result.processes[0].output.splitlines() if "param hash" in li)
  return line.split(":", 1)[1].strip()


@pytest.fixture(scope="module")
@default_emitters()  # the 4 x 1 resume below compares with it to the last bit
def reference(data, tmp_path_factory):
  """The 2 x 2 run of 20 steps, launched with the machine's own JAX platform (no
  JAX_PLATFORMS, as a user's launch without --platform), so that
  `test_a_cpu_run_prints_no_libtpu_lines` reads its processes' output."""
  workdir = tmp_path_factory.mktemp("reference") / "run"
  result = run_trainer(
    flags(data, workdir, "--config.sample_tokens=8", "--config.loss_curve=True"),
    num_processes=2,
    devices_per_process=2,
    cache=data["cache"],
    platform=None,
  )
  assert result.ok, result.report()
  return {
    "workdir": workdir,
    "losses": losses(workdir),
    "hash": param_hash(result),
    "output": result.processes[0].output,
    "outputs": [p.output for p in result.processes],
  }


def test_two_processes_train_and_the_loss_falls(reference):
  curve = reference["losses"]
  assert sorted(curve) == list(range(1, 21))
  assert np.mean([curve[s] for s in (18, 19, 20)]) < 0.7 * np.mean([curve[s] for s in (1, 2, 3)])
  out = reference["output"]
  assert "run summary" in out and "sample (greedy" in out
  for name in ("metrics.jsonl", "loss.png", "checkpoints"):
    assert os.path.exists(os.path.join(reference["workdir"], name)), name
  assert any(
    f.startswith("events.out.tfevents")
    for _, _, files in os.walk(reference["workdir"])
    for f in files
  )


@pytest.fixture(scope="module")
def one_process_ten_steps(data, tmp_path_factory):
  """1 process x 4 devices from a fresh start, stopped after 10 of the 20 steps: `spmd-train`
  run as a plain process (no launcher, no coordinator, no JAX_PLATFORMS), as a user runs it on
  one machine. Its output is `test_a_cpu_run_prints_no_libtpu_lines`' single-process run: it
  starts its backend, trains, evaluates and saves. (workdir, output)"""
  workdir = tmp_path_factory.mktemp("one") / "run"
  command = [
    sys.executable,
    "-m",
    "trainers.run.train_cli",
    *flags(data, workdir, "--config.train.stop_at_step=10"),
  ]
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  env.update(PYTHONPATH=str(ROOT), JAX_COMPILATION_CACHE_DIR=data["cache"], SPMD_CPU_DEVICES="4")
  alone = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
  assert alone.returncode == 0, alone.stdout + alone.stderr
  return workdir, alone.stdout + alone.stderr


def test_same_losses_on_one_process(reference, one_process_ten_steps):
  got = losses(one_process_ten_steps[0])
  assert sorted(got) == list(range(1, 11)), got
  for step in range(1, 11):
    assert got[step] == pytest.approx(reference["losses"][step], rel=1e-5), step


@default_emitters()  # compared to the last bit across host counts (tests/session_settings.py)
def test_stop_and_resume_on_four_processes_is_bit_identical(data, tmp_path, reference):
  # The straight 2 x 2 run as it stood at step 10 (its checkpoint there; stopping
  # at a step is checked by `one_process_ten_steps`), resumed to the end on
  # 4 processes x 1 device. A restore onto another device count (2 x 2 -> 1 x 8)
  # is tests/faults/test_checkpoint_damage.py's.
  workdir = copy_of(reference["workdir"], tmp_path / "run")
  for later in ("15", "20"):
    shutil.rmtree(workdir / "checkpoints" / later)
  second = spmd_train(data, workdir, 4, 1)
  assert second.ok, second.report()
  assert re.search(r"state from\s+: checkpoint step 10\n", second.processes[0].output)
  assert param_hash(second) == reference["hash"]
  got = losses(workdir)
  assert [got[s] for s in range(11, 21)] == [reference["losses"][s] for s in range(11, 21)]


def test_the_mlp_classifier_trains_on_two_processes(data, tmp_path):
  result = spmd_train(
    data,
    tmp_path / "run",
    2,
    2,
    "--config.train.steps=60",
    "--config.eval_every=60",
    "--config.log_every=20",
    config=str(ROOT / "configs" / "mlp.py"),
  )
  assert result.ok, result.report()
  accuracy = re.search(r"eval accuracy\s+: ([\d.]+)%", result.processes[0].output)
  assert accuracy and float(accuracy.group(1)) > 60.0, result.report()
  assert "examples/s" in result.processes[0].output


def test_a_cpu_run_prints_no_libtpu_lines(reference, one_process_ten_steps):
  """With the tpu extra installed and no TPU here, JAX must not initialise libtpu (it
  prints a block of hostname errors): single-process and launched runs alike.

  Each run starts its backend, trains and saves, which is what could print the lines.
  The launched run is the 2 x 2 reference (launched without JAX_PLATFORMS); the
  single-process one (no launcher, no coordinator, no JAX_PLATFORMS) is the 1 x 4 run
  of ten steps above."""
  for out in (one_process_ten_steps[1], *reference["outputs"]):
    assert "TPU_WORKER_HOSTNAMES" not in out and "libtpu" not in out, out
