"""Packing a prepared source's records (`trainers.data.prepare.source_shards`) from files of many short
documents: a record's memory and the document starts read for it stay the same when a file holds
4x the documents, and the records are those `pack_documents` cuts from the whole stream, read in any order.

A file of many short documents (a JSONL of titles, say) puts a document
start every few tokens; the tests pack such files beside a file of one long
document. The bounds are checked on the records as packing makes them from
the spill files, before TFDS serializes them: the serializer leaves
garbage for Python's cycle collector, whose size follows the records made
rather than anything packing holds.
"""

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import tracemalloc
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.multiprocess import ROOT
from trainers.data.prepare import packed, source_shards
from trainers.data.records.datasets import open_source

FEATURES = ["tokens", "starts", "length", "document"]
# A record of 4,096 tokens, as `packed.RECORD_TOKENS` makes them: a few thousand short documents.
LAYOUT = source_shards.ShardLayout(seq_len=4096, run_windows=1, vocab_size=256, split="train")


def short_lengths(count: int, seed: int) -> np.ndarray:
  """The token counts of `count` short documents: 1 to 4 ids, as the titles of a JSONL tokenize."""
  return np.random.default_rng(seed).integers(1, 5, size=count)


def short_documents(count: int, seed: int) -> list[np.ndarray]:
  lengths = short_lengths(count, seed)
  ids = np.random.default_rng(seed).integers(3, 256, size=int(lengths.sum())).astype(np.uint16)
  return np.split(ids, np.cumsum(lengths)[:-1])


def one_long_document(tokens: int) -> list[np.ndarray]:
  return [np.resize(np.arange(3, 256, dtype=np.uint16), tokens)]


