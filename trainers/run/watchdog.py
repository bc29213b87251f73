"""A step-progress watchdog: a job whose steps stop advancing ends, naming who stopped.

JAX's heartbeats catch a process that dies or freezes whole (SIGSTOP), but not
one that is alive and stuck: a hook in an endless loop, a hung filesystem
call, a deadlock in user code. Its peers then wait in their next collective
forever. Every process runs this watchdog: the loop reports each finished
step, a thread publishes the step and when it was reached through the
distributed runtime's key-value store, and when no step has finished for
`timeout_s` the thread reads every process's record, says which process
fell behind (the fewest steps), and ends this process with
`EXIT_NO_PROGRESS`. The launcher's fail-fast stops the rest.

A process that fails (any error, e.g. its own batch check) tells the others
through the same store (`publish_failure`, from `spmd-train`'s entry point);
their watchdogs see it within a tick and end them with `EXIT_PEER_FAILED`
and a message naming that process and its error, so every host says why the
job stopped instead of waiting in a collective its peer will never join.

Example:
  >>> import time
  >>> ended = []
  >>> dog = ProgressWatchdog(timeout_s=0.2, first_timeout_s=0.2, on_stuck=ended.append)
  >>> dog.progress(1); time.sleep(0.6); dog.close()
  >>> "no step finished for" in ended[0]
  True
  >>> publish_failure(ValueError("boom"))  # one process: nobody to tell
  False
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import jax

from spmd import multihost
from spmd.errors import EXIT_PEER_FAILED  # another process failed first

log = logging.getLogger(__name__)

EXIT_NO_PROGRESS = 86  # sysexits-free and distinct: the launcher reports it as such
_KEY = "spmd/progress/"
_FAILED = "spmd/failed/"  # process id -> its error
_SEEN = "spmd/failure_seen/"  # process id -> it has read a peer's error


_LEFT = "spmd/left/"  # process id -> it has said why it stops and is exiting now
LEAVE_WAIT_S = 5.0  # how long the coordinator waits for its peers to leave first


def _exit(message: str, code: int = EXIT_NO_PROGRESS) -> None:
  print(f"spmd-train: {message}", file=sys.stderr, flush=True)
  leave(code, LEAVE_WAIT_S)  # the main thread is blocked; only a hard exit ends it


def leave(code: int, wait_s: float = LEAVE_WAIT_S) -> NoReturn:
  """Ends this process now with `code`; the coordinator leaves last.

  Process 0 hosts the distributed runtime's service, and a peer still
  connected when it goes is aborted by the runtime (SIGABRT) before it can
  say why it stopped. So every process marks in the store that it is
  leaving, after it has printed its reason, and process 0 exits only once
  every peer has marked it, or after `wait_s` (a peer may be dead).
  """
  sys.stdout.flush()
  sys.stderr.flush()
  client = multihost.runtime_client()
  if client is not None and jax.process_count() > 1:
    me, count = jax.process_index(), jax.process_count()
    try:
      client.key_value_set(f"{_LEFT}{me}", str(code), allow_overwrite=True)
      deadline = time.monotonic() + (wait_s if me == 0 else 0)
      while time.monotonic() < deadline:
        left = {k.rsplit("/", 1)[-1] for k, _ in client.key_value_dir_get(_LEFT)}
        if len(left - {str(me)}) >= count - 1:
          break
        time.sleep(0.02)
    except Exception as e:  # the store may be gone already; exiting matters more
      log.debug("could not mark this process as leaving: %s", e)
  os._exit(code)


def publish_failure(error: BaseException, wait_s: float = 3.0) -> bool:
  """Tells the other processes' watchdogs that this one failed, and why.

  The coordinator (process 0) hosts the store: it waits up to `wait_s` for
  every other process to have read the error (or failed too) before it goes
  on to exit and takes the store with it. Returns False in a single process
  (nothing to tell).
  """
  # The client first: before the distributed runtime started (a failure in
  # spmd.initialize itself), asking for the process count would start a backend.
  client = multihost.runtime_client()
  if client is None or jax.process_count() == 1:
    return False
  message = " ".join(f"{type(error).__name__}: {error}".split())[:1500]
  me = jax.process_index()
  try:
    client.key_value_set(f"{_FAILED}{me}", message, allow_overwrite=True)
    deadline = time.monotonic() + (wait_s if me == 0 else 0)
    while time.monotonic() < deadline:
      told = {k.rsplit("/", 1)[-1] for k, _ in client.key_value_dir_get(_SEEN)}
      told |= {k.rsplit("/", 1)[-1] for k, _ in client.key_value_dir_get(_FAILED)}
      if len(told - {str(me)}) >= jax.process_count() - 1:
        break
      time.sleep(0.05)
  except Exception as e:  # the store may be gone already; the error itself matters more
    log.debug("could not publish this process's failure: %s", e)
  return True


def _first_peer_failure(client: Any) -> tuple[int, str] | None:
  """(process, error) of the lowest other process that published a failure; marks it seen."""
  me = jax.process_index()
  try:
    failed = {int(k.rsplit("/", 1)[-1]): v for k, v in client.key_value_dir_get(_FAILED)}
  except Exception:
    return None
  failed.pop(me, None)  # this process's own error is on its way out already
  if not failed:
    return None
  try:
    client.key_value_set(f"{_SEEN}{me}", "1", allow_overwrite=True)
  except Exception:
    pass
  p = min(failed)
  return p, failed[p]


def peer_failed_first(error: BaseException) -> str | None:
  """If another process already published a failure, the message naming it.

  A process whose peer died mid-collective gets an error of its own (gloo's
  "Connection reset by peer"), often before its watchdog's next look at the
  store. That error is an echo; the peer's is the cause, so that is what
  this process reports.
  """
  client = multihost.runtime_client()
  if client is None or jax.process_count() == 1:
    return None
  found = _first_peer_failure(client)
  if found is None:
    return None
  p, cause = found
  here = f"{type(error).__name__} here"
  return f"process {jax.process_index()}: stopping ({here}) because process {p} failed: {cause}"


def furthest_behind(records: dict[int, dict], processes: int, now: float) -> str:
  """Who fell behind, from each process's last published `{"step", "time"}` record.

  The fewest steps, not the oldest progress: a healthy host dispatches ahead
  asynchronously and may have finished its last step before the stuck one
  finished its own, earlier step. Processes tied at the fewest steps are all
  named: a record can be stale (a peer's watchdog held up before publishing
  its latest step), and guessing between them by time named the healthy
  process in a test once.

  Example:
    >>> records = {0: {"step": 7, "time": 95.0}, 1: {"step": 6, "time": 96.0}}
    >>> furthest_behind(records, 2, now=100.0)
    'process 1 is furthest behind (last progress per process: 0: step 7 5s ago, 1: step 6 4s ago)'
    >>> furthest_behind({0: {"step": 6, "time": 95.0}, 1: {"step": 6, "time": 96.0}}, 2, 100.0)[:40]
    'processes [0, 1] are furthest behind, at'
    >>> furthest_behind({0: {"step": 3, "time": 99.0}}, 2, 100.0)[:35]
    'processes [1] never finished a step'
  """
  seen = ", ".join(
    f"{p}: step {r['step']} {now - r['time']:.0f}s ago" for p, r in sorted(records.items())
  )
  missing = sorted(set(range(processes)) - set(records))
  if missing:
    return f"processes {missing} never finished a step (last progress per process: {seen})"
  fewest = min(r["step"] for r in records.values())
  behind = sorted(p for p, r in records.items() if r["step"] == fewest)
  if len(behind) == 1:
    who = f"process {behind[0]} is furthest behind"
  else:
    who = f"processes {behind} are furthest behind, at step {fewest}"
  return f"{who} (last progress per process: {seen})"


class ProgressWatchdog:
  """Ends the process after `timeout_s` without a finished step (first step: `first_timeout_s`).

  Args:
    timeout_s: seconds allowed between two finished steps; 0 disables (a
      multi-process job still watches for failed peers).
    first_timeout_s: seconds allowed for the first step (compilation, restore).
    on_stuck: what to do with the message; default: print it and exit
      with `EXIT_NO_PROGRESS`.
    on_peer_failed: what to do when another process published a failure;
      default: print the message and exit with `EXIT_PEER_FAILED`.
  """

  def __init__(
    self,
    timeout_s: float,
    first_timeout_s: float,
    on_stuck: Callable[[str], None] | None = None,
    on_peer_failed: Callable[[str], None] | None = None,
  ):
    self._timeout, self._first_timeout = timeout_s, first_timeout_s
    self._on_stuck = on_stuck or _exit
    self._on_peer_failed = on_peer_failed or (lambda m: _exit(m, EXIT_PEER_FAILED))
    self._step: int | None = None
    self._since = time.monotonic()
    self._phase: tuple[str, float, str] | None = None  # (what, limit, config key)
    self._published: int | None = None
    self._stop = threading.Event()
    self._client = multihost.runtime_client() if jax.process_count() > 1 else None
    self._thread = None
    if timeout_s > 0 or self._client is not None:
      self._thread = threading.Thread(target=self._watch, name="spmd-watchdog", daemon=True)
      self._thread.start()

  def progress(self, step: int) -> None:
    """Called by the loop after each step (and after long hooks): cheap, no I/O."""
    self._step, self._since = step, time.monotonic()

  @contextlib.contextmanager
  def phase(self, what: str, timeout_s: float, key: str) -> Iterator[None]:
    """Within: `what` (a save, an eval) has its own limit, `timeout_s` (0: none).

    A save or an eval is not a step: timed by the step limit, a save slower
    than one step would end the job and lose the very save it waited for.
    Peer failures are still relayed meanwhile. `key` names the setting in
    the message.

    Example:
      >>> stuck = []
      >>> dog = ProgressWatchdog(0.2, 0.2, on_stuck=stuck.append)
      >>> with dog.phase("a save", 5.0, "checkpoint.save_timeout_s"):
      ...   time.sleep(0.6)  # three step limits, well inside the save's
      >>> dog.close(); stuck
      []
    """
    outer = self._phase  # phases nest: a save inside a hook's end of run
    self._phase, self._since = (what, timeout_s, key), time.monotonic()
    try:
      yield
    finally:
      self._phase, self._since = outer, time.monotonic()

  def _publish(self) -> None:
    if self._client is None or self._step == self._published:
      return
    record = json.dumps({"step": self._step, "time": time.time()})
    try:
      self._client.key_value_set(f"{_KEY}{jax.process_index()}", record, allow_overwrite=True)
      self._published = self._step
    except Exception as e:  # the store may be gone at shutdown; the watchdog must not die
      log.debug("watchdog: could not publish progress: %s", e)

  def _peers(self) -> dict[int, dict]:
    if self._client is None:
      return {}
    try:
      rows = self._client.key_value_dir_get(_KEY)
    except Exception:
      return {}
    return {int(k.rsplit("/", 1)[-1]): json.loads(v) for k, v in rows}

  def _limit(self) -> tuple[float, str]:
    if self._phase is not None:
      return self._phase[1], self._phase[2]
    if self._step is None:
      return self._first_timeout, "train.first_step_timeout_s"
    return self._timeout, "train.step_timeout_s"

  def describe(self, waited: float) -> str:
    """The message: how long, and which process has finished the fewest steps."""
    limit, key = self._limit()
    where = "before the first step" if self._step is None else f"after step {self._step}"
    if self._phase is not None:
      message = (
        f"process {jax.process_index()}: {self._phase[0]} did not finish in {waited:.0f}s "
        f"({where}; limit {limit:g}s, {key})"
      )
    else:
      message = (
        f"process {jax.process_index()}: no step finished for {waited:.0f}s "
        f"({where}; limit {limit:g}s, {key})"
      )
    peers = self._peers()
    if peers and self._step is not None:
      # This process's own record may be stale: its watchdog thread can be
      # held up between a step and the next publish (the GIL, a slow
      # coordination service), so the record may lag a step behind. What it
      # knows of itself is current.
      since_wall = time.time() - (time.monotonic() - self._since)
      peers[jax.process_index()] = {"step": self._step, "time": since_wall}
    if peers:
      message += "; " + furthest_behind(peers, jax.process_count(), time.time())
    return message

  def peer_failure(self) -> str | None:
    """The message for the first other process that published a failure, if any."""
    if self._client is None:
      return None
    found = _first_peer_failure(self._client)
    if found is None:
      return None
    p, error = found
    where = "before its first step" if self._step is None else f"at step {self._step}"
    return f"process {jax.process_index()}: stopping ({where}) because process {p} failed: {error}"

  def _watch(self) -> None:
    tick = min(1.0, self._timeout / 4) if self._timeout > 0 else 1.0
    while not self._stop.wait(tick):
      self._publish()
      failure = self.peer_failure()
      if failure:
        time.sleep(0.2)  # let the failed process exit first: the launcher names the first
        self._on_peer_failed(failure)
        return
      limit, _ = self._limit()
      if self._timeout <= 0 or limit <= 0:
        continue
      waited = time.monotonic() - self._since
      if waited > limit:
        self._on_stuck(self.describe(waited))
        return

  def close(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=5)
