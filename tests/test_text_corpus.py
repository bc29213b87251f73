"""The text corpus builder and `open_source`: round trip, splits, caching, errors."""

import collections
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow_datasets as tfds

from trainers.data.prepare import text_corpus
from trainers.data.records import datasets

CHUNK = 64

# Small files with the cases that matter: several chunks, an exact multiple of
# the chunk size, shorter than a chunk, non-ASCII UTF-8, bytes that are not
# UTF-8, empty, nested, and files the directory source must skip.
FILES = {
  "long.txt": "".join(f"line {i}: the quick brown fox\n" for i in range(40)),
  "exact.txt": "x" * (3 * CHUNK),
  "short.txt": "hi\n",
  "unicode.txt": "naïve café, 東京, 🙂\n" * 7,
  "empty.txt": "",
  "notes/a.md": "# heading\n\nsome *markdown* text\n" * 5,
  "notes/b.md": "another note\n",
  "notes/deeper/c.md": "deep " * 30,
  "code/mod.py": "def f(x):\n  return x + 1\n" * 9,
  "code/other.py": "import os\nprint(os.sep)\n",
  "code/more.py": "x = 1\n" * 50,
  ".hidden": "skipped by the directory source",
}
RAW = {"bytes.bin": bytes(range(256)) * 3}


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> pathlib.Path:
  root = tmp_path_factory.mktemp("src")
  for rel, text in FILES.items():
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(text, encoding="utf-8")
  for rel, data in RAW.items():
    (root / rel).write_bytes(data)
  return root


def _expected(src: pathlib.Path) -> dict[str, bytes]:
  """What the directory source should hold: non-hidden, non-empty files."""
  files = {**{k: v.encode() for k, v in FILES.items()}, **RAW}
  return {str(src / k): v for k, v in files.items() if v and not k.startswith(".")}


@pytest.fixture(scope="module")
def built(src, tmp_path_factory) -> tuple[str, str]:
  """The corpus of `src` with half the files in validation, so both splits have some."""
  data_dir = str(tmp_path_factory.mktemp("data"))
  name = text_corpus.prepare_text_corpus(data_dir, src, chunk_bytes=CHUNK, validation_percent=50)
  return name, data_dir


def _read_all(name: str, split: str, data_dir: str) -> list[dict]:
  source = datasets.open_source(name, split, data_dir)
  return [source[i] for i in range(len(source))]


def _files_of(records: list[dict]) -> dict[str, bytes]:
  chunks = collections.defaultdict(list)
  for r in records:
    chunks[r["source"].decode()].append((int(r["offset"]), r["tokens"].tobytes()))
  return {path: b"".join(data for _, data in sorted(parts)) for path, parts in chunks.items()}


