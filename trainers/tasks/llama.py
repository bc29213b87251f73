"""The Llama task (`config.task = "llama"`): `trainers.models.llama` on the LM task's data.

The data side is the LM task's own (`trainers.tasks.lm_data`): bytes or
subword tokens of the text corpus, or any prepared dataset with a `tokens`
feature, in windows of `seq_len + 1` tokens, packed with segment ids when
`config.data.pack` is set. The loss is next-token cross-entropy over
the unmasked targets; a batch of packed data that carries `segment_ids` and
`positions` has them passed to the model, so attention stays inside each
document and RoPE counts from each document's start. Tokens are the unit and
PaLM's model FLOPs give MFU; at the end, a greedy sample of
`config.sample_tokens` after `config.sample_prompt`, decoded with a KV cache. Its section, `config.model`, is
`LlamaConfig`'s fields plus nothing.

Example:
  >>> from configs import llama_tiny
  >>> task = make_task(llama_tiny.get_config())
  >>> task.unit, task.record_template["tokens"].shape
  ('tokens', (65,))
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import jax
import ml_collections
from flax import nnx

from trainers import paths
from trainers.hf import agreement
from trainers.hf import checkpoint as hf_checkpoint
from trainers.hf import model_config as hf_config
from trainers.models import llama, lora, moe
from trainers.tasks import Batch, Task, model_section
from trainers.tasks.lm import sample_report
from trainers.tasks.lm_data import lm_data
from trainers.tasks.losses import chunked_cross_entropy_sums

log = logging.getLogger(__name__)

# Batch features the model takes besides the tokens, when the data has them.
PACKING_FEATURES = ("segment_ids", "positions")


def default_model_config() -> ml_collections.ConfigDict:
  """The section `config.model` of the Llama task: `LlamaConfig`'s fields and defaults.

  All but `dtype`: what the model computes in is `config.train.precision`.
  """
  fields = dataclasses.asdict(llama.LlamaConfig())
  del fields["dtype"]
  return ml_collections.ConfigDict(fields)


def llama_config(config: ml_collections.ConfigDict) -> llama.LlamaConfig:
  """The model's sizes from `config.model`; a misspelt key is an error naming it.

  With `checkpoint.init_from` naming a Hugging Face folder, each field its
  config.json sets must agree (`trainers.hf.agreement.check_fields`): only
  the RoPE fields and a longer `seq_len` may differ, and only with
  `checkpoint.rope_override`, which logs what changed.

  Example:
    >>> from configs import hf
    >>> config = hf.get_config("tests/fixtures/hf/llama3")
    >>> config.model.seq_len, config.model.rope_theta = 1024, 2e6
    >>> llama_config(config)
    Traceback (most recent call last):
    ...
    ValueError: config.model disagrees with tests/fixtures/hf/llama3/config.json: rope_theta=2000000.0 but the folder's is 500000.0, seq_len=1024 but the folder's max_position_embeddings is 256 (configs/hf.py takes them from the folder); to train with other RoPE settings or longer than the folder was trained, set config.checkpoint.rope_override=True (docs/finetune.md)
    >>> config.checkpoint.rope_override = True
    >>> llama_config(config).rope_theta
    2000000.0
  """
  model = model_section(llama.LlamaConfig, config)
  checkpoint = config.get("checkpoint", {})
  init_from = checkpoint.get("init_from", "")
  if init_from and hf_checkpoint.is_hf_folder(paths.user_path(init_from)):
    hf = hf_config.read_config(paths.user_path(init_from))
    fields = dataclasses.asdict(model)
    changes = agreement.check_fields(fields, hf, init_from, checkpoint.get("rope_override", False))
    if changes:
      _log_rope_changes(init_from, tuple(changes))
  return model


@functools.cache
def _log_rope_changes(where: str, changes: tuple[str, ...]) -> None:
  # Once a process: the config check, the run and an export each build the
  # model's config, and one line says it.
  log.warning(
    "config.model changes the RoPE of %s (%s): %s",
    where,
    agreement.OPT_IN,
    ", ".join(changes),
  )


def next_token_loss(model, batch: Batch, rngs, train: bool):
  """Summed next-token cross-entropy over the unmasked targets, its weight, and accuracy.

  The logits are formed chunk by chunk with the output projection
  (`losses.chunked_cross_entropy_sums`): at a 128k vocabulary the whole
  batch's would be one of the step's largest buffers.

  A model with routed layers (`moe_experts`) adds its router statistics
  (`router_sums`); in training its auxiliary losses join the loss too.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> model = llama.Llama(llama.LlamaConfig(num_layers=1, d_model=16, num_heads=2,
    ...                                       num_kv_heads=1, d_ff=32), rngs=nnx.Rngs(0))
    >>> ones = jnp.ones((2, 4), jnp.int32)
    >>> batch = {"inputs": ones, "targets": ones, "mask": jnp.ones((2, 4)),
    ...          "segment_ids": ones, "positions": jnp.zeros((2, 4), jnp.int32)}
    >>> loss_sum, weight, sums = next_token_loss(model, batch, None, True)
    >>> float(weight), sorted(sums)
    (8.0, ['accuracy'])
  """
  del rngs  # no dropout, no batch statistics
  packing = {k: batch[k] for k in PACKING_FEATURES if k in batch}
  hidden, stats = model.hidden_states_and_stats(batch["inputs"], **packing)
  loss_sum, weight, sums = chunked_cross_entropy_sums(
    hidden, model.unembedding(), batch["targets"], batch["mask"]
  )
  if stats is None:
    return loss_sum, weight, sums
  aux_sum, moe_sums = router_sums(stats, model.config, weight)
  # Only the training loss: eval's loss stays the cross-entropy its perplexity is of.
  return (loss_sum + aux_sum if train else loss_sum), weight, {**sums, **moe_sums}


def router_sums(
  stats: moe.RouterStats, config: llama.LlamaConfig, weight: jax.Array | float
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The weighted auxiliary loss and the router's metric sums, each a mean times `weight`.

  The trainer divides every sum by the total weight (the counted targets)
  over micro-batches and devices, so a mean times its batch's weight comes
  out as the weighted mean over the batches: the training loss gains
  `moe_load_balancing_coef * balance + moe_z_loss_coef * z`, and the metrics
  are `moe_load_balancing_loss`, `moe_z_loss`, `moe_dropped` (the fraction
  of choices dropped: 0, dispatch is dropless) and `moe_expert_<i>_share`
  (the fraction of the tokens' choices expert i took, averaged over the
  routed layers; they sum to 1).

  Example:
    >>> import jax.numpy as jnp
    >>> from trainers.models.moe import RouterStats
    >>> stats = RouterStats(jnp.float32(1.5), jnp.float32(2.0), jnp.array([0.25, 0.75]),
    ...                     jnp.float32(0.0))
    >>> config = llama.LlamaConfig(moe_experts=2, moe_load_balancing_coef=0.1,
    ...                            moe_z_loss_coef=0.01)
    >>> aux, sums = router_sums(stats, config, weight=4.0)
    >>> round(float(aux), 6), float(sums["moe_expert_1_share"])
    (0.68, 3.0)
  """
  aux = (
    config.moe_load_balancing_coef * stats.load_balancing_loss
    + config.moe_z_loss_coef * stats.z_loss
  )
  sums = {
    "moe_load_balancing_loss": stats.load_balancing_loss * weight,
    "moe_z_loss": stats.z_loss * weight,
    "moe_dropped": stats.dropped * weight,
  }
  for i in range(stats.expert_share.shape[0]):
    sums[f"moe_expert_{i}_share"] = stats.expert_share[i] * weight
  return aux * weight, sums


