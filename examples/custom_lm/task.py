"""Your own language model as a harness task: model, loss, optimizer and a hook.

`spmd-train` calls `make_task(config)` (named by `config.task` in config.py).
The model is `model.DecoderLM`; the data is the built-in LM task's (the
embedded `text_corpus` by default, or any prepared TFDS dataset with a
`tokens` feature, cut into next-token windows by `trainers.data.read.pipeline`),
so nothing here reads files. What this task adds of its own:

  loss       cross-entropy plus z-loss, `z_loss_weight * logsumexp(logits)**2`,
             which keeps the softmax normaliser near 1 (PaLM); `z_loss` and
             `accuracy` are reported beside `loss`
  optimizer  lion with its own weight-decay mask (`Task.optimizer`)
  hook       the parameters' global norm every `norm_every` steps, logged on
             every process and appended to `<workdir>/param_norm.jsonl` by process 0

  >>> import config as custom_config
  >>> task = make_task(custom_config.get_config())
  >>> task.unit, task.example_shapes()["inputs"]
  ('tokens', ((128,), dtype('int32')))
"""

from __future__ import annotations

import dataclasses
import json
import logging

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from trainers.data.read import lm_examples
from trainers.hooks import Hook, StepInfo
from trainers.step import optim
from trainers.tasks import Task, config_section, lm_data

import model as model_lib


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The task's section, `config.model`."""

  seq_len: int = 128
  num_layers: int = 2
  d_model: int = 128
  num_heads: int = 4
  d_ff: int = 384
  vocab_size: int = 256  # bytes
  rotary: bool = True
  tie_embeddings: bool = True
  z_loss_weight: float = 1e-4
  norm_every: int = 50  # the parameter-norm hook's interval (0 = never)


def z_loss_sums(z_loss_weight: float):
  """The task's loss: summed cross-entropy + z-loss over the unmasked targets."""

  def loss(model, batch, rngs, train):
    del rngs, train  # no dropout, no batch statistics
    logits = model(batch["inputs"])
    mask = batch["mask"]
    log_z = jax.nn.logsumexp(logits, axis=-1)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    z = z_loss_weight * jnp.square(log_z)
    correct = (jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32)
    # Sums and their weight: the trainer divides after adding up hosts and micro-batches.
    sums = {"z_loss": jnp.sum(z * mask), "accuracy": jnp.sum(correct * mask)}
    return jnp.sum((ce + z) * mask), jnp.sum(mask), sums

  return loss


# Unlike the harness's default mask, the embedding is decayed: tied, it is
# also the output layer. Norm scales are not.
NO_DECAY = (r"(^|/)scale$", r"norm")


def lion_optimizer(train: ml_collections.ConfigDict, schedule: optax.Schedule):
  """`Task.optimizer`: lion on the config's schedule, decay masked by `NO_DECAY`.

  The trainer still clips gradients first and logs `schedule` as the learning rate.
  """
  mask = lambda params: optim.decay_mask(params, NO_DECAY)  # noqa: E731
  return optax.lion(schedule, b1=train.b1, b2=train.b2, weight_decay=train.weight_decay, mask=mask)


def param_norm_hook(every: int) -> Hook:
  """Logs the parameters' global norm; process 0 also appends it to param_norm.jsonl."""

  def log_norm(info: StepInfo) -> None:
    # A collective over every host's shards (every process runs the hook at the
    # same steps), its result replicated so each process reads it locally, and
    # fetched explicitly: the loop may forbid implicit transfers.
    replicated = jax.sharding.NamedSharding(info.mesh, jax.sharding.PartitionSpec())
    norm = jax.jit(optax.global_norm, out_shardings=replicated)(info.state["params"])
    norm = float(jax.device_get(norm))
    process = jax.process_index()
    # WARNING: shown at the default verbosity, on every process.
    logging.warning("param_norm process=%d step=%d norm=%.4f", process, info.step, norm)
    if process == 0:
      with (info.workdir / "param_norm.jsonl").open("a") as f:
        f.write(json.dumps({"step": info.step, "param_norm": norm}) + "\n")

  return Hook(log_norm, every=every, name="param_norm")


def make_task(config: ml_collections.ConfigDict) -> Task:
  sizes = config_section(ModelConfig, config.model)
  seq_len = sizes.seq_len
  return Task(
    model=lambda rngs: model_lib.DecoderLM(
      sizes.vocab_size,
      sizes.d_model,
      sizes.num_layers,
      sizes.num_heads,
      sizes.d_ff,
      rotary=sizes.rotary,
      tie_embeddings=sizes.tie_embeddings,
      rngs=rngs,
    ),
    loss=z_loss_sums(sizes.z_loss_weight),
    # The built-in LM task's data, as it is: the corpus (or config.data.name),
    # every record cut into windows of seq_len + 1 tokens (inputs and shifted
    # targets; what a window lacks is masked).
    prepare_data=lm_data.prepare_data(config),
    record_template={"tokens": np.zeros(seq_len + 1, np.int32)},
    to_example=lm_examples.lm_example(seq_len),
    to_batch=lm_examples.lm_batch(seq_len),
    plan_records=lm_data.lm_records(config, seq_len),
    unit="tokens",
    optimizer=lion_optimizer,
    hooks=[param_norm_hook(sizes.norm_every)] if sizes.norm_every else [],
  )
