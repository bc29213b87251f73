"""The steps of `spmd-launch tpu` before the job: queued resource, slices, code, install.

Each step runs one gcloud command from `launch/tpu_commands.py` to its end
with `run_step`, which streams its output (prefixed `[step]`), or captures it
for a step that returns JSON, and raises `TpuLaunchError` naming the step and
the command when it fails, hangs, or the launcher is asked to stop.

Example:
  >>> import sys
  >>> run_step([sys.executable, "-c", "print('ready')"], "check", 30, echo=False)
  'ready\\n'
  >>> try:
  ...   run_step([sys.executable, "-c", "raise SystemExit(3)"], "check", 30, echo=False)
  ... except TpuLaunchError as e:
  ...   print(str(e).split(":")[0])
  check failed (exit code 3)
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from launch.processes import OutputReader, kill_group, popen
from launch.tpu_commands import (
  TpuJob,
  describe_argv,
  gcloud,
  pack,
  queued_resource_create_argv,
  queued_resource_describe_argv,
  scp_argv,
  setup_scripts,
  ssh_argv,
)

_BAD_QUEUED_STATES = ("FAILED", "SUSPENDING", "SUSPENDED", "DELETING")


class TpuLaunchError(RuntimeError):
  """A step before the job (queued resource, describe, copy, install) failed."""


def _say(message: str, echo: bool) -> None:
  if echo:
    print(f"spmd-launch: {message}", file=sys.stderr, flush=True)


def run_step(
  argv: Sequence[str],
  what: str,
  timeout_s: float,
  echo: bool = True,
  stop: threading.Event | None = None,
  capture: bool = False,
) -> str:
  """Runs one setup command to the end; its output is streamed (or returned, `capture`).

  Raises `TpuLaunchError` naming the step on failure, past `timeout_s`, or on `stop`.
  """
  # gcloud's ssh children are in its group: kill_group reaches them.
  p = popen(argv, stderr=subprocess.PIPE if capture else subprocess.STDOUT)
  lines: list[str] = []
  errors: list[str] = []
  reader = OutputReader()
  reader.add(p.stdout, lines, f"[{what}]", echo and not capture)
  if capture:
    reader.add(p.stderr, errors, echo=False)
  deadline = time.monotonic() + timeout_s
  why = None
  while p.poll() is None:
    if stop is not None and stop.is_set():
      why = "stopped by a signal"
    elif time.monotonic() > deadline:
      why = f"no answer within {timeout_s:g}s"
    if why:
      kill_group(p)
      break
    time.sleep(0.05)
  p.wait()
  reader.join(timeout=5)
  if why or p.returncode:
    tail = "".join((errors or lines)[-20:]).rstrip()
    reason = why or f"exit code {p.returncode}"
    raise TpuLaunchError(f"{what} failed ({reason}): {shlex.join(argv)}\n{tail}".rstrip())
  return "".join(lines)


def wait_for_queued_resource(
  job: TpuJob, echo: bool = True, stop: threading.Event | None = None
) -> None:
  """Creates the queued resource when `job.create`, then waits until it is ACTIVE."""
  name = job.queued_resource or job.tpu
  if job.create:
    run_step(queued_resource_create_argv(job), "create", 600, echo, stop)
  deadline = time.monotonic() + job.ready_timeout_s
  state = None
  while True:
    answer = run_step(queued_resource_describe_argv(job), "describe", 120, False, stop, True)
    try:
      state = json.loads(answer).get("state", {})
    except json.JSONDecodeError as e:
      raise TpuLaunchError(f"queued resource {name!r}: describe gave no JSON ({e})") from None
    current = state.get("state") if isinstance(state, dict) else state
    if current == "ACTIVE":
      return
    if current in _BAD_QUEUED_STATES:
      raise TpuLaunchError(f"queued resource {name!r} is {current}: {json.dumps(state)}")
    if time.monotonic() + job.poll_interval_s > deadline:
      raise TpuLaunchError(
        f"queued resource {name!r} not ACTIVE within {job.ready_timeout_s:g}s "
        f"(last state {current!r}); it is still queued, delete it with: "
        + shlex.join(gcloud(job, "queued-resources", "delete", name))
      )
    _say(f"queued resource {name!r} is {current}; asking again in {job.poll_interval_s:g}s", echo)
    if stop is not None and stop.wait(job.poll_interval_s):
      raise TpuLaunchError(f"stopped by a signal while waiting for queued resource {name!r}")
    if stop is None:
      time.sleep(job.poll_interval_s)


def describe_slice(job: TpuJob, node: str, stop: threading.Event | None = None) -> list[str]:
  """The internal IP of every worker of `node`, worker 0 first."""
  answer = run_step(describe_argv(job, node), "describe", 120, False, stop, capture=True)
  try:
    endpoints = json.loads(answer).get("networkEndpoints") or []
    ips = [e["ipAddress"] for e in endpoints]
  except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
    raise TpuLaunchError(
      f"TPU {node!r}: no networkEndpoints[].ipAddress in describe ({e})"
    ) from None
  if not ips:
    raise TpuLaunchError(f"TPU {node!r} has no workers (networkEndpoints is empty); is it READY?")
  return ips


def prepare_workers(
  job: TpuJob, nodes: Sequence[str], echo: bool = True, stop: threading.Event | None = None
) -> None:
  """Copies the code to every worker of every slice, unpacks it, and installs if asked."""
  if job.copy and not job.image:
    tarball = job.local_tarball()
    try:
      count = pack(job.src, tarball, job.excludes, job.ship)
      _say(f"copying {count} files from {os.path.abspath(job.src)} to every worker", echo)
      for node in nodes:
        run_step(scp_argv(job, tarball, node), f"scp {node}", 1800, echo, stop)
    finally:
      if os.path.exists(tarball):
        os.remove(tarball)
  for script in setup_scripts(job):
    for node in nodes:
      run_step(ssh_argv(job, node, "all", script), f"setup {node}", 3600, echo, stop)