def test_chunks_round_trip_to_the_files(built, src):
  name, data_dir = built
  records = _read_all(name, "train", data_dir) + _read_all(name, "validation", data_dir)
  assert all(r["tokens"].dtype == np.uint8 and 0 < len(r["tokens"]) <= CHUNK for r in records)
  assert _files_of(records) == _expected(src)
  # No chunk is repeated and none is missing: the offsets of a file tile it.
  assert len(records) == sum(-(-len(v) // CHUNK) for v in _expected(src).values())
  assert "tensorflow" not in sys.modules


def test_splits_partition_the_files_by_stable_hash(built, src):
  name, data_dir = built
  train = set(_files_of(_read_all(name, "train", data_dir)))
  validation = set(_files_of(_read_all(name, "validation", data_dir)))
  assert train and validation and not train & validation
  assert train | validation == set(_expected(src))
  for path in train | validation:
    expected = "validation" if path in validation else "train"
    assert text_corpus.split_of(os.path.relpath(path, src), 50) == expected


def test_adding_files_moves_no_file_between_splits(tmp_path):
  def splits() -> dict[str, str]:
    return {f.key: text_corpus.split_of(f.key, 50) for f in text_corpus.list_source_files(tmp_path)}

  for i in range(6):
    (tmp_path / f"f{i}.txt").write_text(f"file {i}\n")
  before = splits()
  for i in range(6, 12):
    (tmp_path / "more").mkdir(exist_ok=True)
    (tmp_path / "more" / f"f{i}.txt").write_text(f"file {i}\n")
  after = splits()
  assert len(after) == 12 and {k: after[k] for k in before} == before
  assert set(after.values()) == {"train", "validation"}


def test_second_prepare_reuses_the_data(built, src, monkeypatch):
  name, data_dir = built
  files = [p for p in pathlib.Path(data_dir).rglob("*") if p.is_file()]
  mtimes = {p: p.stat().st_mtime_ns for p in files}

  def fail(*args, **kwargs):
    raise AssertionError("the corpus was generated again")

  monkeypatch.setattr(text_corpus.TextCorpus, "_generate_examples", fail)
  again = text_corpus.prepare_text_corpus(data_dir, src, chunk_bytes=CHUNK, validation_percent=50)
  assert again == name
  assert {p: p.stat().st_mtime_ns for p in files} == mtimes


def test_glob_selects_only_matching_files(src, tmp_path):
  md = text_corpus.prepare_text_corpus(tmp_path, src / "**" / "*.md", validation_percent=0)
  py = text_corpus.prepare_text_corpus(tmp_path, src / "**" / "*.py", validation_percent=0)
  assert md != py
  expected = _expected(src)
  for name, suffix, count in [(md, ".md", 3), (py, ".py", 3)]:
    want = {k: v for k, v in expected.items() if k.endswith(suffix)}
    assert len(want) == count and _files_of(_read_all(name, "train", str(tmp_path))) == want


def test_build_is_deterministic(src, tmp_path):
  shards = []
  for data_dir in (tmp_path / "one", tmp_path / "two"):
    text_corpus.prepare_text_corpus(data_dir, src, chunk_bytes=CHUNK, validation_percent=50)
    shards.append({p.name: p.read_bytes() for p in data_dir.rglob("*.array_record-*")})
  assert len(shards[0]) == 2 and shards[0] == shards[1]


def test_data_dir_inside_the_source_is_not_read(tmp_path):
  (tmp_path / "a.txt").write_text("some text\n" * 20)
  data_dir = tmp_path / "tfds"
  for chunk in (16, 32):  # The second build must not read the first one's shards.
    name = text_corpus.prepare_text_corpus(
      data_dir, tmp_path, chunk_bytes=chunk, validation_percent=0
    )
    assert set(_files_of(_read_all(name, "train", str(data_dir)))) == {str(tmp_path / "a.txt")}


def test_config_name_follows_the_source_spec(src):
  config = text_corpus.text_corpus_config
  assert config(src).name == config(str(src)).name
  assert config(src).name != config(src, chunk_bytes=CHUNK).name
  assert config(src).name != config(src / "*.txt").name
  assert config([src / "short.txt"]).name.startswith("files-4096b-")
  assert config().name.startswith("stdlib-4096b-")
  with pytest.raises(ValueError, match="chunk_bytes=0"):
    config(src, chunk_bytes=0)
  with pytest.raises(FileNotFoundError, match="selects no file"):
    text_corpus.list_source_files(src / "*.nothing")


def test_unprepared_dataset_names_data_dir_and_how_to_build(tmp_path):
  with pytest.raises(FileNotFoundError) as e:
    datasets.open_source("mnist", "train", tmp_path)
  message = str(e.value)
  assert f"data_dir='{tmp_path}'" in message and "'mnist'" in message
  assert "tfds build mnist" in message
  with pytest.raises(FileNotFoundError) as e:
    datasets.open_source("text_corpus", "train", tmp_path)
  assert f"data_dir='{tmp_path}'" in str(e.value) and "prepare_text_corpus(" in str(e.value)


class TinyDigits(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Stands in for a dataset like mnist that was prepared elsewhere: its code is not registered."""

  VERSION = tfds.core.Version("1.0.0")
  code_path = (
    None  # See TextCorpus.code_path: tfds 4.9.10 needs it set without importlib_resources.
  )

  def _info(self):
    features = {"image": tfds.features.Tensor(shape=(2, 2), dtype=np.uint8), "label": np.int64}
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(features))

  def _split_generators(self, dl_manager):
    return {"train": self._generate_examples(5), "test": self._generate_examples(2)}

  def _generate_examples(self, n):
    for i in range(n):
      yield i, {"image": np.full((2, 2), i, np.uint8), "label": i}


def test_opens_any_prepared_dataset_from_its_files_alone(tmp_path):
  TinyDigits(data_dir=str(tmp_path), file_format="array_record").download_and_prepare(
    download_config=text_corpus.DOWNLOAD_CONFIG
  )
  source = datasets.open_source("tiny_digits", "test", tmp_path)
  assert len(source) == 2
  assert sorted(int(source[i]["label"]) for i in range(2)) == [0, 1]
  assert datasets.open_source("tiny_digits:1.0.0", "train[:3]", tmp_path).info.name == "tiny_digits"


def test_decodes_only_the_features_asked_for(built):
  name, data_dir = built
  full = datasets.open_source(name, "train", data_dir)
  tokens_only = datasets.open_source(name, "train", data_dir, features=["tokens"])
  assert len(tokens_only) == len(full) > 1
  indices = list(range(len(full)))
  for one, batch, whole in zip(
    (tokens_only[i] for i in indices), tokens_only.__getitems__(indices), full.__getitems__(indices)
  ):
    assert set(one) == set(batch) == {"tokens"}
    assert one["tokens"].dtype == whole["tokens"].dtype == np.uint8
    assert one["tokens"].tobytes() == batch["tokens"].tobytes() == whole["tokens"].tobytes()


def test_unknown_feature_lists_the_features(built):
  name, data_dir = built
  with pytest.raises(
    ValueError, match=re.escape("has no feature ['image']; its features are ['offset', 'source',")
  ):
    datasets.open_source(name, "train", data_dir, features=["tokens", "image"])


def test_unknown_split_lists_the_splits(built):
  name, data_dir = built
  with pytest.raises(ValueError, match=r"split='test' is not a split .*\['train', 'validation'\]"):
    datasets.open_source(name, "test", data_dir)


def _copy(built, tmp_path) -> tuple[str, str, pathlib.Path]:
  name, data_dir = built
  copy = tmp_path / "data"
  shutil.copytree(data_dir, copy)
  (shard,) = copy.rglob("*-train.array_record-*")
  return name, str(copy), shard


def test_truncated_shard_is_a_clear_error(built, tmp_path):
  name, data_dir, shard = _copy(built, tmp_path)
  with open(shard, "r+b") as f:
    f.truncate(shard.stat().st_size // 2)
  with pytest.raises(ValueError, match=re.escape(f"shard {shard} is truncated or corrupt")):
    datasets.open_source(name, "train", data_dir)
  shard.unlink()
  with pytest.raises(FileNotFoundError, match=re.escape(f"shard {shard} is missing")):
    datasets.open_source(name, "train", data_dir)


@pytest.mark.parametrize("features", [None, ("tokens", "source", "offset")])
def test_corrupt_record_is_an_error_not_garbage(built, src, tmp_path, features):
  name, data_dir, shard = _copy(built, tmp_path)
  data = bytearray(shard.read_bytes())
  data[100:140] = bytes(b ^ 0xFF for b in data[100:140])  # Inside the first records.
  shard.write_bytes(data)
  source = datasets.open_source(name, "train", data_dir, features)  # The index is intact.
  expected = _expected(src)
  errors = 0
  for i in range(len(source)):
    try:
      record = source[i]
    except ValueError as e:
      assert f"could not read record {i} from {shard}" in str(e)
      errors += 1
    else:
      start = int(record["offset"])
      assert (
        record["tokens"].tobytes() == expected[record["source"].decode()][start : start + CHUNK]
      )
  assert errors > 0
  with pytest.raises(ValueError, match=re.escape(f"from {shard}, which is truncated or corrupt")):
    source.__getitems__(list(range(len(source))))  # Batch reads, as grain does them.


@pytest.mark.slow
def test_default_stdlib_corpus_has_over_10_mb(tmp_path):
  start = time.perf_counter()
  name = text_corpus.prepare_text_corpus(tmp_path)
  built_s = time.perf_counter() - start
  tokens = 0
  sources = set()
  for split in ("train", "validation"):
    source = datasets.open_source(name, split, tmp_path)
    for i in range(len(source)):
      record = source[i]
      tokens += len(record["tokens"])
      sources.add(record["source"].decode())
  assert tokens > 10_000_000
  assert os.path.join(text_corpus.stdlib_dir(), "os.py") in sources
  assert not any("site-packages" in s for s in sources)
  assert datasets.open_source("text_corpus", "train", tmp_path).name.startswith(name.split(":")[0])
  print(f"stdlib corpus: {tokens / 1e6:.1f} MB of tokens, built in {built_s:.1f} s")


def test_changed_or_added_files_build_a_new_corpus(tmp_path):
  src, data_dir = tmp_path / "src", tmp_path / "data"
  src.mkdir()
  (src / "a.txt").write_text("first version\n")

  def prepare():
    name = text_corpus.prepare_text_corpus(data_dir, src, validation_percent=0)
    return name, _files_of(_read_all(name, "train", str(data_dir)))

  first, files = prepare()
  assert files == {str(src / "a.txt"): b"first version\n"}
  assert prepare()[0] == first  # unchanged files: the same corpus, reused
  (src / "b.txt").write_text("added later\n")
  added, files = prepare()
  assert added != first and set(files) == {str(src / "a.txt"), str(src / "b.txt")}
  (src / "a.txt").write_text("second version\n")  # edited: another size
  edited, files = prepare()
  assert edited not in (first, added) and files[str(src / "a.txt")] == b"second version\n"
  stat = (src / "a.txt").stat()
  (src / "a.txt").write_text("third  version\n")  # the same size, a later time
  os.utime(src / "a.txt", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
  touched, files = prepare()
  assert touched != edited and files[str(src / "a.txt")] == b"third  version\n"


def test_a_data_dir_inside_the_source_keeps_the_corpus_name(tmp_path):
  (tmp_path / "a.txt").write_text("some text\n" * 20)
  name = text_corpus.prepare_text_corpus(tmp_path / "tfds", tmp_path, validation_percent=0)
  # The build wrote files under the source: they are not the corpus's files.
  assert text_corpus.prepare_text_corpus(tmp_path / "tfds", tmp_path, validation_percent=0) == name


def test_the_stdlib_corpus_name_is_fixed_by_the_python_version():
  assert text_corpus.text_corpus_config().name == text_corpus.TextCorpus.BUILDER_CONFIGS[0].name


def test_too_few_files_for_validation_name_the_setting_and_what_to_set(tmp_path):
  from configs import default
  from trainers.tasks import make_task

  src = tmp_path / "src"
  src.mkdir()
  names = [n for n in (f"doc{i}.txt" for i in range(50)) if text_corpus.split_of(n) == "train"][:3]
  for n in names:
    (src / n).write_text(f"text of {n}\n")
  config = default.get_config()
  config.data.source = str(src)
  with pytest.raises(ValueError) as e:
    make_task(config).prepare_data(str(tmp_path / "data"))
  message = str(e.value)
  least = re.search(r"set data.validation_percent=([\d.]+) or more", message)
  assert "data.validation_percent=2 holds out none of the 3 non-empty files" in message
  assert least and f"data.source={str(src)!r}" in message and "data.eval_split=" in message
  assert not (tmp_path / "data").exists(), "nothing is built that could not be evaluated"
  config.data.validation_percent = float(least.group(1))  # what the message says works
  name = make_task(config).prepare_data(str(tmp_path / "data"))
  assert len(datasets.open_source(name, "validation", tmp_path / "data")) == 1
  config.data.validation_percent, config.data.eval_split = 2.0, "train[:50%]"
  make_task(config).prepare_data(str(tmp_path / "data"))  # no validation split needed


@pytest.mark.multiprocess
def test_two_runs_preparing_one_data_dir_at_once_both_succeed_with_one_corpus(tmp_path):
  """Two real processes (a sweep's runs on the default data.dir) prepare the same corpus at the
  same moment: both finish with its name, and the corpus holds every file once. Many files
  make each build long enough that the two overlap, unless one waits for the other."""
  src = tmp_path / "src"
  src.mkdir()
  texts = {src / f"f{i:03d}.txt": f"file {i}: " + "lorem ipsum " * (i % 17 + 1) for i in range(300)}
  for path, text in texts.items():
    path.write_text(text)
  go = tmp_path / "go"
  worker = str(pathlib.Path(__file__).parent / "workers" / "prepare_text_corpus_beside_worker.py")
  command = [sys.executable, worker, str(src), str(tmp_path / "data"), str(go)]
  root = str(pathlib.Path(__file__).resolve().parent.parent)
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
  runs = [
    subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    for _ in range(2)
  ]
  time.sleep(8)  # both have imported TFDS and wait for the same moment
  go.touch()
  outputs = []
  try:
    for run in runs:
      outputs.append(run.communicate(timeout=180)[0])
  finally:
    for run in runs:
      run.kill()
  assert [run.returncode for run in runs] == [0, 0], "\n\n".join(outputs)
  names = {output.strip().splitlines()[-1] for output in outputs}
  assert len(names) == 1, outputs
  name = names.pop()
  records = _read_all(name, "train", str(tmp_path / "data"))
  records += _read_all(name, "validation", str(tmp_path / "data"))
  assert _files_of(records) == {str(p): t.encode() for p, t in texts.items()}
