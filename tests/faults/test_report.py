"""The fault report's table lands between docs/faults.md's markers, from a session or a report.json."""

import json

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
