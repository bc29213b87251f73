"""The CNN example's task: its model, its data, its loss, through the public Task API.

`spmd-train` calls `make_task(config)` (named by `config.task` in config.py)
and gets everything it needs to train across hosts: the model (`cnn.CNN`,
with BatchNorm statistics and dropout, carried and seeded by the trainer),
the `shapes` dataset this folder generates, and the loss as sums with their
weight, so means stay exact across hosts and micro-batches.

  >>> import config as cnn_config
  >>> task = make_task(cnn_config.get_config())
  >>> task.unit, task.example_shapes()["image"]
  ('images', ((16, 16, 1), dtype('float32')))
"""

from __future__ import annotations

import dataclasses

import ml_collections
import numpy as np

from trainers.tasks import Task, config_section, cross_entropy_sums

import cnn
import shapes_dataset


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The task's section, `config.model`."""

  num_classes: int = shapes_dataset.NUM_CLASSES
  features: tuple[int, ...] = (16, 32, 64)
  dropout_rate: float = 0.1


def loss(model, batch, rngs, train):
  """Summed cross-entropy of the real images, their count, and the correct ones."""
  del train  # the trainer has already put the model in train or eval mode
  logits = model(batch["image"], rngs=rngs)  # rngs: this step's dropout keys
  return cross_entropy_sums(logits, batch["label"], batch["mask"])


def make_task(config: ml_collections.ConfigDict) -> Task:
  sizes = config_section(ModelConfig, config.model)
  size = shapes_dataset.IMAGE_SIZE
  return Task(
    model=lambda rngs: cnn.CNN(
      sizes.num_classes, tuple(sizes.features), sizes.dropout_rate, rngs=rngs
    ),
    loss=loss,
    prepare_data=shapes_dataset.prepare_shapes,
    record_template={"image": np.zeros((size, size, 1), np.uint8), "label": 0},
    to_example=shapes_dataset.to_example,
    unit="images",
  )