def prepare(data_dir: pathlib.Path, pieces: list, layout: source_shards.ShardLayout) -> int:
  """Prepares `pieces` (each a file's documents) as dataset `packed_source/demo`; its records."""
  sizes = [sum(len(d) for d in piece) for piece in pieces]
  folder = data_dir / "packed_source" / "demo" / "1.0.0"
  source_shards.prepare_shards(folder, sizes, lambda i: (pieces[i], dict), lambda n: {}, layout)
  return -(-sum(sizes) // layout.run)


def write_spill(spill: pathlib.Path, piece: int, lengths: np.ndarray) -> dict:
  """Piece `piece` tokenized into documents of `lengths` tokens, as `prepare_shards` spills it
  (its ids, its documents' starts, its notes: the files `source_shards._spill` writes); its notes.

  Written here in one go: spilling a million documents one by one would take the test's time."""
  starts = (np.cumsum(lengths) - lengths).astype(np.int64)
  tokens = int(lengths.sum())
  np.resize(np.arange(3, 256, dtype=LAYOUT.dtype), tokens).tofile(spill / f"{piece:06d}.tokens")
  starts.tofile(spill / f"{piece:06d}.starts")
  notes = {"tokens": tokens, "documents": len(lengths)}
  (spill / f"{piece:06d}.json").write_text(json.dumps(notes))
  return notes


def spill_files(spill: pathlib.Path, count: int) -> list[dict]:
  """The spill of a file of `count` short documents and a file of one document as long as their
  tokens; their notes."""
  spill.mkdir()
  short = short_lengths(count, seed=count)
  return [write_spill(spill, 0, short), write_spill(spill, 1, np.array([short.sum()]))]


def make_every_record(stream: source_shards._Stream) -> None:
  for r in range(-(-stream.length // LAYOUT.run)):  # as `prepare_shards` does, in order
    source_shards._record(stream, r, LAYOUT)


def traced_peaks(folder: pathlib.Path) -> dict[int, int]:
  """The traced peak while making every record of the spill of 100k and of 400k documents."""
  peaks = {}
  for count in (100_000, 400_000):
    spill = folder / f"{count}"
    stream = source_shards._Stream(spill, spill_files(spill, count), LAYOUT.dtype)
    tracemalloc.start()
    try:
      make_every_record(stream)
      peaks[count] = tracemalloc.get_traced_memory()[1]
    finally:
      tracemalloc.stop()
  return peaks


@pytest.mark.multiprocess
def test_a_records_memory_stays_the_same_for_a_file_of_4x_the_documents(tmp_path):
  """The traced peak while making every record of a file of 400k short documents (and a long one of
  as many tokens) is within 1.15x of that for 100k: a record holds its own documents' starts,
  never its file's (which grow with the file: 4x here). The records are made as
  `prepare_shards` makes them before serializing them, from spill files written here.

  In a process of its own: tracemalloc counts every thread's allocations, and in a
  pytest worker another test's threads can still run and allocate while it traces."""
  code = (
    "import json, pathlib, sys; from tests.test_packing_scale import traced_peaks; "
    "print(json.dumps(traced_peaks(pathlib.Path(sys.argv[1]))))"
  )
  done = subprocess.run(
    [sys.executable, "-c", code, str(tmp_path)],
    capture_output=True,
    text=True,
    cwd=ROOT,
    env=dict(os.environ, PYTHONPATH=str(ROOT)),
    timeout=120,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  peaks = {int(k): v for k, v in json.loads(done.stdout.splitlines()[-1]).items()}
  ratio = peaks[400_000] / peaks[100_000]
  assert ratio <= 1.15, (ratio, peaks)


def test_packing_reads_each_document_start_once_for_a_file_of_4x_the_documents(tmp_path):
  """Making every record of a file of 100k and of 400k short documents (and a long one of as many
  tokens) reads each document start from the spill files once, and a block more at most per
  file: the work follows the records, whatever a file's count. Packing that read or masked every
  start of the file for each record (the defect this guards) reads records x documents: 16x
  the work for 4x the documents. Counted, not timed: the two sizes take milliseconds, and on a
  busy machine the larger one's time grows with the cache misses of other processes."""
  read = {"starts": 0, "tokens": 0}
  real_fromfile = np.fromfile

  def counting_fromfile(file, dtype=float, count=-1, *args, **kwargs):
    out = real_fromfile(file, dtype, count, *args, **kwargs)
    name = str(getattr(file, "name", file))
    for kind in read:
      if name.endswith(f".{kind}"):
        read[kind] += len(out)
    return out

  counts = {}
  for documents in (100_000, 400_000):
    spill = tmp_path / f"{documents}"
    notes = spill_files(spill, documents)
    read.update(starts=0, tokens=0)
    with mock.patch.object(source_shards.np, "fromfile", counting_fromfile):
      make_every_record(source_shards._Stream(spill, notes, LAYOUT.dtype))
    tokens = sum(n["tokens"] for n in notes)
    records = -(-tokens // LAYOUT.run)
    counts[documents] = dict(read, records=records)
    # Each start once, and at most one block past a file's last record; each token once, and
    # the one a record shares with the next.
    assert read["starts"] <= documents + 1 + len(notes) * source_shards._STARTS_BLOCK, counts
    assert read["tokens"] <= tokens + records, counts
  ratio = counts[400_000]["starts"] / counts[100_000]["starts"]
  assert 3.9 <= ratio <= 4.1, counts


def test_the_records_of_files_of_many_short_documents_are_those_of_the_whole_stream(tmp_path):
  """Files of short documents (thousands of starts each), an empty one and one of a long document,
  packed a record at a time from their spill files: the records `pack_documents` cuts from
  the whole stream, records that cross from file to file included."""
  pieces = [short_documents(9_000, seed=1), [], one_long_document(700), short_documents(3, seed=2)]
  pieces += [short_documents(5_000, seed=3)]
  layout = source_shards.ShardLayout(seq_len=128, run_windows=4, vocab_size=256, split="train")
  records = prepare(tmp_path, pieces, layout)
  source = open_source("packed_source/demo:1.0.0", "train", tmp_path, FEATURES)
  documents = [d for piece in pieces for d in piece]
  whole = list(packed.pack_documents(documents, layout.seq_len, np.uint16, layout.run_windows))
  assert len(source) == len(whole) == records
  for i, want in enumerate(whole):
    got = source[i]
    for key in FEATURES:
      np.testing.assert_array_equal(got[key], want[key], err_msg=f"record {i} {key}")


@settings(deadline=None)
@given(
  files=st.lists(st.lists(st.integers(1, 12), max_size=40), min_size=1, max_size=4),
  run=st.integers(1, 12),
  block=st.integers(1, 4),
  data=st.data(),
)
def test_each_records_documents_are_read_right_in_any_order(files, run, block, data):
  """Whatever the files' documents, the record length and the block the starts are read by, the
  records' documents (their first's index, the starts within) are those of the whole stream's
  starts, read as one of a group's processes packs its shards (in order, past the others') or
  in any order."""
  lengths = [np.array(f, np.int64) for f in files]
  total = int(sum(f.sum() for f in lengths))
  offsets = np.cumsum([0] + [int(f.sum()) for f in lengths])
  every = np.concatenate([offsets[i] + np.cumsum(f) - f for i, f in enumerate(lengths)])
  records = -(-total // run)
  # The records of one process's shards, as packing reads them (jumping past the others'), then
  # any records in any order.
  shard_records, processes = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
  process = data.draw(st.integers(0, processes - 1))
  order = [r for r in range(records) if r // shard_records % processes == process]
  order += data.draw(st.lists(st.integers(0, max(0, records - 1)), max_size=records))
  with (
    tempfile.TemporaryDirectory() as folder,
    mock.patch.object(source_shards, "_STARTS_BLOCK", block),
  ):
    spill = pathlib.Path(folder)
    notes = [write_spill(spill, i, f) for i, f in enumerate(lengths)]
    layout = source_shards.ShardLayout(seq_len=run, run_windows=1, vocab_size=256, split="train")
    stream = source_shards._Stream(spill, notes, layout.dtype)
    for r in order:
      lo, hi = r * run, min(total, r * run + run + 1)
      record = source_shards._record(stream, r, layout)
      assert record["document"] == np.searchsorted(every, lo, side="right") - 1, (r, lo)
      want = every[(every >= lo) & (every < hi)] - lo
      np.testing.assert_array_equal(record["starts"], want, err_msg=f"record {r}")
