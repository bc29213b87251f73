"""What differs between training an LM and a classifier, in one place.

A `Task` says how to build the model, prepare and read the data, and count
work (tokens or examples, FLOPs). Everything else in the trainer (state,
step, loop, checkpoints) is the same for both.

Example:
  >>> from configs import lm_tiny
  >>> task = make_task(lm_tiny.get_config())
  >>> task.unit, task.units_per_step
  ('tokens', 2048)
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import ml_collections
import numpy as np

from trainers.data import pipeline
from trainers.models import mlp
from trainers.models import transformer as lm

CORPUS_RECORD_BYTES = 4096  # text_corpus records; LM examples are windows of them


@dataclasses.dataclass(frozen=True)
class Task:
  model_fn: Callable  # nnx.Rngs -> model
  prepare: Callable[[str], str]  # data dir -> dataset name to open (builds if needed)
  to_example: Callable[..., dict]
  examples_per_record: int
  unit: str  # what throughput counts: "tokens" or "examples"
  units_per_step: int
  flops_per_step: float
  language_model: bool  # a greedy sample at the end
  # A record of the data's format (zeros): example shapes without data; its keys are
  # the features `to_example` reads, the only ones the pipeline decodes.
  record_template: dict
  # Optional: all of a batch's rows at once, equal to stacking `to_example`'s.
  to_batch: Callable | None = None


def transformer_config(config: ml_collections.ConfigDict) -> lm.TransformerConfig:
  m = config.model
  return lm.TransformerConfig(
    vocab_size=m.vocab_size,
    seq_len=m.seq_len,
    num_layers=m.num_layers,
    d_model=m.d_model,
    num_heads=m.num_heads,
    d_ff=m.d_ff,
    dtype=m.dtype,
    param_dtype=m.param_dtype,
    scan_layers=m.scan_layers,
    scan_unroll=m.scan_unroll,
    remat_policy=m.remat_policy,
  )


def _prepare_dataset(config: ml_collections.ConfigDict) -> Callable[[str], str]:
  name = config.data.name
  if name == "text_corpus":
    from trainers.data.datasets import prepare_text_corpus

    return lambda data_dir: prepare_text_corpus(
      data_dir,
      config.data.source or None,
      chunk_bytes=CORPUS_RECORD_BYTES,
      validation_percent=config.data.validation_percent,
    )
  if name == "blobs":
    from trainers.data.blobs import prepare_blobs

    return prepare_blobs
  return lambda data_dir: name  # any TFDS dataset already prepared in data_dir


def make_task(config: ml_collections.ConfigDict) -> Task:
  """The task for `config.model.kind`: "transformer" (LM) or "mlp" (classifier)."""
  kind = config.model.kind
  prepare = _prepare_dataset(config)
  if kind == "transformer":
    model_config = transformer_config(config)
    tokens = config.global_batch * config.model.seq_len
    per_record = (
      pipeline.windows_per_record(CORPUS_RECORD_BYTES, config.model.seq_len)
      if config.data.name == "text_corpus"
      else 1
    )
    return Task(
      lambda rngs: lm.TransformerLM(model_config, rngs=rngs),
      prepare,
      pipeline.lm_example(config.model.seq_len),
      per_record,
      "tokens",
      tokens,
      lm.flops_per_token(model_config) * tokens,
      True,
      {"tokens": np.zeros(CORPUS_RECORD_BYTES, np.uint8)},
      pipeline.lm_batch(config.model.seq_len),
    )
  if kind == "mlp":
    from trainers.data.blobs import classification_example

    model_config = mlp.MLPConfig(
      input_dim=config.model.input_dim,
      hidden_sizes=tuple(config.model.hidden_sizes),
      num_classes=config.model.num_classes,
      dtype=config.model.dtype,
      param_dtype=config.model.param_dtype,
    )
    sizes = (model_config.input_dim, *model_config.hidden_sizes, model_config.num_classes)
    params = sum(a * b + b for a, b in itertools.pairwise(sizes))
    return Task(
      lambda rngs: mlp.MLPClassifier(model_config, rngs=rngs),
      prepare,
      classification_example,
      1,
      "examples",
      config.global_batch,
      6.0 * params * config.global_batch,
      False,
      {"features": np.zeros(model_config.input_dim, np.float32), "label": 0},
    )
  raise ValueError(f"model.kind={kind!r}: choose 'transformer' or 'mlp'")
