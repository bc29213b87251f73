"""Running a real training job and hurting it on purpose: start, watch, find, kill.

A job is `spmd-launch local ... -- spmd-train` on the tiny test config,
started as its own process group so a failed test can always kill all of
it. Its processes are found through /proc (command line and SPMD_PROCESS_ID),
its progress through metrics.jsonl (the config logs every step), its
committed checkpoints through orbax's step directories.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tests import shared_runs
from tests.faults.conftest import injections
from tests.multiprocess import ROOT

CONFIG = str(ROOT / "tests" / "configs" / "train_tiny.py")

# Jobs inherit the run's fast compile flags and its one compilation cache
# (tests/session_settings.py): process 0 writes it and every process reads it
# (`spmd.compat.share_cpu_programs_between_processes`), so a restart compiles
# nothing a run before it compiled; the reference runs use the same flags, so
# comparisons stay bit-exact.


def train_flags(data: dict, workdir: Path, *overrides: str) -> list[str]:
  return [
    f"--config={CONFIG}",
    f"--workdir={workdir}",
    f"--config.data.source={data['source']}",
    f"--config.data.dir={data['dir']}",
    "--config.sample_tokens=0",
    *overrides,
  ]


@dataclasses.dataclass
class Job:
  """A running launcher and what it printed so far (with arrival times)."""

  launcher: subprocess.Popen
  workdir: Path
  lines: list[tuple[float, str]] = dataclasses.field(default_factory=list)
  reader: threading.Thread | None = None  # reads the launcher's output into `lines`

  @property
  def output(self) -> str:
    return "".join(line for _, line in self.lines)

  def wait(self, timeout_s: float) -> int:
    try:
      return self.launcher.wait(timeout=timeout_s)
    finally:
      self.kill()

  def kill(self) -> None:
    """Ends the launcher and its processes, then reads what they printed to the end.

    The launcher's last lines (which process failed first) may still be in the
    pipe when it exits: on a busy machine the reader can be a few lines behind.
    """
    if self.launcher.poll() is None:
      os.killpg(self.launcher.pid, signal.SIGKILL)
      self.launcher.wait()
    for pid in pids(self.workdir).values():  # nothing outlives a test
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    if self.reader is not None:
      self.reader.join(timeout=READ_TO_THE_END_S)


def start(
  data: dict,
  workdir: Path,
  *overrides: str,
  num_processes: int = 2,
  devices: int = 2,
  max_restarts: int = 0,
  timeout_s: float = 600,
  entry: str = "trainers.run.train_cli",
  env: dict | None = None,
  cwd: Path | None = None,
) -> Job:
  """Starts `spmd-launch local -- spmd-train` on the tiny config; returns at once.

  `entry` is the module run as `spmd-train` (one of `ENTRIES`), `env` more environment.
  """
  environment = dict(
    os.environ,
    PYTHONPATH=str(ROOT),
    JAX_COMPILATION_CACHE_DIR=data["cache"],
    **(env or {}),
  )
  train = [entry, *train_flags(data, workdir, *overrides)]
  return launch(
    train, workdir, num_processes, devices, max_restarts, timeout_s, environment, cwd or ROOT
  )


def launch(
  train: list[str],
  workdir: Path,
  num_processes: int,
  devices: int,
  max_restarts: int,
  timeout_s: float,
  env: dict,
  cwd: Path,
) -> Job:
  """`spmd-launch local -- python -m TRAIN...` in its own process group, its output read."""
  command = [
    sys.executable,
    "-m",
    "launch.launch_cli",
    "local",
    f"--num-processes={num_processes}",
    f"--devices-per-process={devices}",
    f"--max-restarts={max_restarts}",
    f"--grace={GRACE_S}",
    f"--timeout={timeout_s}",
    "--",
    sys.executable,
    "-m",
    *train,
  ]
  env = dict(env, SPMD_AGREEMENT_TIMEOUT_S="60")
  launcher = subprocess.Popen(
    command,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    env=env,
    cwd=str(cwd),
    start_new_session=True,
  )
  job = Job(launcher, workdir)

  def read():
    for line in launcher.stdout:
      job.lines.append((time.monotonic(), line))

  job.reader = threading.Thread(target=read, daemon=True)
  job.reader.start()
  return job


# Modules a job may run as `spmd-train`: the real one, or a test's wrapper of it.
ENTRIES = (
  "trainers.run.train_cli",
  "tests.workers.slow_save_train",
  "tests.workers.slow_chief_end_train",
)

# After one process fails, the others' time to end on their own before the
# launcher's SIGKILL. They rarely need it (JAX's heartbeat, or the watchdog
# relaying the failure, ends them within a second or two); short, because
# every kill-and-restart waits for it.
GRACE_S = 2
# How long a test waits, once the job has ended, for the rest of its output.
READ_TO_THE_END_S = 30

# One run length for the tests that compare against an uninterrupted run, so
# one reference serves them all (faults 1-4): room for a fault in each stretch
# of 5 steps, and a few steps after the last.
MOST_FAULTS = injections(3, 20)
STEPS = 4 + 5 * MOST_FAULTS + 4
EVERY = 2  # checkpoint interval: at most this many steps are redone after a kill


def long_run(every: int = EVERY) -> tuple[str, ...]:
  """The overrides of the run the reference is: STEPS steps, a checkpoint every EVERY.

  Other tests use them too (another `every` changes no compiled program): the
  schedule's length is part of the train step, so one length means process 0
  compiles it once for the whole suite.
  """
  return (
    f"--config.train.steps={STEPS}",
    f"--config.checkpoint.every={every}",
    "--config.checkpoint.keep=2",
    "--config.eval_every=0",
  )


def fault_steps(count: int, seed: int) -> list[int]:
  """`count` random steps of the long run, one in each stretch, in order.

  After each restart the job has to pass the previous fault before the next.
  """
  rng = random.Random(seed)
  stretch = (STEPS - 8) // count
  return [4 + stretch * i + rng.randrange(min(3, stretch - 2)) for i in range(count)]


_REFERENCE: dict[str, Any] = {}


def reference_run(data: dict, tmp_path_factory) -> tuple[str, Path]:
  """The uninterrupted long run (2 x 2), once a session: (final parameter hash, workdir).

  Its workdir keeps the last two checkpoints; tests copy them, never change them.
  """
  if "hash" not in _REFERENCE:

    def build(folder: Path) -> dict:
      job = start(data, folder / "run", *long_run())
      assert job.wait(600) == 0, job.output
      return {"hash": param_hash(job.output)}

    # Once for the whole pytest run: the other xdist worker reads the same one.
    folder, facts = shared_runs.shared_run(f"fault_reference_{STEPS}_steps", build)
    _REFERENCE.update(hash=facts["hash"], workdir=folder / "run")
  return _REFERENCE["hash"], _REFERENCE["workdir"]


def reference_hash(data: dict, tmp_path_factory) -> str:
  return reference_run(data, tmp_path_factory)[0]


def pids(workdir: Path) -> dict[int, int]:
  """{SPMD process id: pid} of the job's live Python training processes."""
  found = {}
  # The whole argument (cmdline's are NUL-ended): gs://bucket/run is not gs://bucket/run-2's job.
  needle = f"--workdir={workdir}\0".encode()
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/cmdline", "rb") as f:
        cmdline = f.read()
      if needle not in cmdline or not any(e.encode() in cmdline for e in ENTRIES):
        continue
      if not cmdline.startswith(sys.executable.encode()):
        continue  # the `timeout` wrapper
      with open(f"/proc/{name}/environ", "rb") as f:
        env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
      with open(f"/proc/{name}/stat") as f:
        if f.read().rsplit(")", 1)[1].split()[0] == "Z":
          continue  # a zombie has already ended
    except OSError:
      continue
    if b"SPMD_PROCESS_ID" in env:  # not the launcher, whose command line holds the same
      found[int(env[b"SPMD_PROCESS_ID"])] = int(name)
  return found


