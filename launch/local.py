"""Start N processes on this machine as N simulated hosts, and watch them.

Each process gets the environment `spmd.initialize()` reads: the coordinator
on 127.0.0.1 at a free port (and bound there only), its process id, the
process count, its CPU device count and short timeouts. Output lines are
prefixed with the process id. When a process fails, the others get a grace
period to finish (they usually fail on their own within the heartbeat
timeout), then SIGKILL: JAX catches SIGTERM for preemption, so SIGTERM alone
may not stop them. A job has no time limit unless given one; with one, every
process also runs under `timeout -k`, so nothing outlives the job for long
even if this launcher is killed.

Example:
  >>> import sys
  >>> result = run_local([sys.executable, "-c", "print('hi')"], num_processes=2,
  ...                    echo=False)
  >>> result.ok, [p.output.strip() for p in result.processes]
  (True, ['hi', 'hi'])
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence

from launch import allocator
from launch.processes import (
  JobResult,
  OutputReader,
  ProcessResult,
  kill_group,
  popen,
  signal_group,
  watch,
)
from spmd import distributed as env_names

LocalJobResult = JobResult  # how a local job ended; `report()` has every output


def free_port() -> int:
  """A TCP port on 127.0.0.1 that was free a moment ago."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def process_env(
  process_id: int,
  num_processes: int,
  port: int,
  devices_per_process: int,
  heartbeat_timeout_s: float,
  base: Mapping[str, str] | None = None,
  platform: str | None = "cpu",
) -> dict[str, str]:
  """The environment one simulated host starts with.

  `platform` sets JAX_PLATFORMS (simulated hosts are CPU hosts by default);
  None leaves the environment's choice.
  """
  env = dict(os.environ if base is None else base)
  address = f"127.0.0.1:{port}"
  env.update(
    {
      env_names.ENV_COORDINATOR: address,
      env_names.ENV_BIND: address,  # loopback only, never all interfaces
      env_names.ENV_NUM_PROCESSES: str(num_processes),
      env_names.ENV_PROCESS_ID: str(process_id),
      env_names.ENV_CPU_DEVICES: str(devices_per_process),
      env_names.ENV_HEARTBEAT: str(heartbeat_timeout_s),
      env_names.ENV_SHUTDOWN: str(max(5, heartbeat_timeout_s)),
      env_names.ENV_INIT: str(max(30, heartbeat_timeout_s)),
      "PYTHONUNBUFFERED": "1",
    }
  )
  if platform is not None:
    env["JAX_PLATFORMS"] = platform
  return env


def cpu_shares(num_processes: int, cpus: Sequence[int] | None = None) -> list[list[int]]:
  """The CPUs each simulated host gets with `pin_cpus`: disjoint, as even as they go.

  With more processes than CPUs, processes share CPUs round-robin.

  Example:
    >>> cpu_shares(2, [0, 1, 2, 3]), cpu_shares(3, [0, 1])
    ([[0, 1], [2, 3]], [[0], [1], [0]])
  """
  cpus = sorted(os.sched_getaffinity(0)) if cpus is None else list(cpus)
  if num_processes >= len(cpus):
    return [[cpus[i % len(cpus)]] for i in range(num_processes)]
  return [
    cpus[i * len(cpus) // num_processes : (i + 1) * len(cpus) // num_processes]
    for i in range(num_processes)
  ]


def taskset_works() -> bool:
  """Whether `taskset` is installed and may set affinities here.

  Some sandboxes refuse `sched_setaffinity`; pinning by default must not
  make every job fail to start there, so the default asks first (a few ms).
  """
  if not shutil.which("taskset"):
    return False
  cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))))
  try:
    done = subprocess.run(["taskset", "-c", cpus, "true"], capture_output=True, timeout=10)
  except (OSError, subprocess.SubprocessError):
    return False
  return done.returncode == 0


