"""A launcher's child processes: starting them, their output, fail-fast, and how they ended.

What the local and TPU targets share. The local target's children are the
job's processes; the TPU target's are one `gcloud ... ssh` per worker. Either
way a child runs in its own session, one thread (`OutputReader`) collects
every child's output lines (echoed with a prefix, optionally logged), and
`watch` waits for all of them: it names the first failure, gives the others
`grace_s` to end on their own, then calls the target's own kill.

Example:
  >>> import sys
  >>> p = popen([sys.executable, "-c", "print('hi')"])
  >>> lines = []
  >>> reader = OutputReader()
  >>> reader.add(p.stdout, lines, prefix="[p0]", echo=False)
  >>> outcome = watch([p], grace_s=1, timeout_s=10, stop=None, on_kill=lambda: math.inf)
  >>> reader.join(timeout=10), outcome, lines
  (True, Outcome(first_failure=None, timed_out=False, stopped=False), ['hi\\n'])
  >>> ProcessResult(0, -9, "").describe(), ProcessResult(1, 3, "").describe()
  ('killed by SIGKILL', 'exit code 3')
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import dataclasses
import io
import math
import os
import queue
import re
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import IO, ClassVar, NamedTuple

from spmd.errors import EXIT_PEER_FAILED

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


_POLL_S = 0.05  # how soon the reader sees a stream added or a request to stop


class _Echo:
  """Writes text to this process's stdout from a thread of its own, in the order given.

  The reader of the children's pipes hands its lines here and goes back to
  reading: were it to write to stdout itself, a consumer slower than the job
  (a paused terminal, a pipe into a busy process) would stop it, the
  children's pipes would fill, and a child would block in the middle of
  printing why it fails, to be killed there by the fail-fast, its message
  never written; lines already in a pipe were lost when the reader gave up.
  """

  def __init__(self) -> None:
    self._texts: queue.SimpleQueue[str | None] = queue.SimpleQueue()
    self._thread: threading.Thread | None = None
    self._broken = False  # stdout closed: the rest is dropped (the lines are kept elsewhere)

  def put(self, text: str) -> None:
    if self._thread is None:
      self._thread = threading.Thread(target=self._run, name="spmd-launch echo", daemon=True)
      self._thread.start()
    self._texts.put(text)

  def join(self) -> None:
    """Returns once every text put so far is written (or stdout is known to be closed)."""
    if self._thread is not None:
      self._texts.put(None)
      self._thread.join()
      self._thread = None

  def _run(self) -> None:
    while (text := self._texts.get()) is not None:
      if self._broken:
        continue
      try:
        with _ECHO_LOCK:
          sys.stdout.write(text)
          sys.stdout.flush()
      except (OSError, ValueError):  # stdout closed: keep collecting, or the child blocks
        self._broken = True


class _Stream:
  """One child's output: the bytes read so far made into lines, and where they go."""

  def __init__(
    self,
    stream: IO,
    into: list[str],
    prefix: str,
    echo: _Echo | None,
    log_path: str | None,
  ) -> None:
    self.stream, self.fd, self.into = stream, stream.fileno(), into
    self.prefix, self.echo, self.log_path = prefix, echo, log_path
    # What `popen`'s text mode did: its encoding, errors replaced, any newline made "\n".
    encoding = getattr(stream, "encoding", None) or "utf-8"
    self.decoder = io.IncrementalNewlineDecoder(
      codecs.getincrementaldecoder(encoding)(errors="replace"), translate=True
    )
    self.partial = ""

  def read(self) -> bool:
    """Reads what is there (the selector said something is); False at the end of the stream."""
    try:
      data = os.read(self.fd, 1 << 16)
    except OSError:
      data = b""
    self.take(self.decoder.decode(data, final=not data), final=not data)
    return bool(data)

  def take(self, text: str, final: bool = False) -> None:
    *lines, self.partial = (self.partial + text).split("\n")
    lines = [line + "\n" for line in lines]
    if final and self.partial:  # the last line had no newline: it is a line all the same
      lines.append(self.partial)
      self.partial = ""
    if not lines:
      return
    self.into.extend(lines)
    if self.log_path:
      try:
        # Opened for each write, not held: a launcher of hundreds of workers would hold
        # a log descriptor for each. Written as it comes, for whoever watches the log.
        with open(self.log_path, "a") as log:
          log.writelines(lines)
      except OSError as e:
        print(f"spmd-launch: writing {self.log_path} failed ({e})", file=sys.stderr, flush=True)
        self.log_path = None
    if self.echo is not None:
      self.echo.put("".join(f"{self.prefix} {line}" if self.prefix else line for line in lines))

  def close(self) -> None:
    """Takes what the pipe still holds (without waiting for more), then closes it.

    A grandchild of a killed child can hold the pipe open; what the child
    wrote before it died is in the pipe all the same, and may be why it died.
    """
    os.set_blocking(self.fd, False)
    while True:
      try:
        data = os.read(self.fd, 1 << 16)
      except (BlockingIOError, OSError):
        break
      if not data:
        break
      self.take(self.decoder.decode(data))
    self.take(self.decoder.decode(b"", final=True), final=True)
    self.stream.close()


