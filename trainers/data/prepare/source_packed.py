"""`packed_source`: one split of one source of `config.data.sources`, tokenized and packed.

The records are `packed_lm`'s (`trainers.data.prepare.packed`: runs of windows of
`seq_len + 1` tokens with the documents' starts), so the LM task's batch
builder, plan and template read them unchanged.

The documents are streamed (`trainers.data.prepare.documents`): read file after
file in row order, tokenized a batch at a time, framed with BOS/EOS, and
packed as they come. Memory holds a batch of documents and one run,
whatever the source's size. A .txt file, one document, is read, tokenized
and packed in pieces cut at line breaks, with the ids of the whole: a cut
moves on past lines whose ids depend on the text across it, and a piece
is tokenized after the lines before it (`_pieces`). They are packed in
reading order, not shuffled: the input pipeline shuffles the windows every
epoch (records, then windows within blocks), so the documents' order only
decides which share a window, and a source packs the same for any seed
(its key has none).

A document belongs to a split by a hash of its key (its file's key and
row, `trainers.data.prepare.holdout`): the build of a split keeps the documents
that fall in it. Each split is its own dataset, built only when it holds
documents; the build's report, kept with it as `source_report.json`, says
how many documents the split took, how many went to the other, and which
bad rows it skipped.

With `format="prompt_completion"` each JSONL row is a fine-tuning
example: BOS + prompt + completion + EOS, the text tokenized whole (as
any document is), and the records carry a `loss_mask` that is 1 on each
token that holds completion text and on the EOS (`packed.Example`), so the
LM loss counts no token of the prompt alone.

A build is shared by the processes that prepare it
(`trainers.data.prepare.source_shards`): each tokenizes its share of the files and
writes its share of the shards, and the records are those of the files'
documents packed in file order, whatever the number of processes.

The config name hashes what the windows depend on: the source's spec and
every file's key, format, size and version, the text field, the split and
its share, the tokenizer's identity, seq_len, windows per record, the
token dtype and (when not plain text) the format.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from trainers.data.prepare import packed, source_shards
from trainers.data.prepare.documents import (
  BAD_ROWS_SHOWN,
  PROMPT_COMPLETION,
  Document,
  SourceDocuments,
)
from trainers.data.prepare.holdout import TRAIN, VALIDATION, split_of
from trainers.data.prepare.prepare_group import ALONE, PrepareGroup
from trainers.data.prepare.source_files import Source, SourceError, SourceFile
from trainers.data.prepare.tokenizer import Tokenizer

log = logging.getLogger(__name__)
NAME = "packed_source"
REPORT = "source_report.json"
_ENCODE_DOCUMENTS = 256  # documents per tokenizer call: the libraries' threads get a batch
_ENCODE_CHARS = 4 << 20  # ... or this much text, whichever comes first
_CUT_CHECK_CHARS = 1024  # of the lines either side of a large file's cut, tokenized to check it
_CUT_TRIES = 64  # lines a cut may move on before the pieces are joined
_TXT_CUTS = "cuts-see-whitespace"  # in the name of a build with .txt files: how they were cut
_ROWS_WHOLE = "rows-tokenized-whole"  # ... of prompt/completion rows (once tokenized apart)
FORMATS = ("text", "prompt_completion")  # config.data.format


@dataclasses.dataclass(eq=False)
class SourceConfig(tfds.core.BuilderConfig):
  """A `packed_source` config; make one with `source_config`, which names it."""

  spec: str = ""
  # Each SourceFile's fields, in the source's order (left out of the repr TFDS logs).
  files: tuple[tuple, ...] = dataclasses.field(default=(), repr=False)
  text_field: str = "text"
  split: str = TRAIN  # the documents this build keeps
  validation_percent: float = 0.0  # the share of documents in VALIDATION
  skip_bad_rows: int = 0
  tokenizer: str = ""  # the tokenizer file; "" = bytes
  seq_len: int = 128
  windows_per_record: int = 1
  vocab_size: int = 256
  format: str = "text"  # or "prompt_completion" (the module docstring)

  def source(self) -> Source:
    return Source(self.spec, None, tuple(SourceFile(*f) for f in self.files))


def source_config(
  source: Source,
  *,
  split: str,
  validation_percent: float,
  seq_len: int,
  vocab_size: int,
  tokenizer: Tokenizer | None = None,
  text_field: str = "text",
  skip_bad_rows: int = 0,
  run_windows: int | None = None,
  format: str = "text",
) -> SourceConfig:
  """A config whose name hashes the source's files, the split, the tokenizer and the packing."""
  if split not in (TRAIN, VALIDATION):
    raise ValueError(f"{split=} must be {TRAIN!r} or {VALIDATION!r}")
  if format not in FORMATS:
    raise ValueError(f"data.format={format!r} must be one of {FORMATS}")
  per = run_windows or packed.windows_per_record(seq_len)
  identity = tokenizer.identity if tokenizer else "bytes"
  key = [
    source.identity(),
    text_field,
    split,
    float(validation_percent),
    identity,
    seq_len,
    per,
    packed.token_dtype(vocab_size).name,
  ]
  if format != "text":  # so the names of text builds prepared before stay theirs
    key.append(format)
  if format == "prompt_completion" and tokenizer:
    key.append(_ROWS_WHOLE)
  if tokenizer and any(f.format == "txt" for f in source.files):
    # .txt builds cut before blank lines were checked may differ from the file's ids whole.
    key.append(_TXT_CUTS)
  digest = hashlib.sha256(json.dumps(key).encode("utf-8", "surrogateescape")).hexdigest()[:12]
  return SourceConfig(
    name=f"{split}-{seq_len}s-{digest}",
    description=(
      f"The {split} documents of {source.spec!r} ({len(source.files)} files, field "
      f"{text_field!r}), tokenizer {identity}, packed into windows of {seq_len + 1} tokens."
    ),
    spec=source.spec,
    files=tuple(dataclasses.astuple(f) for f in source.files),
    text_field=text_field,
    split=split,
    validation_percent=float(validation_percent),
    skip_bad_rows=skip_bad_rows,
    tokenizer=tokenizer.path if tokenizer else "",
    seq_len=seq_len,
    windows_per_record=per,
    vocab_size=vocab_size,
    format=format,
  )


