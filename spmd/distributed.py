"""`initialize()`: start JAX's distributed runtime the same way everywhere.

Where the settings come from, first match wins:
  1. arguments to `initialize`;
  2. the environment our launchers set (`SPMD_*`, below) or JAX's own
     (`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`);
  3. on a Cloud TPU VM, the slice's TPU_* variables (`spmd.tpu_env`): one host
     is a single process, and no metadata server is asked; a slice whose
     workers they do not name is read by JAX's detection, and where that
     fails the job stops with one line saying what to set (`UserError`);
     elsewhere, JAX's cluster detection (SLURM, Open MPI, Kubernetes), when
     it recognises the environment;
  4. otherwise this is a single process, and only the CPU device count is set.

JAX's default timeouts suit a pod (minutes). Jobs on one machine want
seconds, so the launcher passes short ones through the environment.

Example:
  >>> info = initialize()          # no cluster, no SPMD_* variables
  >>> info.process_count, info.process_index
  (1, 0)
"""

from __future__ import annotations

import dataclasses
import errno
import importlib.util
import logging
import os
import pkgutil
import socket

import jax

from spmd import compat, topology, tpu_env
from spmd.env_names import (
  ENV_BIND,
  ENV_COORDINATOR,
  ENV_CPU_DEVICES,
  ENV_HEARTBEAT,
  ENV_INIT,
  ENV_NUM_PROCESSES,
  ENV_PROCESS_ID,
  ENV_SHUTDOWN,
)
from spmd.errors import UserError

log = logging.getLogger(__name__)


_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")


@dataclasses.dataclass(frozen=True)
class DistributedInfo:
  """What `initialize` set up."""

  process_index: int
  process_count: int
  local_device_count: int
  coordinator_address: str | None


def _env(name: str, *fallbacks: str) -> str | None:
  for key in (name, *fallbacks):
    value = os.environ.get(key)
    if value not in (None, ""):
      return value
  return None


def _int_setting(value, env: str, *fallbacks: str) -> int | None:
  if value is not None:
    return int(value)
  raw = _env(env, *fallbacks)
  if raw is None:
    return None
  try:
    return int(raw)
  except ValueError:
    raise ValueError(f"environment variable {env}={raw!r} is not an integer") from None


def _seconds(value, env: str, default: int) -> int:
  raw = value if value is not None else _env(env)
  if raw is None:
    return default
  seconds = float(raw)
  if seconds <= 0:
    raise ValueError(f"timeout {env}={raw!r} must be positive")
  return max(1, round(seconds))


def cluster_detected() -> bool:
  """True when JAX's own cluster detection recognises this environment."""
  try:
    return compat.cluster_detected()
  except Exception as e:  # detection is best effort; say why it was skipped
    log.debug("cluster detection skipped: %s", e)
    return False


def _gpu_plugin_installed() -> bool:
  return any(
    m.name.startswith(("jax_cuda", "jax_rocm")) and m.name.endswith("_plugin")
    for m in pkgutil.iter_modules()
  )


def skip_absent_tpu() -> bool:
  """Keeps JAX on the CPU where libtpu is installed but there is no TPU; True if it did.

  With the `tpu` extra installed, JAX initialises libtpu on any machine, and
  on one without TPU chips libtpu prints a block of errors about worker
  hostnames to every process's output. Nothing is changed when the platform
  is already chosen (`JAX_PLATFORMS`, `jax_platforms`), when TPU chips are
  present, when a GPU plugin is installed (that choice is JAX's), or once the
  backends have started. Planning for TPU topologies does not need it:
  `spmd-plan` compiles for topology descriptions with the CPU platform.
  """
  if (
    os.environ.get("JAX_PLATFORMS")
    or jax.config.jax_platforms
    or compat.backends_are_initialized()
    or importlib.util.find_spec("libtpu") is None
    or topology.tpu_chips_present()
    or _gpu_plugin_installed()
  ):
    return False
  jax.config.update("jax_platforms", "cpu")
  return True


