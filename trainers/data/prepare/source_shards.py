"""A packed dataset prepared by a group of processes, each its share, in bounded memory.

The input is a list of pieces (a source's files, in their canonical order),
each a stream of token ids (`tokenize(i)`). The dataset is `packed_lm`'s
records (`trainers.data.prepare.packed`) of the pieces' streams concatenated in
that order: the same records `pack_documents` makes of the whole stream,
whatever the number of processes that prepared it. Three steps, each
process doing its share, the group waiting between them
(`trainers.data.prepare.prepare_group`):

  1. tokenize: each piece is given to one process (the largest first, each
     to the least loaded: a deterministic share of the tokens), which
     streams its ids to a spill file, its documents' starts to another (and,
     for prompt/completion data, each token's loss mask to a third) and its
     notes (counts, bad rows) to a small JSON, written last;
  2. pack: with every piece's token count known, record `r` covers the
     stream's tokens `[r * run, r * run + run + 1)` (`run` = windows per
     record x seq_len); records are grouped into shards of a fixed count
     (from the layout, never the group's size), and each process writes the
     shards it owns (`PrepareGroup.owns`), reading the spill files a
     record at a time;
  3. publish: process 0 writes the index (TFDS's `dataset_info.json` and
     `features.json`, through `tfds.folder_dataset.write_metadata`, and
     the caller's notes) and renames the folder to the dataset's name.

Memory holds one piece's batch of documents and one record, never a piece
or the corpus. Everything is written to a hidden folder beside the dataset
(`.VERSION.preparing`) and made final by a rename, file by file: a kill
leaves finished pieces and shards, which the next preparation (on any
number of processes) keeps, and never a dataset under its final name until
the index is written.

Example:
  >>> import tempfile, pathlib
  >>> folder = pathlib.Path(tempfile.mkdtemp()) / "packed_source" / "demo" / "1.0.0"
  >>> pieces = [[np.array([1, 5, 2])], [np.array([1, 6, 7, 2])]]
  >>> layout = ShardLayout(seq_len=4, run_windows=1, vocab_size=256, split="train")
  >>> prepare_shards(folder, [3, 4], lambda i: (pieces[i], dict), lambda notes: {}, layout)
  7
  >>> sorted(p.name for p in folder.iterdir())  # doctest: +NORMALIZE_WHITESPACE
  ['dataset_info.json', 'features.json', 'packed_source-train.array_record-00000-of-00001']
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import json
import logging
import os
import pathlib
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow_datasets as tfds
from array_record.python import array_record_module
from tensorflow_datasets.core import example_serializer

from trainers.data.prepare import packed, preparation_lock
from trainers.data.prepare.prepare_group import ALONE, PrepareGroup

log = logging.getLogger(__name__)

SHARD_BYTES = 64 << 20  # of tokens per shard: records per shard follow from the layout alone
_WORKSPACE = ".{version}.preparing"  # beside the dataset's version folder
_TEMPLATE = "{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}"
_FORMAT = "array_record"

Ids = np.ndarray | packed.Continued | packed.Example
# tokenize(i) -> (piece i's ids, in order; () -> its notes once they are read)
Tokenize = Callable[[int], tuple[Iterable[Ids], Callable[[], dict[str, Any]]]]


@dataclasses.dataclass(frozen=True)
class ShardLayout:
  """What the records and shards depend on besides the tokens."""

  seq_len: int
  run_windows: int
  vocab_size: int
  split: str
  dataset: str = "packed_source"
  shard_bytes: int = SHARD_BYTES
  loss_mask: bool = False  # the records carry each token's loss mask (`packed.Example`s)

  @property
  def run(self) -> int:
    return self.run_windows * self.seq_len

  @property
  def dtype(self) -> np.dtype:
    return packed.token_dtype(self.vocab_size)

  @property
  def shard_records(self) -> int:
    return max(1, self.shard_bytes // ((self.run + 1) * self.dtype.itemsize))

  def features(self) -> tfds.features.FeaturesDict:
    return packed.packed_features(
      self.seq_len, self.run_windows, self.vocab_size, loss_mask=self.loss_mask
    )


def share_pieces(sizes: Sequence[int], count: int) -> list[int]:
  """The process that tokenizes each piece: the largest first, each to the least loaded.

  Depends on the sizes and `count` only, so every process computes the same.

  >>> share_pieces([10, 1, 1, 8], 2)
  [0, 1, 1, 1]
  """
  owners = [0] * len(sizes)
  loads = [(0, process) for process in range(count)]
  for piece in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
    load, process = heapq.heappop(loads)
    owners[piece] = process
    heapq.heappush(loads, (load + sizes[piece], process))
  return owners


def prepare_shards(
  folder: str | os.PathLike,
  sizes: Sequence[int],
  tokenize: Tokenize,
  check: Callable[[list[dict[str, Any]]], dict[str, str]],
  layout: ShardLayout,
  group: PrepareGroup = ALONE,
) -> int:
  """Prepares the dataset `folder` (its version folder) unless it is there; see the module docstring.

  Returns how many tokens this process tokenized (0 when the dataset was
  there, or its pieces were tokenized by a run that stopped part-way).

  Every process of `group` calls it with the same arguments. `sizes` (bytes
  of each piece's input) decide who tokenizes which piece. `check(notes)`,
  with every piece's notes in order, runs on every process before packing:
  it raises for data that must not be prepared (every process raises the
  same) and returns the files process 0 publishes beside the shards.
  """
  folder = pathlib.Path(folder)
  # Barriers by the dataset's own name: hosts may mount data.dir at other paths.
  dataset = f"{folder.parent.name}/{folder.name}"
  with contextlib.ExitStack() as stack:
    if group.chief and not (folder / "dataset_info.json").exists():
      # Another run on this data.dir may be preparing it (preparation_lock).
      stack.enter_context(preparation_lock.held(folder.parent / f".{folder.name}.lock", dataset))
    # Every process decides after the lock: none returns while another prepares.
    group.wait(f"{dataset}/claimed")
    if (folder / "dataset_info.json").exists():
      return 0
    return _prepare(folder, dataset, sizes, tokenize, check, layout, group)


def _prepare(
  folder: pathlib.Path,
  dataset: str,
  sizes: Sequence[int],
  tokenize: Tokenize,
  check: Callable[[list[dict[str, Any]]], dict[str, str]],
  layout: ShardLayout,
  group: PrepareGroup,
) -> int:
  """`prepare_shards` once the dataset is this run's to prepare."""
  work = folder.parent / _WORKSPACE.format(version=folder.name)
  spill, out = work / "pieces", work / folder.name
  if group.chief:
    spill.mkdir(parents=True, exist_ok=True)
    out.mkdir(exist_ok=True)
  group.wait(f"{dataset}/workspace")
  owners = share_pieces(sizes, group.count)
  tokenized = 0
  for piece, owner in enumerate(owners):
    if owner == group.index and not (spill / f"{piece:06d}.json").exists():
      tokenized += _spill(spill, piece, *tokenize(piece), layout)
  group.wait(f"{dataset}/tokenized")
  notes = [json.loads((spill / f"{piece:06d}.json").read_text()) for piece in range(len(sizes))]
  published = check(notes)
  stream = _Stream(spill, notes, layout.dtype, layout.loss_mask)
  records = -(-stream.length // layout.run)
  shards = -(-records // layout.shard_records)
  names = [_shard_name(layout, shard, shards) for shard in range(shards)]
  for shard, name in enumerate(names):
    if group.owns(shard) and not (out / name).exists():
      first = shard * layout.shard_records
      last = min(records, first + layout.shard_records)
      _write_shard(out / name, (_record(stream, r, layout) for r in range(first, last)), layout)
  group.wait(f"{dataset}/packed")
  if group.chief:
    _publish(out, folder, layout, records, shards, published)
    shutil.rmtree(work)
  group.wait(f"{dataset}/published")
  return tokenized


def _shard_name(layout: ShardLayout, shard: int, shards: int) -> str:
  return f"{layout.dataset}-{layout.split}.{_FORMAT}-{shard:05d}-of-{shards:05d}"


def _replace_when_written(path: pathlib.Path, write: Callable[[pathlib.Path], None]) -> None:
  """`write(partial)`, then the partial file renamed to `path`: a kill never leaves `path` half."""
  partial = path.with_name(f".{path.name}.partial")
  write(partial)
  os.replace(partial, path)


def _spill(
  spill: pathlib.Path,
  piece: int,
  ids: Iterable[Ids],
  notes: Callable[[], dict[str, Any]],
  layout: ShardLayout,
) -> int:
  """Piece `piece`'s ids and document starts (and loss masks) to spill files, then its notes.

  The notes are written last: they mark the piece as done. Returns the
  piece's token count.
  """
  stem = f"{piece:06d}"
  kinds = ("tokens", "starts", "mask") if layout.loss_mask else ("tokens", "starts")
  partial = {kind: spill / f".{stem}.{kind}.partial" for kind in kinds}
  length = documents = 0
  with contextlib.ExitStack() as stack:
    out = {kind: stack.enter_context(open(path, "wb")) for kind, path in partial.items()}
    for document in ids:
      continued = isinstance(document, packed.Continued)
      mask = document.loss_mask if isinstance(document, packed.Example) else None
      if layout.loss_mask and mask is None:
        raise TypeError(f"piece {piece}: {type(document).__name__} has no loss mask")
      if isinstance(document, packed.Continued | packed.Example):
        document = document.tokens
      document = np.asarray(document)
      if not len(document):
        continue  # an empty document holds nothing (as `pack_documents`)
      # A piece's first ids always open a document: a piece is read on its own.
      if not continued or not length:
        out["starts"].write(np.int64(length).tobytes())
        documents += 1
      out["tokens"].write(document.astype(layout.dtype).tobytes())
      if layout.loss_mask:
        out["mask"].write(np.asarray(mask, np.uint8).tobytes())
      length += len(document)
  for kind, path in partial.items():
    os.replace(path, spill / f"{stem}.{kind}")
  facts = {"tokens": length, "documents": documents, **notes()}
  _replace_when_written(spill / f"{stem}.json", lambda p: p.write_text(json.dumps(facts)))
  return length


_STARTS_BLOCK = 1024  # document starts read from a spill file at a time (8 KiB)


class _PieceStarts:
  """One piece's document starts, as stream positions, read forward a block at a time.

  Records are packed in order, so each start is read once and a record costs
  its own documents, whatever the piece's count (a file of short documents
  has one every few tokens). Holds the starts from the last one at or before
  the record to the first past it, and a block more at most. A jump ahead
  (to a process's next shard, past the others') is found by a binary search
  of the file, not read through; a call that goes back (packing makes none)
  starts again from the file's start.
  """

  def __init__(self, path: pathlib.Path, offset: int):
    self.path, self.offset = path, offset
    self._rewind()

  def _rewind(self) -> None:
    self._held = np.zeros(0, np.int64)  # starts read and kept, in order
    self._first = 0  # the index in the piece of `_held[0]`
    self._read = 0  # starts read from the file
    self._ended = False
    self._lo = 0

  def span(self, lo: int, hi: int) -> tuple[int, np.ndarray]:
    """(the index in the piece of the document that holds token `lo`, the starts in `[lo, hi)`)."""
    if lo < self._lo:
      self._rewind()
    self._lo = lo
    if not self._ended and (not len(self._held) or self._held[-1] < lo):
      self._skip_to(lo)
    while not self._ended and (not len(self._held) or self._held[-1] < hi):
      self._drop_before(lo)  # a jump past many documents holds a block at a time
      block = np.fromfile(self.path, np.int64, _STARTS_BLOCK, offset=self._read * 8)
      self._ended = len(block) < _STARTS_BLOCK
      self._read += len(block)
      self._held = np.concatenate([self._held, block + self.offset])
    self._drop_before(lo)
    within = np.searchsorted(self._held, [lo, hi], side="left")
    return self._first, self._held[within[0] : within[1]]

  def _skip_to(self, lo: int) -> None:
    """Goes on from the last start at or before `lo`, found by searching the file's unread part."""
    count = os.path.getsize(self.path) // 8
    if count - self._read <= _STARTS_BLOCK:
      return  # read through: no longer than the search
    # Mapped only for the search, which touches a page per step: never the whole file.
    unread = np.memmap(self.path, np.int64, mode="r", offset=self._read * 8)
    at_or_before = int(np.searchsorted(unread, lo - self.offset, side="right"))
    del unread
    if at_or_before:  # else `lo`'s document starts at or before what is held: keep it
      self._held, self._first = np.zeros(0, np.int64), self._read + at_or_before - 1
      self._read = self._first

  def _drop_before(self, lo: int) -> None:
    """Keeps the last start at or before `lo` (the document holding it) and every later one."""
    keep = max(0, int(np.searchsorted(self._held, lo, side="right")) - 1)
    self._first += keep
    self._held = self._held[keep:]


class _Stream:
  """The pieces' spill files read as one stream of tokens and document starts."""

  def __init__(
    self, spill: pathlib.Path, notes: list[dict[str, Any]], dtype: np.dtype, masked: bool = False
  ):
    self.spill, self.dtype, self.masked = spill, dtype, masked
    self.offsets = np.concatenate([[0], np.cumsum([n["tokens"] for n in notes])]).astype(np.int64)
    self.documents_before = np.concatenate([[0], np.cumsum([n["documents"] for n in notes])])
    self.length = int(self.offsets[-1])
    self._starts: dict[int, _PieceStarts] = {}

  def _piece_at(self, at: int) -> int:
    # The last piece that starts at or before `at`: empty pieces share an offset with the next.
    return int(np.searchsorted(self.offsets, at, side="right")) - 1

  def tokens(self, lo: int, hi: int) -> np.ndarray:
    return self._read("tokens", self.dtype, lo, hi)

  def loss_mask(self, lo: int, hi: int) -> np.ndarray:
    return self._read("mask", np.dtype(np.uint8), lo, hi)

  def _read(self, kind: str, dtype: np.dtype, lo: int, hi: int) -> np.ndarray:
    parts, piece = [], self._piece_at(lo)
    while lo < hi:
      end = min(hi, int(self.offsets[piece + 1]))
      if end > lo:
        with open(self.spill / f"{piece:06d}.{kind}", "rb") as f:
          f.seek((lo - int(self.offsets[piece])) * dtype.itemsize)
          parts.append(np.fromfile(f, dtype, end - lo))
      lo, piece = end, piece + 1
    return np.concatenate(parts)

  def documents(self, lo: int, hi: int) -> tuple[int, np.ndarray]:
    """(the index of the document that token `lo` belongs to, where documents start in `[lo, hi)`)."""
    first = piece = self._piece_at(lo)
    document, found = 0, []
    while piece < len(self.offsets) - 1 and self.offsets[piece] < hi:
      within, starts = self._starts_of(piece).span(lo, hi)
      if piece == first:
        document = int(self.documents_before[piece]) + within
      found.append(starts)
      piece += 1
    return document, np.concatenate(found)

  def _starts_of(self, piece: int) -> _PieceStarts:
    # Only the latest piece's reader is kept: the next record goes on from where this one ends.
    if piece not in self._starts:
      path = self.spill / f"{piece:06d}.starts"
      self._starts = {piece: _PieceStarts(path, int(self.offsets[piece]))}
    return self._starts[piece]


def _record(stream: _Stream, r: int, layout: ShardLayout) -> dict[str, Any]:
  """Record `r`: as `pack_documents` cuts the whole stream (its module docstring)."""
  base = r * layout.run
  length = min(layout.run + 1, stream.length - base)
  tokens = np.zeros(layout.run + 1, layout.dtype)
  tokens[:length] = stream.tokens(base, base + length)
  document, starts = stream.documents(base, base + length)
  record = {
    "tokens": tokens,
    "starts": (starts - base).astype(np.int32),
    "length": np.int32(length),
    "document": np.int64(document),
  }
  if layout.loss_mask:
    record["loss_mask"] = np.zeros(layout.run + 1, np.uint8)
    record["loss_mask"][:length] = stream.loss_mask(base, base + length)
  return record


def _write_shard(path: pathlib.Path, records: Iterator[dict[str, Any]], layout: ShardLayout):
  features = layout.features()
  serializer = example_serializer.ExampleSerializer(features.get_serialized_info())

  def write(partial: pathlib.Path) -> None:
    # group_size:1, as TFDS writes ArrayRecord: a record reads without its neighbours.
    writer = array_record_module.ArrayRecordWriter(os.fspath(partial), "group_size:1")
    try:
      for record in records:
        example = serializer.get_tf_example(features.encode_example(record))
        # Deterministic: a tf.train.Example's features are a map, whose order
        # otherwise follows the process's string hashing; every process must
        # write the same bytes.
        writer.write(example.SerializeToString(deterministic=True))
    finally:
      writer.close()

  _replace_when_written(path, write)


def _publish(
  out: pathlib.Path,
  folder: pathlib.Path,
  layout: ShardLayout,
  records: int,
  shards: int,
  files: dict[str, str],
) -> None:
  """The index, then the rename that makes `out` the dataset `folder`."""
  for name, text in files.items():
    (out / name).write_text(text)
  lengths = [min(layout.shard_records, records - s * layout.shard_records) for s in range(shards)]
  template = tfds.core.ShardedFileTemplate(
    data_dir=tfds.core.Path(out),
    template=_TEMPLATE,
    dataset_name=layout.dataset,
    filetype_suffix=_FORMAT,
  )
  split = tfds.core.SplitInfo(
    name=layout.split,
    shard_lengths=lengths,
    num_bytes=sum(os.path.getsize(out / _shard_name(layout, s, shards)) for s in range(shards)),
    filename_template=template,
  )
  tfds.folder_dataset.write_metadata(
    data_dir=out,
    features=layout.features(),
    split_infos=[split],
    filename_template=template,
    check_data=False,
    description=f"{records} records of packed windows of {layout.seq_len + 1} tokens",
    disable_shuffling=True,
  )
  os.replace(out, folder)
