"""Open any TFDS dataset prepared in a data directory as a random-access source.

`open_source(name, split, data_dir)` reads what is already on disk and never
downloads: a dataset that is not there is a `FileNotFoundError` that says how
to prepare it. The source has `len()` and `[i]` (what grain's samplers need),
reads ArrayRecord files without TensorFlow, and checks the files when it
opens them, so a truncated or corrupt shard is an error naming the file
rather than garbage.

Here the byte-level text corpus, prepared by
`trainers.data.prepare.text_corpus.prepare_text_corpus`, is opened:

  >>> import tempfile, pathlib
  >>> from trainers.data.prepare.text_corpus import prepare_text_corpus
  >>> root = pathlib.Path(tempfile.mkdtemp())
  >>> _ = (root / "a.txt").write_text("hello world")
  >>> name = prepare_text_corpus(root / "data", source=root / "*.txt")  # doctest: +ELLIPSIS
  Downloading and preparing dataset ...
  Dataset text_corpus downloaded and prepared to ...
  >>> source = open_source(name, "train", root / "data")
  >>> len(source), source[0]["tokens"].tobytes()
  (1, b'hello world')
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow_datasets as tfds
from array_record.python import array_record_module
from etils import epath
from google.protobuf.message import DecodeError
from tensorflow_datasets.core import read_only_builder

from spmd.errors import UserError
from trainers.data.records import stored_lengths
from trainers.data.records.record_order import ShardWindows
from trainers.data.records.shard_cache import ShardCache

log = logging.getLogger(__name__)

_ARRAY_RECORD = tfds.core.FileFormat.ARRAY_RECORD
# What a bad record raises: array_record for a file it cannot read, protobuf
# for bytes that are not an Example.
_BAD_RECORD = (RuntimeError, DecodeError)


class RecordSource(Sequence):
  """A TFDS data source whose read errors name the shard and how to fix it.

  Attributes:
    name: the dataset's full name, `dataset/config/version`.
    split: the split as requested (TFDS slices like "train[:10%]" work).
    info: the dataset's `tfds.core.DatasetInfo` (features, split sizes).
  """

  def __init__(
    self,
    source: Sequence[Any],
    *,
    name: str,
    split: str,
    info: tfds.core.DatasetInfo,
    files: list[str],
    decode: Callable[[bytes], Any] | None = None,
    shard_windows: ShardWindows | None = None,
  ):
    self._source = source
    # The order its reads need (shards staged into a bounded cache), or None.
    self.shard_windows = shard_windows
    self._decode = decode  # for a source of raw records; None: `source` decodes
    self.name = name
    self.split = split
    self.info = info
    self._files = files
    # First record index of each file, to say which file a bad record is in.
    self._starts = []
    start = 0
    for instruction in info.splits[split].file_instructions:
      self._starts.append(start)
      start += instruction.take

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index: int) -> Any:
    try:
      record = self._source[index]
      return record if self._decode is None else self._decode(record)
    except _BAD_RECORD as e:
      raise self._read_error(index, e) from e

  def __getitems__(self, indices: Sequence[int]) -> Sequence[Any]:
    try:
      records = self._source.__getitems__(indices)
      return records if self._decode is None else [self._decode(r) for r in records]
    except _BAD_RECORD:
      # Read one at a time to name the bad record (the error path only).
      return [self[i] for i in indices]

  def __iter__(self) -> Iterator[Any]:
    for i in range(len(self)):
      yield self[i]

  def stored_lengths(self, feature: str) -> np.ndarray | None:
    """Each record's length of `feature`, as kept when the dataset was prepared; None if not kept."""
    return stored_lengths.read_lengths(self.info, self.split, feature)

  def __repr__(self) -> str:
    return f"RecordSource({self.name}, split={self.split!r}, {len(self)} records)"

  def _read_error(self, index: int, error: Exception) -> ValueError:
    file = self._files[max(0, bisect.bisect_right(self._starts, int(index)) - 1)]
    return ValueError(
      f"{self.name} {self.split!r}: could not read record {index} from {file}, which is "
      f"truncated or corrupt ({error}). Delete {os.path.dirname(self._files[0])} and "
      "prepare the dataset again."
    )


def _prepared_configs(data_dir: str, dataset: str) -> list[str]:
  path = os.path.join(data_dir, dataset)
  if not os.path.isdir(path):
    return []
  return sorted(c for c in os.listdir(path) if not c.startswith(".") and "incomplete" not in c)


