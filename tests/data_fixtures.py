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
