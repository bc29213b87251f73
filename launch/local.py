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

import fcntl
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence

from launch import allocator
from launch.processes import (
  JobResult,
  Outcome,
  OutputReader,
  ProcessResult,
  kill_group,
  popen,
  signal_group,
  watch,
)
from spmd import env_names
from spmd.errors import EXIT_USER_ERROR

LocalJobResult = JobResult  # how a local job ended; `report()` has every output


# How long a port handed out by `free_port` stays reserved for its job: long
# enough for the coordinator to start and bind it.
PORT_RESERVATION_S = 300.0


def free_port() -> int:
  """A TCP port on 127.0.0.1 that was free a moment ago, reserved for the caller.

  The port is given up when it is picked, and the coordinator binds it only
  once its process has started, so two launchers on one machine could both
  be handed the same free port in between. Each port handed out is recorded
  under the machine's temporary folder for `PORT_RESERVATION_S`, and no
  other `free_port` call on the machine returns it meanwhile.

  >>> free_port() != free_port()
  True
  """
  folder = os.path.join(tempfile.gettempdir(), f"spmd-ports-{os.getuid()}")
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, ".lock"), "a") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    _forget_old_reservations(folder)
    for _ in range(100):
      with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
      marker = os.path.join(folder, str(port))
      try:
        if time.time() - os.path.getmtime(marker) < PORT_RESERVATION_S:
          continue  # handed out recently, maybe not bound yet
      except FileNotFoundError:
        pass
      with open(marker, "w"):
        pass
      return port
  raise RuntimeError(f"no free port on 127.0.0.1 that is not reserved in {folder}")


def _forget_old_reservations(folder: str) -> None:
  """Removes the port markers (files named by a number) whose reservation has run out."""
  now = time.time()
  for name in os.listdir(folder):
    if name.isdigit():
      path = os.path.join(folder, name)
      try:
        if now - os.path.getmtime(path) >= PORT_RESERVATION_S:
          os.remove(path)
      except FileNotFoundError:
        pass


