"""A small text corpus built once per test session, shared by data tests."""

import pathlib

import numpy as np

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
  from trainers.data.datasets import prepare_text_corpus

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
  """Trainer test data under `root`: a text glob, a data dir, a shared compile cache.

  One compilation cache for all the runs of a test module: each layout
  compiles once.
  """
  return {
    "source": write_training_text(root),
    "dir": str(root / "data"),
    "cache": str(root / "jax_cache"),
  }
