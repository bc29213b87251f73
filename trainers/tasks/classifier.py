"""The built-in classifier task (`config.task = "classifier"`), through the public Task API.

An MLP (`trainers.models.mlp`) on the generated `blobs` dataset (or any
prepared TFDS dataset with `features` and `label`): cross-entropy,
accuracy, examples as the unit, 6 FLOPs per parameter and example. Its
section, `config.model`, is `MLPConfig`'s fields.

Example:
  >>> from configs import mlp
  >>> task = make_task(mlp.get_config())
  >>> task.unit, task.flops_per_step == 6.0 * param_count(classifier_config(mlp.get_config())) * 128
  ('examples', True)
"""

from __future__ import annotations

import itertools

import ml_collections
import numpy as np

from trainers.data.prepare.blobs import classification_example, prepare_blobs
from trainers.models import mlp
from trainers.tasks import Task, cross_entropy_sums, model_section


def default_model_config() -> ml_collections.ConfigDict:
  """The section `config.model` of the classifier task: `MLPConfig`'s fields."""
  return ml_collections.ConfigDict(
    {
      "input_dim": 16,
      "hidden_sizes": (256, 256),
      "num_classes": 10,
      "param_dtype": "float32",  # storage; compute is config.train.precision
    }
  )


def classifier_config(config: ml_collections.ConfigDict) -> mlp.MLPConfig:
  return model_section(mlp.MLPConfig, config)


def param_count(model_config: mlp.MLPConfig) -> int:
  sizes = (model_config.input_dim, *model_config.hidden_sizes, model_config.num_classes)
  return sum(a * b + b for a, b in itertools.pairwise(sizes))


def classification_loss(model, batch, rngs, train):
  """Summed cross-entropy over the real examples, their count, and the correct ones."""
  del rngs, train
  return cross_entropy_sums(model(batch["inputs"]), batch["targets"], batch["mask"])


def _prepare(config: ml_collections.ConfigDict):
  name = config.data.name
  if name == "blobs":
    return prepare_blobs
  return lambda data_dir: name  # any TFDS dataset already prepared in data_dir


def make_task(config: ml_collections.ConfigDict) -> Task:
  """The classifier task for `config` (sizes from `config.model`)."""
  model_config = classifier_config(config)
  return Task(
    model=lambda rngs: mlp.MLPClassifier(model_config, rngs=rngs),
    loss=classification_loss,
    prepare_data=_prepare(config),
    record_template={"features": np.zeros(model_config.input_dim, np.float32), "label": 0},
    to_example=classification_example,
    label_classes={"targets": model_config.num_classes},
    unit="examples",
    flops_per_step=6.0 * param_count(model_config) * config.global_batch,
  )
