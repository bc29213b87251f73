"""Every test process sees 8 CPU devices, set before JAX starts its backend.

Every process of the run (pytest, its xdist workers, the jobs tests start)
compiles with XLA's fast CPU pipeline into one shared compilation cache
(`tests/session_settings.py`).

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

from spmd import startup_gc
from tests import session_settings

session_settings.apply()  # before JAX reads its flags
# As the commands do (spmd/startup_gc.py): no collector passes while the test modules
# import JAX, Flax and the trainer, and what they made is frozen once they are collected.
startup_gc.pause_collection()

import jax  # noqa: E402
import pytest  # noqa: E402

from tests.faults import report as fault_report  # noqa: E402

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


_fault_rows: list[dict] = []  # the xdist controller's: every worker's fault report rows


# Before xdist reads the groups off the markers.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
  for item in items:
    if isinstance(item, pytest.DoctestItem) and str(item.path).endswith(
      DOCTESTS_THAT_START_PROCESSES
    ):
      item.add_marker(pytest.mark.multiprocess)
    if _shares_module_setup(item):
      # `--dist loadgroup`: one worker runs the module, so its setup runs once.
      item.add_marker(pytest.mark.xdist_group(item.module.__name__))
  # The long tests first, so that two workers end together on short ones rather
  # than one waiting on a long module started last (stable: order kept within each).
  items.sort(key=lambda item: 0 if _is_long(item) else 1)


class _GroupCheck:
  """Fails a worker's collection where `loadgroup` lost a group (a new pytest or xdist).

  xdist's worker writes each test's group into its id ("...@group"), and the
  controller schedules by that id; where it no longer can, a module's tests
  spread over the workers and each builds the module's shared runs again.
  """

  @pytest.hookimpl(trylast=True)  # after xdist's own hook, which writes the groups
  def pytest_collection_modifyitems(self, config, items):
    if not config.getvalue("loadgroup"):
      return
    lost = [i.nodeid for i in items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
    if lost:
      raise pytest.UsageError(
        f"pytest-xdist's loadgroup did not group {len(lost)} tests (e.g. {lost[0]}): this "
        f"pytest ({pytest.__version__}) and pytest-xdist do not work together; see setup.py"
      )


def _is_long(item) -> bool:
  return any(item.get_closest_marker(name) for name in ("multiprocess", "slow"))


def _shares_module_setup(item) -> bool:
  """True when the test uses a module-scoped fixture of its own module (a shared run, say)."""
  info = getattr(item, "_fixtureinfo", None)
  if info is None or getattr(item, "module", None) is None:
    return False
  return any(
    defs[-1].scope == "module"
    and defs[-1].baseid.endswith(".py")
    and str(item.path).endswith(defs[-1].baseid)
    for defs in info.name2fixturedefs.values()
    if defs
  )


def pytest_collection_finish(session):
  startup_gc.freeze_and_resume()  # later passes walk the tests' own objects


def pytest_runtest_protocol(item, nextitem):
  _running["test"] = item.nodeid  # returns None: pytest runs the test as usual


@pytest.fixture(scope="session")
def training_corpus() -> dict[str, str]:
  """The run's one prepared training corpus (tests/shared_runs.py); a copy of its paths."""
  from tests.shared_runs import prepared_training_data  # TFDS only for the tests that train

  return dict(prepared_training_data())


def pytest_unconfigure(config):
  session_settings.clean_up()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
  """xdist: a worker ended; keep the fault report rows it ran (tests/faults/conftest.py)."""
  _fault_rows.extend(getattr(node, "workeroutput", {}).get(fault_report.WORKER_ROWS_KEY, ()))


def pytest_sessionfinish(session, exitstatus):
  if _is_xdist_controller(session.config) and _fault_rows:
    fault_report.write(_fault_rows, fault_report.FULL)


def _is_xdist_controller(config) -> bool:
  """True in the process that hands tests to xdist workers and runs none itself."""
  return not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", 0))


def pytest_configure(config):
  if _is_xdist_controller(config):  # it collects no tests: its collector resumes now
    startup_gc.freeze_and_resume()
  if hasattr(config, "workerinput"):  # an xdist worker: it names the groups
    config.pluginmanager.register(_GroupCheck(), "spmd-group-check")
  # The controller starts the workers as processes; the guard belongs in the
  # processes that run tests.
  if not FAST_TIER or _is_xdist_controller(config):
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
