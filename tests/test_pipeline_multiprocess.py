"""The input pipeline on 1, 2 and 4 real processes: same global batches, each row once."""

import json
import shutil

import pytest

from tests.data_fixtures import build_corpus
from tests.multiprocess import assert_ok, run_worker

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  return build_corpus(tmp_path_factory.mktemp("corpus"))


def run(mode, corpus, out_dir, num_processes, *opts, devices=2):
  name, data_dir = corpus
  out_dir.mkdir(parents=True, exist_ok=True)
  return run_worker(
    "data_worker",
    mode,
    name,
    data_dir,
    str(out_dir),
    *opts,
    num_processes=num_processes,
    devices_per_process=devices,
  )


def load(path):
  with open(path) as f:
    return json.load(f)


@pytest.fixture(scope="module")
def streams(corpus, tmp_path_factory):
  """The first 14 global batches streamed on 1, 2 and 4 processes: their folders.

  The 2-process stream also saves its position after 5 steps (`save_at`), for
  the resume below: one job both streams and saves."""
  root = tmp_path_factory.mktemp("streams")
  for n in (1, 2, 4):
    save = ("save_at=5",) if n == 2 else ()
    assert_ok(run("stream", corpus, root / f"n{n}", n, "steps=14", *save))
  return {n: root / f"n{n}" for n in (1, 2, 4)}


def test_global_batches_identical_for_1_2_4_processes_and_each_row_once(streams):
  hashes = {n: load(folder / "hashes.json") for n, folder in streams.items()}
  assert hashes[1] == hashes[2] == hashes[4] and len(hashes[1]) == 14

  # Over one epoch, the hosts of the 4-process run fed every used record once.
  per_host = [load(streams[4] / f"indices_p{p}.json") for p in range(4)]
  spe, n = per_host[0]["steps_per_epoch"], per_host[0]["num_records"]
  assert 14 > spe  # the run crossed an epoch boundary
  fed = [i for h in per_host for s in range(spe) for i in h["indices"][str(s)]]
  assert len(fed) == len(set(fed)) == spe * 16 and set(fed) <= set(range(n))
  rows = sorted(tuple(h["rows"]) for h in per_host)
  assert rows == [(0, 4), (4, 8), (8, 12), (12, 16)]


def test_resume_continues_the_same_stream_on_another_process_count(corpus, streams, tmp_path):
  """Saved by the 2-process stream of the test above after 5 steps, resumed on 4; the
  reference is that stream's own later batches (the 1, 2 and 4-process streams agree
  step by step)."""
  (tmp_path / "resume").mkdir()
  shutil.copy(streams[2] / "state.json", tmp_path / "resume" / "state.json")
  assert load(tmp_path / "resume" / "state.json")["next_step"] == 5
  resumed = run("resume", corpus, tmp_path / "resume", 4, "steps=4")
  assert_ok(resumed)
  expected = load(streams[2] / "hashes.json")
  got = load(tmp_path / "resume" / "resumed.json")
  assert got == {str(s): expected[str(s)] for s in range(5, 9)}


def test_missing_data_dir_fails_on_every_process(tmp_path):
  result = run("open", ("text_corpus", str(tmp_path / "nowhere")), tmp_path / "out", 2)
  for p in result.processes:
    assert "FileNotFoundError" in p.output and "not prepared in data_dir=" in p.output, (
      result.report()
    )