VERSION = "1.0.0"  # the prepared folder's version: datasets prepared before are read as they are


def _tokenize(config: SourceConfig) -> source_shards.Tokenize:
  """`i -> (file i's ids, its notes)`: the documents of the config's split, tokenized and framed."""
  source = config.source()
  tokenizer = Tokenizer(config.tokenizer) if config.tokenizer else None

  examples = config.format == "prompt_completion"

  def tokenize(i: int):
    tally = {"documents": 0, "other_split": 0}

    def keep(document: Document) -> bool:
      if not examples and not document.text:
        return False  # an empty document holds nothing (an example still has its EOS)
      mine = split_of(document.key, config.validation_percent) == config.split
      if not document.part:  # a large file's later pieces are the same document
        tally["documents" if mine else "other_split"] += 1
      return mine

    field = PROMPT_COMPLETION if examples else config.text_field
    documents = SourceDocuments(source, field, config.skip_bad_rows, keep)
    read = documents.of_file(source.files[i])
    ids = _example_ids(read, tokenizer) if examples else _token_ids(read, tokenizer)
    return ids, lambda: {**tally, "bad_rows": documents.report()}

  return tokenize


def _checked_report(config: SourceConfig, notes: list[dict]) -> dict[str, str]:
  """The build's report from every file's notes (`REPORT`); raises for too many bad rows or none kept.

  Each file was read with the whole allowance; here the source's total is
  held to it, naming the first row past it in file order.
  """
  bad = sum(n["bad_rows"]["count"] for n in notes)
  if bad > config.skip_bad_rows:
    seen = 0
    for file, note in zip(config.source().files, notes):
      count = note["bad_rows"]["count"]
      if seen + count > config.skip_bad_rows:
        rows = note["bad_rows"]["rows"]
        at = config.skip_bad_rows - seen
        shown = rows[at] if at < len(rows) else f"{file.path}: bad row number {at + 1} of the file"
        break
      seen += count
    raise SourceError(
      f"data.sources {config.spec!r}: {shown}; this is its bad row number "
      f"{config.skip_bad_rows + 1}, and data.skip_bad_rows={config.skip_bad_rows} lets a source "
      "skip that many"
    )
  documents = sum(n["documents"] for n in notes)
  other = sum(n["other_split"] for n in notes)
  if not sum(n["tokens"] for n in notes):
    raise SourceError(
      f"data.sources {config.spec!r} has no documents for its {config.split} split: "
      f"{other} of its non-empty documents went to the other split and {bad} rows were bad"
    )
  rows = [row for n in notes for row in n["bad_rows"]["rows"]][:BAD_ROWS_SHOWN]
  report = {"documents": documents, "other_split": other, "bad_rows": {"count": bad, "rows": rows}}
  return {REPORT: json.dumps(report, indent=1)}


