"""The one helper that runs a test body as N real JAX processes.

Processes talk over 127.0.0.1 with gloo collectives and a few CPU devices
each. Hard limits everywhere: JAX heartbeat and shutdown timeouts of a few
seconds, `timeout -k` around each process, SIGKILL after a grace period, and
the whole output of every process in the failure message.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from launch.local import LocalJobResult, run_local

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"


def run_worker(
  worker: str,
  *args: str,
  num_processes: int,
  devices_per_process: int,
  timeout_s: float = 180,
  grace_s: float = 10,
  env: dict[str, str] | None = None,
) -> LocalJobResult:
  """Runs `tests/workers/<worker>.py args...` as a job of `num_processes`."""
  extra = {
    "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    "SPMD_AGREEMENT_TIMEOUT_S": "15",
  }
  extra.update(env or {})
  return run_local(
    [sys.executable, str(WORKERS / f"{worker}.py"), *args],
    num_processes=num_processes,
    devices_per_process=devices_per_process,
    timeout_s=timeout_s,
    grace_s=grace_s,
    heartbeat_timeout_s=5,
    env=extra,
    echo=False,
    cwd=str(ROOT),
  )


def run_trainer(
  args: list[str],
  *,
  num_processes: int,
  devices_per_process: int,
  cache: str,
  timeout_s: float = 240,
  env: dict[str, str] | None = None,
  platform: str | None = "cpu",
) -> LocalJobResult:
  """`spmd-train ARGS` (`python -m trainers.run.train_cli`) as a job of `num_processes`.

  `cache`: the compilation cache the test's runs share, so each layout
  compiles once. `platform`: JAX_PLATFORMS, or None for the machine's own
  (`launch.local.run_local`). Not checked: a test of a refusal reads the
  result itself.
  """
  extra = {
    "PYTHONPATH": str(ROOT),
    "SPMD_AGREEMENT_TIMEOUT_S": "60",
    "JAX_COMPILATION_CACHE_DIR": cache,
    **(env or {}),
  }
  return run_local(
    [sys.executable, "-m", "trainers.run.train_cli", *args],
    num_processes=num_processes,
    devices_per_process=devices_per_process,
    timeout_s=timeout_s,
    grace_s=10,
    echo=False,
    cwd=str(ROOT),
    env=extra,
    platform=platform,
  )


def assert_ok(result: LocalJobResult) -> None:
  assert result.ok, result.report()
