"""The fault suite: each test injects one kind of fault and records how it ended.

CI runs every test with few injections (`SPMD_FAULTS` unset); `make faults`
sets `SPMD_FAULTS=full` for the full counts. Each test adds a row to the
report: the fault, injections, how many ended as promised, the worst time to
detection and the steps lost beyond the last committed checkpoint. The
report is written at the end of the session to `$SPMD_FAULT_REPORT` (default
`workdir/faults/report.json`, and `report.md` beside it); with
`SPMD_FAULTS_UPDATE_DOCS=1` its table also goes into docs/faults.md
(`tests.faults.report`).
"""

import datetime
import json
import os
from pathlib import Path

import pytest

from tests.data_fixtures import training_data
from tests.faults.report import markdown, update_docs
from tests.multiprocess import ROOT

FULL = os.environ.get("SPMD_FAULTS", "") == "full"
_ROWS: list[dict] = []


def injections(ci: int, full: int) -> int:
  """How many times to inject a fault: a bounded subset in CI, all of it in `make faults`."""
  return full if FULL else ci


@pytest.fixture(scope="session")
def data(tmp_path_factory):
  return training_data(tmp_path_factory.mktemp("fault_data"))


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
  if not _ROWS:
    return
  path = Path(os.environ.get("SPMD_FAULT_REPORT", ROOT / "workdir" / "faults" / "report.json"))
  path.parent.mkdir(parents=True, exist_ok=True)
  # By fault number, in the order run within one fault.
  rows = sorted(_ROWS, key=lambda r: int(r["fault"].split(".", 1)[0]))
  report = {"full": FULL, "date": datetime.date.today().isoformat(), "rows": rows}
  path.write_text(json.dumps(report, indent=1) + "\n")
  path.with_suffix(".md").write_text(markdown(rows))
  if os.environ.get("SPMD_FAULTS_UPDATE_DOCS") == "1":
    update_docs(report)
