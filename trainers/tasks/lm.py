"""The built-in language-model task (`config.task = "lm"`), through the public Task API.

A decoder-only transformer (`trainers.models.transformer`) on the byte-level
`text_corpus` dataset, or on any prepared TFDS dataset with a `tokens`
feature (pre-tokenized, any integer dtype, fixed or variable length, ids
below `config.model.vocab_size`): next-token cross-entropy over the unmasked
targets, accuracy, tokens as the unit, PaLM's model FLOPs, and a greedy
sample at the end. Each record gives every window of `seq_len + 1` tokens it
holds (`pipeline.lm_windows`), and the run logs what is used and dropped.
Its section, `config.model`, is `TransformerConfig`'s fields plus nothing.

Example:
  >>> from configs import lm_tiny
  >>> task = make_task(lm_tiny.get_config())
  >>> task.unit, task.record_template["tokens"].shape
  ('tokens', (65,))
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from trainers.data import pipeline
from trainers.models import transformer as lm
from trainers.tasks import Task, config_section, cross_entropy_sums

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
    }
  )


def transformer_config(config: ml_collections.ConfigDict) -> lm.TransformerConfig:
  """The model's sizes from `config.model`; a misspelt key is an error naming it."""
  return config_section(lm.TransformerConfig, config.model)


def next_token_loss(model, batch, rngs, train):
  """Summed next-token cross-entropy over the unmasked targets, its weight, and accuracy.

  A packed batch's `segment_ids` and `positions` go to the model, when it has them.
  """
  del rngs, train  # the transformer has no dropout and no batch statistics
  packing = {key: batch[key] for key in ("segment_ids", "positions") if key in batch}
  return cross_entropy_sums(model(batch["inputs"], **packing), batch["targets"], batch["mask"])


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


def _prompt_ids(codec: TokenCodec, prompt: str, model_config: lm.TransformerConfig) -> list[int]:
  """The prompt's ids, checked up front so that the sample cannot fail at the end."""
  ids = codec.encode(prompt)
  vocab, seq_len = model_config.vocab_size, model_config.seq_len
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


def _sample_report(model_config: lm.TransformerConfig, num_tokens: int, prompt: str):
  codec = token_codec(model_config.vocab_size)
  ids = _prompt_ids(codec, prompt, model_config)

  def report(model, step: int) -> str:
    count = min(num_tokens, model_config.seq_len - len(ids))
    tokens = jnp.asarray([ids], jnp.int32)
    out = np.asarray(jax.device_get(lm.generate(model, tokens, count)))[0]
    return f"sample (greedy, prompt {prompt!r}, {codec.describe}):\n{codec.decode(out)}"

  return report


def lm_records(config: ml_collections.ConfigDict, seq_len: int):
  """`Task.plan_records` for windows of `seq_len + 1` tokens of `config.data.name`."""
  # The corpus's chunks are at most CORPUS_RECORD_BYTES long, so its windows
  # are known without reading it; other datasets say it themselves.
  record_tokens = CORPUS_RECORD_BYTES if config.data.name == "text_corpus" else None
  return pipeline.lm_windows(seq_len, "tokens", record_tokens)


def make_task(config: ml_collections.ConfigDict) -> Task:
  """The LM task for `config` (sizes from `config.model`)."""
  model_config = transformer_config(config)
  seq_len = model_config.seq_len
  tokens = config.global_batch * seq_len
  sample_tokens = config.get("sample_tokens", 0)
  report = None
  if sample_tokens:
    report = _sample_report(model_config, sample_tokens, config.get("sample_prompt", "def "))
  return Task(
    model=lambda rngs: lm.TransformerLM(model_config, rngs=rngs),
    loss=next_token_loss,
    prepare_data=prepare_data(config),
    # One window of int32 ids: the records' own length and dtype are the data's.
    record_template={"tokens": np.zeros(seq_len + 1, np.int32)},
    to_example=pipeline.lm_example(seq_len),
    to_batch=pipeline.lm_batch(seq_len),
    plan_records=lm_records(config, seq_len),
    unit="tokens",
    compute_dtype=model_config.dtype,
    flops_per_step=lm.flops_per_token(model_config) * tokens,
    report=report,
  )
