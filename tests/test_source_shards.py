"""A `data.sources` source prepared by a group of processes (`trainers.data.prepare.source_shards`): the
records of the whole stream packed at once, the same bytes on 1 and 2 real processes, memory
bounded below the corpus's size, and a preparation stopped part-way that resumes and never
publishes half a dataset."""

import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.data_fixtures import source_texts, write_jsonl
from tests.multiprocess import ROOT, WORKERS, assert_ok, run_worker
from trainers.data.prepare import packed, source_packed, source_shards
from trainers.data.prepare.documents import SourceDocuments
from trainers.data.prepare.holdout import TRAIN
from trainers.data.prepare.source_files import SourceError, SourceSpec, list_source
from trainers.data.records.datasets import open_source

SEQ_LEN, RUN_WINDOWS = 16, 4
FEATURES = ["tokens", "starts", "length", "document"]


def config_of(spec: str, skip_bad_rows: int = 0):
  return source_packed.source_config(
    list_source(SourceSpec(spec)),
    split=TRAIN,
    validation_percent=20.0,
    seq_len=SEQ_LEN,
    vocab_size=256,
    run_windows=RUN_WINDOWS,
    skip_bad_rows=skip_bad_rows,
  )


def records_of(data_dir, name: str) -> list[dict]:
  source = open_source(name, TRAIN, data_dir, FEATURES)
  return [source[i] for i in range(len(source))]


def assert_same_records(got: list[dict], want: list[dict]) -> None:
  assert len(got) == len(want)
  for i, (a, b) in enumerate(zip(got, want)):
    for key in FEATURES:
      np.testing.assert_array_equal(a[key], b[key], err_msg=f"record {i} {key}")


def shard_bytes_of(folder: pathlib.Path) -> dict[str, bytes]:
  return {p.name: p.read_bytes() for p in sorted(folder.glob("packed_source-*"))}


