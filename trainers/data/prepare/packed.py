"""`packed_lm`: documents tokenized, concatenated and cut into windows, stored in runs of windows.

Documents are the text corpus's files (tokenized by a `Tokenizer`, or as
bytes), or the records of a prepared TFDS dataset with an integer `tokens`
feature. Each is framed with BOS/EOS when the tokenizer has them, and the
documents of a split are concatenated in an order drawn from the seed. The
stream of `L` tokens is cut into `ceil(L / seq_len)` windows of `seq_len + 1`
tokens that overlap by one: window `k` holds stream tokens
`[k * seq_len, k * seq_len + seq_len + 1)`, so every token is an input
exactly once and every token after the first a target exactly once. Only
the last window is short (zero padding after its real tokens).

Each record holds `windows_per_record(seq_len)` consecutive windows (fewer
in the split's last record), as one run of the stream:

  tokens    uint16 (int32 past 65536 ids) [n * seq_len + 1]  the run, zero-padded
  starts    int32[m]   offsets in the run where a document begins
  length    int32      real tokens in the run
  document  int64      index, in the split's order, of the document of token 0
  loss_mask uint8 [n * seq_len + 1]  (prompt/completion data only) 1 where the token
                       counts as a target: one that holds completion text, or the EOS

Window `w` of a record is its tokens `[w * seq_len, w * seq_len + seq_len + 1)`.
A run rather than a record per window: the dataset is written and decoded a
record at a time, and the input pipeline caches decoded records while it
draws a shuffle block's windows from them (`GlobalBatches`), so a batch's
rows cost a slice each rather than a decode each. The pipeline is told the
exact window count (`RecordPlan.examples`): the last record's missing windows
are never rows.

`packed_batch` turns windows into the batch contract: `inputs`, `targets`,
`segment_ids`, `positions`, `mask` (see its docstring). The records are in
window order (no TFDS shuffling); the input pipeline shuffles them per epoch.

The config name encodes everything the windows depend on: the documents'
source (`corpus_key`), the tokenizer's identity, seq_len, the seed, the
validation percentage and the token dtype.

Example:
  >>> runs = list(pack_documents([np.array([1, 5, 2]), np.array([1, 6, 7, 2])], seq_len=4,
  ...                            run_windows=1))
  >>> [(r["tokens"].tolist(), r["starts"].tolist(), int(r["length"])) for r in runs]
  [([1, 5, 2, 1, 6], [0, 3], 5), ([6, 7, 2, 0, 0], [], 3)]
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from trainers.data.prepare import preparation_lock, text_corpus
from trainers.data.prepare.tokenizer import Tokenizer, read_text
from trainers.data.records import datasets
from trainers.data.records.datasets import open_source
from trainers.data.records.plan import RecordPlan

NAME = "packed_lm"
_READ_BATCH = 1024  # source records per batched read
# Tokens per record: a few KB, like the text corpus's chunks. Long windows get
# a record each.
RECORD_TOKENS = 4096


def windows_per_record(seq_len: int) -> int:
  """How many windows of `seq_len` inputs a record holds.

  >>> windows_per_record(64), windows_per_record(8192)
  (64, 1)
  """
  return max(1, RECORD_TOKENS // seq_len)


def token_dtype(vocab_size: int) -> np.dtype:
  """The smallest simple dtype for ids below `vocab_size`: uint16, else int32.

  >>> token_dtype(1024), token_dtype(100_000)
  (dtype('uint16'), dtype('int32'))
  """
  return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.int32)


def document_order(count: int, seed: int) -> np.ndarray:
  """The order in which a split's `count` documents are concatenated, from the seed.

  >>> sorted(document_order(5, seed=0).tolist())
  [0, 1, 2, 3, 4]
  """
  return np.random.default_rng([seed, count]).permutation(count)


@dataclasses.dataclass(frozen=True)
class Example:
  """A document whose tokens count as targets only where `loss_mask` is 1 (prompt/completion)."""

  tokens: np.ndarray
  loss_mask: np.ndarray  # uint8, one per token


@dataclasses.dataclass(frozen=True)
class Continued:
  """More tokens of the document before it (a file read in pieces): no document starts here."""

  tokens: np.ndarray


def pack_documents(
  documents: Iterable[np.ndarray],
  seq_len: int,
  dtype: np.dtype | type = np.int32,
  run_windows: int | None = None,
) -> Iterator[dict[str, Any]]:
  """The records of the concatenated `documents` (in the given order): runs of windows.

  `run_windows` (windows a record holds) defaults to `windows_per_record(seq_len)`.
  Streamed: the documents are read once, in order, and memory holds one
  record's run and the document being cut, never the whole stream, so a
  corpus of any size packs in the same memory. A document may come in
  pieces: a `Continued` goes on with the document before it, so a large
  one is never held whole either. Empty documents are skipped (they do not
  count in `document`).
  """
  per = run_windows or windows_per_record(seq_len)
  run = per * seq_len
  pending: list[np.ndarray] = []  # tokens from stream offset `base` on
  buffered = 0
  base = 0  # the stream offset of the next record's token 0
  opened: collections.deque[tuple[int, int]] = collections.deque()  # (offset, document)
  documents_seen = 0

  def record(tokens: np.ndarray, start: int, length: int) -> dict[str, Any]:
    while len(opened) > 1 and opened[1][0] <= start:
      opened.popleft()  # documents that end before this run
    run_tokens = np.zeros(run + 1, dtype)
    run_tokens[:length] = tokens[:length]
    starts = [o - start for o, _ in opened if start <= o < start + length]
    return {
      "tokens": run_tokens,
      "starts": np.asarray(starts, np.int32),
      "length": np.int32(length),
      "document": np.int64(opened[0][1]),
    }

  for document in documents:
    continued = isinstance(document, Continued) and bool(opened)
    document = np.asarray(document.tokens if isinstance(document, Continued) else document)
    if not len(document):
      continue
    if not continued:
      opened.append((base + buffered, documents_seen))
      documents_seen += 1
    pending.append(document)
    buffered += len(document)
    if buffered < run + 1:
      continue
    stream = np.concatenate(pending)  # once per document: the cost stays linear
    offset = 0
    while buffered - offset >= run + 1:
      yield record(stream[offset : offset + run + 1], base, run + 1)
      offset += run  # the run's last token is the next run's first
      base += run
    pending, buffered = [stream[offset:]], buffered - offset
  if buffered:
    stream = np.concatenate(pending)
    yield record(stream, base, buffered)


def packed_batch(seq_len: int) -> Callable[[Sequence[Any], np.ndarray], dict[str, np.ndarray]]:
  """`(records, windows) -> rows` of packed windows: the batch contract.

  Per row, of the window's `seq_len + 1` tokens:
    inputs       int32  window[:-1]
    targets      int32  window[1:]
    segment_ids  int32  of the inputs: documents numbered 1, 2, ... in this row;
                        0 = padding (only in a split's last window)
    positions    int32  index within its segment in this row: a document cut
                        at the window's start continues as a new segment at 0
    mask         float32  1 where the target is a real token of the input's
                        document (so EOS -> next BOS pairs and padding are 0),
                        and, when the records carry a `loss_mask`, one it marks

  Example:
    >>> records = list(pack_documents([np.array([1, 5, 2]), np.array([1, 6, 7, 2])], seq_len=4))
    >>> len(records), records[0]["tokens"].shape  # one run of up to 1024 windows
    (1, (4097,))
    >>> rows = packed_batch(4)(records * 2, np.array([0, 1]))
    >>> rows["segment_ids"].tolist(), rows["positions"].tolist()
    ([[1, 1, 1, 2], [1, 1, 1, 0]], [[0, 1, 2, 0], [0, 1, 2, 0]])
    >>> rows["mask"].tolist()
    [[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]]
  """
  index = np.arange(seq_len)

  def to_batch(records: Sequence[Any], windows: np.ndarray) -> dict[str, np.ndarray]:
    n = len(records)
    first = np.asarray(windows, np.int64) * seq_len  # each window's offset in its run
    tokens = np.zeros((n, seq_len + 1), np.int32)
    starts = np.zeros((n, seq_len + 1), bool)
    lengths = np.zeros((n, 1), np.int64)
    counted = np.ones((n, seq_len), bool)  # targets a `loss_mask` keeps (all without one)
    for row, (record, lo) in enumerate(zip(records, first)):
      run = record["tokens"]
      tokens[row] = run[lo : lo + seq_len + 1]
      if "loss_mask" in record:
        kept = np.asarray(record["loss_mask"][lo + 1 : lo + seq_len + 1], bool)
        counted[row] = np.pad(kept, (0, seq_len - len(kept)))
      opened = np.asarray(record["starts"], np.int64) - lo
      starts[row, opened[(opened >= 0) & (opened <= seq_len)]] = True
      lengths[row] = min(max(int(record["length"]) - lo, 0), seq_len + 1)
    boundary = starts[:, :seq_len].copy()
    boundary[:, 0] = True  # each row's first token opens a segment
    real = index < lengths
    segment_ids = np.where(real, np.cumsum(boundary, axis=1), 0).astype(np.int32)
    opened = np.maximum.accumulate(np.where(boundary, index, 0), axis=1)
    positions = np.where(real, index - opened, 0).astype(np.int32)
    mask = (index + 1 < lengths) & ~starts[:, 1:] & counted
    return {
      "inputs": np.ascontiguousarray(tokens[:, :-1]),
      "targets": np.ascontiguousarray(tokens[:, 1:]),
      "segment_ids": segment_ids,
      "positions": positions,
      "mask": mask.astype(np.float32),
    }

  return to_batch


def packed_example(seq_len: int) -> Callable[..., dict[str, np.ndarray]]:
  """`(record, window) -> example`: one row of `packed_batch`."""
  to_batch = packed_batch(seq_len)

  def to_example(record: dict[str, Any], window: int = 0) -> dict[str, np.ndarray]:
    return {k: v[0] for k, v in to_batch([record], np.array([window])).items()}

  return to_example


def record_template(seq_len: int, loss_mask: bool = False) -> dict[str, np.ndarray]:
  """One packed record as zeros (one window of padding: the data decides the run's length).

  `loss_mask`: the records carry one (prompt/completion data), so it is decoded.
  """
  template = {
    "tokens": np.zeros(seq_len + 1, np.int32),
    "starts": np.zeros(0, np.int32),
    "length": np.int32(0),
    "document": np.int64(0),
  }
  if loss_mask:
    template["loss_mask"] = np.zeros(seq_len + 1, np.uint8)
  return template


def packed_plan(seq_len: int, identity: Callable[[], str] = lambda: ""):
  """`records -> RecordPlan` for packed windows, from the first and last record only.

  All windows but a split's last are full, so the tokens and documents
  follow from the ends. `identity()` is the tokenizer's, for the saved
  position (a resume on other data is refused).
  """

  def plan(records: Sequence[Any]) -> RecordPlan:
    first, last = records[0], records[len(records) - 1]
    per = (len(first["tokens"]) - 1) // seq_len  # as the data was packed
    tokens = (len(records) - 1) * per * seq_len + int(last["length"])  # each an input once
    windows = -(-tokens // seq_len)
    documents = (
      int(last["document"])
      - int(first["document"])
      + 1
      + int(np.sum(np.asarray(last["starts"]) > 0))
    )
    padding = windows * seq_len - tokens
    return RecordPlan(
      examples_per_record=per,
      examples=windows,
      unit="tokens",
      total=tokens,
      in_examples=tokens,
      example=f"windows of {seq_len + 1} tokens",
      detail=f"{documents} documents packed, {padding} padding tokens in the last window",
      identity=identity(),
      units_per_example=seq_len,
    )

  return plan


def packed_features(
  seq_len: int, run_windows: int, vocab_size: int, loss_mask: bool = False
) -> tfds.features.FeaturesDict:
  """The features of a record of packed windows (the module docstring), as TFDS stores them."""
  run = run_windows * seq_len + 1
  features = {
    "tokens": tfds.features.Tensor(shape=(run,), dtype=token_dtype(vocab_size), encoding="bytes"),
    "starts": tfds.features.Tensor(shape=(None,), dtype=np.int32, encoding="bytes"),
    "length": tfds.features.Scalar(dtype=np.int32),
    "document": tfds.features.Scalar(dtype=np.int64),
  }
  if loss_mask:
    features["loss_mask"] = tfds.features.Tensor(shape=(run,), dtype=np.uint8, encoding="bytes")
  return tfds.features.FeaturesDict(features)


@dataclasses.dataclass(eq=False)
class PackedConfig(tfds.core.BuilderConfig):
  """A `packed_lm` config; make one with `packed_config`, which names it."""

  source: str | tuple[str, ...] | None = None  # text files (text_corpus's spec)
  dataset: str = ""  # or a prepared TFDS dataset with a `tokens` feature ...
  dataset_dir: str = ""  # ... in this data dir
  tokenizer: str = ""  # the tokenizer file; "" = bytes (text) or ids as they are
  seq_len: int = 128
  seed: int = 0
  validation_percent: float = text_corpus.DEFAULT_VALIDATION_PERCENT
  vocab_size: int = 256
  exclude: str = ""  # the data dir, left out of a text source
  windows_per_record: int = 1


def corpus_key(config: PackedConfig) -> list:
  """What the documents are: the text files' state, or the dataset and its split sizes."""
  if config.dataset:
    info = _dataset_info(config)
    return [info.full_name, sorted((s, info.splits[s].num_examples) for s in info.splits)]
  return [
    text_corpus.text_corpus_config(
      config.source, validation_percent=config.validation_percent, exclude=config.exclude or None
    ).name
  ]


def _dataset_info(config: PackedConfig) -> tfds.core.DatasetInfo:
  """The source dataset's info, from its files (nothing downloads)."""
  from tensorflow_datasets.core import read_only_builder

  try:
    return read_only_builder.builder_from_files(config.dataset, data_dir=config.dataset_dir).info
  except tfds.core.DatasetNotFoundError:
    raise datasets._not_prepared(config.dataset, config.dataset_dir) from None


def packed_config(
  *,
  seq_len: int,
  seed: int,
  vocab_size: int,
  tokenizer: Tokenizer | None = None,
  source: text_corpus.SourceSpec = None,
  dataset: str = "",
  dataset_dir: str = "",
  validation_percent: float = text_corpus.DEFAULT_VALIDATION_PERCENT,
  exclude: str | os.PathLike | None = None,
  run_windows: int | None = None,
) -> PackedConfig:
  """A config whose name hashes the documents, tokenizer, seq_len, seed and split.

  `run_windows` (windows a record holds) defaults to `windows_per_record(seq_len)`.
  """
  per = run_windows or windows_per_record(seq_len)
  if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
    raise ValueError(f"{seq_len=} must be a positive int")
  if isinstance(source, str | os.PathLike):
    source = os.path.abspath(os.fspath(source))
  elif source is not None:
    source = tuple(sorted({os.fspath(p) for p in source}))
  config = PackedConfig(
    name="unnamed",
    source=source,
    dataset=dataset,
    dataset_dir=os.fspath(dataset_dir),
    tokenizer=tokenizer.path if tokenizer else "",
    seq_len=seq_len,
    seed=seed,
    validation_percent=float(validation_percent),
    vocab_size=vocab_size,
    exclude=os.fspath(exclude) if exclude else "",
    windows_per_record=per,
  )
  identity = tokenizer.identity if tokenizer else "bytes" if not dataset else "ids"
  dtype = token_dtype(vocab_size)
  key = [
    corpus_key(config),
    identity,
    seq_len,
    per,
    seed,
    config.validation_percent,
    dtype.name,
  ]
  digest = hashlib.sha256(json.dumps(key).encode("utf-8", "surrogateescape")).hexdigest()[:12]
  label = "tfds" if dataset else "stdlib" if source is None else "files"
  config.name = f"{label}-{seq_len}s-{digest}"
  config.description = (
    f"Windows of {seq_len + 1} tokens packed from {dataset or 'text files'} "
    f"(tokenizer {identity}), seed {seed}."
  )
  return config


class PackedLm(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Packed LM windows, one record each (see the module docstring)."""

  name = NAME
  VERSION = tfds.core.Version("2.0.0")
  RELEASE_NOTES: ClassVar[dict[str, str]] = {
    "1.0.0": "One window a record: tokens, starts, length, document.",
    "2.0.0": "Runs of windows_per_record(seq_len) windows a record.",
  }
  code_path = epath.Path(__file__)  # as text_corpus.TextCorpus.code_path

  def __init__(self, **kwargs):
    kwargs.setdefault("file_format", "array_record")
    super().__init__(**kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    config = self.builder_config
    return tfds.core.DatasetInfo(
      builder=self,
      description=config.description,
      features=packed_features(config.seq_len, config.windows_per_record, config.vocab_size),
      disable_shuffling=True,  # records in window order; epochs are shuffled when read
    )

  def _split_generators(self, dl_manager) -> dict[str, Iterator]:
    del dl_manager
    config = self.builder_config
    tokenizer = Tokenizer(config.tokenizer) if config.tokenizer else None
    if config.dataset:
      loaders = {
        split: (lambda s=split: _dataset_documents(config, s, tokenizer))
        for split in _dataset_info(config).splits
      }
    else:
      files = text_corpus.corpus_files(config.source, exclude=config.exclude or None)
      by_split = text_corpus.split_files(files, config.validation_percent)
      if not by_split:
        raise ValueError(f"{config.source=} has no text: its {len(files)} files are empty")
      loaders = {
        split: (lambda found=found: _text_documents(found, tokenizer))
        for split, found in by_split.items()
      }
    return {split: self._generate_examples(load) for split, load in loaders.items()}

  def _generate_examples(self, load: Callable[[], list[np.ndarray]]) -> Iterator[tuple[int, dict]]:
    config = self.builder_config
    documents = load()
    order = document_order(len(documents), config.seed)
    dtype = token_dtype(config.vocab_size)
    runs = pack_documents(
      [documents[i] for i in order], config.seq_len, dtype, config.windows_per_record
    )
    yield from enumerate(runs)


def framed(
  ids: np.ndarray, tokenizer: Tokenizer | None, start: bool = True, end: bool = True
) -> np.ndarray:
  """A document's ids between its tokenizer's BOS and EOS (those it has); bytes: as they are.

  A piece of a document takes the BOS only if it is its `start`, the EOS only
  if it is its `end`.
  """
  if tokenizer is None:
    return ids
  head = [tokenizer.bos_id] if tokenizer.bos_id is not None and start else []
  tail = [tokenizer.eos_id] if tokenizer.eos_id is not None and end else []
  return np.concatenate(
    [np.asarray(head, np.int64), ids.astype(np.int64), np.asarray(tail, np.int64)]
  )


def _text_documents(
  files: Sequence[text_corpus.SourceFile], tokenizer: Tokenizer | None
) -> list[np.ndarray]:
  if tokenizer is None:  # bytes, unframed: a byte vocabulary has no room for markers
    return [np.fromfile(f.path, np.uint8) for f in files]
  texts = [read_text(f.path) for f in files]
  return [framed(ids, tokenizer) for ids in tokenizer.encode_batch(texts)]


def _dataset_documents(
  config: PackedConfig, split: str, tokenizer: Tokenizer | None
) -> list[np.ndarray]:
  records = open_source(config.dataset, split, config.dataset_dir, ["tokens"])
  documents = []
  for start in range(0, len(records), _READ_BATCH):
    batch = records.__getitems__(list(range(start, min(start + _READ_BATCH, len(records)))))
    documents.extend(np.asarray(r["tokens"]).reshape(-1) for r in batch)
  top = max((int(d.max()) for d in documents if d.size), default=0)
  if top >= config.vocab_size:
    raise ValueError(
      f"{config.dataset}[{split}] has token id {top}, outside config.model.vocab_size="
      f"{config.vocab_size}"
    )
  return [framed(d, tokenizer) for d in documents]


def prepare_packed(data_dir: str | os.PathLike, config: PackedConfig) -> str:
  """Builds the packed dataset in `data_dir` unless it is there; returns its name to open."""
  builder = PackedLm(data_dir=os.fspath(data_dir), config=config)
  preparation_lock.prepare_builder(builder, text_corpus.DOWNLOAD_CONFIG)
  return f"{NAME}/{config.name}:{builder.version}"