def _token_ids(
  documents: Iterable[Document], tokenizer: Tokenizer | None
) -> Iterator[np.ndarray | packed.Continued]:
  """Each document's ids, framed; tokenized in batches (`encode_batch` uses several threads).

  A document read in pieces (a large .txt) comes out in pieces, each after
  the first `packed.Continued`, with BOS on its first and EOS on its last.
  """
  if tokenizer is None:  # bytes, unframed: a byte vocabulary has no room for markers
    for document in documents:
      ids = np.frombuffer(document.text.encode("utf-8", "surrogateescape"), np.uint8)
      yield packed.Continued(ids) if document.part else ids
    return
  for batch in _encode_batches(_pieces(documents, tokenizer), lambda piece: len(piece.text)):
    yield from _encoded(batch, tokenizer)


def _example_ids(
  documents: Iterable[Document], tokenizer: Tokenizer | None
) -> Iterator[packed.Example]:
  """Each prompt/completion as BOS + prompt + completion + EOS, the loss on completion and EOS.

  The row is tokenized whole, as any document is (`_framed_examples`).
  Bytes: the texts' bytes, unframed (a byte vocabulary has no room for
  markers).
  """
  for batch in _encode_batches(documents, lambda d: len(d.prompt) + len(d.text)):
    yield from _framed_examples(batch, tokenizer)


def _encode_batches(items: Iterable, chars_of: Callable[[Any], int]) -> Iterator[list]:
  """`items` in lists of `_ENCODE_DOCUMENTS`, or fewer that hold `_ENCODE_CHARS` of text.

  >>> [len(b) for b in _encode_batches(["ab"] * 600, len)]
  [256, 256, 88]
  """
  batch: list = []
  chars = 0
  for item in items:
    batch.append(item)
    chars += chars_of(item)
    if len(batch) >= _ENCODE_DOCUMENTS or chars >= _ENCODE_CHARS:
      yield batch
      batch, chars = [], 0
  if batch:
    yield batch


def _framed_examples(
  batch: list[Document], tokenizer: Tokenizer | None
) -> Iterator[packed.Example]:
  """The examples' tokens and loss masks: 1 on each token that holds completion text, and the EOS.

  The tokens are the tokenizer's of the whole text, prompt and completion
  joined, as any document's are: no token that tokenizing them apart would
  add (a SentencePiece-style "▁" before a completion that starts with a
  space, or a doubled one after a prompt that ends in one). A token that holds text of both (" Paris" after a prompt
  that ends in a space) counts, since it is the first the model must emit.
  """
  if tokenizer is None:
    for d in batch:
      prompt = d.prompt.encode("utf-8", "surrogateescape")
      text = np.frombuffer(prompt + d.text.encode("utf-8", "surrogateescape"), np.uint8)
      mask = np.zeros(len(text), np.uint8)
      mask[len(prompt) :] = 1
      yield packed.Example(text.astype(np.int64), mask)
    return
  bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
  eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
  encoded = tokenizer.encode_batch_with_offsets([d.prompt + d.text for d in batch])
  for d, (ids, spans) in zip(batch, encoded):
    completion = _holds_text(spans, len(d.prompt), len(d.prompt) + len(d.text))
    tokens = np.concatenate([np.asarray(bos, np.int64), ids, np.asarray(eos, np.int64)])
    mask = np.concatenate([np.zeros(len(bos), np.uint8), completion, np.ones(len(eos), np.uint8)])
    yield packed.Example(tokens, mask)


