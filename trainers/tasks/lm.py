"""The built-in language-model task (`config.task = "lm"`), through the public Task API.

A byte-level decoder-only transformer (`trainers.models.transformer`) on the
`text_corpus` dataset (or any prepared TFDS dataset with a `tokens`
feature): next-token cross-entropy over the unmasked targets, accuracy,
tokens as the unit, PaLM's model FLOPs, and a greedy sample at the end.
Its section, `config.model`, is `TransformerConfig`'s fields plus nothing.

Example:
  >>> from configs import lm_tiny
  >>> task = make_task(lm_tiny.get_config())
  >>> task.unit, task.examples_per_record
  ('tokens', 63)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from trainers.data import pipeline
from trainers.models import transformer as lm
from trainers.tasks import Task, config_section, cross_entropy_sums

CORPUS_RECORD_BYTES = 4096  # text_corpus records; LM examples are windows of them
SAMPLE_PROMPT = "def "


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
  """Summed next-token cross-entropy over the unmasked targets, its weight, and accuracy."""
  del rngs, train  # the transformer has no dropout and no batch statistics
  return cross_entropy_sums(model(batch["inputs"]), batch["targets"], batch["mask"])


def _prepare(config: ml_collections.ConfigDict):
  name = config.data.name
  if name == "text_corpus":
    from trainers.data.datasets import prepare_text_corpus

    return lambda data_dir: prepare_text_corpus(
      data_dir,
      config.data.source or None,
      chunk_bytes=CORPUS_RECORD_BYTES,
      validation_percent=config.data.validation_percent,
    )
  return lambda data_dir: name  # any TFDS dataset already prepared in data_dir


def _sample_report(model_config: lm.TransformerConfig, num_tokens: int):
  def report(model, step: int) -> str:
    prompt = np.frombuffer(SAMPLE_PROMPT.encode(), np.uint8).astype(np.int32)[None, :]
    count = min(num_tokens, model_config.seq_len - prompt.shape[1])
    out = np.asarray(jax.device_get(lm.generate(model, jnp.asarray(prompt), count)))[0]
    text = bytes(int(t) % 256 for t in out).decode("utf-8", errors="replace")
    return f"sample (greedy, prompt {SAMPLE_PROMPT!r}):\n{text}"

  return report


def make_task(config: ml_collections.ConfigDict) -> Task:
  """The LM task for `config` (sizes from `config.model`)."""
  model_config = transformer_config(config)
  seq_len = model_config.seq_len
  tokens = config.global_batch * seq_len
  per_record = (
    pipeline.windows_per_record(CORPUS_RECORD_BYTES, seq_len)
    if config.data.name == "text_corpus"
    else 1
  )
  sample_tokens = config.get("sample_tokens", 0)
  return Task(
    model=lambda rngs: lm.TransformerLM(model_config, rngs=rngs),
    loss=next_token_loss,
    prepare_data=_prepare(config),
    record_template={"tokens": np.zeros(CORPUS_RECORD_BYTES, np.uint8)},
    to_example=pipeline.lm_example(seq_len),
    to_batch=pipeline.lm_batch(seq_len),
    examples_per_record=per_record,
    unit="tokens",
    compute_dtype=model_config.dtype,
    flops_per_step=lm.flops_per_token(model_config) * tokens,
    report=_sample_report(model_config, sample_tokens) if sample_tokens else None,
  )
