"""What every process of a pytest run shares: fast compiles and one compilation cache.

`conftest.py` calls `apply()` before JAX starts, in the pytest process and
(through the environment) in every xdist worker and every job a test starts:

- XLA's cheapest CPU pipeline (`FAST_COMPILE_FLAGS`). Compiling is most of
  the suite's time, and these flags change how fast XLA compiles, not what
  a program computes: a test that compares two runs compares two runs
  compiled alike. A test that checks the default pipeline itself (the
  README's demo) takes `default_pipeline_env()`.
- One persistent compilation cache for each xdist worker, with no minimum
  compile time, so a program compiled by one test or job is read back by
  the next on that worker. It is on from the first compile, so no test
  depends on another having switched it on. Tests that read XLA's log keep
  it off for their compile (`spmd.compiler_log`). Not one for the whole
  run: with the compile shared between a job's processes (below), a job
  whose process 0 finds a program in the cache and whose process 1 does
  not (another worker's job wrote it between their two reads, or process 1
  read it half-written) hangs: process 1 waits for a compile process 0
  never shares, until the job's limit or JAX's shutdown barrier ends it.
  A worker runs one test at a time, so only the job it runs writes its
  cache, and only that job's process 0.
- One compile per job, not one per process: a program that spans the
  processes of a job and is not in the cache yet is compiled by the process
  holding its first device and handed to the others through JAX's
  distributed key-value store (`jax_share_binary_between_hosts`). The
  processes of a job compile the same program (SPMD), so the others' compiles
  were the same work done again, on the same two cores.
  Programs on one process's devices alone never wait for another.
- Bytecode written and read back (`__pycache__`, git-ignored), whatever
  `PYTHONDONTWRITEBYTECODE` says: every process a test starts imports the
  checkout's few hundred modules, and without bytecode each compiles them
  all again (about 0.2 CPU s a process, hundreds of processes a run).

The first process to call `apply()` (the pytest controller under xdist)
owns the session folder and removes it when the run ends; the processes it
starts find it through `SESSION_DIR_ENV`.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

SESSION_DIR_ENV = "SPMD_TEST_SESSION_DIR"
# XLA:CPU's backend optimization level 0 compiles much sooner;
# `--xla_llvm_disable_expensive_passes` added little. XLA:CPU's classic
# emitters (`--xla_cpu_use_fusion_emitters=false`) compile a third as long,
# but their results differ in the last bit between layouts the default
# emitters compute alike (scanned and unrolled layers, a step on 2 x 2 and on
# 4 x 1), which the suite's bit-identical comparisons rely on, as users do:
# not used. One job is known to hang
# under level 0: a whole-split eval on one process of 2 CPU devices waits
# in its all-reduce for a device that never arrives, until XLA aborts it (with
# the flag always, without it mostly); tests/test_eval_export.py's jobs keep
# the default pipeline.
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0",)
# No size limit for the cache (JAX's default), so no eviction and no access-time
# files: with a limit, a job killed between writing an entry and its access
# time (the fault tests kill jobs) leaves an entry that every later write's
# eviction scan fails on, and nothing more is cached for the rest of the run.
# A reader that finds an entry half-written gets a decompression error, which
# JAX reports as a warning before it compiles the program itself.

# How long a process waits for the compile another process of its job shares.
SHARED_COMPILE_WAIT_MS = 600_000

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
  flags = [f for f in out.get("XLA_FLAGS", "").split() if f not in FAST_COMPILE_FLAGS]
  out["XLA_FLAGS"] = " ".join(flags)
  return out


def apply() -> None:
  """Sets this process's environment for the run; call before JAX starts its backend."""
  if SESSION_DIR_ENV not in os.environ:
    folder = Path(tempfile.mkdtemp(prefix="spmd-tests-"))
    _owned.append(folder)
    os.environ[SESSION_DIR_ENV] = str(folder)
  os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
  sys.dont_write_bytecode = False
  os.environ["XLA_FLAGS"] = with_fast_compile(os.environ.get("XLA_FLAGS", ""))
  # One cache a worker (see the module docstring: a job's processes must see it alike).
  worker = os.environ.get("PYTEST_XDIST_WORKER", "controller")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = str(session_dir() / "jax_cache" / worker)
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_SHARE_BINARY_BETWEEN_HOSTS"] = "1"
  # A process waits this long for another's compile (JAX's default: 20 minutes);
  # every job a test starts has a shorter limit of its own, so this only bounds
  # a process that outlives its job's limit.
  os.environ["JAX_SHARE_BINARY_BETWEEN_HOSTS_TIMEOUT_MS"] = str(SHARED_COMPILE_WAIT_MS)


def clean_up() -> None:
  """Removes the session folder, where this process made it."""
  for folder in _owned:
    shutil.rmtree(folder, ignore_errors=True)
  _owned.clear()