class OutputReader:
  """One thread that collects the output lines of any number of children, as they print them.

  Each stream `add`ed (a `popen` child's stdout) is read whenever it has data
  (a selector), its lines appended to the list that came with it, echoed
  after a prefix (by a thread of its own, so a slow stdout never holds up
  the reading), and appended to a log file; it is closed at its end. One
  thread for all: a TPU launcher has one ssh per worker, and a thread per
  child grew with the slice. Log files are opened per write, so the launcher
  holds one descriptor (the pipe) per running child and a fixed few besides.

  Example:
    >>> import sys
    >>> procs = [popen([sys.executable, "-c", f"print({i}); print('x', end='')"]) for i in (0, 1)]
    >>> outputs = [[], []]
    >>> reader = OutputReader()
    >>> for i, p in enumerate(procs):
    ...   reader.add(p.stdout, outputs[i], prefix=f"[p{i}]", echo=False)
    >>> reader.join(timeout=30), [p.wait() for p in procs], outputs
    (True, [0, 0], [['0\\n', 'x'], ['1\\n', 'x']])
  """

  def __init__(self) -> None:
    self._pending: queue.SimpleQueue[_Stream] = queue.SimpleQueue()
    self._open = 0  # streams added and not at their end yet
    self._changed = threading.Condition()
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._echo = _Echo()

  def add(
    self,
    stream: IO,
    into: list[str],
    prefix: str = "",
    echo: bool = True,
    log_path: str | None = None,
  ) -> None:
    """Reads `stream` until it ends, into `into`; `echo` prints each line after `prefix`.

    With `log_path` each line is also appended to that file (created here, so a
    child that prints nothing still has its log).
    """
    if self._stop.is_set():
      raise RuntimeError(f"this OutputReader was joined; it cannot read {stream!r}")
    if log_path:
      open(log_path, "a").close()
    with self._changed:
      self._open += 1
    # The reader thread registers it: a selector is not to be changed from two threads.
    self._pending.put(_Stream(stream, into, prefix, self._echo if echo else None, log_path))
    if self._thread is None:
      self._thread = threading.Thread(target=self._run, name="spmd-launch output", daemon=True)
      self._thread.start()

  def join(self, timeout: float | None = None) -> bool:
    """Waits until every stream has ended (`timeout` at most), then ends the thread.

    Streams still open then are closed once what they hold is taken (a
    grandchild of a killed child can hold a pipe open for as long as it
    lives). Returns whether all ended, once every line taken is echoed.
    """
    with self._changed:
      ended = self._changed.wait_for(lambda: self._open == 0, timeout)
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
    self._echo.join()
    return ended

  def _ended(self, stream: _Stream) -> None:
    stream.close()
    with self._changed:
      self._open -= 1
      self._changed.notify_all()

  def _register_pending(self, selector: selectors.BaseSelector) -> None:
    while True:
      try:
        stream = self._pending.get_nowait()
      except queue.Empty:
        return
      selector.register(stream.fd, selectors.EVENT_READ, stream)

  def _run(self) -> None:
    with selectors.DefaultSelector() as selector:
      while not self._stop.is_set():
        self._register_pending(selector)
        for key, _ in selector.select(timeout=_POLL_S):
          if not key.data.read():
            selector.unregister(key.fd)
            self._ended(key.data)
      self._register_pending(selector)
      for key in list(selector.get_map().values()):
        selector.unregister(key.fd)
        self._ended(key.data)


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
  """Lower for a likely cause: a signal from outside, then an error exit, then a consequence.

  A consequence is an abort (JAX aborts a process whose peer died) or the
  trainer's own exit for "another process failed first"; a busy machine can
  let both the cause and its consequence end between two polls.
  """
  if returncode == -signal.SIGABRT or returncode == EXIT_PEER_FAILED:
    return 2
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
