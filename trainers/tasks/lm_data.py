"""The LM tasks' data: `config.data` as `Task` keywords, for any decoder trained on the same data.

Bytes or a pre-tokenized dataset in windows of its records, or, with
`config.data.pack`, documents tokenized by `config.data.tokenizer` ("bytes",
"bpe" trained on the corpus, or a tokenizer file), framed with BOS/EOS and
packed into windows (`trainers.data.prepare.packed`); batches then also carry
`segment_ids` and `positions`, and throughput counts real input tokens.
With `config.data.sources`, the documents are the sources' (JSONL, Parquet,
text, HF datasets; weighted), each packed on its own (`lm_sources`).

Example:
  >>> from configs import lm_tiny
  >>> data = lm_data(lm_tiny.get_config(), seq_len=64, vocab_size=1024)
  >>> data.fields["unit"], data.fields["count_units"] is real_tokens
  ('tokens', True)
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from trainers.data.prepare import tokenizer as tok
from trainers.data.prepare.token_codec import TokenCodec, prompt_ids, token_codec, tokenizer_codec
from trainers.data.read import lm_examples

log = logging.getLogger(__name__)

CORPUS_RECORD_BYTES = 4096  # text_corpus records; LM examples are windows of them

# The dataset modules (text_corpus, packed, datasets) import TFDS; they are
# imported in the functions that prepare or read data, so that building a
# task's model, config or step (a notebook, `spmd-plan`, the accelerator
# check on a machine without TFDS) needs no TFDS. The same holds for
# `lm_sources` (`data.sources`: pyarrow, zstandard, fsspec), imported where a
# config has sources.


def check_held_out(config: ml_collections.ConfigDict, data_dir: str) -> None:
  """Raises `ValueError` when the eval split is "validation" and no file goes there.

  A text corpus puts a file in "validation" by a hash of its name, so a few
  files at a small `data.validation_percent` may hold out none; the error
  says how many files there are and the least percentage that holds one out.
  """
  from trainers.data.prepare import text_corpus  # TFDS: see the top

  parts = [part.split("[")[0].strip() for part in config.data.eval_split.split("+")]
  if text_corpus.VALIDATION not in parts:
    return
  percent = float(config.data.validation_percent)
  files = text_corpus.corpus_files(config.data.source or None, exclude=data_dir)
  if text_corpus.VALIDATION in text_corpus.split_files(files, percent):
    return
  texts = [f.key for f in files if os.path.getsize(f.path)]
  hint = ""
  if texts:
    least = text_corpus.validation_percent_to_hold_out(texts)
    hint = f"set data.validation_percent={least:g} or more (the least that holds out a file), "
  source = repr(config.data.source) if config.data.source else "'' (the stdlib)"
  raise ValueError(
    f"data.validation_percent={percent:g} holds out none of the {len(texts)} non-empty files of "
    f"data.source={source}, so data.eval_split="
    f"{config.data.eval_split!r} would be empty (a file goes to validation when a hash of its "
    f"name falls in the first {percent:g}% of the hash range). Either {hint}add files, or "
    "evaluate on some training files with data.eval_split='train[:10%]'."
  )


@dataclasses.dataclass
class PreparedData:
  """What `prepare_data` found, for the parts of the task that run after it.

  The tokenizer lives in the data dir, known only once the data is prepared
  (on every process: process 0 first, then the others).
  """

  tokenizer: object = None  # trainers.data.prepare.tokenizer.Tokenizer, or None for bytes
  identity: str = ""  # what the packed data was made with, saved with its position


def check_data(config: ml_collections.ConfigDict, vocab_size: int) -> None:
  """Raises `ValueError` for a tokenizer or packing choice the task cannot run with.

  Runs when the task is made (`trainers.config.resolve`, up front): a user's
  tokenizer file is read here to compare its vocabulary with the model's.

  Example:
    >>> from configs import lm_tiny
    >>> config = lm_tiny.get_config()
    >>> config.data.tokenizer, config.data.pack
    ('bpe', True)
    >>> config.data.pack = False
    >>> check_data(config, config.model.vocab_size)
    Traceback (most recent call last):
    ...
    ValueError: data.tokenizer='bpe' needs data.pack=True on the text corpus: subword tokens are packed into windows (set data.pack=True, or data.tokenizer='bytes')
  """
  if config.data.get("sources"):
    from trainers.tasks import lm_sources  # pyarrow and more: see the top

    lm_sources.check_sources(config)
  elif config.data.get("format", "text") != "text":
    raise ValueError(
      f"data.format={config.data.format!r} reads data.sources: name your JSONL files there"
    )
  spec, pack, name = (
    tok.tokenizer_spec(config),
    bool(config.data.get("pack", False)),
    config.data.name,
  )
  vocab = vocab_size
  if spec != tok.BYTES and name == "text_corpus" and not pack:
    raise ValueError(
      f"data.tokenizer={spec!r} needs data.pack=True on the text corpus: subword tokens are "
      "packed into windows (set data.pack=True, or data.tokenizer='bytes')"
    )
  if spec == tok.BPE:
    if name != "text_corpus":
      raise ValueError(
        f"data.tokenizer='bpe' trains on the text corpus, but data.name={name!r}; give the "
        "tokenizer file your dataset was tokenized with, or data.tokenizer='bytes'"
      )
    if vocab < tok.BPE_MIN_VOCAB:
      raise ValueError(
        f"config.model.vocab_size={vocab} is too small for data.tokenizer='bpe': a byte-level "
        f"BPE needs at least {tok.BPE_MIN_VOCAB} ids (256 bytes and {len(tok.BPE_SPECIALS)} "
        "special tokens)"
      )
  elif spec != tok.BYTES:
    tok.check_spec(spec)
    found = tok.Tokenizer(spec)
    if vocab < found.vocab_size:
      raise ValueError(
        f"config.model.vocab_size={vocab} is smaller than data.tokenizer={spec!r}'s "
        f"vocabulary of {found.vocab_size}; set config.model.vocab_size={found.vocab_size}"
      )


def _tokenizer(config: ml_collections.ConfigDict, data_dir: str, vocab_size: int):
  """The run's tokenizer in `data_dir` (trained or copied on first use), None for bytes."""
  from trainers.data.prepare import text_corpus  # TFDS: see the top

  spec = tok.tokenizer_spec(config)
  if spec == tok.BYTES:
    return None
  if spec == tok.BPE:
    source = config.data.source or None
    percent = float(config.data.validation_percent)
    files = text_corpus.split_files(text_corpus.corpus_files(source, exclude=data_dir), percent)
    key = text_corpus.text_corpus_config(source, validation_percent=percent, exclude=data_dir)
    train = [f.path for f in files.get(text_corpus.TRAIN, [])]
    return tok.bpe_tokenizer(data_dir, key.name, train, vocab_size)
  found = tok.user_tokenizer(spec, data_dir)
  if found.missing:
    log.warning("spmd-train: data: %s: documents are packed without it", found.missing)
  return found


