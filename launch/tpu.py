"""`spmd-launch tpu`: run one job on every worker of a Cloud TPU VM slice, or of several.

Every step is a `gcloud compute tpus ...` command from `launch/tpu_commands.py`,
which quotes everything user-supplied; this module runs them, in order:
  1. Multislice (`--num-slices N`): create the queued resource if asked
     (`--create`), then wait until it is ACTIVE. Its nodes are NAME-0 ...
     NAME-(N-1): the TPU API names the nodes of a node prefix that way.
  2. `tpu-vm describe` every slice: how many workers, and their internal IPs.
     Worker 0 of slice 0 is the coordinator (and the megascale coordinator).
  3. Code: the local repository, packed here as a tarball, is copied to every
     worker and unpacked in `--remote-dir` (or the job runs in a docker image,
     `--image`); `--install` installs it there (or pulls the image). A task
     folder outside the repository travels with `--ship DIR`, to
     `ship/<name>/` (then `--config=ship/<name>/config.py`); a `--config=` that
     the copy would not hold is an error saying so.
  4. Run: one `tpu-vm ssh --worker=i` per worker, watched here like the local
     target: output prefixed `[wN]`, the first failure named, and then the job
     killed on every worker. Each worker's job runs in its own process group
     (setsid) and records its id in ~/.spmd-launch/TAG.pgid, so one
     `tpu-vm ssh --worker=all` per slice can end it (SIGTERM, a short grace,
     SIGKILL) even when the ssh connection that started it is gone.

A job time limit (`--timeout`) also runs on the workers under `timeout -k`, so a
job outlives a killed launcher by that long at most.

Example:
  spmd-launch tpu --tpu my-v4-32 --zone us-central2-b --install -- \\
      spmd-train --config=configs/lm_small.py --workdir=gs://my-bucket/lm_small

  >>> w = WorkerResult(3, 143, "", slice_id=1, worker=1, node="pod-1", multislice=True)
  >>> w.full_name, w.describe()
  ('slice 1 worker 1 (process 3) on pod-1', 'exit code 143 (killed by SIGTERM)')
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from launch.processes import (
  JobResult,
  OutputReader,
  ProcessResult,
  env_assignment,
  kill_group,
  popen,
  stop_on_signals,
  watch,
)
from launch.tpu_commands import (
  DEFAULT_EXCLUDES,
  KILL_GRACE_S,
  TpuJob,
  check_config_is_copied,
  dry_run_commands,
  kill_script,
  ssh_argv,
  worker_env,
  worker_script,
)
from launch.tpu_setup import (
  TpuLaunchError,
  describe_slice,
  prepare_workers,
  wait_for_queued_resource,
)

SSH_SLACK_S = 60.0  # how long one gcloud ssh may take on top of the remote work


@dataclasses.dataclass(kw_only=True)
class WorkerResult(ProcessResult):
  """How one worker's job ended, as its ssh reported it.

  `returncode` is the remote status; negative, the local ssh got that signal.
  """

  slice_id: int
  worker: int
  node: str
  multislice: bool = False

  @property
  def name(self) -> str:
    if self.multislice:
      return f"slice {self.slice_id} worker {self.worker} (process {self.process_id})"
    return f"worker {self.worker}"

  @property
  def full_name(self) -> str:
    return f"{self.name} on {self.node}"

  def describe(self) -> str:
    code = self.returncode
    if code is not None and code < 0:
      return f"its ssh was stopped here by {signal.Signals(-code).name}"
    if code == 255:
      return "exit code 255 (ssh failed, or the connection was lost)"
    if code is not None and 128 < code < 128 + signal.NSIG:
      try:
        return f"exit code {code} (killed by {signal.Signals(code - 128).name})"
      except ValueError:
        pass
    return super().describe()


class TpuJobResult(JobResult):
  """How the job ended on every worker (`processes`, `WorkerResult`s), and which failed first."""

  members = "workers"
  stop_note = "SIGTERM sent to the job on every worker"

  @property
  def workers(self) -> list[WorkerResult]:
    return self.processes  # every one a WorkerResult


def run_tpu(
  command: Sequence[str],
  job: TpuJob,
  echo: bool = True,
  log_dir: str | None = None,
  stop: threading.Event | None = None,
) -> TpuJobResult:
  """Runs `command` on every worker of the job's slice(s) and waits; fails fast.

  Args:
    command: the program and its arguments, identical on every worker.
    job: the slices, code, install step and limits.
    echo: print each line as it arrives, prefixed `[wN]` (`[sSwN]` for several slices).
    log_dir: also write each worker's output to `log_dir/process_N.log`.
    stop: when set (the launcher got SIGINT/SIGTERM), the job gets SIGTERM on
      every worker so it can save, then SIGKILL after `job.term_grace_s`.

  Returns:
    A `TpuJobResult`. Raises `TpuLaunchError` if a step before the job fails.
  """
  if not command:
    raise ValueError(f"the command to run is empty: {command=}")
  if job.uses_queued_resource:
    wait_for_queued_resource(job, echo, stop)
  nodes = job.nodes()
  slices = [describe_slice(job, node, stop) for node in nodes]
  sizes = {len(ips) for ips in slices}
  if len(sizes) != 1:
    counts = dict(zip(nodes, map(len, slices)))
    raise TpuLaunchError(f"slices differ in their number of workers: {counts}")
  per_slice = sizes.pop()
  prepare_workers(job, nodes, echo, stop)
  return _watch(command, job, nodes, slices, per_slice, echo, log_dir, stop)


def _watch(command, job, nodes, slices, per_slice, echo, log_dir, stop) -> TpuJobResult:
  multislice = len(nodes) > 1
  coordinator = slices[0][0]
  workers: list[WorkerResult] = []
  procs: list[subprocess.Popen] = []
  reader = OutputReader()  # one thread for every worker's ssh, however many workers
  outputs: list[list[str]] = []
  if log_dir:
    os.makedirs(log_dir, exist_ok=True)
  for s, node in enumerate(nodes):
    for w in range(per_slice):
      i = len(procs)
      env = worker_env(job, s, w, per_slice, coordinator)
      workers.append(
        WorkerResult(i, None, "", slice_id=s, worker=w, node=node, multislice=multislice)
      )
      outputs.append([])
      procs.append(popen(ssh_argv(job, node, w, worker_script(job, command, env))))
      prefix = f"[s{s}w{w}]" if multislice else f"[w{w}]"
      log = os.path.join(log_dir, f"process_{i}.log") if log_dir else None
      reader.add(procs[-1].stdout, outputs[i], prefix, echo, log)

  killers: list[tuple[str, subprocess.Popen]] = []

  def kill_everywhere(grace_s: float) -> float:
    """Starts the remote kill on every slice; returns when to give up on the local ssh."""
    _mark_running(workers, procs)
    for node in nodes:
      # In a session of its own (popen): a second Ctrl-C must not cut the kill short.
      killers.append((node, popen(ssh_argv(job, node, "all", kill_script(job, grace_s)))))
    return time.monotonic() + grace_s + SSH_SLACK_S

  try:
    outcome = watch(
      procs,
      job.grace_s,
      job.timeout_s or math.inf,
      stop,
      on_kill=lambda: kill_everywhere(KILL_GRACE_S),
      # The remote kill script itself saves (SIGTERM), waits, then SIGKILLs.
      on_stop=lambda: kill_everywhere(job.term_grace_s),
    )
  finally:
    if any(p.poll() is None for p in procs):
      if not killers:  # an exception got us here: never leave the job running
        kill_everywhere(KILL_GRACE_S)
      for p in procs:  # the remote kill did not end them: end the local side
        if p.poll() is None:
          kill_group(p)
    for p in procs:
      p.wait()
    for node, k in killers:
      try:
        out, _ = k.communicate(timeout=max(KILL_GRACE_S, job.term_grace_s) + SSH_SLACK_S)
      except subprocess.TimeoutExpired:
        k.kill()
        out, _ = k.communicate()
      if k.returncode:
        print(
          f"spmd-launch: stopping the job on {node} failed ({k.returncode}): {out.strip()}",
          file=sys.stderr,
          flush=True,
        )
    reader.join(timeout=5)
  for i, p in enumerate(procs):
    workers[i].returncode = p.returncode
    workers[i].output = "".join(outputs[i])
  return TpuJobResult(workers, outcome.first_failure, outcome.timed_out, outcome.stopped)


def _mark_running(workers: list[WorkerResult], procs: list[subprocess.Popen]) -> None:
  for w, p in zip(workers, procs):
    if p.poll() is None:
      w.killed_by_launcher = True


# ---- the command line ----------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """The flags of `spmd-launch tpu`."""
  _slice_arguments(parser)
  _code_arguments(parser)
  _job_arguments(parser)
  parser.add_argument(
    "--dry-run", action="store_true", help="print every command it would run; run nothing"
  )
  parser.add_argument(
    "--num-workers",
    type=int,
    default=0,
    help="workers per slice, for --dry-run only (a dry run cannot describe the slice)",
  )
  parser.add_argument("command", nargs=argparse.REMAINDER, help="-- program args...")


def _slice_arguments(parser: argparse.ArgumentParser) -> None:
  """Which TPU VMs run the job, and creating their queued resource."""
  parser.add_argument("--tpu", required=True, help="TPU VM name; with --num-slices, the prefix")
  parser.add_argument("--zone", required=True)
  parser.add_argument("--project", default="", help="default: gcloud's configured project")
  parser.add_argument(
    "--num-slices",
    type=int,
    default=1,
    help="multislice: the slices of one queued resource, nodes TPU-0 ... TPU-(N-1)",
  )
  parser.add_argument("--queued-resource", default="", help="its name (default: --tpu)")
  parser.add_argument(
    "--create", action="store_true", help="create the queued resource, then wait until ACTIVE"
  )
  parser.add_argument("--accelerator-type", default="", help="with --create, e.g. v5litepod-16")
  parser.add_argument(
    "--runtime-version", default="", help="with --create, e.g. v2-alpha-tpuv5-lite"
  )
  parser.add_argument(
    "--ready-timeout", type=float, default=3600, help="seconds to wait for the queued resource"
  )
  parser.add_argument("--poll-interval", type=float, default=30, help="seconds between its checks")


def _code_arguments(parser: argparse.ArgumentParser) -> None:
  """What reaches the workers: the copied code and folders, or an image, and its install."""
  parser.add_argument("--src", default=".", help="the local directory copied to every worker")
  parser.add_argument(
    "--remote-dir", default="spmd-harness", help="where the code lives on the workers (under ~)"
  )
  parser.add_argument(
    "--no-copy", action="store_true", help="the code is already in --remote-dir: copy nothing"
  )
  parser.add_argument(
    "--exclude",
    action="append",
    default=[],
    help="a file or directory name pattern left out of the copy (repeatable); "
    f"always left out: {', '.join(DEFAULT_EXCLUDES)}",
  )
  parser.add_argument(
    "--ship",
    action="append",
    default=[],
    metavar="DIR",
    help="also copy this local folder, to ship/<its name>/ beside the code (repeatable): "
    "a task folder outside the checkout, then --config=ship/<name>/config.py",
  )
  parser.add_argument(
    "--image", default="", help="run the command in this docker image instead of copying code"
  )
  parser.add_argument(
    "--install",
    action="store_true",
    help="pip install -e '.[tpu]' in --remote-dir on every worker (with --image: docker pull)",
  )
  parser.add_argument(
    "--install-command",
    default="",
    help="a shell command to install with instead (implies --install)",
  )


def _job_arguments(parser: argparse.ArgumentParser) -> None:
  """The job's environment, ports, time limits and logs."""
  parser.add_argument(
    "--env",
    type=env_assignment,
    action="append",
    default=[],
    metavar="NAME=VALUE",
    help="for the job (repeatable)",
  )
  parser.add_argument("--coordinator-port", type=int, default=8476)
  parser.add_argument("--megascale-port", type=int, default=8080)
  parser.add_argument(
    "--timeout",
    type=float,
    default=0,
    help="seconds for the whole job, also enforced on the workers (0: none)",
  )
  parser.add_argument(
    "--grace",
    type=float,
    default=5.0,
    help="seconds the others get after a failure before the kill",
  )
  parser.add_argument(
    "--term-grace",
    type=float,
    default=60.0,
    help="after Ctrl-C/SIGTERM: seconds the job may take to save, then SIGKILL",
  )
  parser.add_argument("--log-dir", default=None, help="also write process_N.log files here")


