"""The built-in language-model task (`config.task = "lm"`), through the public Task API.

A decoder-only transformer (`trainers.models.transformer`) on the byte-level
`text_corpus` dataset, or on any prepared TFDS dataset with a `tokens`
feature (pre-tokenized, any integer dtype, fixed or variable length, ids
below `config.model.vocab_size`): next-token cross-entropy over the unmasked
targets, accuracy, tokens as the unit, PaLM's model FLOPs, and a greedy
sample at the end (with a KV cache, `trainers.models.decode`). Each record gives every window of `seq_len + 1` tokens it
holds (`lm_examples.lm_windows`), and the run logs what is used and dropped.
Its section, `config.model`, is `TransformerConfig`'s fields plus nothing.

With `config.data.pack` the documents (the corpus's files, or a
pre-tokenized dataset's records) are tokenized by `config.data.tokenizer`
("bytes", "bpe" trained on the corpus, or a tokenizer file), framed with
BOS/EOS and packed into windows, stored in runs (`trainers.data.packed`);
batches then also carry `segment_ids` and `positions`, and throughput counts
real input tokens (`segment_ids != 0`), not padding.

Example:
  >>> from configs import lm_tiny
  >>> task = make_task(lm_tiny.get_config())
  >>> task.unit, task.record_template["tokens"].shape
  ('tokens', (65,))
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from trainers.data import lm_examples
from trainers.models import decode
from trainers.models import transformer as lm
from trainers.tasks import Task, config_section
from trainers.tasks.losses import chunked_cross_entropy_sums

log = logging.getLogger(__name__)

CORPUS_RECORD_BYTES = 4096  # text_corpus records; LM examples are windows of them
BYTE_VOCAB = 256  # a vocabulary this size or smaller is read as bytes


def default_model_config() -> ml_collections.ConfigDict:
  """The section `config.model` of the LM task: `TransformerConfig`'s fields."""
  return ml_collections.ConfigDict(
    {
      "seq_len": 128,
      "num_layers": 4,
      "d_model": 256,
      "num_heads": 4,
      "d_ff": 1024,
      "vocab_size": 256,
      # Compute dtype; "bfloat16" for mixed precision.
      "dtype": "float32",
      "param_dtype": "float32",
      # lax.scan over the layers' stacked weights: XLA compiles one block, not
      # num_layers of them. False unrolls the blocks; checkpoints of one layout
      # do not load into the other.
      "scan_layers": True,
      # Layers per iteration of that scan; num_layers unrolls it into
      # straight-line code (same parameters and remat).
      "scan_unroll": 1,
      # What each scanned layer keeps for the backward pass: "minimal" (the
      # weight matmuls' outputs) or "none" (everything, no recomputation).
      "remat_policy": "minimal",
      # The attention kernel: "auto" (splash on TPU, cuDNN on GPU, else XLA),
      # "xla", "splash" or "cudnn" (trainers/models/attention.py).
      "attention": "auto",
    }
  )


def transformer_config(config: ml_collections.ConfigDict) -> lm.TransformerConfig:
  """The model's sizes from `config.model`; a misspelt key is an error naming it."""
  return config_section(lm.TransformerConfig, config.model)


def next_token_loss(model, batch, rngs, train):
  """Summed next-token cross-entropy over the unmasked targets, its weight, and accuracy.

  A packed batch's `segment_ids` and `positions` go to the model, when it has them.
  The logits are formed chunk by chunk (`losses.chunked_cross_entropy_sums`),
  never for the whole batch at once.
  """
  del rngs, train  # the transformer has no dropout and no batch statistics
  packing = {key: batch[key] for key in ("segment_ids", "positions") if key in batch}
  hidden = model.hidden_states(batch["inputs"], **packing)
  return chunked_cross_entropy_sums(hidden, model.unembedding(), batch["targets"], batch["mask"])


def check_held_out(config: ml_collections.ConfigDict, data_dir: str) -> None:
  """Raises `ValueError` when the eval split is "validation" and no file goes there.

  A text corpus puts a file in "validation" by a hash of its name, so a few
  files at a small `data.validation_percent` may hold out none; the error
  says how many files there are and the least percentage that holds one out.
  """
  from trainers.data import text_corpus

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

  tokenizer: object = None  # trainers.data.tokenizer.Tokenizer, or None for bytes
  identity: str = ""  # what the packed data was made with, saved with its position