def packed_prepare(
  config: ml_collections.ConfigDict,
  prepared: PreparedData,
  check: Callable[[], None],
  seq_len: int,
  vocab_size: int,
) -> Callable[[str], str]:
  """`Task.prepare_data` with packing: the tokenizer, then the packed windows.

  `check()` runs once the tokenizer is known, before any step (the sample's
  prompt must encode).
  """
  from trainers.data.prepare import packed  # TFDS: see the top

  def prepare(data_dir: str) -> str:
    name = config.data.name
    if name == "text_corpus":
      check_held_out(config, data_dir)
    prepared.tokenizer = _tokenizer(config, data_dir, vocab_size)
    prepared.identity = (
      f"tokenizer {prepared.tokenizer.identity}" if prepared.tokenizer else "tokenizer bytes"
    )
    check()
    common = dict(
      seq_len=seq_len,
      seed=int(config.seed),
      vocab_size=vocab_size,
      tokenizer=prepared.tokenizer,
      validation_percent=float(config.data.validation_percent),
    )
    if name == "text_corpus":
      built = packed.packed_config(source=config.data.source or None, exclude=data_dir, **common)
    else:
      built = packed.packed_config(dataset=name, dataset_dir=data_dir, **common)
    return packed.prepare_packed(data_dir, built)

  return prepare


def prepare_data(config: ml_collections.ConfigDict) -> Callable[[str], str]:
  """`Task.prepare_data` for `config.data`: builds text_corpus, or names a prepared dataset.

  Either way the records' token lengths are kept beside the dataset's index
  (read once here, where the data is prepared, if it has none yet), so that
  no host reads every record at startup.
  """
  name = config.data.name

  def prepare(data_dir: str) -> str:
    from trainers.data.prepare import text_corpus  # TFDS: see the top
    from trainers.data.records import datasets

    found = name
    if name == "text_corpus":
      check_held_out(config, data_dir)  # before a build that could not be evaluated
      found = text_corpus.prepare_text_corpus(
        data_dir,
        config.data.source or None,
        chunk_bytes=CORPUS_RECORD_BYTES,
        validation_percent=config.data.validation_percent,
      )
    datasets.keep_record_lengths(found, data_dir, "tokens")
    return found

  return prepare


