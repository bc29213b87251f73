"""The fault suite's report: its Markdown table, and that table written into docs/faults.md.

  python -m tests.faults.report --update-docs workdir/faults/report.json

The suite writes `report.json` (and `report.md` beside it) at the end of
every session; `SPMD_FAULTS_UPDATE_DOCS=1` also writes its table into
docs/faults.md, between the `faults:start`/`faults:end` markers. The
command above does the same from a report already written, so the guide
can show the latest full run (`make faults`) without running it again.

Example:
  >>> print(markdown([{"fault": "1. kill -9", "injected": 2, "as_promised": 2,
  ...                  "worst_detection_s": 1.25, "steps_lost": 0}]), end="")
  | fault | injected | ended as promised | worst detection | steps lost |
  |---|---|---|---|---|
  | 1. kill -9 | 2 | 2/2 | 1.2 s | 0 |
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
from pathlib import Path

from tests.multiprocess import ROOT

FAULTS_DOC = Path(ROOT) / "docs" / "faults.md"
FULL = os.environ.get("SPMD_FAULTS", "") == "full"  # `make faults`: the full injection counts
WORKER_ROWS_KEY = "fault_report_rows"  # where an xdist worker hands its rows to the controller
_BLOCK = re.compile(r"(<!-- faults:start -->\n)(.*?)(<!-- faults:end -->)", re.S)


def markdown(rows: list[dict]) -> str:
  """The report's rows as a Markdown table; a figure that is None prints as "-"."""
  lines = [
    "| fault | injected | ended as promised | worst detection | steps lost |",
    "|---|---|---|---|---|",
  ]
  for r in rows:
    worst = "-" if r["worst_detection_s"] is None else f"{r['worst_detection_s']:.1f} s"
    lost = "-" if r["steps_lost"] is None else r["steps_lost"]
    lines.append(
      f"| {r['fault']} | {r['injected']} | {r['as_promised']}/{r['injected']} | {worst} | {lost} |"
    )
  return "\n".join(lines) + "\n"


def docs_block(report: dict) -> str:
  """What goes between the guide's markers: which run it was, then its table.

  Example:
    >>> print(docs_block({"full": True, "date": "2026-11-30", "rows": []}), end="")
    Latest full run (`make faults`, 2026-11-30):
    <BLANKLINE>
    | fault | injected | ended as promised | worst detection | steps lost |
    |---|---|---|---|---|
  """
  kind = "full run (`make faults`" if report["full"] else "CI-subset run (`SPMD_FAULTS` unset"
  date = f", {report['date']}" if report.get("date") else ""
  return f"Latest {kind}{date}):\n\n" + markdown(report["rows"])


def update_docs(report: dict, doc: Path = FAULTS_DOC) -> None:
  """Replace the table between `doc`'s `faults:start`/`faults:end` markers with `report`'s."""
  text = Path(doc).read_text()
  if not _BLOCK.search(text):
    raise ValueError(f"{doc} has no <!-- faults:start --> ... <!-- faults:end --> block")
  Path(doc).write_text(_BLOCK.sub(lambda m: m.group(1) + docs_block(report) + m.group(3), text))


def write(rows: list[dict], full: bool) -> Path:
  """Writes the session's rows to `$SPMD_FAULT_REPORT` (and .md beside it); returns the JSON's path.

  Called once per pytest run, by the process that saw every row: pytest
  itself, or the xdist controller after each worker handed its rows over
  (conftest.py). Rows are ordered by fault number, then in the order run.
  """
  path = Path(os.environ.get("SPMD_FAULT_REPORT", ROOT / "workdir" / "faults" / "report.json"))
  path.parent.mkdir(parents=True, exist_ok=True)
  rows = sorted(rows, key=lambda r: int(r["fault"].split(".", 1)[0]))
  report = {"full": full, "date": datetime.date.today().isoformat(), "rows": rows}
  path.write_text(json.dumps(report, indent=1) + "\n")
  path.with_suffix(".md").write_text(markdown(rows))
  if os.environ.get("SPMD_FAULTS_UPDATE_DOCS") == "1":
    update_docs(report)
  return path


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--update-docs", metavar="REPORT_JSON", required=True, help="a report.json the suite wrote"
  )
  parser.add_argument("--doc", default=str(FAULTS_DOC), help="the guide to write the table into")
  args = parser.parse_args(argv)
  update_docs(json.loads(Path(args.update_docs).read_text()), Path(args.doc))


if __name__ == "__main__":
  main()
