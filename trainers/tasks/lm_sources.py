"""The LM tasks' data from `config.data.sources`: the tokenizer, each source packed, the mixture.

`config.data.sources` (see `trainers.data.prepare.source_files`) names the sources
and their weights; `prepare(data_dir, group)` lists them, finds or trains the
tokenizer, packs each source's train documents and, when it holds some
out, its validation documents (`trainers.data.prepare.source_packed`), and returns
the `DataMixture` the trainer opens. Every process of `group` calls it
at once and packs its share of each source. With `data.eval_sources`, those
sources are the eval data and the train sources hold nothing out.

A trained BPE (`data.tokenizer=bpe`) learns from a bounded, deterministic
sample of every train source's train documents (`documents.sample_texts`),
cached by the sources' identities: the same files, the same tokenizer.

Example:
  >>> from configs import llama_tiny
  >>> config = llama_tiny.get_config()
  >>> config.data.sources = "corpus/*.jsonl@0.7,more/*.parquet@0.3"
  >>> check_sources(config)  # the settings alone; nothing is read
  >>> config.data.pack = False
  >>> check_sources(config)
  Traceback (most recent call last):
  ...
  spmd.errors.UserError: data.sources packs documents into windows: set data.pack=True
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable

import ml_collections

from spmd.errors import UserError
from trainers.data.prepare import documents as docs
from trainers.data.prepare import tokenizer as tok
from trainers.data.prepare.holdout import TRAIN, VALIDATION, split_of
from trainers.data.prepare.prepare_group import ALONE, PrepareGroup
from trainers.data.prepare.source_files import (
  Source,
  SourceFile,
  list_sources,
  parse_sources,
  refuse_shared_files,
)
from trainers.data.read.mixture import DataMixture, MixtureSource

log = logging.getLogger(__name__)

# The source builds (trainers.data.prepare.source_packed) import TFDS; they are
# imported where data is prepared, as lm_data's (see there).


def check_sources(config: ml_collections.ConfigDict) -> None:
  """Raises `UserError` for `data.sources` settings that cannot work; reads no file."""
  data = config.data
  parse_sources(data.sources)
  if data.eval_sources:
    parse_sources(data.eval_sources, "data.eval_sources")
  if not data.pack:
    raise UserError("data.sources packs documents into windows: set data.pack=True")
  if data.source:
    raise UserError(
      f"data.source={data.source!r} and data.sources={data.sources!r} both name the text; "
      "put every path in data.sources"
    )
  if data.name != "text_corpus":
    raise UserError(
      f"data.name={data.name!r} and data.sources={data.sources!r} both name the data; "
      "leave data.name at its default with data.sources"
    )
  if not isinstance(data.text_field, str) or not data.text_field:
    raise UserError(f"data.text_field={data.text_field!r} must name a field (e.g. 'text')")
  if data.skip_bad_rows < 0:
    raise UserError(f"data.skip_bad_rows={data.skip_bad_rows} must be >= 0")
  if data.get("format", "text") not in ("text", "prompt_completion"):
    raise UserError(f"data.format={data.format!r} must be 'text' or 'prompt_completion'")


def _tokenizer(config, data_dir: str, sources: list[Source], percent: float, vocab_size: int):
  """The run's tokenizer: a BPE trained on a sample of the sources, a user's file, or None."""
  spec = tok.tokenizer_spec(config)
  if spec == tok.BYTES:
    return None
  if spec != tok.BPE:
    found = tok.user_tokenizer(spec, data_dir)
    if found.missing:
      log.warning("spmd-train: data: %s: documents are packed without it", found.missing)
    return found
  field, skip = config.data.text_field, int(config.data.skip_bad_rows)
  if config.data.get("format", "text") == "prompt_completion":
    field = docs.PROMPT_COMPLETION
  key = [[s.identity() for s in sources], field, percent, docs.BPE_SAMPLE_CHARS]
  digest = hashlib.sha256(json.dumps(key).encode("utf-8", "surrogateescape")).hexdigest()[:12]

  def keep(document: docs.Document) -> bool:
    text = document.prompt + document.text
    return bool(text) and split_of(document.key, percent) == TRAIN

  return tok.bpe_tokenizer(
    data_dir,
    f"sources-{digest}",
    vocab_size=vocab_size,
    texts=lambda: docs.sample_texts(sources, field, skip, keep),
  )


def _listed(group: PrepareGroup, text: str, setting: str) -> list[Source]:
  """The sources of a setting as process 0 lists them, on every process of `group`.

  The builds' names hash each file's identity: hosts that listed a file
  being written at different moments would prepare different datasets and
  never meet at the group's barriers.
  """
  specs = parse_sources(text, setting)
  listed = group.agree(
    setting, lambda: [dataclasses.asdict(s) for s in list_sources(specs, setting)]
  )
  return [
    Source(s["spec"], s["weight"], tuple(SourceFile(**f) for f in s["files"])) for s in listed
  ]


def sources_prepare(
  config: ml_collections.ConfigDict,
  prepared,
  check: Callable[[], None],
  seq_len: int,
  vocab_size: int,
) -> Callable[[str], DataMixture]:
  """`Task.prepare_data` for `data.sources`: the tokenizer, then each source's splits packed.

  `prepared` (`lm_data.PreparedData`) receives the tokenizer and its
  identity; `check()` runs once the tokenizer is known, before any source is
  packed.
  """
  from trainers.data.prepare import source_packed  # TFDS: see the top

  data = config.data

  def prepare(data_dir: str, group: PrepareGroup = ALONE) -> DataMixture:
    train = _listed(group, data.sources, "data.sources")
    evals = []
    if data.eval_sources:
      evals = _listed(group, data.eval_sources, "data.eval_sources")
      refuse_shared_files(train, evals)
    percent = 0.0 if evals else float(data.validation_percent)
    # The tokenizer (trained or copied into data_dir on first use) is made by
    # process 0; the others find it there.
    if group.chief:
      prepared.tokenizer = _tokenizer(config, data_dir, train, percent, vocab_size)
    group.wait("tokenizer")
    if not group.chief:
      prepared.tokenizer = _tokenizer(config, data_dir, train, percent, vocab_size)
    prepared.identity = (
      f"tokenizer {prepared.tokenizer.identity}" if prepared.tokenizer else "tokenizer bytes"
    )
    check()
    common = dict(
      seq_len=seq_len,
      vocab_size=vocab_size,
      tokenizer=prepared.tokenizer,
      text_field=data.text_field,
      skip_bad_rows=int(data.skip_bad_rows),
      format=data.get("format", "text"),
    )

    def split(source: Source, which: str, share: float):
      built = source_packed.source_config(source, split=which, validation_percent=share, **common)
      return source_packed.prepare_source(data_dir, built, group)

    mixed = []
    for source in train:
      first = split(source, TRAIN, percent)
      datasets = {TRAIN: first.name}
      if first.other_split:  # documents held out: their own dataset
        datasets[VALIDATION] = split(source, VALIDATION, percent).name
      mixed.append(MixtureSource(source.spec, datasets, source.weight, first.note()))
    held = []
    for source in evals:
      built = split(source, VALIDATION, 100.0)
      held.append(MixtureSource(source.spec, {VALIDATION: built.name}, None, built.note()))
    return DataMixture(train=tuple(mixed), eval=tuple(held))

  return prepare
