"""A weighted mixture of a JSONL and a Parquet source on 1, 2 and 4 real processes: the same
global batches, each source's windows once per epoch over the hosts, the shares in every
batch, and a position saved by 2 processes resumed by 4."""

import json
import shutil

import numpy as np
import pytest

from tests.configs import train_tiny
from tests.data_fixtures import source_texts, write_jsonl, write_parquet
from tests.multiprocess import assert_ok, run_worker
from trainers.tasks import make_task

pytestmark = pytest.mark.multiprocess

SEQ_LEN, BATCH, STEPS = 16, 16, 24


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
  """Two small sources, prepared here once; every worker process finds them prepared."""
  root = tmp_path_factory.mktemp("mixture")
  a = write_jsonl(root / "a", source_texts(5, seed=4), files=2)
  b = write_parquet(root / "b", source_texts(4, seed=5))
  spec = f"{a}@0.7,{b}@0.3"
  config = train_tiny.get_config()
  config.data.update(sources=spec, pack=True, dir=str(root / "data"), validation_percent=0.0)
  config.model.seq_len = SEQ_LEN
  make_task(config).prepare_data(config.data.dir)
  return spec, str(root / "data")


def run(mode, sources, out_dir, num_processes, *opts):
  spec, data_dir = sources
  out_dir.mkdir(parents=True, exist_ok=True)
  return run_worker(
    "data_worker",
    mode,
    "-",
    data_dir,
    str(out_dir),
    f"sources={spec}",
    f"global_batch={BATCH}",
    f"seq_len={SEQ_LEN}",
    *opts,
    num_processes=num_processes,
    devices_per_process=2,
  )


def load(path):
  with open(path) as f:
    return json.load(f)


@pytest.fixture(scope="module")
def streams(sources, tmp_path_factory):
  """The mixture's first STEPS global batches streamed on 1, 2 and 4 processes: their folders.

  The 2-process stream also saves its position after 6 steps (`save_at`), for the
  resume below: one job both streams and saves."""
  root = tmp_path_factory.mktemp("streams")
  for n in (1, 2, 4):
    save = ("save_at=6",) if n == 2 else ()
    assert_ok(run("stream", sources, root / f"n{n}", n, f"steps={STEPS}", *save))
  return {n: root / f"n{n}" for n in (1, 2, 4)}


def test_same_mixture_on_1_2_4_processes_each_window_once_per_source_epoch(streams):
  hashes, rows = {}, {}
  for n, folder in streams.items():
    hashes[n] = load(folder / "hashes.json")
    hosts = sorted((load(folder / f"indices_p{p}.json") for p in range(n)), key=lambda h: h["rows"])
    assert [h["rows"] for h in hosts] == [[i * BATCH // n, (i + 1) * BATCH // n] for i in range(n)]
    # The global batch's rows, host after host: (source, example of that source).
    rows[n] = {s: [r for h in hosts for r in h["indices"][str(s)]] for s in range(STEPS)}
  assert hashes[1] == hashes[2] == hashes[4] and len(hashes[1]) == STEPS
  assert rows[1] == rows[2] == rows[4]

  fed = {0: [], 1: []}
  for step in range(STEPS):
    counts = np.bincount([s for s, _ in rows[4][step]], minlength=2)
    assert np.all(np.abs(counts - BATCH * np.array([0.7, 0.3])) <= 1.5), (step, counts)
    for source, example in rows[4][step]:
      fed[source].append(example)
  for source, examples in fed.items():
    n = max(examples) + 1  # every window of the source is fed in its first epoch
    assert len(examples) >= 2 * n, f"source {source} did not reach its second epoch"
    for epoch in range(len(examples) // n):
      assert sorted(examples[epoch * n : (epoch + 1) * n]) == list(range(n)), (source, epoch)


def test_a_position_saved_on_2_processes_resumes_the_mixture_on_4(sources, streams, tmp_path):
  """Saved by the 2-process stream of the test above after 6 steps, resumed on 4; the
  reference is that stream's own later batches (the 1, 2 and 4-process streams agree
  step by step)."""
  (tmp_path / "resume").mkdir()
  shutil.copy(streams[2] / "state.json", tmp_path / "resume" / "state.json")
  assert load(tmp_path / "resume" / "state.json")["next_step"] == 6
  assert_ok(run("resume", sources, tmp_path / "resume", 4, "steps=8"))
  expected = load(streams[2] / "hashes.json")
  assert load(tmp_path / "resume" / "resumed.json") == {
    str(s): expected[str(s)] for s in range(6, 14)
  }
