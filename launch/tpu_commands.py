"""What `spmd-launch tpu` runs, as data: the job, its gcloud commands and remote scripts.

Nothing here starts a process (`launch/tpu.py` runs these), so the whole plan
can be printed (`dry_run_commands`, for `--dry-run`) and tested as strings.
Every user-supplied string reaches a command through `shlex.quote`/`shlex.join`,
so a flag like `--name='x; rm -rf ~'` arrives at the remote program as one
argument and is never run.

Example:
  >>> job = TpuJob(tpu="pod", zone="us-central2-b", num_slices=2, tag="t")
  >>> job.nodes()
  ['pod-0', 'pod-1']
  >>> env = worker_env(job, slice_id=1, worker=0, workers_per_slice=4, coordinator_ip="10.0.0.2")
  >>> env["SPMD_COORDINATOR_ADDRESS"], env["SPMD_NUM_PROCESSES"], env["SPMD_PROCESS_ID"]
  ('10.0.0.2:8476', '8', '4')
  >>> env["MEGASCALE_SLICE_ID"], env["MEGASCALE_COORDINATOR_ADDRESS"]
  ('1', '10.0.0.2:8080')
  >>> shlex.join(describe_argv(job, "pod-0"))
  'gcloud compute tpus tpu-vm describe pod-0 --format=json --zone=us-central2-b'
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import re
import secrets
import shlex
import tarfile
import tempfile
import time
from collections.abc import Mapping, Sequence

from launch.processes import ENV_NAME
from spmd import env_names

DEFAULT_EXCLUDES = (
  ".git",
  ".venv",
  "workdir",
  "__pycache__",
  "*.egg-info",
  ".pytest_cache",
  ".ruff_cache",
)
STATE_DIR = ".spmd-launch"  # on each worker, under $HOME: the jobs' process-group files
KILL_GRACE_S = 3.0  # after a failure: SIGTERM, then SIGKILL this much later


def _new_tag() -> str:
  return f"spmd-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


@dataclasses.dataclass(frozen=True)
class TpuJob:
  """Where and how to run: the slice(s), the code, the install step, the limits.

  Attributes:
    tpu: the TPU VM name; with `num_slices > 1` the node prefix (nodes NAME-i).
    zone, project: passed to every gcloud command (project: gcloud's default if empty).
    num_slices: slices of one multislice job, from one queued resource.
    queued_resource: its name (default `tpu`).
    create: create the queued resource (needs `accelerator_type`, `runtime_version`).
    src: the local directory copied to the workers.
    remote_dir: where it is unpacked, relative to the remote home (or absolute).
    copy: False runs in `remote_dir` as it already is on the workers.
    excludes: name patterns left out of the copy, besides `DEFAULT_EXCLUDES`.
    ship: more local directories copied with the code, each to `ship/<its name>/`
      under `remote_dir` (a task folder that lives outside the checkout).
    image: run the command in this docker image instead (nothing is copied).
    install: `pip install -e '.[tpu]'` in `remote_dir`, or `docker pull` the image.
    install_command: a shell command to run instead (in `remote_dir` when copying).
    env: extra environment for the job on every worker.
    coordinator_port, megascale_port: ports on worker 0 of slice 0.
    timeout_s: the whole job's limit, here and on the workers (0: none).
    grace_s: after the first failure, how long the others may take to end on
      their own before they are killed.
    term_grace_s: after Ctrl-C/SIGTERM, how long the job may take to save.
    ready_timeout_s, poll_interval_s: waiting for the queued resource.
    tag: names this job's files and container on the workers.
  """

  tpu: str
  zone: str
  project: str = ""
  num_slices: int = 1
  queued_resource: str = ""
  create: bool = False
  accelerator_type: str = ""
  runtime_version: str = ""
  src: str = "."
  remote_dir: str = "spmd-harness"
  copy: bool = True
  excludes: tuple[str, ...] = ()
  ship: tuple[str, ...] = ()
  image: str = ""
  install: bool = False
  install_command: str = ""
  env: Mapping[str, str] = dataclasses.field(default_factory=dict)
  coordinator_port: int = 8476
  megascale_port: int = 8080
  timeout_s: float = 0
  grace_s: float = 5.0
  term_grace_s: float = 60.0
  ready_timeout_s: float = 3600.0
  poll_interval_s: float = 30.0
  tag: str = dataclasses.field(default_factory=_new_tag)

  def __post_init__(self):
    if not self.tpu or not self.zone:
      raise ValueError(f"a TPU name and zone are needed; got {self.tpu=}, {self.zone=}")
    if self.num_slices < 1:
      raise ValueError(f"{self.num_slices=} must be at least 1")
    if self.create and not (self.accelerator_type and self.runtime_version):
      raise ValueError(
        "creating a queued resource needs the accelerator type and runtime version; got "
        f"{self.accelerator_type=}, {self.runtime_version=}"
      )
    for port in (self.coordinator_port, self.megascale_port):
      if not 0 < port < 65536:
        raise ValueError(f"{port=} is not a TCP port")
    for name in self.env:
      if not ENV_NAME.fullmatch(name):
        raise ValueError(f"environment variable {name=} is not a valid name")
    if self.remote_dir.startswith("~/"):  # a quoted ~ is not expanded; the shell starts in ~
      object.__setattr__(self, "remote_dir", self.remote_dir[2:] or ".")
    names = [os.path.basename(os.path.normpath(d)) for d in self.ship]
    if len(set(names)) != len(names):
      raise ValueError(f"ship={self.ship}: two folders share a name, and both would be ship/<name>")
    if self.ship and (self.image or not self.copy):
      raise ValueError(
        f"ship={self.ship} copies folders with the code; with --image or --no-copy nothing is "
        "copied: put the folder in the image or in --remote-dir instead"
      )
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.tag):
      raise ValueError(f"{self.tag=} may hold only letters, digits, '_', '.' and '-'")

  def nodes(self) -> list[str]:
    """The TPU VM of each slice: NAME, or NAME-0 ... NAME-(N-1) for a multislice job."""
    if self.num_slices == 1:
      return [self.tpu]
    return [f"{self.tpu}-{i}" for i in range(self.num_slices)]

  @property
  def uses_queued_resource(self) -> bool:
    return self.num_slices > 1 or self.create

  @property
  def container(self) -> str:
    return self.tag

  def tarball_name(self) -> str:
    return f"{self.tag}.tar.gz"

  def local_tarball(self) -> str:
    """Where the code is packed on this machine before the copy."""
    return os.path.join(tempfile.gettempdir(), self.tarball_name())


# ---- the gcloud commands -------------------------------------------------------------------


def gcloud(job: TpuJob, *args: str) -> list[str]:
  """`gcloud compute tpus ARGS --zone=Z [--project=P]`."""
  argv = ["gcloud", "compute", "tpus", *args, f"--zone={job.zone}"]
  if job.project:
    argv.append(f"--project={job.project}")
  return argv


def describe_argv(job: TpuJob, node: str) -> list[str]:
  return gcloud(job, "tpu-vm", "describe", node, "--format=json")


def ssh_argv(job: TpuJob, node: str, worker: int | str, remote: str) -> list[str]:
  """Runs the shell string `remote` on one worker (or `all`): one argv element, quoted once."""
  return gcloud(job, "tpu-vm", "ssh", node, f"--worker={worker}", f"--command={remote}")


def scp_argv(job: TpuJob, tarball: str, node: str) -> list[str]:
  """Copies the local `tarball` to the home of every worker of `node`."""
  return gcloud(job, "tpu-vm", "scp", tarball, f"{node}:~/{job.tarball_name()}", "--worker=all")


def queued_resource_create_argv(job: TpuJob) -> list[str]:
  name = job.queued_resource or job.tpu
  argv = [
    "queued-resources",
    "create",
    name,
    f"--accelerator-type={job.accelerator_type}",
    f"--runtime-version={job.runtime_version}",
  ]
  if job.num_slices == 1:
    argv.append(f"--node-id={job.tpu}")
  else:
    argv += [f"--node-count={job.num_slices}", f"--node-prefix={job.tpu}"]
  return gcloud(job, *argv)


def queued_resource_describe_argv(job: TpuJob) -> list[str]:
  return gcloud(
    job, "queued-resources", "describe", job.queued_resource or job.tpu, "--format=json"
  )


def _home(relative: str) -> str:
  """A path under the remote $HOME, safe to paste into a remote shell string."""
  return '"$HOME"/' + shlex.quote(relative)


def _host_port(host: str, port: int) -> str:
  return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def worker_env(
  job: TpuJob, slice_id: int, worker: int, workers_per_slice: int, coordinator_ip: str
) -> dict[str, str]:
  """The variables one worker's job gets: `spmd.initialize()`'s, megascale's, then `job.env`.

  Process ids run slice by slice (slice * workers_per_slice + worker), the
  order JAX itself uses on a multislice TPU job.
  """
  if not (0 <= slice_id < job.num_slices and 0 <= worker < workers_per_slice):
    raise ValueError(f"{slice_id=}, {worker=} outside {job.num_slices=}, {workers_per_slice=}")
  env = {
    env_names.ENV_COORDINATOR: _host_port(coordinator_ip, job.coordinator_port),
    env_names.ENV_NUM_PROCESSES: str(job.num_slices * workers_per_slice),
    env_names.ENV_PROCESS_ID: str(slice_id * workers_per_slice + worker),
  }
  if job.num_slices > 1:
    env.update(
      {
        "MEGASCALE_COORDINATOR_ADDRESS": _host_port(coordinator_ip, job.megascale_port),
        "MEGASCALE_NUM_SLICES": str(job.num_slices),
        "MEGASCALE_SLICE_ID": str(slice_id),
        "MEGASCALE_PORT": str(job.megascale_port),
      }
    )
  env.update(job.env)
  return env


def worker_script(job: TpuJob, command: Sequence[str], env: Mapping[str, str]) -> str:
  """The remote shell string that runs `command` on one worker.

  The job runs in a new session (so its own process group), records that
  group's id, and refuses to start if the job was already stopped there (the
  kill may reach a worker before its job starts). The login shell waits for it
  and exits with its status (128+N when signal N ended it).
  """
  if not command:
    raise ValueError(f"the command to run is empty: {command=}")
  pgid, stopped = _home(f"{STATE_DIR}/{job.tag}.pgid"), _home(f"{STATE_DIR}/{job.tag}.stop")
  if job.image:
    program = ["sudo", "docker", "run", "--rm", "--privileged", "--net=host"]
    program += [f"--name={job.container}", f"--entrypoint={command[0]}"]
    # sudo resets the environment, so values go on the command line, not `-e NAME`.
    for name, value in env.items():
      program += ["-e", f"{name}={value}"]
    program += [job.image, *command[1:]]  # --entrypoint: the image's own one is replaced
  else:
    program = list(command)
  if job.timeout_s:
    program = ["timeout", "-k", str(round(KILL_GRACE_S + 2)), str(_backstop_s(job)), *program]
  # A fixed script: the program comes in as its arguments, quoted once like everything else.
  inner = f'echo $$ > {pgid}; if [ -e {stopped} ]; then exit 143; fi; exec "$@"'
  prepare = [f"mkdir -p {_home(STATE_DIR)}"]
  if not job.image:
    prepare.append(f"cd {shlex.quote(job.remote_dir)}")
    if env:
      prepare.append("export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()))
  return (
    f"{' && '.join(prepare)} || exit 1; "
    f"setsid bash -c {shlex.quote(inner)} spmd-launch {shlex.join(program)} & "
    f"wait $!; s=$?; rm -f {pgid}; exit $s"
  )


def kill_script(job: TpuJob, grace_s: float) -> str:
  """The remote shell string that ends this job on a worker: SIGTERM, `grace_s`, SIGKILL.

  It leaves a stop file first, so a job that has not started yet never will.
  """
  state = _home(STATE_DIR)
  pgid, stopped = _home(f"{STATE_DIR}/{job.tag}.pgid"), _home(f"{STATE_DIR}/{job.tag}.stop")
  ticks = max(1, round(grace_s * 10))
  script = (
    f"mkdir -p {state}; touch {stopped}; "
    f"if [ -f {pgid} ]; then g=$(cat {pgid}); kill -TERM -$g 2>/dev/null; n=0; "
    f'while kill -0 -$g 2>/dev/null && [ "$n" -lt {ticks} ]; do sleep 0.1; n=$((n+1)); done; '
    f"kill -KILL -$g 2>/dev/null; fi; "
  )
  if job.image:
    script += f"sudo docker rm -f {shlex.quote(job.container)} >/dev/null 2>&1; "
  return script + "true"


def setup_scripts(job: TpuJob) -> list[str]:
  """The remote shell strings every worker runs before the job: unpack, install."""
  scripts = []
  if job.copy and not job.image:
    tarball, target = shlex.quote(job.tarball_name()), shlex.quote(job.remote_dir)
    scripts.append(f"mkdir -p {target} && tar -xzf {tarball} -C {target} && rm -f {tarball}")
  if job.install or job.install_command:
    if job.install_command:
      install = job.install_command  # the user's own shell command, run as given
    elif job.image:
      install = shlex.join(["sudo", "docker", "pull", job.image])
    else:
      install = "python3 -m pip install -e '.[tpu]'"
    if not job.image:
      install = f"cd {shlex.quote(job.remote_dir)} && {install}"
    scripts.append(install)
  return scripts


def _backstop_s(job: TpuJob) -> int:
  # Fires only when this launcher is gone: its own deadline comes first.
  return round(job.timeout_s + job.grace_s + job.term_grace_s + 10)


SHIP_DIR = "ship"  # where `--ship` folders land in the copy


def pack(src: str, dest: str, excludes: Sequence[str] = (), ship: Sequence[str] = ()) -> int:
  """Writes `src` as a gzipped tarball to `dest`, without `DEFAULT_EXCLUDES` or `excludes`.

  Each folder in `ship` goes in as `ship/<its name>/`. Returns how many files went in.
  """
  for folder in (src, *ship):
    if not os.path.isdir(folder):
      raise ValueError(f"{folder=} is not a directory")
  patterns = (*DEFAULT_EXCLUDES, *excludes)
  count = 0

  def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    nonlocal count
    name = os.path.basename(info.name)
    if any(fnmatch.fnmatch(name, p) for p in patterns):
      return None
    count += info.isfile()
    return info

  with tarfile.open(dest, "w:gz") as tar:
    tar.add(src, arcname=".", filter=keep)
    for folder in ship:
      name = os.path.basename(os.path.normpath(folder))
      tar.add(folder, arcname=f"{SHIP_DIR}/{name}", filter=keep)
  return count


def check_config_is_copied(job: TpuJob, command: Sequence[str]) -> None:
  """Raises `ValueError` when `--config=` names a local file the workers will not have.

  The workers run in `remote_dir`, which holds `src` and the shipped folders
  only; a config elsewhere on this machine (a task folder outside the
  checkout) has to be shipped and named by its place in the copy.
  """
  if not job.copy or job.image:
    return
  for arg in command:
    if not arg.startswith("--config="):
      continue
    path = os.path.abspath(arg.split("=", 1)[1])
    copied = [os.path.abspath(job.src), *(os.path.abspath(d) for d in job.ship)]
    if os.path.exists(path) and not any(
      os.path.commonpath([path, root]) == root for root in copied
    ):
      folder = os.path.dirname(path)
      name = os.path.basename(folder)
      raise ValueError(
        f"{arg}: the workers run in --remote-dir={job.remote_dir} with a copy of "
        f"--src={job.src} only, so they cannot see {path}. Ship its folder: "
        f"--ship {folder} and --config={SHIP_DIR}/{name}/{os.path.basename(path)}"
      )


# ---- the plan, for --dry-run ---------------------------------------------------------------


def dry_run_commands(job: TpuJob, command: Sequence[str], workers_per_slice: int) -> list[str]:
  """Every command a run would issue, one per line, pasteable; `#` lines say what is implied.

  Without a slice to describe, the workers' IPs are placeholders.
  """
  if workers_per_slice < 1:
    raise ValueError(f"{workers_per_slice=} must be at least 1")
  lines = []
  if job.create:
    lines.append(shlex.join(queued_resource_create_argv(job)))
  if job.uses_queued_resource:
    lines.append("# repeat until its state is ACTIVE:")
    lines.append(shlex.join(queued_resource_describe_argv(job)))
  nodes = job.nodes()
  lines += [shlex.join(describe_argv(job, node)) for node in nodes]
  tarball = job.local_tarball()
  if job.copy and not job.image:
    lines.append(f"# pack {os.path.abspath(job.src)} into {tarball} (tar.gz, without .git etc.)")
    lines += [shlex.join(scp_argv(job, tarball, node)) for node in nodes]  # then unpack, below
  for script in setup_scripts(job):
    lines += [shlex.join(ssh_argv(job, node, "all", script)) for node in nodes]
  coordinator = f"<{nodes[0]}-worker-0-ip>"
  for s, node in enumerate(nodes):
    for w in range(workers_per_slice):
      env = worker_env(job, s, w, workers_per_slice, coordinator)
      lines.append(shlex.join(ssh_argv(job, node, w, worker_script(job, command, env))))
  lines.append("# on the first failure, or Ctrl-C (then with --term-grace), on every slice:")
  lines += [
    shlex.join(ssh_argv(job, node, "all", kill_script(job, KILL_GRACE_S))) for node in nodes
  ]
  return lines