def _adapter_params(config: ml_collections.ConfigDict, model_config) -> int | None:
  """With `config.lora`: the adapters' parameter count (their shapes only), else None."""
  settings = lora.settings_from_config(config.get("lora"))
  if settings is None:
    return None
  abstract = nnx.eval_shape(lambda: llama.Llama(model_config, rngs=nnx.Rngs(0)))
  adapters = lora.find_adapters(abstract, settings)
  return sum(math.prod(a.a_shape) + math.prod(a.b_shape) for a in adapters)


def make_task(config: ml_collections.ConfigDict) -> Task:
  """The Llama task for `config` (sizes from `config.model`, data as the LM task's)."""
  model_config = llama_config(config)
  seq_len = model_config.seq_len
  sample_tokens = config.get("sample_tokens", 0)
  prompt = config.get("sample_prompt", "def ") if sample_tokens else None
  data = lm_data(config, seq_len, model_config.vocab_size, prompt)
  report = None
  if sample_tokens:
    report = sample_report(model_config, sample_tokens, prompt, codec=data.codec)
  return Task(
    model=lambda rngs: llama.Llama(model_config, rngs=rngs),
    loss=next_token_loss,
    **data.fields,
    label_classes={"targets": model_config.vocab_size},
    flops_per_step=llama.flops_per_token(model_config, _adapter_params(config, model_config))
    * config.global_batch
    * seq_len,
    report=report,
  )