def run_local(
  command: Sequence[str],
  num_processes: int,
  devices_per_process: int = 1,
  timeout_s: float | None = None,
  grace_s: float = 5.0,
  heartbeat_timeout_s: float = 5.0,
  env: Mapping[str, str] | None = None,
  echo: bool = True,
  cwd: str | None = None,
  platform: str | None = "cpu",
  log_dir: str | None = None,
  stop: threading.Event | None = None,
  term_grace_s: float = 60.0,
  pin_cpus: bool | None = None,
  tcmalloc: bool = True,
) -> LocalJobResult:
  """Runs `command` as `num_processes` processes of one JAX job and waits.

  Args:
    command: the program and its arguments, identical for every process.
    num_processes: how many simulated hosts.
    devices_per_process: CPU devices each process exposes.
    timeout_s: the whole job's limit in seconds; past it every process is
      killed. None or 0 (the default): no limit, as a training run has none.
    grace_s: after the first failure, how long the others may take to end on
      their own (and print why) before SIGKILL.
    heartbeat_timeout_s: JAX's heartbeat timeout for the job.
    env: extra environment variables for every process.
    echo: print each line as it arrives, prefixed with `[pN]`.
    cwd: working directory of the processes.
    platform: JAX_PLATFORMS for the processes; None keeps the environment's.
    log_dir: also write each process's output to `log_dir/process_N.log`.
    stop: when set (the launcher got SIGINT/SIGTERM), every process gets
      SIGTERM so the job can save (its preemption path), then SIGKILL after
      `term_grace_s`.
    term_grace_s: how long a stopped job may take to save and exit.
    pin_cpus: give each process its own share of this machine's CPUs
      (`cpu_shares`, through `taskset`), as separate hosts have. None (the
      default) pins whenever the job has several processes and `taskset`
      works here (`taskset_works`). Unpinned, every process's XLA thread
      pool spans all CPUs, so N simulated hosts run N times as many compute
      threads as there are CPUs, and a process that falls behind holds up
      the others at every collective: 2 processes x 1 device took
      1.08-1.30x the step of 1 process x 2 devices unpinned and 0.95-1.11x
      pinned (lm_tiny, 2 cores; README, P6).
    tcmalloc: preload TCMalloc into every process when this machine has it
      (`launch.allocator`: XLA:CPU steps ran 15% faster with it here).

  Returns:
    A `LocalJobResult`; its `report()` has every process's output.
  """
  if num_processes < 1:
    raise ValueError(f"{num_processes=} must be at least 1")
  if timeout_s is not None and not timeout_s >= 0:
    raise ValueError(f"{timeout_s=} must be a number of seconds >= 0 (0 or None: no limit)")
  port = free_port()
  base = dict(os.environ)
  base.update(env or {})
  if tcmalloc:
    base = allocator.with_tcmalloc(base)
  wrapper = []
  if timeout_s and shutil.which("timeout"):
    # A backstop for when this launcher itself dies: our own deadline fires first.
    # Its -k also bounds how long a forwarded SIGTERM may take to save. Without a
    # limit there is no deadline to back up: the launcher's own kill bounds the save.
    backstop = timeout_s + 2 * grace_s + term_grace_s + 10
    wrapper = ["timeout", "-k", str(max(1, round(term_grace_s))), str(round(backstop))]
  outputs: list[list[str]] = [[] for _ in range(num_processes)]
  procs: list[subprocess.Popen] = []
  reader = OutputReader()
  if log_dir:
    os.makedirs(log_dir, exist_ok=True)
  if pin_cpus is None:
    pin_cpus = num_processes > 1 and taskset_works()
  elif pin_cpus and not shutil.which("taskset"):
    raise ValueError("pin_cpus needs `taskset` (util-linux) on PATH")
  shares = cpu_shares(num_processes) if pin_cpus else []
  for i in range(num_processes):
    env_i = process_env(
      i, num_processes, port, devices_per_process, heartbeat_timeout_s, base, platform
    )
    pin = []
    if pin_cpus:
      pin = ["taskset", "-c", ",".join(map(str, shares[i]))]
    procs.append(popen(pin + wrapper + list(command), cwd=cwd, env=env_i))
    log = os.path.join(log_dir, f"process_{i}.log") if log_dir else None
    reader.add(procs[-1].stdout, outputs[i], f"[p{i}]", echo, log)

  killed = [False] * num_processes

  def forward_sigterm() -> float:
    for p in procs:
      signal_group(p, signal.SIGTERM)
    return math.inf

  def kill_running() -> float:
    for i, p in enumerate(procs):
      if p.poll() is None:
        killed[i] = True
        kill_group(p)
    return math.inf  # SIGKILL here always works: wait for them

  try:
    outcome = watch(
      procs,
      grace_s,
      timeout_s or math.inf,
      stop,
      on_kill=kill_running,
      on_stop=forward_sigterm,
      kill_after_stop_s=term_grace_s,
    )
  finally:
    kill_running()
    for p in procs:
      p.wait()
    reader.join(timeout=5)
  results = [
    ProcessResult(i, p.returncode, "".join(outputs[i]), killed[i]) for i, p in enumerate(procs)
  ]
  return LocalJobResult(results, outcome.first_failure, outcome.timed_out, outcome.stopped)


def run_with_restarts(
  command: Sequence[str],
  num_processes: int,
  max_restarts: int = 0,
  stop: threading.Event | None = None,
  echo: bool = True,
  **kwargs,
) -> list[LocalJobResult]:
  """Runs the job; after a failure runs it again (new port), up to `max_restarts` times.

  The command is expected to resume from its own checkpoints (spmd-train
  does, from its workdir). A job stopped by a signal is not restarted.
  Returns every attempt's result, the last one last.
  """
  attempts = []
  while True:
    result = run_local(command, num_processes, stop=stop, echo=echo, **kwargs)
    attempts.append(result)
    if result.ok or result.stopped or len(attempts) > max_restarts:
      return attempts
    if echo:
      print(
        f"spmd-launch: attempt {len(attempts)} failed ({result.summary().splitlines()[0]}); "
        f"restarting ({len(attempts)} of {max_restarts} restarts)",
        file=sys.stderr,
        flush=True,
      )
