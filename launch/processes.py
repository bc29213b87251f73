"""A launcher's child processes: starting them, their output, fail-fast, and how they ended.

What the local and TPU targets share. The local target's children are the
job's processes; the TPU target's are one `gcloud ... ssh` per worker. Either
way a child runs in its own session, a thread collects its output lines
(echoed with a prefix, optionally logged), and `watch` waits for all of them:
it names the first failure, gives the others `grace_s` to end on their own,
then calls the target's own kill.

Example:
  >>> import sys
  >>> p = popen([sys.executable, "-c", "print('hi')"])
  >>> lines = []
  >>> reader = read_lines(p.stdout, lines, prefix="[p0]", echo=False)
  >>> outcome = watch([p], grace_s=1, timeout_s=10, stop=None, on_kill=lambda: math.inf)
  >>> reader.join(); outcome, lines
  (Outcome(first_failure=None, timed_out=False, stopped=False), ['hi\\n'])
  >>> ProcessResult(0, -9, "").describe(), ProcessResult(1, 3, "").describe()
  ('killed by SIGKILL', 'exit code 3')
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import IO, ClassVar, NamedTuple

_ECHO_LOCK = threading.Lock()  # one line at a time on stdout, whichever child printed it


@dataclasses.dataclass
class ProcessResult:
  """How one process of a job ended."""

  process_id: int
  returncode: int | None  # negative: killed by that signal
  output: str  # stdout and stderr, interleaved as printed
  killed_by_launcher: bool = False

  @property
  def name(self) -> str:
    return f"process {self.process_id}"

  @property
  def full_name(self) -> str:
    """The name and where it ran, for the line that names the first failure."""
    return self.name

  def describe(self) -> str:
    if self.returncode is None:
      return "still running"
    if self.returncode < 0:
      return f"killed by {signal.Signals(-self.returncode).name}"
    if self.returncode == 124:
      return "timed out (exit 124 from timeout)"
    return f"exit code {self.returncode}"


@dataclasses.dataclass
class JobResult:
  """How a job ended: per process, and which failed first."""

  processes: list[ProcessResult]
  first_failure: int | None  # an index into `processes`
  timed_out: bool
  stopped: bool = False  # the launcher was asked to stop and passed SIGTERM on to the job

  members: ClassVar[str] = "processes"  # what the summary calls them
  stop_note: ClassVar[str] = "SIGTERM forwarded to every process"

  @property
  def ok(self) -> bool:
    return self.first_failure is None and not self.timed_out

  def summary(self) -> str:
    if self.ok:
      done = f"all {len(self.processes)} {self.members} exited 0"
      return f"stopped by a signal; {done} (saved)" if self.stopped else done
    lines = []
    if self.stopped:
      lines.append(f"stopped by a signal to the launcher ({self.stop_note})")
    if self.timed_out:
      lines.append("the job ran past its time limit and was killed")
    if self.first_failure is not None:
      p = self.processes[self.first_failure]
      lines.append(f"{p.full_name} failed first: {p.describe()}")
    for p in self.processes:
      lines.append(
        f"  {p.name}: {p.describe()}"
        + (" (stopped by the launcher)" if p.killed_by_launcher else "")
      )
    return "\n".join(lines)

  def report(self) -> str:
    """The summary followed by every process's output, for test failures."""
    parts = [self.summary()]
    for p in self.processes:
      parts.append(f"----- {p.name} ({p.describe()}) -----\n{p.output}")
    return "\n".join(parts)


def popen(
  argv: Sequence[str],
  stderr: int = subprocess.STDOUT,
  cwd: str | None = None,
  env: Mapping[str, str] | None = None,
) -> subprocess.Popen:
  """Starts `argv` with its output piped as text and no stdin, in a session of its own.

  Its own session, so its own process group: `kill_group` reaches its children
  too, and Ctrl-C on the terminal reaches only the launcher, which decides what
  the job gets.
  """
  return subprocess.Popen(
    list(argv),
    stdout=subprocess.PIPE,
    stderr=stderr,
    stdin=subprocess.DEVNULL,
    text=True,
    errors="replace",
    cwd=cwd,
    env=env,
    start_new_session=True,
  )


