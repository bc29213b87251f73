"""A job on a Cloud TPU VM starts without a metadata server, or stops with one line.

The commands run as real processes on this CPU with the variables of a
one-chip v5e machine (`ONE_HOST`, as the issue lists them) and
`JAX_FORCE_TPU_INIT=1`, so that JAX's own detection takes the machine for a
TPU VM exactly as on the chip; `GCE_METADATA_IP` points at a closed port,
so any query of the metadata server fails at once with the
`requests.ConnectionError` a machine without one gives. JAX stays on the CPU
(`JAX_PLATFORMS=cpu`).

Before `spmd.tpu_env`, `spmd.initialize` handed such a machine to JAX's
detection, which asked the server for the workers and ended in that
traceback; a slice of several hosts whose workers cannot be read must stop
with one line naming what to set, never train each host alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from spmd import distributed, tpu_env
from spmd.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
ONE_HOST = {
  "TPU_ACCELERATOR_TYPE": "v5litepod-4",
  "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
  "TPU_HOST_BOUNDS": "1,1,1",
  "TPU_WORKER_HOSTNAMES": "localhost",
}
# Two hosts, named, but not which one this is: JAX's detection would have to
# ask the metadata server (for this host's index and the coordinator).
TWO_HOSTS = {**ONE_HOST, "TPU_HOST_BOUNDS": "2,1,1", "TPU_WORKER_HOSTNAMES": "host0,host1"}
_TPU_VARIABLES = (
  *tpu_env.WORKERS,
  tpu_env.WORKER_ID,
  tpu_env.HOST_BOUNDS,
  tpu_env.ACCELERATOR_TYPE,
  tpu_env.CHIPS_PER_HOST,
  tpu_env.NUM_SLICES,
  "TPU_SKIP_MDS_QUERY",
  "MEGASCALE_COORDINATOR_ADDRESS",
)


def _env(tpu: dict[str, str]) -> dict[str, str]:
  env = {
    k: v
    for k, v in os.environ.items()
    if k not in _TPU_VARIABLES and not k.startswith(("SPMD_", "JAX_COORDINATOR", "JAX_NUM_PROC"))
  }
  env.update(
    tpu,
    JAX_FORCE_TPU_INIT="1",
    JAX_PLATFORMS="cpu",
    GCE_METADATA_IP="127.0.0.1:9",  # nothing listens there: a refused connection
    PYTHONPATH=str(ROOT),
    PYTHONUNBUFFERED="1",
  )
  return env


def _run(tpu: dict[str, str], *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
  return subprocess.run(
    ["timeout", "-k", "5", str(timeout), sys.executable, *args],
    env=_env(tpu),
    cwd=ROOT,
    capture_output=True,
    text=True,
  )


_INITIALIZE = (
  "import sys, spmd; from spmd import errors; "
  "sys.exit(errors.run('init', lambda: print('INFO', spmd.initialize())))"
)


def _one_line_naming_the_fix(result: subprocess.CompletedProcess, prog: str) -> None:
  assert result.returncode == 2, result.stdout + result.stderr
  assert "Traceback" not in result.stderr, result.stderr
  lines = [line for line in result.stderr.splitlines() if line.startswith(f"{prog}: ")]
  assert len(lines) == 1, result.stderr
  assert "SPMD_NUM_PROCESSES=1" in lines[0] and "TPU_WORKER_ID" in lines[0], lines[0]


# The environment, read (no process).


def test_the_slice_is_read_from_whichever_variables_say_it():
  assert tpu_env.read_slice(ONE_HOST).processes == 1
  two = tpu_env.read_slice(TWO_HOSTS)
  assert (two.hosts, two.workers, two.names_every_worker) == (2, ("host0", "host1"), False)
  assert tpu_env.read_slice({**TWO_HOSTS, "TPU_WORKER_ID": "1"}).names_every_worker
  by_chips = {"TPU_ACCELERATOR_TYPE": "v5litepod-16", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1"}
  assert tpu_env.read_slice(by_chips).hosts == 4
  assert tpu_env.read_slice({"TPU_ACCELERATOR_TYPE": "v5p-8"}).hosts is None  # chips per host?
  assert tpu_env.read_slice({**ONE_HOST, "MEGASCALE_NUM_SLICES": "2"}).processes == 2
  with pytest.raises(ValueError, match="TPU_HOST_BOUNDS='2,two' is not a list of sizes"):
    tpu_env.read_slice({"TPU_HOST_BOUNDS": "2,two"})


def test_named_workers_set_up_the_job_without_asking_anyone(monkeypatch):
  for name in _TPU_VARIABLES:
    monkeypatch.delenv(name, raising=False)
  for name, value in {**TWO_HOSTS, "TPU_WORKER_ID": "1"}.items():
    monkeypatch.setenv(name, value)
  assert distributed._tpu_vm_settings() == ("host0:8482", 2, 1)
  monkeypatch.setenv("TPU_WORKER_ID", "0")
  monkeypatch.setenv("TPU_HOST_BOUNDS", "1,1,1")
  monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "localhost")
  assert distributed._tpu_vm_settings() is None  # one host: a single process
  monkeypatch.setenv("TPU_WORKER_ID", "first")
  with pytest.raises(UserError, match="TPU_WORKER_ID='first' is not an integer.*SPMD_NUM_PROC"):
    distributed._tpu_vm_settings()


# Real processes, JAX's real detection.


@pytest.mark.multiprocess
def test_one_tpu_host_is_one_process_without_a_metadata_server():
  result = _run(ONE_HOST, "-c", _INITIALIZE)
  assert result.returncode == 0, result.stderr
  assert "process_count=1" in result.stdout and "coordinator_address=None" in result.stdout
  assert "ConnectionError" not in result.stderr, result.stderr


@pytest.mark.multiprocess
def test_a_slice_whose_workers_cannot_be_read_stops_with_one_line():
  result = _run(TWO_HOSTS, "-c", _INITIALIZE)
  _one_line_naming_the_fix(result, "init")
  # The cause is named: the metadata server JAX's detection asked.
  assert "metadata server (ConnectionError" in result.stderr, result.stderr


@pytest.mark.multiprocess
@pytest.mark.slow
def test_spmd_train_on_one_tpu_host_trains_and_on_an_unread_slice_says_what_to_set(tmp_path):
  config = str(ROOT / "configs" / "mlp.py")
  train = ("-m", "trainers.run.train_cli", f"--config={config}", f"--workdir={tmp_path / 'w'}")
  short = ("--config.train.steps=2", "--config.eval_every=2", "--config.checkpoint.every=2")
  result = _run(ONE_HOST, *train, *short, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "ConnectionError" not in result.stderr
  failed = _run(TWO_HOSTS, *train, *short)
  _one_line_naming_the_fix(failed, "spmd-train")
  evaluate = ("-m", "trainers.run.train_cli", "--mode=eval", f"--workdir={tmp_path / 'w'}")
  _one_line_naming_the_fix(_run(TWO_HOSTS, *evaluate), "spmd-train")


@pytest.mark.multiprocess
@pytest.mark.parametrize("tpu", [ONE_HOST, TWO_HOSTS], ids=["one_host", "unread_slice"])
def test_sample_and_export_never_ask_for_the_slice(tmp_path, tpu):
  """A workdir that is no run gets their own answer first: no metadata query, no slice asked about
  (spmd-export reads on this host's CPU; spmd-sample joins the slice only for a real run)."""
  empty = tmp_path / "empty"
  empty.mkdir()
  sample = _run(tpu, "-m", "trainers.sampling.sample_cli", f"--workdir={empty}", "--prompt=x")
  assert sample.returncode == 2 and "has no config.json" in sample.stderr, sample.stderr
  export = _run(tpu, "-m", "trainers.checkpoints.export_cli", f"--workdir={empty}")
  assert export.returncode == 2 and "no checkpoint in" in export.stderr, export.stderr
  for result in (sample, export):
    assert "Traceback" not in result.stderr and "ConnectionError" not in result.stderr
