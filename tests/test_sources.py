"""`config.data.sources`: the setting, the files each source is, every format's documents,
and every kind of bad input named by its file and row (or line)."""

import gzip
import json
import re

import numpy as np
import pytest

from spmd.errors import UserError
from tests.data_fixtures import (
  source_texts,
  write_hf_dataset,
  write_jsonl,
  write_parquet,
)
from trainers.data.prepare import documents as docs
from trainers.data.prepare.source_files import (
  SourceError,
  SourceSpec,
  list_source,
  list_sources,
  parse_sources,
)

TEXTS = source_texts(30, seed=1)


def read(pattern, **options):
  return [d.text for d in docs.SourceDocuments(list_source(SourceSpec(str(pattern))), **options)]


def test_the_setting_parses_weights_and_names_what_is_wrong():
  assert parse_sources(" a/*.jsonl@2 ,gs://b/x@y/c.parquet@1.5") == [
    SourceSpec("a/*.jsonl", 2.0),
    SourceSpec("gs://b/x@y/c.parquet", 1.5),
  ]
  assert parse_sources("a/@home/b.txt") == [SourceSpec("a/@home/b.txt", None)]
  for text, message in [
    ("a.jsonl,,b.jsonl", "has an empty entry"),
    ("a.jsonl@0", "has weight '0'; a weight must be a number > 0"),
    ("a.jsonl@-1", "a weight must be a number > 0"),
    ("a.jsonl@nan", "a weight must be a number > 0"),
    ("a.jsonl@1,b.jsonl", "give every source a weight"),
    ("a.jsonl,a.jsonl", "names ['a.jsonl'] more than once"),
  ]:
    with pytest.raises(UserError, match=re.escape(message)):
      parse_sources(text)


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_jsonl_plain_gzip_and_zstd_read_every_document_in_order(tmp_path, suffix):
  pattern = write_jsonl(tmp_path, TEXTS, files=3, suffix=suffix)
  source = list_source(SourceSpec(pattern))
  assert [f.format for f in source.files] == [suffix[1:]] * 3
  expected = [t for f in range(3) for t in TEXTS[f::3]]
  assert read(pattern) == expected
  rows = [d.row for d in docs.SourceDocuments(source)]
  assert rows[:3] == [1, 2, 3]  # JSONL rows are lines, from 1


def test_a_lone_surrogate_in_json_becomes_a_replacement_character(tmp_path):
  (tmp_path / "s.jsonl").write_text('{"text": "a\\ud800b"}\n{"text": "\\ud83d\\ude00"}\n')
  assert read(tmp_path / "s.jsonl") == ["a\ufffdb", "\U0001f600"]  # a valid pair stays one


def test_parquet_arrow_hf_folder_and_text_files_read_their_documents(tmp_path):
  assert read(write_parquet(tmp_path / "pq", TEXTS, files=2)) == TEXTS[0::2] + TEXTS[1::2]
  hf = write_hf_dataset(tmp_path / "hf", TEXTS, files=2)
  source = list_source(SourceSpec(hf))
  assert [f.format for f in source.files] == ["arrow", "arrow"]
  assert read(hf) == TEXTS[0::2] + TEXTS[1::2]  # the order state.json gives
  (tmp_path / "txt").mkdir()
  for i in range(3):
    (tmp_path / "txt" / f"{i}.txt").write_text(TEXTS[i])
  (tmp_path / "txt" / "README.md").write_text("not data")  # a folder keeps known formats only
  assert read(tmp_path / "txt") == TEXTS[:3]


def test_identity_is_each_file_key_size_and_time(tmp_path):
  pattern = write_jsonl(tmp_path / "a", TEXTS, files=2)
  before = list_source(SourceSpec(pattern)).identity()
  assert [f[0] for f in before[1]] == ["part-0.jsonl", "part-1.jsonl"]
  path = tmp_path / "a" / "part-1.jsonl"
  path.write_text(path.read_text().replace("the", "a"))
  assert list_source(SourceSpec(pattern)).identity() != before


