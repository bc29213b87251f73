"""A classifier with model state of both kinds, for the warm-start tests: small and quick.

The model is an MLP on the generated `blobs` data with a BatchNorm (its
running statistics are `nnx.BatchStat`s) and a variable of its own, `calls`,
counting the training calls the model has seen. So a run's `model_state`
tells whether it was carried: after a warm start from a run of N steps and
k more steps, `calls` is N + k (k if it was dropped). `model.bn_momentum=1.0`
keeps the running statistics as they are (1.0 x old + 0.0 x the batch's), so a
run can check that they are exactly the ones it started from.

  spmd-train --config=tests/configs/stateful_classifier.py --workdir=/tmp/run \\
      --config.data.dir=DATA

Example:
  >>> config = get_config()
  >>> task = make_task(config)
  >>> model = task.model(nnx.Rngs(0))
  >>> sorted(type(v).__name__ for v in jax.tree.leaves(
  ...   nnx.state(model, nnx.Not(nnx.Param)), is_leaf=lambda x: isinstance(x, nnx.Variable)))
  ['BatchStat', 'BatchStat', 'Calls']
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from configs import default
from tests import injection
from trainers.data.prepare.blobs import (
  NUM_CLASSES,
  NUM_FEATURES,
  classification_example,
  prepare_blobs,
)
from trainers.tasks import Task, config_section, cross_entropy_sums


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The task's section, `config.model`."""

  hidden: int = 32
  bn_momentum: float = 0.9


class Calls(nnx.Variable):
  """The model's own variable: training calls seen (neither a parameter nor a statistic)."""


class StatefulMLP(nnx.Module):
  """Linear, BatchNorm, ReLU, Linear; `calls` counts the calls in training mode."""

  def __init__(self, sizes: ModelConfig, *, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(NUM_FEATURES, sizes.hidden, rngs=rngs)
    self.norm = nnx.BatchNorm(sizes.hidden, momentum=sizes.bn_momentum, rngs=rngs)
    self.out = nnx.Linear(sizes.hidden, NUM_CLASSES, rngs=rngs)
    self.calls = Calls(jnp.zeros((), jnp.int32))

  def __call__(self, x: jax.Array) -> jax.Array:
    if not self.norm.use_running_average:  # training mode (the trainer's `model.train()`)
      self.calls.value = self.calls.value + 1
    return self.out(jax.nn.relu(self.norm(self.hidden(x))))


def loss(model, batch, rngs, train):
  del rngs, train
  return cross_entropy_sums(model(batch["inputs"]), batch["targets"], batch["mask"])


def make_task(config: ml_collections.ConfigDict) -> Task:
  sizes = config_section(ModelConfig, config.model)
  return Task(
    model=lambda rngs: StatefulMLP(sizes, rngs=rngs),
    loss=loss,
    prepare_data=prepare_blobs,
    record_template={"features": np.zeros(NUM_FEATURES, np.float32), "label": 0},
    to_example=classification_example,
    unit="examples",
  )


def get_config() -> ml_collections.ConfigDict:
  config = default.get_config()
  config.task = "tests.configs.stateful_classifier:make_task"
  config.model = ml_collections.ConfigDict(dataclasses.asdict(ModelConfig()))
  config.data.name = "blobs"
  config.data.eval_split = "test"
  config.global_batch = 32
  config.train.steps = 10
  config.train.learning_rate = 1e-2
  config.train.warmup_steps = 2
  config.log_every = 1
  config.eval_every = 0
  config.eval_batches = 2
  config.checkpoint.every = 5
  config.sample_tokens = 0
  config.transfer_guard = "disallow"  # any implicit transfer in the loop is an error
  return injection.add_to(config)  # fault injection (tests/injection.py), off
