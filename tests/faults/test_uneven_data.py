"""Fault 7: data that does not divide across hosts, an empty shard, a tiny eval split.

Promise: identical step counts on every host, the documented policy
(trainers/data/read/pipeline.py: train drops each epoch's `len % global_batch`
tail, a different one each epoch; eval is one pass padded with mask 0 so
every example counts once), no hang; data that cannot work (a batch that
does not divide over the data-parallel size, less than one batch of data,
one host's copy empty or truncated) is a clear error on every host.
"""

import json
import shutil
import time

import pytest

from tests.data_fixtures import build_corpus
from tests.multiprocess import run_worker

pytestmark = [pytest.mark.multiprocess, pytest.mark.faults]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  return build_corpus(tmp_path_factory.mktemp("corpus"))


def open_data(corpus, out_dir, num_processes, *opts):
  name, data_dir = corpus
  out_dir.mkdir(parents=True, exist_ok=True)
  return run_worker(
    "data_worker",
    "open",
    name,
    data_dir,
    str(out_dir),
    *opts,
    num_processes=num_processes,
    devices_per_process=2,
  )


def test_uneven_data_same_steps_on_every_host_drop_and_pad_as_documented(record):
  # 37 train records for a global batch of 8 on 4 hosts: 4 steps, 5 dropped.
  # 2 eval records for 4 hosts: hosts 1-3 hold only padding (empty shards).
  train_records, eval_records, batch = 37, 2, 8
  started = time.monotonic()
  result = run_worker(
    "uneven_worker",
    str(train_records),
    str(eval_records),
    str(batch),
    num_processes=4,
    devices_per_process=1,
  )
  took = time.monotonic() - started
  assert result.ok, result.report()
  rows = [
    json.loads(line.split(" ", 1)[1])
    for p in result.processes
    for line in p.output.splitlines()
    if line.startswith("RESULT ")
  ]
  assert sorted(r["process"] for r in rows) == [0, 1, 2, 3], result.report()
  fed = [i for r in rows for i in r["fed"]]
  checks = {
    "same train steps everywhere": {r["train_steps"] for r in rows} == {train_records // batch},
    "each used record once, the tail dropped": len(fed) == len(set(fed)) == 32,
    "same eval steps everywhere": {r["eval_steps"] for r in rows} == {1},
    "every eval example counted once": {r["eval_mask_total"] for r in rows} == {2 * 16.0},
    "hosts 1-3 hold only padding": [
      r["eval_rows_here"] for r in sorted(rows, key=lambda r: r["process"])
    ]
    == [2, 0, 0, 0],
  }
  record(
    "7. data not divisible; eval split smaller than the hosts", 1, int(all(checks.values())), took
  )
  assert all(checks.values()), (checks, rows)


CANNOT_WORK = [
  (
    "batch not divisible by the data-parallel size",
    ("global_batch=12",),
    "global_batch=12 is not divisible by the data-parallel size 8",
  ),
  ("less than one batch of data", ("global_batch=4096",), "fewer than one global_batch=4096"),
]


@pytest.mark.parametrize("name,opts,message", CANNOT_WORK, ids=[c[0] for c in CANNOT_WORK])
def test_data_that_cannot_work_is_an_error_on_every_host(
  corpus, tmp_path, record, name, opts, message
):
  started = time.monotonic()
  result = open_data(corpus, tmp_path, 4, *opts)
  took = time.monotonic() - started
  ok = not result.ok and all(message in p.output for p in result.processes)
  record(f"7. {name}", 1, int(ok), took)
  assert ok, result.report()


def _truncate(shard):
  shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def _empty(shard):
  shard.write_bytes(b"")


@pytest.mark.parametrize("name,damage", [("truncated", _truncate), ("empty", _empty)])
def test_one_host_with_a_bad_copy_of_the_data_stops_every_host(
  corpus, tmp_path, record, name, damage
):
  _, data_dir = corpus
  broken = tmp_path / "broken"
  shutil.copytree(data_dir, broken)
  damage(next(broken.rglob("*train.array_record*")))
  started = time.monotonic()
  result = open_data(corpus, tmp_path / "out", 2, f"data_dir_p1={broken}")
  took = time.monotonic() - started
  ok = (
    not result.ok
    and all("truncated or corrupt" in p.output for p in result.processes)
    and "AgreementError" in result.processes[0].output
  )
  record(f"7. one host's copy of the data {name}", 1, int(ok), took)
  assert ok, result.report()