def lm_records(config: ml_collections.ConfigDict, seq_len: int):
  """`Task.plan_records` for windows of `seq_len + 1` tokens of `config.data.name`."""
  # The corpus's chunks are at most CORPUS_RECORD_BYTES long, so its windows
  # are known without reading it; other datasets say it themselves.
  record_tokens = CORPUS_RECORD_BYTES if config.data.name == "text_corpus" else None
  return lm_examples.lm_windows(seq_len, "tokens", record_tokens)


SEQUENCE_FEATURES = ("inputs", "targets", "mask", "segment_ids", "positions")
"""The batch features whose axis 1 is the sequence (`Task.sequence_features`); packed
batches carry all five, unpacked ones the first three."""


def real_tokens(batch) -> jax.Array:
  """`Task.count_units` of packed batches: real input tokens (`segment_ids != 0`).

  Inputs, not targets: every token of the stream is an input once per epoch
  (the loss weight, the mask sum, leaves out each document's last token and
  the EOS -> BOS pairs, so it is a little smaller).
  """
  return jnp.sum(batch["segment_ids"] != 0).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class LmData:
  """The data side of an LM task, for any decoder trained on the same data (`lm_data`).

  Attributes:
    fields: the `Task` keywords of the data: `prepare_data`,
      `prepares_together`, `record_template`, `to_example`, `to_batch`, `plan_records`, `unit`,
      `count_units`, `units_per_batch`, `run_files`.
    codec: `() -> TokenCodec`: text to ids and back, through the run's
      tokenizer once the data is prepared (bytes or ids before, and without
      one).
  """

  fields: dict[str, Any]
  codec: Callable[[], TokenCodec]


def lm_data(
  config: ml_collections.ConfigDict, seq_len: int, vocab_size: int, prompt: str | None = None
) -> LmData:
  """The LM data of `config.data` in windows of `seq_len + 1` tokens, as `Task` keywords.

  Bytes or a pre-tokenized dataset in windows of its records, or, with
  `config.data.pack`, documents tokenized and packed (batches then carry
  `segment_ids` and `positions`, and throughput counts real input tokens).
  `prompt`, when given, must encode to 1..seq_len-1 ids of the vocabulary:
  checked as soon as the tokenizer is known, before any step.

  Example:
    >>> from configs import lm_tiny
    >>> data = lm_data(lm_tiny.get_config(), seq_len=64, vocab_size=1024)
    >>> data.fields["unit"], data.fields["count_units"] is real_tokens
    ('tokens', True)
  """
  check_data(config, vocab_size)
  units = float(config.global_batch * seq_len)
  if not config.data.get("pack", False):
    fixed = token_codec(vocab_size)
    if prompt is not None:
      prompt_ids(fixed, prompt, vocab_size, seq_len)
    fields = dict(
      prepare_data=prepare_data(config),
      # One window of int32 ids: the records' own length and dtype are the data's.
      record_template={"tokens": np.zeros(seq_len + 1, np.int32)},
      to_example=lm_examples.lm_example(seq_len),
      to_batch=lm_examples.lm_batch(seq_len),
      plan_records=lm_records(config, seq_len),
      unit="tokens",
      units_per_batch=units,
      sequence_features=SEQUENCE_FEATURES[:3],
    )
    return LmData(fields=fields, codec=lambda: fixed)

  from trainers.data.prepare import packed  # TFDS: see the top

  prepared = PreparedData()

  def codec() -> TokenCodec:
    if prepared.tokenizer is None:
      return token_codec(vocab_size)
    return tokenizer_codec(prepared.tokenizer)

  def check() -> None:
    if prompt is not None:
      prompt_ids(codec(), prompt, vocab_size, seq_len)

  prepare = packed_prepare
  if config.data.get("sources"):
    from trainers.tasks import lm_sources  # pyarrow and more: see the top

    prepare = lm_sources.sources_prepare
  fields = dict(
    prepare_data=prepare(config, prepared, check, seq_len, vocab_size),
    record_template=packed.record_template(
      seq_len, loss_mask=config.data.get("format", "text") == "prompt_completion"
    ),
    to_example=packed.packed_example(seq_len),
    to_batch=packed.packed_batch(seq_len),
    plan_records=packed.packed_plan(seq_len, lambda: prepared.identity),
    unit="tokens",
    count_units=real_tokens,
    units_per_batch=units,
    sequence_features=SEQUENCE_FEATURES,
    run_files=lambda: (
      {"tokenizer" + _suffix(prepared): prepared.tokenizer.path} if prepared.tokenizer else {}
    ),
    prepares_together=bool(config.data.get("sources")),  # every host packs its share
  )
  return LmData(fields=fields, codec=codec)


def _suffix(prepared: PreparedData) -> str:
  return os.path.splitext(prepared.tokenizer.path)[1] or ".json"