def test_a_path_that_selects_nothing_is_named(tmp_path):
  (tmp_path / "notes.csv").write_text("a,b\n")
  (tmp_path / "empty").mkdir()
  cases = [
    (str(tmp_path / "*.jsonl"), "matches no file"),
    (str(tmp_path / "missing.jsonl"), "is not a file, a folder or a glob"),
    (str(tmp_path / "*.csv"), "notes.csv .*is in no format the readers know"),
    (str(tmp_path / "empty"), "holds no file in a known format"),
  ]
  for spec, message in cases:
    with pytest.raises(SourceError, match=message):
      list_source(SourceSpec(spec))
  (tmp_path / "dd").mkdir()
  (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
  with pytest.raises(SourceError, match=r"HF DatasetDict with splits \['train', 'test'\]; name"):
    list_source(SourceSpec(str(tmp_path / "dd")))


def bad_jsonl(tmp_path, line):
  """A JSONL file whose line 3 is `line`."""
  rows = [json.dumps({"text": "ok"}), json.dumps({"text": "fine"}), line, json.dumps({"text": "x"})]
  path = tmp_path / "bad.jsonl"
  path.write_text("\n".join(rows) + "\n")
  return path


BAD_LINES = {
  "not JSON": ('{"text": "cut', r"bad.jsonl line 3: is not JSON"),
  "no field": (
    '{"body": "x"}',
    r"bad.jsonl line 3: has no 'text' field \(its fields: \['body'\]\)",
  ),
  "not a string": ('{"text": 7}', r"bad.jsonl line 3: 'text' is a number, not a string"),
  "null": ('{"text": null}', r"bad.jsonl line 3: 'text' is a null, not a string"),
  "not an object": ('["text"]', r"bad.jsonl line 3: is a JSON array, not an object"),
}


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_each_bad_jsonl_row_is_an_error_naming_file_and_line(tmp_path, kind):
  line, message = BAD_LINES[kind]
  path = bad_jsonl(tmp_path, line)
  with pytest.raises(SourceError, match=f"{tmp_path}/{message}.*set data.skip_bad_rows=N"):
    read(path)


def test_bad_parquet_rows_and_columns_name_file_and_row(tmp_path):
  pattern = write_parquet(tmp_path / "nulls", ["a", "b", None, "d"])
  with pytest.raises(SourceError, match=r"part-0.parquet row 2: 'text' is null, not a string"):
    read(pattern)
  pattern = write_parquet(tmp_path / "ints", [1, 2, 3])
  with pytest.raises(SourceError, match=r"part-0.parquet row 0: column 'text' holds int64"):
    read(pattern)
  pattern = write_parquet(tmp_path / "other", ["a"], column="body")
  with pytest.raises(
    SourceError, match=r"row 0: has no column 'text' \(its columns: \['body', 'n'\]\)"
  ):
    read(pattern)


def test_an_unreadable_file_is_named_with_the_row_it_reached(tmp_path):
  lines = "".join(json.dumps({"text": t}) + "\n" for t in TEXTS).encode()
  (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(lines)[:-40])
  with pytest.raises(SourceError, match=r"cut.jsonl.gz: cannot be read as jsonl.gz after line \d+"):
    read(tmp_path / "cut.jsonl.gz")
  (tmp_path / "fake.parquet").write_bytes(b"PAR1 this is not parquet")
  with pytest.raises(SourceError, match=r"fake.parquet: cannot be read as parquet after its start"):
    read(tmp_path / "fake.parquet")
  (tmp_path / "fake.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd garbage")
  with pytest.raises(SourceError, match=r"fake.jsonl.zst: cannot be read as jsonl.zst"):
    read(tmp_path / "fake.jsonl.zst")


def test_skip_bad_rows_lets_n_through_and_stops_at_the_next(tmp_path):
  path = tmp_path / "some_bad.jsonl"
  rows = ['{"text": "a"}', "{oops", '{"text": "b"}', '{"body": 1}', '{"text": "c"}', "[]"]
  path.write_text("\n".join(rows) + "\n")
  source = list_source(SourceSpec(str(path)))
  kept = docs.SourceDocuments(source, skip_bad_rows=3)
  assert [d.text for d in kept] == ["a", "b", "c"]
  assert kept.report()["count"] == 3
  assert [r.split(": ", 1)[0] for r in kept.report()["rows"]] == [
    f"{path} line 2",
    f"{path} line 4",
    f"{path} line 6",
  ]
  with pytest.raises(
    SourceError, match=r"line 6: is a JSON array.*bad row number 3, and data.skip"
  ):
    list(docs.SourceDocuments(source, skip_bad_rows=2))


def test_the_bpe_sample_is_bounded_deterministic_and_spreads_over_files(tmp_path, monkeypatch):
  monkeypatch.setattr(docs, "MIN_FILE_SAMPLE", 10)
  many = [list_source(SourceSpec(write_jsonl(tmp_path / "a", TEXTS, files=5)))]
  many.append(list_source(SourceSpec(write_parquet(tmp_path / "b", TEXTS[::-1]))))
  sample = list(docs.sample_texts(many, budget=400))
  assert sum(map(len, sample)) <= 400
  assert sample == list(docs.sample_texts(many, budget=400))
  first_source = "".join(sample)[:200]
  files_seen = {f for f in range(5) if any(t[:20] in first_source for t in TEXTS[f::5])}
  assert len(files_seen) >= 3, files_seen  # not the first file alone
  assert any(t[:20] in "".join(sample)[200:] for t in TEXTS)  # the second source too


@pytest.mark.multiprocess  # the emulator is a process
def test_gs_sources_list_with_generations_and_read_every_format(tmp_path, monkeypatch):
  """`gs://` globs and HF folders through gcsfs, on a local GCS emulator."""
  from etils import epath

  from tests.gcs_emulator import serving

  local = tmp_path / "local"
  write_jsonl(local / "a", TEXTS, files=2, suffix=".jsonl.zst")
  write_parquet(local / "b", TEXTS)
  write_hf_dataset(local / "hf", TEXTS, files=2)
  with serving(tmp_path / "gcs", monkeypatch):
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
      epath.Path(f"gs://bucket/corpus/{path.relative_to(local)}").write_bytes(path.read_bytes())
    zst = list_source(SourceSpec("gs://bucket/corpus/a/*.jsonl.zst"))
    assert [f.path for f in zst.files] == [
      "gs://bucket/corpus/a/part-0.jsonl.zst",
      "gs://bucket/corpus/a/part-1.jsonl.zst",
    ]
    assert all(f.version.isdigit() for f in zst.files)  # the objects' generations
    assert read("gs://bucket/corpus/a/*.jsonl.zst") == TEXTS[0::2] + TEXTS[1::2]
    assert read("gs://bucket/corpus/b/part-0.parquet") == TEXTS
    assert read("gs://bucket/corpus/hf") == TEXTS[0::2] + TEXTS[1::2]
    with pytest.raises(SourceError, match=r"'gs://bucket/corpus/c/\*.jsonl' matches no file"):
      list_source(SourceSpec("gs://bucket/corpus/c/*.jsonl"))


def _strings_with_invalid_utf8(values: list[bytes]):
  """A string column holding `values` as they are, UTF-8 or not (Arrow does not check)."""
  import pyarrow as pa

  offsets = [0]
  for value in values:
    offsets.append(offsets[-1] + len(value))
  offsets = pa.array(offsets, pa.int32()).buffers()[1]
  column = pa.Array.from_buffers(
    pa.string(), len(values), [None, offsets, pa.py_buffer(b"".join(values))]
  )
  return pa.table({"text": column})


@pytest.mark.parametrize("suffix", ["parquet", "arrow"])
def test_undecodable_text_in_a_column_is_a_bad_row_naming_file_and_row(tmp_path, suffix):
  import pyarrow as pa
  import pyarrow.parquet as pq

  table = _strings_with_invalid_utf8([b"caf\xc3\xa9", b"ok", b"torn \xe2\x82", b"last"])
  path = tmp_path / f"mixed.{suffix}"
  if suffix == "parquet":
    pq.write_table(table, path)
  else:
    with pa.ipc.new_stream(str(path), table.schema) as writer:
      writer.write_table(table)
  with pytest.raises(SourceError, match=rf"mixed.{suffix} row 2: 'text' is not valid UTF-8"):
    read(path)
  assert read(path, skip_bad_rows=1) == ["café", "ok", "last"]


def test_a_file_listed_by_two_sources_or_twice_in_one_is_refused_naming_both(tmp_path):
  write_jsonl(tmp_path / "d", TEXTS, files=2)
  (tmp_path / "d" / "c.jsonl").write_text('{"text": "one"}\n')
  d = tmp_path / "d"
  setting = f"{d}/c.jsonl@1,{d}/*.jsonl@2,{d}/./c.jsonl@1"
  with pytest.raises(
    UserError, match=rf"{d}/c.jsonl is listed by '{d}/c.jsonl' and by '{d}/\*.jsonl'"
  ):
    list_sources(parse_sources(setting))
  (tmp_path / "e").mkdir()
  (tmp_path / "e" / "again.jsonl").symlink_to(d / "c.jsonl")  # one file, two names
  with pytest.raises(
    UserError, match=r"e/again.jsonl \(listed by .*\) and .*d/c.jsonl \(listed by .*\) are one file"
  ):
    list_sources(parse_sources(f"{d}/part-*.jsonl,{d}/c.jsonl,{tmp_path}/e"))
  assert [len(s.files) for s in list_sources(parse_sources(f"{d}/part-*.jsonl,{d}/c.jsonl"))] == [
    2,
    1,
  ]


def test_a_same_size_copy_that_keeps_its_mtime_is_not_taken_for_the_file_it_replaced(tmp_path):
  """`cp -p` of another file of the same size: size and mtime agree, the content does not."""
  import os

  path = tmp_path / "c.jsonl"
  path.write_text('{"text": "the first version of this row"}\n' * 3)
  before = list_source(SourceSpec(str(path))).identity()
  stat = os.stat(path)
  path.write_text('{"text": "the other version of this row"}\n' * 3)  # the same size
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
  assert os.stat(path).st_size == stat.st_size and os.stat(path).st_mtime_ns == stat.st_mtime_ns
  assert list_source(SourceSpec(str(path))).identity() != before


def _lines_of_text(count: int) -> str:
  """Lines unlike the corpus: code, prose, blank lines and indented ones (cuts a BPE could see)."""
  shapes = ["def f{i}(x):", "    return x * {i}", "", "Line {i}: é ü — naïve", "   ", "{i}{i}{i}"]
  return "".join(shapes[i % len(shapes)].format(i=i) + "\n" for i in range(count))


def _packed_records(path, tokenizer):
  from trainers.data.prepare import packed, source_packed

  documents = docs.SourceDocuments(list_source(SourceSpec(str(path))))
  ids = source_packed._token_ids(documents, tokenizer)
  return packed.pack_documents(ids, seq_len=32, dtype=np.int32, run_windows=4)


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_a_large_text_file_packs_in_pieces_as_read_whole_in_bounded_memory(
  tmp_path, monkeypatch, tokenizer
):
  import tracemalloc

  from trainers.data.prepare import source_packed
  from trainers.data.prepare.tokenizer import Tokenizer, train_bpe

  if tokenizer == "bpe":
    tokenizer = Tokenizer(train_bpe([_lines_of_text(300)], 320, tmp_path / "tok.json"))
  else:
    tokenizer = None
  small, large = tmp_path / "small.txt", tmp_path / "large.txt"
  small.write_text(_lines_of_text(4_000))
  large.write_text(_lines_of_text(16_000))
  monkeypatch.setattr(docs, "TEXT_PIECE", 1 << 30)
  whole = list(_packed_records(large, tokenizer))
  monkeypatch.setattr(docs, "TEXT_PIECE", 4096)
  monkeypatch.setattr(source_packed, "_ENCODE_CHARS", 4096)  # tokenized a piece at a time
  pieces = list(_packed_records(large, tokenizer))
  assert len(pieces) == len(whole) > 10
  for got, want in zip(pieces, whole):
    assert got.keys() == want.keys()
    for key in want:
      np.testing.assert_array_equal(got[key], want[key], err_msg=key)
  assert {int(r["document"]) for r in pieces} == {0}  # one document, however many pieces

  def peak(path) -> int:
    tracemalloc.start()
    for _ in _packed_records(path, tokenizer):
      pass
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak

  # Four times the text, about the same peak (read whole, it is four times too).
  assert peak(large) < 1.5 * peak(small), (peak(large), peak(small))
