"""The fault suite: each test injects one kind of fault and records how it ended.

CI runs every test with few injections (`SPMD_FAULTS` unset); `make faults`
sets `SPMD_FAULTS=full` for the full counts. Each test adds a row to the
report: the fault, injections, how many ended as promised, the worst time to
detection and the steps lost beyond the last committed checkpoint. The
report is written once at the end of the run (under xdist by the controller,
with every worker's rows) to `$SPMD_FAULT_REPORT` (default
`workdir/faults/report.json`, and `report.md` beside it); with
`SPMD_FAULTS_UPDATE_DOCS=1` its table also goes into docs/faults.md
(`tests.faults.report`).
"""

import pytest

from tests.faults.report import FULL, WORKER_ROWS_KEY, write

_ROWS: list[dict] = []


def injections(ci: int, full: int) -> int:
  """How many times to inject a fault: a bounded subset in CI, all of it in `make faults`."""
  return full if FULL else ci


@pytest.fixture(scope="session")
def data(training_corpus):
  return training_corpus


@pytest.fixture
def record():
  """`record(fault, injected, as_promised, worst_detection_s, steps_lost)` adds a report row.

  None (the default for both figures) prints as "-": nothing was timed, or no
  training state is at stake (a job that must not start, a check of data).
  """

  def add(fault, injected, as_promised, worst_detection_s=None, steps_lost=None):
    _ROWS.append(
      {
        "fault": fault,
        "injected": injected,
        "as_promised": as_promised,
        "worst_detection_s": worst_detection_s,
        "steps_lost": steps_lost,
      }
    )

  return add


def pytest_sessionfinish(session, exitstatus):
  # Under xdist each worker hands its rows to the controller, which writes
  # one report with all of them (conftest.py); alone, pytest writes it here.
  worker_output = getattr(session.config, "workeroutput", None)
  if worker_output is not None:
    worker_output[WORKER_ROWS_KEY] = list(_ROWS)
  elif _ROWS:
    write(_ROWS, FULL)