def tokenizer_spec(config: ml_collections.ConfigDict) -> str:
  """`config.data.tokenizer`: "bytes", "bpe", or a tokenizer file's path/URL."""
  return config.data.get("tokenizer", "bytes") or "bytes"


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
  from trainers.data import tokenizer as tok

  spec, pack, name = tokenizer_spec(config), bool(config.data.get("pack", False)), config.data.name
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
  from trainers.data import text_corpus
  from trainers.data import tokenizer as tok

  spec = tokenizer_spec(config)
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
  from trainers.data import packed

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
  """`Task.prepare_data` for `config.data`: builds text_corpus, or names a prepared dataset."""
  name = config.data.name
  if name == "text_corpus":
    from trainers.data.datasets import prepare_text_corpus

    def prepare(data_dir: str) -> str:
      check_held_out(config, data_dir)  # before a build that could not be evaluated
      return prepare_text_corpus(
        data_dir,
        config.data.source or None,
        chunk_bytes=CORPUS_RECORD_BYTES,
        validation_percent=config.data.validation_percent,
      )

    return prepare
  return lambda data_dir: name  # any TFDS dataset already prepared in data_dir


@dataclasses.dataclass(frozen=True)
class TokenCodec:
  """Text to token ids and back, for the sample; where a tokenizer plugs in.

  Attributes:
    encode: `text -> ids`, for the prompt.
    decode: `ids -> text`, for the sample.
    describe: how the sample is shown, for its heading.
  """

  encode: Callable[[str], list[int]]
  decode: Callable[[Sequence[int]], str]
  describe: str


def token_codec(vocab_size: int) -> TokenCodec:
  """The codec of a vocabulary: bytes when it is byte-level (<= 256 ids), else ids.

  Without a tokenizer a larger vocabulary's ids have no text: the prompt
  becomes its UTF-8 bytes (ids every such vocabulary has) and the sample is
  shown as token ids, never as bytes it is not.

  Example:
    >>> token_codec(256).encode("hi"), token_codec(256).decode([104, 105])
    ([104, 105], 'hi')
    >>> token_codec(1000).decode([104, 999])
    '[104, 999]'
  """
  encode = list  # a str's UTF-8 bytes, as ints
  if vocab_size <= BYTE_VOCAB:
    return TokenCodec(
      encode=lambda text: encode(text.encode()),
      decode=lambda ids: bytes(int(t) for t in ids).decode("utf-8", errors="replace"),
      describe="bytes",
    )
  return TokenCodec(
    encode=lambda text: encode(text.encode()),
    decode=lambda ids: str([int(t) for t in ids]),
    describe=f"token ids: {vocab_size=} is not byte-level and there is no tokenizer; "
    "the prompt is its UTF-8 bytes",
  )


def prompt_ids(codec: TokenCodec, prompt: str, vocab: int, seq_len: int) -> list[int]:
  """The prompt's ids, checked up front so that the sample cannot fail at the end."""
  ids = codec.encode(prompt)
  if not ids or len(ids) >= seq_len:
    raise ValueError(
      f"config.sample_prompt={prompt!r} is {len(ids)} tokens; a sample needs 1 to "
      f"{seq_len - 1} ({seq_len=}), or config.sample_tokens=0 for no sample"
    )
  if max(ids) >= vocab:
    raise ValueError(
      f"config.sample_prompt={prompt!r} has token id {max(ids)}, outside vocab_size={vocab}; "
      "use a prompt of ASCII text, or config.sample_tokens=0 for no sample"
    )
  return ids


