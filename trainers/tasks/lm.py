"""The built-in language-model task (`config.task = "lm"`), through the public Task API.

A decoder-only transformer (`trainers.models.transformer`) on the byte-level
`text_corpus` dataset, or on any prepared TFDS dataset with a `tokens`
feature (pre-tokenized, any integer dtype, fixed or variable length, ids
below `config.model.vocab_size`): next-token cross-entropy over the unmasked
targets, accuracy, tokens as the unit, PaLM's model FLOPs, and a greedy
sample at the end (with a KV cache, `trainers.models.decode`). The data side,
shared with the Llama task, is `lm_data.py`. Its section, `config.model`, is
`TransformerConfig`'s fields plus nothing.

With `config.data.pack` the documents (the corpus's files, or a
pre-tokenized dataset's records) are tokenized by `config.data.tokenizer`
("bytes", "bpe" trained on the corpus, or a tokenizer file), framed with
BOS/EOS and packed into windows, stored in runs (`trainers.data.prepare.packed`);
batches then also carry `segment_ids` and `positions`, and throughput counts
real input tokens (`segment_ids != 0`), not padding.

Example:
  >>> from configs import lm_tiny
  >>> task = make_task(lm_tiny.get_config())
  >>> task.unit, task.record_template["tokens"].shape
  ('tokens', (65,))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from trainers.data.prepare.token_codec import TokenCodec, prompt_ids, token_codec
from trainers.models import decode
from trainers.models import transformer as lm
from trainers.tasks import Task, model_section
from trainers.tasks.lm_data import lm_data
from trainers.tasks.losses import chunked_cross_entropy_sums


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
      # Storage dtype of the parameters; what they compute in is
      # config.train.precision (trainers/step/precision.py).
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
  return model_section(lm.TransformerConfig, config)


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
    label_classes={"targets": model_config.vocab_size},
    flops_per_step=lm.flops_per_token(model_config) * config.global_batch * seq_len,
    report=report,
  )