def process_env(
  process_id: int,
  num_processes: int,
  port: int,
  devices_per_process: int,
  heartbeat_timeout_s: float,
  base: Mapping[str, str] | None = None,
  platform: str | None = "cpu",
  gpus: Sequence[str] | None = None,
) -> dict[str, str]:
  """The environment one simulated host starts with.

  `platform` sets JAX_PLATFORMS (simulated hosts are CPU hosts by default);
  None leaves the environment's choice. `gpus` (CUDA device ids or UUIDs)
  become its CUDA_VISIBLE_DEVICES; None leaves that variable as it is.
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
  if gpus is not None:
    env[CUDA_VISIBLE] = ",".join(gpus)
  return env


CUDA_VISIBLE = "CUDA_VISIBLE_DEVICES"
GPU_PLATFORMS = ("cuda", "gpu")  # JAX_PLATFORMS names that mean CUDA GPUs


def uses_gpus(platform: str | None, env: Mapping[str, str]) -> bool:
  """Whether JAX_PLATFORMS (`platform`, or the environment's when None) names CUDA GPUs.

  Example:
    >>> uses_gpus("cuda", {}), uses_gpus("cpu", {}), uses_gpus(None, {"JAX_PLATFORMS": "gpu,cpu"})
    (True, False, True)
  """
  chosen = env.get("JAX_PLATFORMS", "") if platform is None else platform
  return any(name.strip() in GPU_PLATFORMS for name in chosen.split(","))


def visible_gpus(env: Mapping[str, str]) -> list[str] | None:
  """The GPUs a job started with `env` may use, as CUDA_VISIBLE_DEVICES entries.

  CUDA_VISIBLE_DEVICES's own entries when it is set (indices or UUIDs, as
  given); else one index per `GPU N:` line of `nvidia-smi -L`, found on the
  `PATH` of `env`; else None: the count is unknown.

  Example:
    >>> visible_gpus({"CUDA_VISIBLE_DEVICES": "4,5, 7"}), visible_gpus({"PATH": ""})
    (['4', '5', '7'], None)
  """
  if CUDA_VISIBLE in env:
    return [d.strip() for d in env[CUDA_VISIBLE].split(",") if d.strip()]
  smi = shutil.which("nvidia-smi", path=env.get("PATH", ""))
  if not smi:
    return None
  try:
    done = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
  except (OSError, subprocess.SubprocessError):
    return None
  if done.returncode:
    return None
  count = sum(line.startswith("GPU ") for line in done.stdout.splitlines())
  return [str(i) for i in range(count)]


def gpu_shares(
  num_processes: int, devices_per_process: int, gpus: Sequence[str], share: bool = False
) -> list[list[str]]:
  """Each process's GPUs: process i gets `gpus[i*d : i*d+d]`, wrapping round `gpus`.

  A job that needs more GPUs than `gpus` holds is an error unless `share`,
  when processes share GPUs round-robin; a process never gets one GPU twice.

  Example:
    >>> gpu_shares(2, 2, ["0", "1", "2", "3"])
    [['0', '1'], ['2', '3']]
    >>> gpu_shares(3, 1, ["4", "6"], share=True)
    [['4'], ['6'], ['4']]
  """
  n, d = len(gpus), devices_per_process
  if num_processes < 1 or d < 1:
    raise ValueError(f"{num_processes=} and {devices_per_process=} must be at least 1")
  needed = num_processes * d
  if d > n:
    raise ValueError(
      f"{devices_per_process=} GPUs per process, but only {n} GPUs are visible "
      f"({CUDA_VISIBLE}={','.join(gpus)!r}): a process cannot use one GPU twice"
    )
  if needed > n and not share:
    raise ValueError(
      f"{num_processes} processes x {d} GPUs need {needed} GPUs, but {n} are visible "
      f"({CUDA_VISIBLE}={','.join(gpus)!r}); pass share_gpus=True (--share-gpus) to let "
      "processes share GPUs"
    )
  return [[gpus[(i * d + k) % n] for k in range(d)] for i in range(num_processes)]


def job_envs(
  num_processes: int,
  port: int,
  devices_per_process: int,
  heartbeat_timeout_s: float,
  base: Mapping[str, str],
  platform: str | None = "cpu",
  share_gpus: bool = False,
) -> list[dict[str, str]]:
  """Every process's environment (`process_env`); on CUDA GPUs, each with its own GPUs.

  When `uses_gpus`, the GPUs of `visible_gpus(base)` (or, where that cannot
  tell, `num_processes * devices_per_process` GPUs 0, 1, ...) are dealt out
  by `gpu_shares`: process i's CUDA_VISIBLE_DEVICES holds the i-th
  `devices_per_process` of them, so no two processes share a GPU unless
  `share_gpus`. Shared GPUs also get XLA_PYTHON_CLIENT_MEM_FRACTION, each
  process its share of XLA's usual 75%, unless `base` sets how XLA allocates:
  two processes that each preallocate 75% of one GPU cannot both start.

  Example:
    >>> envs = job_envs(2, 1234, 2, 5.0, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, platform="cuda")
    >>> [(e["SPMD_PROCESS_ID"], e["CUDA_VISIBLE_DEVICES"]) for e in envs]
    [('0', '4,5'), ('1', '6,7')]
  """
  shares: list[list[str]] | list[None] = [None] * num_processes
  per_gpu = 1
  if uses_gpus(platform, base):
    gpus = visible_gpus(base)
    if gpus is None:
      gpus = [str(i) for i in range(num_processes * devices_per_process)]
    shares = gpu_shares(num_processes, devices_per_process, gpus, share_gpus)
    per_gpu = math.ceil(num_processes * devices_per_process / len(gpus))
  envs = [
    process_env(
      i, num_processes, port, devices_per_process, heartbeat_timeout_s, base, platform, shares[i]
    )
    for i in range(num_processes)
  ]
  allocating = ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE")
  if per_gpu > 1 and not any(name in base for name in allocating):
    for env in envs:
      env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{0.75 / per_gpu:.3f}"
  return envs


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
  share_gpus: bool = False,
) -> LocalJobResult:
  """Runs `command` as `num_processes` processes of one JAX job and waits.

  Args:
    command: the program and its arguments, identical for every process.
    num_processes: how many simulated hosts.
    devices_per_process: CPU devices each process exposes; on CUDA GPUs, the
      GPUs each process gets (`job_envs`).
    timeout_s: the whole job's limit in seconds; past it every process is
      killed. None or 0 (the default): no limit, as a training run has none.
    grace_s: after the first failure, how long the others may take to end on
      their own (and print why) before SIGKILL.
    heartbeat_timeout_s: JAX's heartbeat timeout for the job.
    env: extra environment variables for every process.
    echo: print each line as it arrives, prefixed with `[pN]`.
    cwd: working directory of the processes.
    platform: JAX_PLATFORMS for the processes; None keeps the environment's.
      "cuda" (or "gpu") gives each process its own GPUs: `job_envs`.
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
      the others at every collective; pinned, each host computes on its own
      CPUs, as on separate machines, and none waits on another's threads.
    tcmalloc: preload TCMalloc into every process when this machine has it
      (`launch.allocator`: it keeps the step's large freed buffers for the
      next step instead of returning them to the kernel).
    share_gpus: on CUDA GPUs, let processes share GPUs when there are fewer
      than `num_processes * devices_per_process` (otherwise a ValueError).

  Returns:
    A `LocalJobResult`; its `report()` has every process's output.
  """
  if num_processes < 1:
    raise ValueError(f"{num_processes=} must be at least 1")
  if timeout_s is not None and not timeout_s >= 0:
    raise ValueError(f"{timeout_s=} must be a number of seconds >= 0 (0 or None: no limit)")
  envs = _environments(
    env, tcmalloc, num_processes, devices_per_process, heartbeat_timeout_s, platform, share_gpus
  )
  backstop = _deadline_backstop(timeout_s, grace_s, term_grace_s)
  if log_dir:
    os.makedirs(log_dir, exist_ok=True)
  pins = _cpu_pins(num_processes, pin_cpus)
  outputs: list[list[str]] = [[] for _ in range(num_processes)]
  reader = OutputReader()
  procs: list[subprocess.Popen] = []
  for i in range(num_processes):
    procs.append(popen(pins[i] + backstop + list(command), cwd=cwd, env=envs[i]))
    log = os.path.join(log_dir, f"process_{i}.log") if log_dir else None
    reader.add(procs[-1].stdout, outputs[i], f"[p{i}]", echo, log)
  killed = [False] * num_processes
  outcome = _watch_until_done(procs, killed, reader, grace_s, timeout_s, stop, term_grace_s)
  results = [
    ProcessResult(i, p.returncode, "".join(outputs[i]), killed[i]) for i, p in enumerate(procs)
  ]
  return LocalJobResult(results, outcome.first_failure, outcome.timed_out, outcome.stopped)


def _environments(
  env: Mapping[str, str] | None,
  tcmalloc: bool,
  num_processes: int,
  devices_per_process: int,
  heartbeat_timeout_s: float,
  platform: str | None,
  share_gpus: bool,
) -> list[dict[str, str]]:
  """Each process's environment: ours, the caller's `env`, TCMalloc, a fresh coordinator port."""
  port = free_port()
  base = dict(os.environ)
  base.update(env or {})
  if tcmalloc:
    base = allocator.with_tcmalloc(base)
  return job_envs(
    num_processes, port, devices_per_process, heartbeat_timeout_s, base, platform, share_gpus
  )


def _deadline_backstop(timeout_s: float | None, grace_s: float, term_grace_s: float) -> list[str]:
  """A `timeout -k` prefix that ends each process if this launcher dies; [] without a limit."""
  if not (timeout_s and shutil.which("timeout")):
    return []
  # A backstop for when this launcher itself dies: our own deadline fires first.
  # Its -k also bounds how long a forwarded SIGTERM may take to save. Without a
  # limit there is no deadline to back up: the launcher's own kill bounds the save.
  backstop = timeout_s + 2 * grace_s + term_grace_s + 10
  return ["timeout", "-k", str(max(1, round(term_grace_s))), str(round(backstop))]


def _cpu_pins(num_processes: int, pin_cpus: bool | None) -> list[list[str]]:
  """Each process's `taskset -c CPUS` prefix (`cpu_shares`), or [] for each when unpinned."""
  if pin_cpus is None:
    pin_cpus = num_processes > 1 and taskset_works()
  elif pin_cpus and not shutil.which("taskset"):
    raise ValueError("pin_cpus needs `taskset` (util-linux) on PATH")
  if not pin_cpus:
    return [[] for _ in range(num_processes)]
  return [["taskset", "-c", ",".join(map(str, cpus))] for cpus in cpu_shares(num_processes)]


