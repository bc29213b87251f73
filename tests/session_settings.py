"""What every process of a pytest run shares: fast compiles and one compilation cache.

`conftest.py` calls `apply()` before JAX starts, in the pytest process and
(through the environment) in every xdist worker and every job a test starts:

- XLA's cheapest CPU pipeline (`FAST_COMPILE_FLAGS`). Compiling is most of
  the suite's time. These flags change how fast XLA compiles and, with the
  classic emitters, the last bit of some results, never more: a test that
  compares two runs compares two runs compiled alike, and one that compares
  layouts to the last bit compiles them with the default emitters
  (`DEFAULT_EMITTERS`, `default_emitters()`). A test that checks the default
  pipeline itself (the README's demo) takes `default_pipeline_env()`.
- One persistent compilation cache for the whole run, with no minimum
  compile time, so a program compiled by one test, worker or job is read
  back by the next. It is on from the first compile, so no test depends on
  another having switched it on. Tests that read XLA's log keep it off for
  their compile (`spmd.compiler_log`).
- Each process of a job compiles what the cache lacks itself. JAX's
  `jax_share_binary_between_hosts` (process 0 compiles, the others wait for
  its program) hung jobs beside this cache: when process 0 finds a program
  there and process 1 does not (another job wrote it between their reads,
  or process 1 read it half-written), process 1 waits for a compile process
  0 never shares, until the job's limit, gloo's deadline at the next
  collective or JAX's shutdown barrier ends the job. One cache a worker did
  not end it (a job's processes still disagreed about some programs).
- Bytecode written and read back (`__pycache__`, git-ignored), whatever
  `PYTHONDONTWRITEBYTECODE` says: every process a test starts imports the
  checkout's few hundred modules, and without bytecode each compiles them
  all again (about 0.2 CPU s a process, hundreds of processes a run).

The first process to call `apply()` (the pytest controller under xdist)
owns the session folder and removes it when the run ends; the processes it
starts find it through `SESSION_DIR_ENV`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

SESSION_DIR_ENV = "SPMD_TEST_SESSION_DIR"
# XLA:CPU's backend optimization level 0 compiles much sooner;
# `--xla_llvm_disable_expensive_passes` added little. XLA:CPU's classic
# emitters (`--xla_cpu_use_fusion_emitters=false`) compile a tiny train step
# in a quarter of the time, but differ in the last bit between layouts the
# default emitters compute alike (scanned and unrolled layers, a step on 2 x 2 and on
# 4 x 1). Users compile with the default emitters, so the comparisons to the
# last bit across layouts do too: in process with `DEFAULT_EMITTERS` as a
# compile's options, and for a test's jobs with `default_emitters()` (those
# runs alone: the default emitters compile slower).
# One job is known to hang
# under level 0: a whole-split eval on one process of 2 CPU devices waits
# in its all-reduce for a device that never arrives, until XLA aborts it (with
# the flag always, without it mostly); tests/test_eval_export.py's jobs keep
# the default pipeline.
CLASSIC_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", CLASSIC_EMITTERS)
# A compile's options that bring XLA:CPU's default emitters back for that compile:
# `jax.jit(f, compiler_options=DEFAULT_EMITTERS)` or `.compile(DEFAULT_EMITTERS)`.
DEFAULT_EMITTERS = {"xla_cpu_use_fusion_emitters": True}
# No size limit for the cache (JAX's default), so no eviction and no access-time
# files: with a limit, a job killed between writing an entry and its access
# time (the fault tests kill jobs) leaves an entry that every later write's
# eviction scan fails on, and nothing more is cached for the rest of the run.
# A reader that finds an entry half-written gets a decompression error, which
# JAX reports as a warning before it compiles the program itself.

_owned: list[Path] = []


def session_dir() -> Path:
  """The folder every process of this pytest run shares (made by `apply`)."""
  return Path(os.environ[SESSION_DIR_ENV])


def compilation_cache_dir() -> str:
  """The run's one persistent compilation cache: give it to a config's `compilation_cache_dir`."""
  return os.environ["JAX_COMPILATION_CACHE_DIR"]


def with_fast_compile(flags: str) -> str:
  """`flags` (an XLA_FLAGS value) with the fast compile flags, each once.

  >>> with_fast_compile("--xla_dump_to=/tmp/x").split()[1:] == list(FAST_COMPILE_FLAGS)
  True
  >>> with_fast_compile(" ".join(FAST_COMPILE_FLAGS)) == " ".join(FAST_COMPILE_FLAGS)
  True
  """
  words = flags.split()
  return " ".join([*words, *(f for f in FAST_COMPILE_FLAGS if f not in words)])


def default_pipeline_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
  """`env` (default: this process's) with XLA's default pipeline: the fast flags removed.

  >>> default_pipeline_env({"XLA_FLAGS": "--a=1 --xla_backend_optimization_level=0"})["XLA_FLAGS"]
  '--a=1'
  """
  out = dict(os.environ if env is None else env)
  out["XLA_FLAGS"] = _without(out.get("XLA_FLAGS", ""), FAST_COMPILE_FLAGS)
  return out


def _without(flags: str, dropped: tuple[str, ...]) -> str:
  """An XLA_FLAGS value with the flags in `dropped` taken out."""
  return " ".join(f for f in flags.split() if f not in dropped)


@contextlib.contextmanager
def default_emitters() -> Iterator[None]:
  """Within the block (or the decorated test or fixture), the processes this one starts
  compile with XLA:CPU's default emitters.

  For jobs whose results are compared to the last bit with a run on another
  layout (this process's own compiles keep the flags its backend started with).

  >>> with default_emitters():
  ...   CLASSIC_EMITTERS in os.environ["XLA_FLAGS"]
  False
  """
  before = os.environ.get("XLA_FLAGS")
  os.environ["XLA_FLAGS"] = _without(before or "", (CLASSIC_EMITTERS,))
  try:
    yield
  finally:
    if before is None:
      os.environ.pop("XLA_FLAGS", None)
    else:
      os.environ["XLA_FLAGS"] = before


def apply() -> None:
  """Sets this process's environment for the run; call before JAX starts its backend."""
  if SESSION_DIR_ENV not in os.environ:
    folder = Path(tempfile.mkdtemp(prefix="spmd-tests-"))
    _owned.append(folder)
    os.environ[SESSION_DIR_ENV] = str(folder)
  os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
  sys.dont_write_bytecode = False
  os.environ["XLA_FLAGS"] = with_fast_compile(os.environ.get("XLA_FLAGS", ""))
  os.environ["JAX_COMPILATION_CACHE_DIR"] = str(session_dir() / "jax_cache")
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"


def clean_up() -> None:
  """Removes the session folder, where this process made it."""
  for folder in _owned:
    shutil.rmtree(folder, ignore_errors=True)
  _owned.clear()
