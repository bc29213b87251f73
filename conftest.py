"""Every test process sees 8 CPU devices, set before JAX starts its backend.

`make test-fast` sets `SPMD_TEST_TIER=fast` and deselects the `multiprocess`
and `slow` tests. There, a test that still starts a process fails, naming the
test and the command: every test that starts processes must carry the
`multiprocess` marker, or the fast tier would quietly grow slow. The guard is
set for the whole session, so a module-scoped fixture that starts a job is
caught too.
"""

import os
import subprocess
from pathlib import Path

import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

# Scripts that run as their own processes, not test modules.
collect_ignore_glob = ["tests/workers/*", "examples/*", "benchmarks/*"]

FAST_TIER = os.environ.get("SPMD_TEST_TIER") == "fast"

# Processes libraries start for themselves to look the machine up (matplotlib
# lists fonts once): not a job the test starts.
LIBRARY_PROBES = {"fc-list", "ldconfig", "uname"}

# Doctests whose examples start processes (a launcher's own examples).
DOCTESTS_THAT_START_PROCESSES = ("launch/local.py", "launch/processes.py", "launch/tpu_setup.py")

_running = {"test": "collection"}


def pytest_collection_modifyitems(config, items):
  for item in items:
    if isinstance(item, pytest.DoctestItem) and str(item.path).endswith(
      DOCTESTS_THAT_START_PROCESSES
    ):
      item.add_marker(pytest.mark.multiprocess)


def pytest_runtest_protocol(item, nextitem):
  _running["test"] = item.nodeid  # returns None: pytest runs the test as usual


def pytest_configure(config):
  if not FAST_TIER:
    return
  start = subprocess.Popen._execute_child

  def refuse_unmarked_processes(self, args, *rest, **kwargs):
    program = args if isinstance(args, str | bytes | os.PathLike) else args[0]
    if Path(os.fsdecode(program).split()[0]).name in LIBRARY_PROBES:
      return start(self, args, *rest, **kwargs)
    raise AssertionError(
      f"{_running['test']} starts a process ({args!r}) but has no `multiprocess` marker: "
      "mark it (pytest.mark.multiprocess) so `make test-fast` leaves it out"
    )

  subprocess.Popen._execute_child = refuse_unmarked_processes
