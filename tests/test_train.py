"""The trainer end to end: the real entry point, on 1, 2 and 4 processes.

One 2-process x 2-device run of 20 steps is the reference; the other runs
must match it: other process counts (losses to 1e-5), a stop and resume on
the same layout (bit-identical state), a resume on another process count,
and a SIGTERM preemption.
"""

import json
import os
import re
import signal
import sys
import threading
import time

import numpy as np
import pytest

from launch.local import run_local
from tests.data_fixtures import training_data
from tests.multiprocess import ROOT

CONFIG = str(ROOT / "tests" / "configs" / "train_tiny.py")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  return training_data(tmp_path_factory.mktemp("train_data"))


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
  command = [
    sys.executable,
    "-m",
    "trainers.main",
    *flags(data, workdir, *overrides, config=config),
  ]
  return run_local(
    command,
    num_processes=num_processes,
    devices_per_process=devices,
    timeout_s=timeout_s,
    grace_s=10,
    echo=False,
    cwd=str(ROOT),
    env={
      "PYTHONPATH": str(ROOT),
      "SPMD_AGREEMENT_TIMEOUT_S": "60",
      # One compilation cache for every run here: each layout compiles once.
      "JAX_COMPILATION_CACHE_DIR": data["cache"],
    },
  )


def losses(workdir):
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


def param_hash(result):
  line = next(li for li in result.processes[0].output.splitlines() if "param hash" in li)
  return line.split(":", 1)[1].strip()


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("reference") / "run"
  result = spmd_train(data, workdir, 2, 2)
  assert result.ok, result.report()
  return {
    "workdir": workdir,
    "losses": losses(workdir),
    "hash": param_hash(result),
    "output": result.processes[0].output,
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
def four_processes_ten_steps(data, tmp_path_factory):
  """4 processes x 1 device, stopped after 10 of the 20 steps."""
  workdir = tmp_path_factory.mktemp("four") / "run"
  result = spmd_train(data, workdir, 4, 1, "--config.train.stop_at_step=10")
  assert result.ok, result.report()
  return workdir


def test_same_losses_for_any_process_count(data, tmp_path, reference, four_processes_ten_steps):
  one = spmd_train(data, tmp_path / "run", 1, 4, "--config.train.stop_at_step=10")
  assert one.ok, one.report()
  for workdir in (tmp_path / "run", four_processes_ten_steps):
    got = losses(workdir)
    for step in range(1, 11):
      assert got[step] == pytest.approx(reference["losses"][step], rel=1e-5), (workdir, step)


def test_stop_and_resume_is_bit_identical(data, tmp_path, reference):
  workdir = tmp_path / "run"
  first = spmd_train(data, workdir, 2, 2, "--config.train.stop_at_step=10")
  assert first.ok, first.report()
  second = spmd_train(data, workdir, 2, 2)
  assert second.ok, second.report()
  assert re.search(r"state from\s+: checkpoint step 10\n", second.processes[0].output)
  assert param_hash(second) == reference["hash"]
  got = losses(workdir)
  assert [got[s] for s in range(11, 21)] == [reference["losses"][s] for s in range(11, 21)]


def test_resume_on_another_process_count(data, reference, four_processes_ten_steps):
  # Saved by 4 processes x 1 device, resumed by 1 process x 2 devices.
  resumed = spmd_train(data, four_processes_ten_steps, 1, 2)
  assert resumed.ok, resumed.report()
  got = losses(four_processes_ten_steps)
  for step in range(11, 21):
    assert got[step] == pytest.approx(reference["losses"][step], rel=1e-5), step


def test_sigterm_saves_at_an_agreed_step_and_resume_loses_nothing(data, tmp_path):
  workdir = tmp_path / "run"
  steps = ["--config.train.steps=400", "--config.checkpoint.every=1000", "--config.eval_every=0"]
  reference_dir = tmp_path / "uninterrupted"
  reference = spmd_train(data, reference_dir, 2, 2, *steps, "--config.train.stop_at_step=60")
  assert reference.ok, reference.report()

  # Send SIGTERM to process 1 once a few steps are logged.
  metrics = os.path.join(workdir, "metrics.jsonl")

  def preempt():
    deadline = time.monotonic() + 200
    while time.monotonic() < deadline:
      if os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= 3:
        for pid in _pids_with(f"--workdir={workdir}"):
          if _process_id(pid) == "1":
            os.kill(pid, signal.SIGTERM)
            return
      time.sleep(0.05)

  killer = threading.Thread(target=preempt, daemon=True)
  killer.start()
  interrupted = spmd_train(data, workdir, 2, 2, *steps, "--config.train.stop_at_step=60")
  killer.join(timeout=5)
  assert interrupted.ok, interrupted.report()  # every process exited 0
  assert "preempted at step" in interrupted.processes[0].output, interrupted.report()
  saved = max(losses(workdir))
  assert 3 <= saved < 60
  resumed = spmd_train(data, workdir, 2, 2, *steps, "--config.train.stop_at_step=60")
  assert resumed.ok, resumed.report()
  assert re.search(rf"state from\s+: checkpoint step {saved}\n", resumed.processes[0].output)
  got, want = losses(workdir), losses(reference_dir)
  assert sorted(got) == list(range(1, 61))  # no step lost, none repeated
  for step in range(1, 61):
    assert got[step] == pytest.approx(want[step], rel=1e-5), step


def _pids_with(text):
  for pid in os.listdir("/proc"):
    if pid.isdigit():
      try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
          cmdline = f.read()
      except OSError:
        continue
      if text.encode() in cmdline and b"trainers.main" in cmdline:
        yield int(pid)


def _process_id(pid):
  try:
    with open(f"/proc/{pid}/environ", "rb") as f:
      env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
  except OSError:
    return None
  cmd = open(f"/proc/{pid}/cmdline", "rb").read()
  if not cmd.startswith(sys.executable.encode()):
    return None  # the `timeout` wrapper, not python
  return env.get(b"SPMD_PROCESS_ID", b"").decode()


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
