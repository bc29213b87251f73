"""Processes meet after compiling a program that spans them, before its first run.

Why: the agreement check (`multihost.check_agreement`) runs when JAX traces,
before it compiles, and compiling can end far apart on different hosts: a
host under load, a persistent-cache hit on one host and not another. XLA's
CPU collectives (gloo) open their communicators at a program's first run
and wait a fixed 30 s for every peer, so a process that finished compiling
30 s before another fails with `Gloo context initialization failed:
DEADLINE_EXCEEDED`, and the job ends. A barrier of the distributed runtime,
whose timeout is ours, between the compile and the first run brings the
first runs within milliseconds of each other.

How: `expect(name)` is called at trace time for a program that spans
processes (`sharded_jit` does it for every new signature). JAX reports each
finished backend compile to its monitoring listeners, in the compiling
thread, before the program runs; the listener here meets the other processes
when the compiled program is one it expects. Programs compiled ahead of time
(`.lower(...).compile()`) meet with `meet(what)` before their first call, or
come from `compile_together`.
A cached program neither traces nor compiles, so steady calls pay nothing.

Every process must compile the same cross-process programs in the same
order (as every process traces them: the agreement check's rule), so the
meetings are numbered.

Example (one process: nothing to wait for):
  >>> expect("step")
  >>> meet("decode")
"""

from __future__ import annotations

import itertools
import os
import threading
from typing import Any

import jax

from spmd import multihost

TIMEOUT_ENV = "SPMD_COMPILE_MEETING_TIMEOUT_S"
# Long: it bounds how far apart two hosts may finish one compile, which for
# a large model on a loaded host is minutes; a process that dies meanwhile
# ends the job through the runtime's heartbeat, not through this timeout.
DEFAULT_TIMEOUT_S = 900.0
# What JAX names the event (`jax._src.dispatch.BACKEND_COMPILE_EVENT`); it
# passes the program's name, e.g. "jit(train_step)", as `fun_name`.
_COMPILED_EVENT = "/jax/core/compile/backend_compile_duration"

_meetings = itertools.count()
_expected = threading.local()  # tracing and compiling happen in one thread
_registered = False
_register_lock = threading.Lock()


def timeout_s() -> float:
  return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


def expect(name: str) -> None:
  """The next compile of the program named `name` meets every process before it runs.

  A no-op in one process. Call it while tracing (the compile follows).
  """
  if multihost.runtime_client() is None or jax.process_count() == 1:
    return
  _listen()
  pending = getattr(_expected, "names", None)
  if pending is None:
    pending = _expected.names = []
  pending.append(name)


def meet(what: str) -> None:
  """Waits until every process reaches this point (after compiling `what`).

  Raises `multihost.AgreementError` naming `what` when some process does not
  arrive within `SPMD_COMPILE_MEETING_TIMEOUT_S` seconds.
  """
  if multihost.runtime_client() is None or jax.process_count() == 1:
    return
  seq = next(_meetings)
  timeout = timeout_s()
  try:
    multihost.barrier(f"compiled/{seq}", timeout_s=timeout)
  except Exception as e:  # the runtime raises a bare XlaRuntimeError
    raise multihost.AgreementError(
      f"{what}: some process did not finish compiling it within {timeout:g}s of this one "
      f"(raise {TIMEOUT_ENV} for a slower compile), or it died: {e}"
    ) from None


def compile_together(what: str, jitted: Any, *args: Any, **kwargs: Any) -> Any:
  """`jitted.lower(*args, **kwargs).compile()`, then `meet(what)`: ready to run on every process.

  For programs that span processes and are compiled ahead of time, or by a
  plain `jax.jit` whose first run must not leave a slower host behind.
  """
  compiled = jitted.lower(*args, **kwargs).compile()
  meet(what)
  return compiled


def _listen() -> None:
  global _registered
  with _register_lock:
    if not _registered:
      jax.monitoring.register_event_duration_secs_listener(_on_compiled)
      _registered = True


def _on_compiled(event: str, duration: float, **kwargs) -> None:
  if event != _COMPILED_EVENT:
    return
  pending = getattr(_expected, "names", None)
  if not pending:
    return
  program = str(kwargs.get("fun_name", ""))
  for i, name in enumerate(pending):
    # Other programs may compile in between: small eager ones while tracing.
    if program == name or program.endswith(f"({name})"):
      del pending[i]
      meet(program)
      return