def last_step(workdir: Path) -> int:
  """The highest step in metrics.jsonl (0 before the first)."""
  path = workdir / "metrics.jsonl"
  if not path.exists():
    return 0
  steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line]
  return max(steps, default=0)


def committed_steps(workdir: Path) -> list[int]:
  """Checkpoint steps orbax has committed (its temporary directories excluded)."""
  root = workdir / "checkpoints"
  if not root.exists():
    return []
  return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit())


def saved_state(workdir: Path, step: int) -> dict:
  """The train state of checkpoint `step`, read here as numpy arrays (any saving layout)."""
  import jax
  import numpy as np
  import orbax.checkpoint as ocp

  path = workdir / "checkpoints" / str(step) / "state"
  checkpointer = ocp.PyTreeCheckpointer()
  tree = checkpointer.metadata(path).item_metadata.tree
  as_numpy = jax.tree.map(
    lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree, is_leaf=lambda x: hasattr(x, "shape")
  )
  return checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=as_numpy))


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.02):
  """Polls until `predicate()` is truthy; returns its value or raises naming `what`."""
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    value = predicate()
    if value:
      return value
    time.sleep(poll_s)
  raise TimeoutError(f"timed out after {timeout_s:g}s waiting for {what}")


def gone_after(pid_list: list[int], timeout_s: float) -> float:
  """Seconds until every pid in the list has exited (or raises after `timeout_s`)."""
  started = time.monotonic()

  def all_gone():
    for pid in pid_list:
      try:
        with open(f"/proc/{pid}/stat") as f:
          if f.read().rsplit(")", 1)[1].split()[0] != "Z":
            return False
      except OSError:
        continue
    return True

  wait_for(all_gone, timeout_s, f"processes {pid_list} to exit", poll_s=0.01)
  return time.monotonic() - started


def resumed_steps(output: str) -> list[int]:
  """The checkpoint step each restarted attempt resumed from, in order (0: none yet).

  The first attempt's own start (a fresh init) is left out.
  """
  starts = re.findall(r"; state from (?:checkpoint step (\d+)|fresh init)", output)
  return [int(step or 0) for step in starts[1:]]


def param_hash(output: str) -> str | None:
  found = re.findall(r"param hash\s+: ([0-9a-f]+)", output)
  return found[-1] if found else None