def read_lines(
  stream: IO[str],
  into: list[str],
  prefix: str = "",
  echo: bool = True,
  log_path: str | None = None,
) -> threading.Thread:
  """Starts a thread that appends every line of `stream` to `into` until it closes.

  With `echo` each line is printed as it arrives, after `prefix`; with
  `log_path` it is also appended to that file.
  """

  def pump() -> None:
    with open(log_path, "a") if log_path else contextlib.nullcontext() as log:
      for line in iter(stream.readline, ""):
        into.append(line)
        if log:
          log.write(line)
          log.flush()  # the log is how a test or a person sees a job that is still running
        if echo:
          with _ECHO_LOCK:
            sys.stdout.write(f"{prefix} {line}" if prefix else line)
            sys.stdout.flush()
    stream.close()

  reader = threading.Thread(target=pump, daemon=True)
  reader.start()
  return reader


def signal_group(p: subprocess.Popen, sig: int) -> None:
  """Sends `sig` to the process group `p` leads (see `popen`); a group already gone is fine."""
  try:
    os.killpg(p.pid, sig)
  except ProcessLookupError:
    pass


def kill_group(p: subprocess.Popen) -> None:
  signal_group(p, signal.SIGKILL)


class Outcome(NamedTuple):
  """How `watch` ended: which process failed first, past the time limit, or asked to stop."""

  first_failure: int | None
  timed_out: bool
  stopped: bool


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # what a shell accepts as a variable name


def env_assignment(text: str) -> tuple[str, str]:
  """An argparse type for `--env NAME=VALUE`: the pair, or an error naming the text.

  Example:
    >>> env_assignment("XLA_FLAGS=--a=1 --b")
    ('XLA_FLAGS', '--a=1 --b')
  """
  name, sep, value = text.partition("=")
  if not sep or not ENV_NAME.fullmatch(name):
    raise argparse.ArgumentTypeError(
      f"expected NAME=VALUE with a valid variable name, got {text!r}"
    )
  return name, value


def _consequence_rank(returncode: int) -> int:
  """Lower for a likely cause: a signal from outside, then an error exit, then an abort."""
  if returncode == -signal.SIGABRT:
    return 2  # JAX aborts a process whose peer died
  return 0 if returncode < 0 else 1


def watch(
  procs: Sequence[subprocess.Popen],
  grace_s: float,
  timeout_s: float,
  stop: threading.Event | None,
  on_kill: Callable[[], float],
  on_stop: Callable[[], float] | None = None,
  kill_after_stop_s: float = math.inf,
) -> Outcome:
  """Waits until every process has exited; fails fast.

  After the first process that exits non-zero, the others get `grace_s` to end
  on their own (they usually do, and print why), then `on_kill()` ends them.
  Past `timeout_s` (math.inf: no limit) `on_kill()` comes at once. When `stop`
  is set, `on_stop()` (if given) asks the job to save and exit, and `on_kill()`
  follows `kill_after_stop_s` later if it has not; `on_stop` comes once at most.

  `on_kill` and `on_stop` return when to give up waiting (time.monotonic();
  math.inf: wait): a kill that cannot be seen to work here, such as one over
  ssh, bounds the wait. Processes still running then are the caller's to end.
  """
  first_failure = None
  timed_out = stopping = False
  deadline = time.monotonic() + timeout_s
  kill_at = None
  give_up_at = math.inf
  while True:
    if stop is not None and stop.is_set() and not stopping:
      stopping = True  # once: the job's preemption path saves
      give_up_at = on_stop() if on_stop else math.inf
      kill_at = time.monotonic() + kill_after_stop_s
    codes = [p.poll() for p in procs]
    failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
    if first_failure is None and failed:
      # Several can end between two polls: a killed process's peers abort
      # within milliseconds (JAX's fatal error is SIGABRT). Name the cause.
      first_failure = min(failed, key=lambda i: _consequence_rank(codes[i]))
      kill_at = min(kill_at or math.inf, time.monotonic() + grace_s)
    if all(c is not None for c in codes):
      break
    now = time.monotonic()
    if now > deadline and kill_at is None:
      timed_out = True
      kill_at = now
    if kill_at is not None and now >= kill_at:
      give_up_at = on_kill()
      kill_at = math.inf
    if now >= give_up_at:
      break
    time.sleep(0.05)
  return Outcome(first_failure, timed_out, stopping)


@contextlib.contextmanager
def stop_on_signals(what_happens: str) -> Iterator[threading.Event]:
  """While inside, SIGINT and SIGTERM set the event it yields instead of ending the launcher.

  Each one prints `spmd-launch: SIGNAME: ` and `what_happens`. The previous
  handlers come back on the way out.
  """
  stop = threading.Event()

  def request_stop(signum, frame):
    print(
      f"spmd-launch: {signal.Signals(signum).name}: {what_happens}", file=sys.stderr, flush=True
    )
    stop.set()

  previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
  try:
    yield stop
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)