def _holds_text(spans: np.ndarray, start: int, end: int) -> np.ndarray:
  """1 for each token whose span `[a, b)` holds characters of `[start, end)`, as uint8.

  A token that holds none (an empty span) goes with what follows it: it
  counts when it stands in the text `[start, end)`.

  >>> _holds_text(np.array([[0, 3], [3, 8], [8, 8], [8, 12]]), 5, 12).tolist()
  [0, 1, 1, 1]
  """
  a, b = spans[:, 0], spans[:, 1]
  inside = np.where(a == b, (a >= start) & (a < end), (b > start) & (a < end))
  return inside.astype(np.uint8)


@dataclasses.dataclass(frozen=True)
class _Piece:
  """A piece of a document, and the text before it that it is tokenized after."""

  text: str
  starts: bool  # the document's first piece
  ends: bool  # its last
  context: str = ""  # the lines before the cut, tokenized with the piece ...
  context_ids: int = 0  # ... into this many ids, which are not the piece's


def _encoded(batch: list[_Piece], tokenizer: Tokenizer) -> Iterator[np.ndarray | packed.Continued]:
  for piece, ids in zip(batch, tokenizer.encode_batch([p.context + p.text for p in batch])):
    ids = packed.framed(ids[piece.context_ids :], tokenizer, piece.starts, piece.ends)
    yield ids if piece.starts else packed.Continued(ids)


def _pieces(documents: Iterable[Document], tokenizer: Tokenizer) -> Iterator[_Piece]:
  """The documents' pieces, cut where the tokenizer can (`_clean_cut`), so the ids are the whole's.

  A cut is moved on, a line at a time, past lines whose ids depend on the
  text across it (whitespace that merges across the line break). A piece
  after a cut is tokenized after the lines before the cut, whose ids are
  then dropped: a tokenizer that marks a text's start (SentencePiece's dummy
  prefix) marks the context's, not the piece's. A document that cuts
  cleanly nowhere is tokenized whole.
  """
  held: _Piece | None = None
  for document in documents:
    if held and document.part:
      cut = _clean_cut(tokenizer, held.text, document.text)
      if cut is None:
        held = dataclasses.replace(held, text=held.text + document.text)
        continue
      yield dataclasses.replace(held, text=held.text + document.text[: cut.at], ends=False)
      held = _Piece(document.text[cut.at :], False, True, cut.context, cut.context_ids)
      continue
    if held:
      yield held
    held = _Piece(document.text, not document.part, True)
  if held:
    yield held


@dataclasses.dataclass(frozen=True)
class _Cut:
  """Where a document's next piece starts, and what it is tokenized after."""

  at: int  # where in the text after the cut
  context: str  # the lines before it that the rest is tokenized after
  context_ids: int  # the context's ids


def _clean_cut(tokenizer: Tokenizer, before: str, after: str) -> _Cut | None:
  """The first line break of `after` (0: its start) where the tokenizer cuts cleanly, if any.

  Clean: the ids of the text before the cut are the same with or without
  the text after it, each side taken to the line that holds its nearest
  character other than whitespace (`_back_to_text`, `_on_to_text`).
  Whitespace that runs across the cut (blank lines, a line's indent) is
  then all in the check: a BPE that merges "\\n\\n" tokenizes ")\\n\\nclass"
  otherwise than ")\\n\\n", though "\\n" tokenizes alike before "class".
  The text after the cut is tokenized after that context (`_Piece`).

  The tests cut files of each tokenizer family (tests/test_text_pieces.py).
  """
  tail = before[-_CUT_CHECK_CHARS:]
  at = 0
  for _ in range(_CUT_TRIES):
    left = _back_to_text((tail + after[max(0, at - _CUT_CHECK_CHARS) : at])[-_CUT_CHECK_CHARS:])
    right = _on_to_text(after[at : at + _CUT_CHECK_CHARS])
    if left and right:
      alone = tokenizer.encode(left)
      if tokenizer.encode(left + right)[: len(alone)] == alone:
        return _Cut(at, left, len(alone))
    at = after.find("\n", at) + 1
    if not at or at >= len(after):
      return None
  return None


