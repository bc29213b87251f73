"""Per-record lengths kept beside a prepared dataset, so that no host reads every record to open it.

An LM task cuts records of varied length into windows, and needs every
record's length before its first step (how many windows each record holds,
what an epoch uses). Reading them from the records themselves means reading
the whole split, on every host, at every start. Instead the lengths are read
once, where the dataset is prepared, and kept beside its index as one `.npy`
of int64 per split and feature (`lengths-<split>-<feature>.npy`, no pickle):
the text corpus writes them into its build before TFDS publishes it, and the
LM tasks' `prepare_data` adds them, on process 0 first, to any dataset that
has none (one prepared elsewhere, or before lengths were kept).

A requested split ("train[:10%]", "train+validation") takes its records'
lengths from the files of the splits it reads, in TFDS's order of shards.

Example:
  >>> import tempfile
  >>> folder = tempfile.mkdtemp()
  >>> write_lengths(folder, "train", "tokens", [3, 5, 2])
  >>> np.load(lengths_path(folder, "train", "tokens")).tolist()
  [3, 5, 2]
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import tensorflow_datasets as tfds
from array_record.python import array_record_module

_READ_BATCH = 1024  # records per read while scanning a shard


def lengths_path(dataset_dir: str | os.PathLike, split: str, feature: str) -> str:
  """Where the lengths of `feature` in split `split` are kept, beside the dataset's index."""
  return os.path.join(os.fspath(dataset_dir), f"lengths-{split}-{feature}.npy")


def has_variable_length(features: tfds.features.FeaturesDict, feature: str) -> bool:
  """Whether records differ in `feature`'s length (its shape has an unknown dimension).

  >>> tokens = tfds.features.Tensor(shape=(None,), dtype=np.int32)
  >>> has_variable_length(tfds.features.FeaturesDict({"tokens": tokens}), "tokens")
  True
  """
  if feature not in features:
    return False
  shape = getattr(features[feature], "shape", None)
  return shape is not None and any(d is None or d < 0 for d in shape)


def write_lengths(
  dataset_dir: str | os.PathLike, split: str, feature: str, lengths: Sequence[int] | np.ndarray
) -> None:
  """Writes a split's lengths under their final name only once whole.

  A reader sees the whole file or none: a process stopped while writing
  leaves a hidden temporary file, never a short lengths file.
  """
  path = lengths_path(dataset_dir, split, feature)
  partial = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.partial")
  with open(partial, "wb") as f:
    np.save(f, np.asarray(lengths, np.int64), allow_pickle=False)
  os.replace(partial, path)


def scan_split(info: tfds.core.DatasetInfo, split: str, feature: str) -> np.ndarray:
  """Every record's length of `feature` in split `split`, read from its shards in order.

  Only `feature` is decoded. This is the read that keeping the lengths saves
  every later start.
  """
  decode = tfds.features.FeaturesDict({feature: info.features[feature]}).deserialize_example_np
  lengths = []
  for instruction in info.splits[split].file_instructions:
    reader = array_record_module.ArrayRecordReader(os.fspath(instruction.filename))
    try:
      end = instruction.skip + instruction.take
      for start in range(instruction.skip, end, _READ_BATCH):
        for raw in reader.read(start, min(start + _READ_BATCH, end)):
          lengths.append(np.size(decode(raw)[feature]))
    finally:
      reader.close()
  return np.asarray(lengths, np.int64)


def keep_lengths(
  dataset_dir: str | os.PathLike, info: tfds.core.DatasetInfo, feature: str
) -> list[str]:
  """Writes the lengths of `feature` for each split of the dataset that has none; returns those splits.

  Nothing is written for a feature of fixed length (its length is in the
  dataset's info).
  """
  if not has_variable_length(info.features, feature):
    return []
  written = []
  for split in sorted(info.splits):
    if not os.path.exists(lengths_path(dataset_dir, split, feature)):
      write_lengths(dataset_dir, split, feature, scan_split(info, split, feature))
      written.append(split)
  return written


def read_lengths(info: tfds.core.DatasetInfo, split: str, feature: str) -> np.ndarray | None:
  """The kept lengths of `feature` for the records of `split` (a TFDS split spec), in order.

  None when a split it reads has no lengths file (a dataset prepared before
  they were kept): the caller then reads the records.

  Raises:
    ValueError: a lengths file that is not a 1-D array of non-negative
      integers, one per record of its split; the message names the file.
  """
  dataset_dir = os.fspath(info.data_dir)
  # Where each shard's records start in its split's lengths.
  starts: dict[str, tuple[str, int]] = {}
  for name, split_info in info.splits.items():
    start = 0
    for instruction in split_info.file_instructions:
      starts[os.path.basename(os.fspath(instruction.filename))] = (name, start)
      start += instruction.take
  kept: dict[str, np.ndarray] = {}
  pieces = []
  for instruction in info.splits[split].file_instructions:
    name, start = starts[os.path.basename(os.fspath(instruction.filename))]
    if name not in kept:
      path = lengths_path(dataset_dir, name, feature)
      if not os.path.exists(path):
        return None
      kept[name] = _load(path, info.splits[name].num_examples)
    begin = start + instruction.skip
    pieces.append(kept[name][begin : begin + instruction.take])
  return np.concatenate(pieces) if pieces else np.zeros(0, np.int64)


def _load(path: str, records: int) -> np.ndarray:
  """A lengths file, checked against the number of records its split holds."""
  fix = f"Delete {path}: the next preparation writes it again from the records."
  try:
    lengths = np.load(path, allow_pickle=False)
  except (OSError, ValueError) as e:
    raise ValueError(f"record lengths {path} cannot be read ({e}). {fix}") from e
  if lengths.ndim != 1 or not np.issubdtype(lengths.dtype, np.integer):
    raise ValueError(
      f"record lengths {path} hold {lengths.dtype}{list(lengths.shape)}, not one integer per "
      f"record. {fix}"
    )
  if len(lengths) != records:
    raise ValueError(
      f"record lengths {path} hold {len(lengths)} lengths for a split of {records} records. {fix}"
    )
  if len(lengths) and lengths.min() < 0:
    row = int(np.argmin(lengths))
    raise ValueError(f"record lengths {path}: row {row} is {int(lengths[row])}, below 0. {fix}")
  return lengths.astype(np.int64, copy=False)