def tokenizer_codec(tokenizer) -> TokenCodec:
  """The codec of a subword tokenizer: the prompt opens a document (BOS first).

  Example:
    >>> import tempfile, pathlib
    >>> from trainers.data.tokenizer import Tokenizer, train_bpe
    >>> path = train_bpe(["def f(): pass"] * 9, 300, pathlib.Path(tempfile.mkdtemp()) / "t.json")
    >>> codec = tokenizer_codec(Tokenizer(path))
    >>> codec.encode("def")[0], codec.decode(codec.encode("def g"))
    (1, 'def g')
  """
  bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
  return TokenCodec(
    encode=lambda text: bos + tokenizer.encode(text),
    decode=tokenizer.decode,
    describe=f"text through the tokenizer {os.path.basename(tokenizer.path)}",
  )


def sample_report(
  model_config: Any,
  num_tokens: int,
  prompt: str,
  codec: Callable[[], TokenCodec] | None = None,
):
  """The end-of-run greedy sample of a decoder with a KV cache (`trainers.models.decode`).

  `model_config` gives `vocab_size` and `seq_len` (a `TransformerConfig` or
  `LlamaConfig`); `codec()` (default: bytes or ids) is called when it runs.
  """
  if codec is None:
    fixed = token_codec(model_config.vocab_size)
    prompt_ids(fixed, prompt, model_config.vocab_size, model_config.seq_len)  # up front
    codec = lambda: fixed  # noqa: E731

  def report(model, step: int) -> str:
    found = codec()
    ids = prompt_ids(found, prompt, model_config.vocab_size, model_config.seq_len)
    count = min(num_tokens, model_config.seq_len - len(ids))
    tokens = jnp.asarray([ids], jnp.int32)
    out = np.asarray(jax.device_get(decode.generate(model, tokens, count)))[0]
    return f"sample (greedy, prompt {prompt!r}, {found.describe}):\n{found.decode(out)}"

  return report


def lm_records(config: ml_collections.ConfigDict, seq_len: int):
  """`Task.plan_records` for windows of `seq_len + 1` tokens of `config.data.name`."""
  # The corpus's chunks are at most CORPUS_RECORD_BYTES long, so its windows
  # are known without reading it; other datasets say it themselves.
  record_tokens = CORPUS_RECORD_BYTES if config.data.name == "text_corpus" else None
  return lm_examples.lm_windows(seq_len, "tokens", record_tokens)


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
      `record_template`, `to_example`, `to_batch`, `plan_records`, `unit`,
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
    )
    return LmData(fields=fields, codec=lambda: fixed)

  from trainers.data import packed

  prepared = PreparedData()

  def codec() -> TokenCodec:
    if prepared.tokenizer is None:
      return token_codec(vocab_size)
    return tokenizer_codec(prepared.tokenizer)

  def check() -> None:
    if prompt is not None:
      prompt_ids(codec(), prompt, vocab_size, seq_len)

  fields = dict(
    prepare_data=packed_prepare(config, prepared, check, seq_len, vocab_size),
    record_template=packed.record_template(seq_len),
    to_example=packed.packed_example(seq_len),
    to_batch=packed.packed_batch(seq_len),
    plan_records=packed.packed_plan(seq_len, lambda: prepared.identity),
    unit="tokens",
    count_units=real_tokens,
    units_per_batch=units,
    run_files=lambda: (
      {"tokenizer" + _suffix(prepared): prepared.tokenizer.path} if prepared.tokenizer else {}
    ),
  )
  return LmData(fields=fields, codec=codec)


def _suffix(prepared: PreparedData) -> str:
  return os.path.splitext(prepared.tokenizer.path)[1] or ".json"


def make_task(config: ml_collections.ConfigDict) -> Task:
  """The LM task for `config` (sizes from `config.model`)."""
  model_config = transformer_config(config)
  seq_len = model_config.seq_len
  sample_tokens = config.get("sample_tokens", 0)
  prompt = config.get("sample_prompt", "def ") if sample_tokens else None
  data = lm_data(config, seq_len, model_config.vocab_size, prompt)
  report = None
  if sample_tokens:
    report = sample_report(model_config, sample_tokens, prompt, codec=data.codec)
  return Task(
    model=lambda rngs: lm.TransformerLM(model_config, rngs=rngs),
    loss=next_token_loss,
    **data.fields,
    compute_dtype=model_config.dtype,
    flops_per_step=lm.flops_per_token(model_config) * config.global_batch * seq_len,
    report=report,
  )