def _not_prepared(name: str, data_dir: str) -> FileNotFoundError:
  dataset = name.split("/")[0].split(":")[0]
  where = f"{data_dir=}" + ("" if os.path.isdir(data_dir) else " (which does not exist)")
  configs = _prepared_configs(data_dir, dataset)
  found = f" Prepared there: {dataset}/{configs}." if configs else ""
  # The name of `trainers.data.prepare.text_corpus.TextCorpus`: the record format imports no room.
  if dataset == "text_corpus":
    how = (
      'Build it (no network needed) with: python -c "from trainers.data.prepare.text_corpus import '
      f'prepare_text_corpus; print(prepare_text_corpus({data_dir!r}))" (add source=... for '
      "your own files; that call returns the name to open)."
    )
  else:
    how = (
      "Nothing is downloaded here. On a machine with network run "
      f"`tfds build {dataset} --data_dir=DIR --file_format=array_record`, then copy "
      f"DIR/{dataset} to {os.path.join(data_dir, dataset)}."
    )
  return FileNotFoundError(f"dataset {name!r} is not prepared in {where}.{found} {how}")


def _check_files(name: str, split: str, info: tfds.core.DatasetInfo) -> list[str]:
  """Each shard exists and holds the records the dataset info promises."""
  files = []
  for instruction in info.splits[split].file_instructions:
    path = os.fspath(instruction.filename)
    if not os.path.isfile(path):
      raise FileNotFoundError(f"{name} {split!r}: shard {path} is missing; prepare it again")
    reader = array_record_module.ArrayRecordReader(path)
    ok, found = reader.ok(), reader.num_records()
    if ok:  # Closing a reader that failed to open raises its error again.
      reader.close()
    if not ok or found != instruction.examples_in_shard:
      raise ValueError(
        f"{name} {split!r}: shard {path} is truncated or corrupt: it should hold "
        f"{instruction.examples_in_shard} records, {found=} ({ok=}). Delete "
        f"{os.path.dirname(path)} and prepare the dataset again."
      )
    files.append(path)
  return files


def open_source(
  name: str,
  split: str,
  data_dir: str | os.PathLike,
  features: Sequence[str] | None = None,
  staging: Staging | None = None,
) -> RecordSource:
  """Opens split `split` of dataset `name`, already prepared in `data_dir`.

  Args:
    name: a TFDS name: "mnist", "mnist:3.0.1", "text_corpus" (the default,
      stdlib config), or "text_corpus/<config>" as `prepare_text_corpus`
      returns it.
    split: "train", "validation", "test", or a TFDS slice like "train[:5%]".
    data_dir: the TFDS data directory the dataset was prepared in.
    features: the top-level features to decode (the ones the task reads);
      None decodes all. The others are never decoded: for the text corpus
      that is a third of the decoding time, for an image dataset with unused
      images or masks far more.
    staging: the shards are not in `data_dir` (which holds the dataset's
      metadata) but at `staging.remote`, read through `staging.cache`; the
      records are then ordered a window of shards at a time (`Staging`).

  Returns:
    A `RecordSource`: `len()` and `[i]`, each record a dict of numpy values.

  Raises:
    FileNotFoundError: the dataset is not prepared in `data_dir` (the message
      says how to prepare it), or one of its shards is missing.
    ValueError: unknown split or feature, a format without random access
      (e.g. TFRecord), or a truncated or corrupt shard.

  >>> open_source("mnist", "train", "/nonexistent")  # doctest: +ELLIPSIS
  Traceback (most recent call last):
  FileNotFoundError: dataset 'mnist' is not prepared in data_dir='/nonexistent' ...
  """
  data_dir = os.fspath(data_dir)
  try:
    # From the files alone: no dataset code runs and nothing can download.
    builder = read_only_builder.builder_from_files(name, data_dir=data_dir)
  except tfds.core.DatasetNotFoundError:
    raise _not_prepared(name, data_dir) from None
  info = builder.info
  full_name = _full_name(builder)
  # A TFDS split spec: names, each maybe sliced ("train[:5%]"), joined by "+".
  if any(part.split("[")[0].strip() not in info.splits for part in split.split("+")):
    raise ValueError(
      f"{split=} is not a split of {full_name} in {data_dir=}; it has {sorted(info.splits)}"
    )
  if _ARRAY_RECORD not in info.available_file_formats():
    raise ValueError(
      f"{full_name} in {data_dir=} is stored as {info.file_format.value}, which has no random "
      f"access. Prepare it again with `tfds build {info.name} --file_format=array_record`."
    )
  if staging is not None:
    return _staged_source(builder, full_name, split, features, staging)
  files = _check_files(full_name, split, info)
  if features is None:
    source, decode = builder.as_data_source(split, file_format=_ARRAY_RECORD), None
  else:
    available = sorted(info.features.keys())
    missing = [f for f in features if f not in available]
    if missing:
      raise ValueError(f"{full_name} has no feature {missing}; its features are {available}")
    # TFDS's own decoder for a dict of just these features, over raw records:
    # its parser skips what is not in the dict.
    decode = tfds.features.FeaturesDict(
      {f: info.features[f] for f in features}
    ).deserialize_example_np
    source = builder.as_data_source(
      split, file_format=_ARRAY_RECORD, deserialize_method=tfds.decode.DeserializeMethod.RAW_BYTES
    )
  return RecordSource(source, name=full_name, split=split, info=info, files=files, decode=decode)