def _back_to_text(text: str) -> str:
  """`text`'s end from the start of the line of its last character that is not whitespace.

  "" when `text` is all whitespace: the check would not see where the run
  of whitespace starts, so the cut is not taken.

  >>> _back_to_text("a\\nf(x)\\n\\n \\n")
  'f(x)\\n\\n \\n'
  """
  content = len(text.rstrip())
  return text[text.rfind("\n", 0, content) + 1 :] if content else ""


def _on_to_text(text: str) -> str:
  """`text`'s start up to the end of the line of its first character that is not whitespace.

  >>> _on_to_text("\\n\\n  class A:\\n  x\\n")
  '\\n\\n  class A:\\n'
  """
  content = len(text) - len(text.lstrip())
  if content == len(text):
    return ""
  return text[: text.find("\n", content) + 1 or len(text)]


@dataclasses.dataclass(frozen=True)
class PreparedSplit:
  """A source's split, prepared: the name to open and what its build reported."""

  name: str
  documents: int
  other_split: int
  bad_rows: int
  bad_examples: tuple[str, ...]
  tokenized_here: int = 0  # tokens this process tokenized for it (0: found prepared)

  def note(self) -> str:
    """What to log of its bad rows ("" when there were none)."""
    if not self.bad_rows:
      return ""
    shown = "; ".join(self.bad_examples)
    more = (
      f" (the first {len(self.bad_examples)} shown)"
      if self.bad_rows > len(self.bad_examples)
      else ""
    )
    return f"{self.bad_rows} bad rows skipped{more}: {shown}"


def prepare_source(
  data_dir: str | os.PathLike, config: SourceConfig, group: PrepareGroup = ALONE
) -> PreparedSplit:
  """Builds the split in `data_dir` unless it is there; returns its name and report.

  Every process of `group` calls it: each tokenizes its share of the files
  and writes its share of the shards (`trainers.data.prepare.source_shards`), and
  the dataset is the same for any group. A build reused from a run that
  let more bad rows be skipped than this one (`data.skip_bad_rows`) is
  refused, naming the row past this run's limit.
  """
  folder = pathlib.Path(data_dir) / NAME / config.name / VERSION
  if group.chief and not folder.exists():
    log.warning(
      "spmd-train: data: preparing %r (%s split, %d files) on %d processes",
      config.spec,
      config.split,
      len(config.files),
      group.count,
    )
  layout = source_shards.ShardLayout(
    seq_len=config.seq_len,
    run_windows=config.windows_per_record,
    vocab_size=config.vocab_size,
    split=config.split,
    dataset=NAME,
    shard_bytes=source_shards.SHARD_BYTES,
    loss_mask=config.format == "prompt_completion",
  )
  tokenized = source_shards.prepare_shards(
    folder,
    [file.size for file in config.source().files],
    _tokenize(config),
    lambda notes: _checked_report(config, notes),
    layout,
    group,
  )
  report = json.loads((folder / REPORT).read_text())
  bad = report["bad_rows"]
  if bad["count"] > config.skip_bad_rows:
    shown = bad["rows"][min(config.skip_bad_rows, len(bad["rows"]) - 1)]
    raise SourceError(
      f"data.sources {config.spec!r}: {shown}; the data prepared in {folder} "
      f"skipped {bad['count']} bad rows and data.skip_bad_rows={config.skip_bad_rows} lets a "
      "source skip fewer"
    )
  return PreparedSplit(
    name=f"{NAME}/{config.name}:{VERSION}",
    documents=report["documents"],
    other_split=report["other_split"],
    bad_rows=bad["count"],
    bad_examples=tuple(bad["rows"]),
    tokenized_here=tokenized,
  )