def set_cpu_device_count(count: int) -> None:
  """Makes the CPU backend expose `count` devices; must precede first use."""
  if count < 1:
    raise ValueError(f"CPU device {count=} must be at least 1")
  if compat.backends_are_initialized():
    have = jax.local_device_count("cpu") if jax.default_backend() == "cpu" else None
    if have not in (None, count):
      raise RuntimeError(
        f"JAX already started with {have} CPU devices; cannot switch to {count}. "
        "Call spmd.initialize() before any other JAX call"
      )
    return
  jax.config.update("jax_num_cpu_devices", count)


def initialize(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  cpu_devices: int | None = None,
  heartbeat_timeout_s: float | None = None,
  shutdown_timeout_s: float | None = None,
  initialization_timeout_s: float | None = None,
  coordinator_bind_address: str | None = None,
) -> DistributedInfo:
  """Starts `jax.distributed` if this is one process of several; idempotent.

  Args:
    coordinator_address: host:port of process 0's coordination service.
    num_processes: how many processes the job has.
    process_id: this process's index.
    cpu_devices: devices the CPU backend exposes per process (simulated hosts).
    heartbeat_timeout_s: a process silent this long is declared dead.
    shutdown_timeout_s: how long shutdown waits for the other processes.
    initialization_timeout_s: how long to wait for every process to connect.
    coordinator_bind_address: where process 0 listens. Defaults to the
      coordinator address itself when that is a loopback address, so a local
      job never listens on other interfaces.

  Returns:
    A `DistributedInfo` describing this process.
  """
  skip_absent_tpu()
  cpu_devices = _int_setting(cpu_devices, ENV_CPU_DEVICES)
  if cpu_devices is not None:
    set_cpu_device_count(cpu_devices)

  if jax.distributed.is_initialized():  # already started
    return _info(compat.coordinator_address())

  coordinator_address = coordinator_address or _env(ENV_COORDINATOR, "JAX_COORDINATOR_ADDRESS")
  num_processes = _int_setting(num_processes, ENV_NUM_PROCESSES, "JAX_NUM_PROCESSES")
  process_id = _int_setting(process_id, ENV_PROCESS_ID, "JAX_PROCESS_ID")
  explicit = coordinator_address is not None or num_processes is not None
  on_tpu_vm = not explicit and compat.on_cloud_tpu_vm()
  if on_tpu_vm:
    found = _tpu_vm_settings()
    if found is None:  # one host: nothing to start, no server to ask
      return _info(None)
    coordinator_address, num_processes, process_id = found
  if num_processes == 1 or (not explicit and not on_tpu_vm and not cluster_detected()):
    return _info(None)
  if (
    explicit
    and None in (coordinator_address, num_processes, process_id)
    and (not cluster_detected())
  ):
    raise ValueError(
      "A multi-process job needs the coordinator address, the number of "
      f"processes and this process's id; got {coordinator_address=}, "
      f"{num_processes=}, {process_id=} (environment: {ENV_COORDINATOR}, "
      f"{ENV_NUM_PROCESSES}, {ENV_PROCESS_ID})"
    )

  bind = coordinator_bind_address or _env(ENV_BIND)
  if bind is None and coordinator_address is not None:
    host = coordinator_address.rsplit(":", 1)[0]
    if host in _LOOPBACK_HOSTS:
      bind = coordinator_address
  if process_id == 0 and (bind or coordinator_address):
    _check_port_free(bind or coordinator_address)
  if jax.config.jax_cpu_collectives_implementation is None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  settings = dict(
    coordinator_address=coordinator_address,
    num_processes=num_processes,
    process_id=process_id,
    initialization_timeout=_seconds(initialization_timeout_s, ENV_INIT, 300),
    heartbeat_timeout_seconds=_seconds(heartbeat_timeout_s, ENV_HEARTBEAT, 100),
    shutdown_timeout_seconds=_seconds(shutdown_timeout_s, ENV_SHUTDOWN, 300),
    coordinator_bind_address=bind,
  )
  if on_tpu_vm and None in (coordinator_address, num_processes, process_id):
    _initialize_from_metadata(settings)
  else:
    jax.distributed.initialize(**settings)
  # Programs on CPU devices only: other platforms keep JAX's cache key.
  compat.share_cpu_programs_between_processes()
  return _info(coordinator_address)