def test_shards_hold_the_records_of_the_whole_stream_packed_at_once(tmp_path, monkeypatch):
  """Per-file pieces, packed per shard: the records `pack_documents` makes of every file in turn."""
  monkeypatch.setattr(source_shards, "SHARD_BYTES", 3 * (RUN_WINDOWS * SEQ_LEN + 1) * 2)
  spec = write_jsonl(tmp_path / "a", source_texts(90, seed=1), files=5)
  config = config_of(spec)
  prepared = source_packed.prepare_source(tmp_path / "data", config)
  kept = lambda d: bool(d.text) and source_packed.split_of(d.key, 20.0) == TRAIN  # noqa: E731
  documents = SourceDocuments(config.source(), keep=kept)
  whole = packed.pack_documents(
    source_packed._token_ids(documents, None), SEQ_LEN, np.uint16, RUN_WINDOWS
  )
  got = records_of(tmp_path / "data", prepared.name)
  assert_same_records(got, list(whole))
  folder = tmp_path / "data" / "packed_source" / config.name / source_packed.VERSION
  assert len(shard_bytes_of(folder)) == -(-len(got) // 3) > 2  # several shards, 3 records each
  assert prepared.documents == int(got[-1]["document"]) + 1 + int(np.sum(got[-1]["starts"] > 0))
  # The workspace is gone once published; the lock file stays (preparation_lock).
  assert [p.name for p in folder.parent.glob(".*")] == [f".{folder.name}.lock"]


def test_a_preparation_stopped_part_way_resumes_and_never_publishes_half(tmp_path):
  """A bad row in the last file stops it after the others were tokenized; a limit that lets the
  row through (not part of the dataset's name) finishes it, keeping what was done."""
  spec = write_jsonl(tmp_path / "a", source_texts(60, seed=2), files=3)
  last = tmp_path / "a" / "part-2.jsonl"
  last.write_text(last.read_text() + '{"body": "no text"}\n')
  config, lenient = config_of(spec), config_of(spec, skip_bad_rows=1)
  folder = tmp_path / "data" / "packed_source" / config.name / source_packed.VERSION
  with pytest.raises(SourceError, match=r"part-2.jsonl line 21: has no 'text' field"):
    source_packed.prepare_source(tmp_path / "data", config)
  assert not folder.exists()  # nothing published under the dataset's name
  work = folder.parent / f".{folder.name}.preparing"
  assert sorted(p.name for p in (work / "pieces").glob("*.json")) == ["000000.json", "000001.json"]
  (work / folder.name / ".packed_source-train.array_record-00000-of-00001.partial").write_text(
    "what a kill mid-write leaves"
  )
  done = [tmp_path / "a" / "part-0.jsonl", tmp_path / "a" / "part-1.jsonl"]
  for path in done:  # the files already tokenized cannot be read again: they must not be
    path.rename(path.with_name(f".{path.name}"))
  try:
    resumed = source_packed.prepare_source(tmp_path / "data", lenient)
  finally:
    for path in done:
      path.with_name(f".{path.name}").rename(path)
  assert resumed.bad_rows == 1 and not work.exists()
  fresh = source_packed.prepare_source(tmp_path / "fresh", config_of(spec, skip_bad_rows=1))
  assert_same_records(
    records_of(tmp_path / "data", resumed.name), records_of(tmp_path / "fresh", fresh.name)
  )


def test_bad_rows_over_the_whole_source_are_held_to_the_limit_naming_the_row(tmp_path):
  """Each file alone is within the limit; the source is not: the error names the next bad row."""
  spec = write_jsonl(tmp_path / "a", source_texts(40, seed=3), files=2)
  for part in ("part-0.jsonl", "part-1.jsonl"):
    path = tmp_path / "a" / part
    path.write_text(path.read_text() + '{"text": 7}\n')
  with pytest.raises(SourceError, match=r"part-1.jsonl line 21: 'text' is a number.*number 2"):
    source_packed.prepare_source(tmp_path / "data", config_of(spec, skip_bad_rows=1))


@pytest.mark.multiprocess
def test_2_processes_prepare_the_bytes_1_does_each_in_memory_below_the_corpus(tmp_path):
  """2 real processes prepare a corpus of JSONL files, of many short documents and of a few long
  ones, each tokenizing its share and writing its shards; the shards and index equal those 1
  process writes, and each process's peak memory while preparing stays below a limit smaller
  than its share of the tokens (held whole, it would exceed it), whatever the documents a file
  holds."""
  corpus, limit_mib = tmp_path / "corpus", 24
  corpus.mkdir()
  letters = "".join(chr(ord("a") + i % 26) for i in range(1 << 18))
  for i in range(8):  # 8 files of 4 MiB of text: 64 MiB of uint16 ids, 32 MiB a process
    rows, size, d = [], 0, 0
    while size < 4 * 2**20:  # the first 4 of ~48k short documents, the others of 16 long ones
      text = f"{i} {d} {letters[: 20 + d * 37 % 120 if i < 4 else (1 << 18) - 8]}"
      rows.append(f'{{"text": "{text}"}}\n')
      size, d = size + len(text), d + 1
    (corpus / f"{i:02d}.jsonl").write_text("".join(rows))
  options = ("seq_len=64", f"shard_bytes={8 << 20}")
  facts = {}
  for n in (1, 2):
    out = tmp_path / f"out{n}"
    out.mkdir()
    assert_ok(
      run_worker(
        "prepare_worker",
        str(corpus),
        str(tmp_path / f"data{n}"),
        str(out),
        *options,
        num_processes=n,
        devices_per_process=1,
        timeout_s=240,
      )
    )
    facts[n] = [json.loads((out / f"p{p}.json").read_text()) for p in range(n)]
  name = facts[1][0]["name"]
  assert {f["name"] for f in facts[2]} == {name}
  config = name.split("/")[1].split(":")[0]
  one, two = (
    tmp_path / f"data{n}" / "packed_source" / config / source_packed.VERSION for n in (1, 2)
  )
  assert shard_bytes_of(one) == shard_bytes_of(two) and len(shard_bytes_of(one)) >= 8
  info = [json.loads((d / "dataset_info.json").read_text())["splits"] for d in (one, two)]
  assert info[0] == info[1]
  share_mib = 64 // 2
  assert limit_mib < share_mib
  for process in facts[2]:
    assert process["peak_growth_kib"] < limit_mib * 1024, facts


@pytest.mark.multiprocess
def test_two_runs_preparing_one_data_dir_at_once_both_succeed_with_the_dataset_one_run_makes(
  tmp_path,
):
  """Two real processes (a sweep's runs, sibling workdirs, the default data.dir) prepare the same
  source into one folder at the same moment: both finish with the dataset a run alone makes,
  byte for byte, and leave no workspace behind. Many files and small shards make the runs
  write the same spill and shard files at once, unless one waits for the other."""
  spec = write_jsonl(tmp_path / "a", source_texts(400, seed=4), files=24)
  shard_bytes = 2 * (RUN_WINDOWS * SEQ_LEN + 1) * 2  # 2 records a shard
  go = tmp_path / "go"
  worker = str(WORKERS / "prepare_beside_worker.py")
  command = [sys.executable, worker, spec, str(tmp_path / "data"), str(go), str(shard_bytes)]
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
  runs = [
    subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    for _ in range(2)
  ]
  time.sleep(5)  # both have imported and wait for the same moment
  go.touch()
  outputs = []
  try:
    for run in runs:
      outputs.append(run.communicate(timeout=120)[0])
  finally:
    for run in runs:
      run.kill()
  assert [run.returncode for run in runs] == [0, 0], "\n\n".join(outputs)
  names = {output.strip().splitlines()[-1] for output in outputs}
  assert len(names) == 1, outputs
  alone = [sys.executable, worker, spec, str(tmp_path / "alone"), str(go), str(shard_bytes)]
  subprocess.run(alone, check=True, env=env, capture_output=True)
  config = names.pop().split("/")[1].split(":")[0]
  shared, fresh = (
    tmp_path / d / "packed_source" / config / source_packed.VERSION for d in ("data", "alone")
  )
  assert shard_bytes_of(shared) == shard_bytes_of(fresh) and len(shard_bytes_of(fresh)) > 20
  assert not [p for p in shared.parent.iterdir() if p.name.endswith(".preparing")]
