"""The fault report's table lands between docs/faults.md's markers, from a session or a report.json."""

import json
import os

import pytest

from tests.faults import report

ROWS = [
  {
    "fault": "1. kill -9",
    "injected": 3,
    "as_promised": 3,
    "worst_detection_s": 2.04,
    "steps_lost": 0,
  },
  {
    "fault": "10. unknown key",
    "injected": 1,
    "as_promised": 1,
    "worst_detection_s": None,
    "steps_lost": None,
  },
]
DOC = "# Faults\n\nbefore\n\n<!-- faults:start -->\nold table\n<!-- faults:end -->\n\nafter\n"


def test_update_docs_replaces_only_the_block(tmp_path):
  doc = tmp_path / "faults.md"
  doc.write_text(DOC)
  report.update_docs({"full": True, "date": "2026-11-30", "rows": ROWS}, doc)
  text = doc.read_text()
  assert text.startswith(
    "# Faults\n\nbefore\n\n<!-- faults:start -->\nLatest full run (`make faults`, 2026-11-30):\n\n"
  )
  assert (
    "| 1. kill -9 | 3 | 3/3 | 2.0 s | 0 |\n| 10. unknown key | 1 | 1/1 | - | - |\n<!-- faults:end -->\n\nafter\n"
    in text
  )
  assert "old table" not in text


def test_command_writes_a_saved_report(tmp_path):
  doc = tmp_path / "faults.md"
  doc.write_text(DOC)
  saved = tmp_path / "report.json"
  saved.write_text(json.dumps({"full": False, "rows": ROWS[:1]}))
  report.main(["--update-docs", str(saved), "--doc", str(doc)])
  assert "Latest CI-subset run (`SPMD_FAULTS` unset):\n\n| fault |" in doc.read_text()


def test_a_doc_without_markers_is_an_error(tmp_path):
  doc = tmp_path / "faults.md"
  doc.write_text("# Faults\n")
  with pytest.raises(ValueError, match="faults:start"):
    report.update_docs({"full": True, "rows": ROWS}, doc)
  assert doc.read_text() == "# Faults\n"


def test_the_guide_has_the_markers():
  assert report._BLOCK.search(report.FAULTS_DOC.read_text())


# A session of its own: the checkout's two conftests' hooks, loaded under other
# names (its folder has a conftest.py of its own), and the fault suite's `record`.
SESSION_CONFTEST = """
import importlib.util
import pathlib

def _load(name, path):
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module

_root = _load("checkout_conftest", pathlib.Path(ROOT) / "conftest.py")
_faults = _load("checkout_faults_conftest", pathlib.Path(ROOT) / "tests" / "faults" / "conftest.py")
record = _faults.record
pytest_testnodedown = _root.pytest_testnodedown

def pytest_sessionfinish(session, exitstatus):
  _faults.pytest_sessionfinish(session, exitstatus)
  _root.pytest_sessionfinish(session, exitstatus)
"""
SESSION_TESTS = """
import os
import pytest

@pytest.mark.parametrize("i", range(4))
def test_one(record, i):
  record(f"{FAULT}. {i} on {os.environ.get('PYTEST_XDIST_WORKER', 'pytest')}", 1, 1)
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("workers", ["2", "0"])
def test_the_report_holds_every_row_whichever_worker_ran_it(tmp_path, workers):
  """Under xdist each worker runs some faults; the controller writes one report of them all."""
  import subprocess
  import sys

  from tests.multiprocess import ROOT

  session = tmp_path / "session"
  session.mkdir()
  (session / "conftest.py").write_text(f"ROOT = {str(ROOT)!r}\n" + SESSION_CONFTEST)
  for fault in (1, 2):
    (session / f"test_fault_{fault}.py").write_text(f"FAULT = {fault}\n" + SESSION_TESTS)
  saved = tmp_path / "report.json"
  done = subprocess.run(
    [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", workers, str(session)],
    capture_output=True,
    text=True,
    cwd=str(tmp_path),
    env={
      **{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")},  # its own
      "SPMD_FAULT_REPORT": str(saved),
      "PYTHONPATH": str(ROOT),
    },
    timeout=240,
  )
  assert done.returncode == 0, done.stdout + done.stderr
  rows = json.loads(saved.read_text())["rows"]
  ran, where = zip(*(r["fault"].split(" on ") for r in rows))
  # By fault number; within one, each worker's rows in the order it ran them.
  assert [r[0] for r in ran] == ["1"] * 4 + ["2"] * 4, rows
  assert sorted(ran) == [f"{f}. {i}" for f in (1, 2) for i in range(4)], rows
  assert set(where) == ({"gw0", "gw1"} if workers == "2" else {"pytest"}), rows
  assert "| 2. 3 on " in saved.with_suffix(".md").read_text()
