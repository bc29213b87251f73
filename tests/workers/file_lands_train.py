"""`spmd-train` in which a file lands in a source's folder while process 0 prepares.

Usage: file_lands_train.py LANDING_FILE [spmd-train flags]

Process 0, right after it lists `data.sources`, writes LANDING_FILE (a
JSONL file the source's glob takes in), as a writer filling a bucket does
while a job starts (tests/test_staged_data.py). The listing itself is the
real one; only the file's arrival is placed at that moment, so that any
process that lists the sources after process 0 sees another source.
"""

import json
import pathlib
import sys

import jax

from trainers.run import train_cli
from trainers.tasks import lm_sources

landing = pathlib.Path(sys.argv.pop(1))
listed = lm_sources.list_sources


def list_then_a_file_lands(*args, **kwargs):
  sources = listed(*args, **kwargs)
  if jax.process_index() == 0 and not landing.exists():
    lines = [json.dumps({"text": f"a late document number {i} of many words"}) for i in range(200)]
    landing.write_text("\n".join(lines) + "\n")
  return sources


lm_sources.list_sources = list_then_a_file_lands

if __name__ == "__main__":
  raise SystemExit(train_cli.main())