def _full_name(builder) -> str:
  """NAME/CONFIG/VERSION: TFDS's full name, with the config a builder read from files leaves out.

  A mixture's sources are one dataset (`packed_source`) in as many configs:
  without it, errors about them cannot say which.
  """
  version = epath.Path(builder.data_dir)
  config = version.parent.name
  if config == builder.info.name:  # a dataset without configs
    return builder.info.full_name
  return f"{builder.info.name}/{config}/{version.name}"


@dataclasses.dataclass(frozen=True)
class Staging:
  """Where a dataset's shards are (`remote`, the data.dir its metadata came from) and the cache."""

  remote: str  # the remote data.dir: `data_dir`'s files are copies of its metadata
  local: str  # the local data_dir the dataset is opened from
  cache: ShardCache
  share: int = 1  # datasets read at once (a mixture's sources): each gets 1/share of the cache


def _staged_source(builder, name: str, split: str, features, staging: Staging) -> RecordSource:
  """A split whose shards are read through `staging.cache`, in a shard-window order."""
  info = builder.info
  instructions = info.splits[split].file_instructions
  urls = [
    os.fspath(epath.Path(staging.remote) / os.path.relpath(os.fspath(i.filename), staging.local))
    for i in instructions
  ]
  largest = max(epath.Path(url).stat().length for url in urls)
  # Two windows fit the cache: a shuffle block straddles two at most.
  window = staging.cache.capacity // (2 * max(largest, 1) * staging.share)
  if window < 1:
    each = f" for each of the {staging.share} sources read at once" if staging.share > 1 else ""
    raise UserError(
      f"data.cache_bytes={staging.cache.capacity} is less than two of {name}'s shards "
      f"({largest} bytes the largest){each}: raise it to at least {2 * largest * staging.share}"
    )
  chosen = features if features is not None else list(info.features.keys())
  decode = tfds.features.FeaturesDict({f: info.features[f] for f in chosen}).deserialize_example_np
  source = _StagedShards(urls, [(i.skip, i.take) for i in instructions], staging.cache)
  windows = ShardWindows(sizes=tuple(i.take for i in instructions), window=window)
  return RecordSource(
    source, name=name, split=split, info=info, files=urls, decode=decode, shard_windows=windows
  )


class _StagedShards(Sequence):
  """Raw records of a split's shards, each read through the cache (staged when first needed)."""

  def __init__(self, urls: list[str], parts: list[tuple[int, int]], cache: ShardCache):
    self._urls, self._parts, self._cache = urls, parts, cache
    self._starts = np.concatenate([[0], np.cumsum([take for _, take in parts])]).tolist()

  def __len__(self) -> int:
    return self._starts[-1]

  def __getitem__(self, index: int) -> bytes:
    return self.__getitems__([index])[0]

  def __getitems__(self, indices: Sequence[int]) -> list[bytes]:
    by_shard: dict[int, list[int]] = {}
    for k, index in enumerate(indices):
      if not 0 <= index < len(self):
        raise IndexError(f"record {index} of {len(self)}")
      by_shard.setdefault(bisect.bisect_right(self._starts, index) - 1, []).append(k)
    out: list[bytes] = [b""] * len(indices)
    for shard, ks in by_shard.items():
      skip = self._parts[shard][0] - self._starts[shard]
      records = self._cache.read(self._urls[shard], [skip + int(indices[k]) for k in ks])
      for k, record in zip(ks, records):
        out[k] = record
    return out


def keep_record_lengths(name: str, data_dir: str | os.PathLike, feature: str) -> list[str]:
  """Keeps `feature`'s per-record lengths beside a prepared dataset that has none; returns the splits.

  For a dataset prepared elsewhere (`tfds build`) or before lengths were
  kept: its records are read once here, where the data is prepared (process
  0 first), so that no host reads them all at startup (`RecordSource.stored_lengths`).
  A dataset that is not prepared, or has a bad shard, is left to
  `open_source` to report on every host; a folder that cannot be written
  (read-only) is read at startup as before.

  >>> import tempfile
  >>> keep_record_lengths("mnist", tempfile.mkdtemp(), "tokens")
  []
  """
  try:
    info = read_only_builder.builder_from_files(name, data_dir=os.fspath(data_dir)).info
  except tfds.core.DatasetNotFoundError:
    return []
  try:
    written = stored_lengths.keep_lengths(info.data_dir, info, feature)
  except (OSError, ValueError, *_BAD_RECORD) as e:
    log.warning(
      "spmd-train: data: cannot keep the record lengths of %s in %s (%s); every host reads "
      "them from the records at startup",
      info.full_name,
      info.data_dir,
      e,
    )
    return []
  if written:
    log.warning(
      "spmd-train: data: kept the %r lengths of %s's records (splits %s) beside its index",
      feature,
      info.full_name,
      written,
    )
  return written
