"""`shapes`: generated 16x16 grayscale images of six simple shapes, no download.

Each image holds one shape, drawn at a random place and size with a random
line thickness, contrast, background level and Gaussian pixel noise, all from a
fixed seed, so every machine builds the same records:

  image  uint8[16, 16, 1]
  label  int64 in [0, 6): horizontal_bar, vertical_bar, square_outline,
         filled_square, cross, diagonal

Written as ArrayRecord by TFDS and read back through `tfds.data_source` like any
prepared dataset; neither writing nor reading needs TensorFlow. The noise makes
faint, small or thick-lined shapes ambiguous (a thick outline of a small square
is nearly a filled square), so a small CNN takes a few hundred steps to pass 90%
rather than being right at once, and stays short of 100%.

  >>> import tempfile
  >>> data_dir = tempfile.mkdtemp()
  >>> name = prepare_shapes(data_dir)  # doctest: +ELLIPSIS
  Downloading and preparing dataset ...
  >>> name
  'shapes:1.0.0'
  >>> example = to_example(tfds.data_source(name, split="test", data_dir=data_dir)[0])
  >>> example["image"].shape, example["image"].dtype, example["label"].dtype
  ((16, 16, 1), dtype('float32'), dtype('int32'))
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

IMAGE_SIZE = 16
CLASS_NAMES = (
  "horizontal_bar",
  "vertical_bar",
  "square_outline",
  "filled_square",
  "cross",
  "diagonal",
)
NUM_CLASSES = len(CLASS_NAMES)
SPLIT_SIZES = {"train": 12_000, "test": 2_000}
_SEED = 20261203


def draw(split: str) -> tuple[np.ndarray, np.ndarray]:
  """The images (uint8 [N, 16, 16, 1]) and labels (int64 [N]) of one split.

  All images of a split are drawn at once with array operations, so a split
  takes milliseconds; the same split gives the same arrays on every call.

  >>> images, labels = draw("test")
  >>> images.shape, images.dtype, labels.shape
  ((2000, 16, 16, 1), dtype('uint8'), (2000,))
  >>> bool(np.array_equal(images, draw("test")[0]))
  True
  """
  if split not in SPLIT_SIZES:
    raise ValueError(f"split={split!r}: expected one of {sorted(SPLIT_SIZES)}")
  n = SPLIT_SIZES[split]
  # A seed of its own per split: the test images are not a prefix of the train images.
  rng = np.random.default_rng([_SEED, list(SPLIT_SIZES).index(split)])
  labels = rng.integers(0, NUM_CLASSES, n)
  side = rng.integers(5, 12, n)  # the shape's bounding box is side x side pixels
  top = rng.integers(0, IMAGE_SIZE - side + 1)
  left = rng.integers(0, IMAGE_SIZE - side + 1)
  width = rng.integers(1, 3, n)  # line thickness
  mirrored = rng.integers(0, 2, n).astype(bool)  # the diagonal runs either way

  # Per image (leading axis) coordinates relative to the bounding box.
  y = np.arange(IMAGE_SIZE)[None, :, None] - top[:, None, None]
  x = np.arange(IMAGE_SIZE)[None, None, :] - left[:, None, None]
  s, w = side[:, None, None], width[:, None, None]
  inside = (y >= 0) & (y < s) & (x >= 0) & (x < s)
  middle = (s - w) // 2
  across = (y >= middle) & (y < middle + w)
  down = (x >= middle) & (x < middle + w)
  hole = (y >= w) & (y < s - w) & (x >= w) & (x < s - w)
  diagonal = np.abs(np.where(mirrored[:, None, None], s - 1 - x, x) - y) < w
  masks = np.stack(
    [
      inside & across,
      inside & down,
      inside & ~hole,
      inside,
      inside & (across | down),
      inside & diagonal,
    ]
  )[labels, np.arange(n)]

  background = rng.uniform(0.0, 0.4, (n, 1, 1))
  contrast = rng.uniform(0.45, 0.95, (n, 1, 1))
  noise = rng.normal(0.0, 0.2, (n, IMAGE_SIZE, IMAGE_SIZE))
  pixels = np.clip(background + contrast * masks + noise, 0.0, 1.0)
  images = np.round(pixels * 255).astype(np.uint8)[..., None]
  return images, labels


# skip_registration: tfds registers a builder class by name when the class is
# defined and refuses a second class of the same name, so importing this file
# under two module names would fail. `tfds.data_source` opens the prepared
# files by name without the registry.
class Shapes(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Six shapes on noisy 16x16 grayscale images, generated, no download."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "Generated from a fixed seed."}

  def __init__(self, **kwargs: Any):
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
          # Tensor, not Image: Image encodes arrays to PNG through TensorFlow.
          "image": tfds.features.Tensor(shape=(IMAGE_SIZE, IMAGE_SIZE, 1), dtype=np.uint8),
          "label": tfds.features.ClassLabel(names=CLASS_NAMES),
        }
      ),
      supervised_keys=("image", "label"),
    )

  def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict[str, Iterator]:
    return {split: self._generate_examples(split) for split in SPLIT_SIZES}

  def _generate_examples(self, split: str) -> Iterator[tuple[int, dict[str, Any]]]:
    images, labels = draw(split)
    for i, (image, label) in enumerate(zip(images, labels)):
      yield i, {"image": image, "label": int(label)}


def prepare_shapes(data_dir: str | os.PathLike) -> str:
  """Builds `shapes` in `data_dir` unless it is there; returns the name to open.

  >>> import tempfile
  >>> prepare_shapes(tempfile.mkdtemp())  # doctest: +ELLIPSIS
  Downloading and preparing dataset ...
  'shapes:1.0.0'
  """
  builder = Shapes(data_dir=os.fspath(data_dir))
  builder.download_and_prepare(
    download_config=tfds.download.DownloadConfig(
      try_download_gcs=False, download_mode=tfds.download.GenerateMode.REUSE_DATASET_IF_EXISTS
    )
  )
  return f"{builder.name}:{builder.version}"


def to_example(record: Mapping[str, Any]) -> dict[str, np.ndarray]:
  """Record -> `image` (float32 [16, 16, 1] in [0, 1]), `label` (int32) and `mask` (1: counts).

  >>> example = to_example({"image": np.full((16, 16, 1), 255, np.uint8), "label": 4})
  >>> float(example["image"].max()), int(example["label"]), float(example["mask"])
  (1.0, 4, 1.0)
  """
  return {
    "image": np.asarray(record["image"], np.float32) / 255.0,
    "label": np.asarray(record["label"], np.int32),
    "mask": np.ones((), np.float32),
  }
