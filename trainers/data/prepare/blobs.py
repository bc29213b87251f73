"""`blobs`: a generated classification dataset, for the MLP path without downloads.

Ten classes, each a Gaussian cloud around its own centre in 16 dimensions,
generated from a fixed seed, so every machine builds the same records:

  features  float32[16]
  label     int64 in [0, 10)

Written as ArrayRecord by TFDS and read back through `tfds.data_source` like
any prepared dataset. The clouds overlap, so accuracy rises from 10% to about
90% as an MLP learns, rather than jumping to 100% at once.

  >>> import tempfile
  >>> name = prepare_blobs(tempfile.mkdtemp())  # doctest: +ELLIPSIS
  Downloading and preparing dataset ...
  >>> name
  'blobs:1.0.0'
"""

from __future__ import annotations

import os
from typing import ClassVar

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from trainers.data.prepare import preparation_lock

NUM_FEATURES = 16
NUM_CLASSES = 10
SPLIT_SIZES = {"train": 8192, "test": 1024}
_SEED = 20261130


def _points(split: str) -> tuple[np.ndarray, np.ndarray]:
  # Centres ~N(0, 0.8^2) with unit noise: the clouds overlap (an MLP reaches ~90%).
  centres = np.random.default_rng(_SEED).normal(0.0, 0.8, (NUM_CLASSES, NUM_FEATURES))
  rng = np.random.default_rng(_SEED + (1 if split == "train" else 2))
  labels = rng.integers(0, NUM_CLASSES, SPLIT_SIZES[split])
  features = centres[labels] + rng.normal(0.0, 1.0, (len(labels), NUM_FEATURES))
  return features.astype(np.float32), labels


class Blobs(tfds.core.GeneratorBasedBuilder):
  """Gaussian blobs: 10 classes in 16 dimensions, generated, no download."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "Generated from a fixed seed."}

  def __init__(self, **kwargs):
    kwargs.setdefault("file_format", tfds.core.FileFormat.ARRAY_RECORD)
    super().__init__(**kwargs)

  # tfds finds a package module's files through importlib_resources; say it directly.
  code_path = epath.Path(__file__)

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
      builder=self,
      description=__doc__.splitlines()[0],
      features=tfds.features.FeaturesDict(
        {
          "features": tfds.features.Tensor(shape=(NUM_FEATURES,), dtype=np.float32),
          "label": tfds.features.ClassLabel(num_classes=NUM_CLASSES),
        }
      ),
      supervised_keys=("features", "label"),
    )

  def _split_generators(self, dl_manager):
    return {split: self._generate_examples(split) for split in SPLIT_SIZES}

  def _generate_examples(self, split: str):
    features, labels = _points(split)
    for i, (x, y) in enumerate(zip(features, labels)):
      yield i, {"features": x, "label": int(y)}


def prepare_blobs(data_dir: str | os.PathLike) -> str:
  """Builds `blobs` in `data_dir` unless it is there; returns the name to open."""
  builder = Blobs(data_dir=os.fspath(data_dir))
  preparation_lock.prepare_builder(
    builder,
    tfds.download.DownloadConfig(
      try_download_gcs=False, download_mode=tfds.download.GenerateMode.REUSE_DATASET_IF_EXISTS
    ),
  )
  return f"{builder.name}:{builder.version}"


def classification_example(record: dict) -> dict[str, np.ndarray]:
  """Record -> `inputs` (features), `targets` (label) and `mask` (1: counts)."""
  return {
    "inputs": np.asarray(record["features"], np.float32),
    "targets": np.asarray(record["label"], np.int32),
    "mask": np.ones((), np.float32),
  }