def job_from_args(args: argparse.Namespace) -> TpuJob:
  """The `TpuJob` the parsed flags describe; ValueError names a bad flag."""
  env = dict(args.env)
  return TpuJob(
    tpu=args.tpu,
    zone=args.zone,
    project=args.project,
    num_slices=args.num_slices,
    queued_resource=args.queued_resource,
    create=args.create,
    accelerator_type=args.accelerator_type,
    runtime_version=args.runtime_version,
    src=args.src,
    remote_dir=args.remote_dir,
    copy=not args.no_copy,
    excludes=tuple(args.exclude),
    ship=tuple(args.ship),
    image=args.image,
    install=args.install,
    install_command=args.install_command,
    env=env,
    coordinator_port=args.coordinator_port,
    megascale_port=args.megascale_port,
    timeout_s=args.timeout,
    grace_s=args.grace,
    term_grace_s=args.term_grace,
    ready_timeout_s=args.ready_timeout,
    poll_interval_s=args.poll_interval,
  )


def main(args: argparse.Namespace, command: Sequence[str]) -> int:
  """Runs `spmd-launch tpu` with parsed flags; returns the exit code."""
  try:
    job = job_from_args(args)
    check_config_is_copied(job, command)
    if args.dry_run:
      if args.num_workers < 1:
        raise ValueError(
          f"--dry-run cannot describe the slice: give --num-workers (got {args.num_workers})"
        )
      print("\n".join(dry_run_commands(job, command, args.num_workers)))
      return 0
  except ValueError as e:
    print(f"spmd-launch: {e}", file=sys.stderr)
    return 2
  saving = f"asking the job to save and stop on every worker (SIGKILL in {job.term_grace_s:g}s)"
  with stop_on_signals(saving) as stop:
    try:
      result = run_tpu(command, job, log_dir=args.log_dir, stop=stop)
    except TpuLaunchError as e:
      print(f"spmd-launch: {e}", file=sys.stderr)
      return 1
  print(f"spmd-launch: {result.summary()}", file=sys.stderr if not result.ok else sys.stdout)
  return 0 if result.ok else 1