# What a user sets where the slice's workers cannot be found (one line, exit 2).
_SET_WORKERS = (
  f"for a job on this host alone set {ENV_NUM_PROCESSES}=1; for one process per host set "
  f"{tpu_env.WORKERS[0]} (every host, in order) and {tpu_env.WORKER_ID} on each host, or "
  f"{ENV_COORDINATOR}, {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} (spmd-launch tpu sets them)"
)


def _tpu_vm_settings() -> tuple[str | None, int | None, int | None] | None:
  """On a Cloud TPU VM: None for one host, else (coordinator, processes, id), None where unknown.

  The environment decides where it can (`spmd.tpu_env`): one host needs no
  distributed runtime, and a slice whose variables name every worker and this
  one's index is set up from them, the coordinator on the first worker at
  JAX's TPU port. What they leave open is asked of JAX's detection, which
  reads the GCE metadata server (`_initialize_from_metadata`).
  """
  try:
    tpu = tpu_env.read_slice()
  except ValueError as e:
    raise UserError(f"{e}; {_SET_WORKERS}") from None
  if tpu.processes == 1:
    log.info("one TPU host (%s): a single process", tpu.evidence)
    return None
  if tpu.names_every_worker:
    host = tpu.workers[0].split(":")[0]
    port = _env("JAX_COORDINATOR_PORT") or str(_TPU_COORDINATOR_PORT)
    return f"{host}:{port}", len(tpu.workers), tpu.worker_id
  log.info("TPU slice of %s hosts (%s): asking JAX's detection", tpu.processes, tpu.evidence)
  return None, tpu.processes, None


# The port JAX's TPU cluster detection gives the coordinator (jax._src.clusters).
_TPU_COORDINATOR_PORT = 8482


def _initialize_from_metadata(settings: dict) -> None:
  """`jax.distributed.initialize` by JAX's TPU detection; a slice it cannot read is a `UserError`.

  The detection asks the GCE metadata server for the workers and the
  multislice coordinator. Where that server cannot be reached, or says
  nothing, training each host alone would be wrong, so the job stops with one
  line naming the cause and what to set.
  """
  hosts = settings["num_processes"]
  what = f"this TPU VM is one host of a slice of {hosts}" if hosts else "this is a Cloud TPU VM"
  try:
    jax.distributed.initialize(**settings)
  except Exception as e:
    if not _metadata_failure(e):
      raise
    cause = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    raise UserError(
      f"{what}, but its workers could not be read from the environment or the GCE "
      f"metadata server ({cause}); {_SET_WORKERS}"
    ) from None


def _metadata_failure(error: BaseException) -> bool:
  """Whether JAX's TPU detection failed for want of the metadata server or of its answers."""
  module = type(error).__module__ or ""
  text = str(error)
  return (
    module.startswith(("requests", "urllib3"))
    or isinstance(error, OSError)
    or "metadata" in text
    or "should be defined" in text  # JAX found no cluster to ask
    or "must be defined" in text
  )


def _check_port_free(address: str) -> None:
  """Process 0 says at once that its coordinator port is taken.

  Otherwise JAX's coordination service fails to start on process 0 while
  every other process waits for it until the initialization timeout.
  """
  host, _, port = address.rpartition(":")
  host = host.strip("[]")
  if not port.isdigit() or host in ("", "0.0.0.0", "::", "[::]"):
    return
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  try:
    with socket.socket(family, socket.SOCK_STREAM) as probe:
      probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      probe.bind((host, int(port)))
  except OSError as e:
    if e.errno == errno.EADDRINUSE:
      raise ValueError(
        f"coordinator address {address!r} is already in use on this host; "
        f"choose another port ({ENV_COORDINATOR})"
      ) from None
    log.debug("coordinator port check skipped for %s: %s", address, e)


def _info(coordinator_address: str | None) -> DistributedInfo:
  return DistributedInfo(
    jax.process_index(), jax.process_count(), jax.local_device_count(), coordinator_address
  )
