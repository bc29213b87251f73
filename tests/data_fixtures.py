"""A small text corpus built once per test session, shared by data tests."""

import pathlib

import numpy as np

from tests import session_settings

SEQ_LEN = 16


def write_text_files(root: pathlib.Path, count: int = 40, seed: int = 0) -> pathlib.Path:
  """`count` files of printable text of varied lengths under root/src."""
  rng = np.random.default_rng(seed)
  src = root / "src"
  src.mkdir(parents=True, exist_ok=True)
  for i in range(count):
    n = int(rng.integers(20, 160))
    text = "".join(chr(c) for c in rng.integers(32, 127, size=n))
    (src / f"file_{i:03d}.txt").write_text(f"#{i}: {text}\n")
  return src


def build_corpus(root: pathlib.Path) -> tuple[str, str]:
  """(dataset name, data dir) of a corpus with SEQ_LEN + 1 byte records."""
  from trainers.data.prepare.text_corpus import prepare_text_corpus

  src = write_text_files(root)
  data_dir = root / "data"
  name = prepare_text_corpus(
    data_dir, source=str(src / "*.txt"), chunk_bytes=SEQ_LEN + 1, validation_percent=10.0
  )
  return name, str(data_dir)


WORDS = (
  "the",
  "model",
  "learns",
  "bytes",
  "of",
  "text",
  "and",
  "every",
  "host",
  "feeds",
  "its",
  "own",
  "rows",
  "while",
  "devices",
  "share",
  "one",
  "program",
)


def write_training_text(
  root: pathlib.Path, files: int = 12, words: int = 1500, seed: int = 0
) -> str:
  """Files of word-salad text a tiny LM can learn from; returns their glob."""
  rng = np.random.default_rng(seed)
  src = root / "train_src"
  src.mkdir(parents=True, exist_ok=True)
  for i in range(files):
    text = " ".join(WORDS[j] for j in rng.integers(0, len(WORDS), size=words))
    (src / f"doc_{i:02d}.txt").write_text(text + "\n")
  return str(src / "*.txt")


def training_data(root: pathlib.Path) -> dict[str, str]:
  """Trainer test data under `root`: a text glob, a data dir, the run's compile cache.

  The pytest run's one compilation cache (`tests/session_settings.py`): each
  layout compiles once for every test and job of the run.
  """
  return {
    "source": write_training_text(root),
    "dir": str(root / "data"),
    "cache": session_settings.compilation_cache_dir(),
  }


def source_texts(count: int, seed: int, words: tuple[str, ...] = WORDS) -> list[str]:
  """`count` documents of word salad, 5 to 60 words each."""
  rng = np.random.default_rng(seed)
  return [" ".join(rng.choice(words, size=int(rng.integers(5, 60)))) for _ in range(count)]


def write_jsonl(
  folder: pathlib.Path, texts: list[str], files: int = 2, suffix: str = ".jsonl", field="text"
) -> str:
  """`texts` as JSONL over `files` files (.jsonl, .jsonl.gz or .jsonl.zst); returns their glob."""
  import gzip
  import json

  import zstandard

  folder.mkdir(parents=True, exist_ok=True)
  for f in range(files):
    lines = "".join(json.dumps({field: t, "i": i}) + "\n" for i, t in enumerate(texts[f::files]))
    data = lines.encode()
    if suffix.endswith(".gz"):
      data = gzip.compress(data)
    elif suffix.endswith(".zst"):
      data = zstandard.ZstdCompressor().compress(data)
    (folder / f"part-{f}{suffix}").write_bytes(data)
  return str(folder / f"*{suffix}")


def write_parquet(folder: pathlib.Path, texts: list, files: int = 1, column: str = "text") -> str:
  """`texts` as Parquet over `files` files, in row groups of 16; returns their glob."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  folder.mkdir(parents=True, exist_ok=True)
  for f in range(files):
    part = texts[f::files]
    table = pa.table({column: part, "n": list(range(len(part)))})
    pq.write_table(table, folder / f"part-{f}.parquet", row_group_size=16)
  return str(folder / "*.parquet")


def write_hf_dataset(folder: pathlib.Path, texts: list[str], files: int = 2) -> str:
  """A folder as HF `datasets`' `save_to_disk` writes it: Arrow IPC streams and state.json."""
  import json

  import pyarrow as pa

  folder.mkdir(parents=True, exist_ok=True)
  names = []
  for f in range(files):
    name = f"data-{f:05d}-of-{files:05d}.arrow"
    part = pa.table({"text": texts[f::files]})
    with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, part.schema) as w:
      for batch in part.to_batches(max_chunksize=10):
        w.write_batch(batch)
    names.append(name)
  state = {"_data_files": [{"filename": n} for n in names], "_fingerprint": "0", "_split": None}
  (folder / "state.json").write_text(json.dumps(state))
  (folder / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string"}}}))
  return str(folder)