def _watch_until_done(
  procs: list[subprocess.Popen],
  killed: list[bool],
  reader: OutputReader,
  grace_s: float,
  timeout_s: float | None,
  stop: threading.Event | None,
  term_grace_s: float,
) -> Outcome:
  """`watch`es the job to its end, then makes sure every process is gone and read.

  Marks in `killed` each process this launcher had to SIGKILL.
  """

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
    return watch(
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
  does, from its workdir). A job stopped by a signal is not restarted, nor one
  that failed on a user error (`user_error`): a bad flag, config or path fails
  the same way every time. Returns every attempt's result, the last one last.
  """
  attempts = []
  while True:
    result = run_local(command, num_processes, stop=stop, echo=echo, **kwargs)
    attempts.append(result)
    if result.ok or result.stopped or len(attempts) > max_restarts:
      return attempts
    wrong_input = user_error(result)
    if wrong_input is not None:
      if echo:
        print(
          f"spmd-launch: attempt {len(attempts)} failed: {wrong_input.name} exited "
          f"{EXIT_USER_ERROR}, a user error (its output says which input); not restarting, "
          "since the same command fails the same way: fix it and run again",
          file=sys.stderr,
          flush=True,
        )
      return attempts
    if echo:
      print(
        f"spmd-launch: attempt {len(attempts)} failed ({result.summary().splitlines()[0]}); "
        f"restarting ({len(attempts)} of {max_restarts} restarts)",
        file=sys.stderr,
        flush=True,
      )


def user_error(result: LocalJobResult) -> ProcessResult | None:
  """The first process that exited `spmd.errors.EXIT_USER_ERROR` (2), if any.

  Every `spmd-*` command exits 2 on a wrong input and only then (as do
  argparse and absl on bad usage); its peers may exit otherwise, told of it.

  Example:
    >>> done = run_local([sys.executable, "-c", "import sys; sys.exit(2)"], 1, echo=False)
    >>> user_error(done).name
    'process 0'
  """
  return next((p for p in result.processes if p.returncode == EXIT_USER_ERROR), None)
