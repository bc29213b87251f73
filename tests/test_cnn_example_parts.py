"""The parts of examples/cnn_classifier on their own: the `shapes` dataset and the CNN.

The example is meant to be copied out of the checkout, so its modules import
each other by plain name; these tests put its folder on sys.path the same way
and take it off again afterwards.
"""

import importlib
import importlib.util
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tensorflow_datasets as tfds
from flax import nnx

EXAMPLE_DIR = pathlib.Path(__file__).resolve().parent.parent / "examples" / "cnn_classifier"
EXAMPLE_MODULES = ("shapes_dataset", "cnn")


@pytest.fixture(scope="module")
def example():
  """The example's modules, imported by plain name from its folder."""
  previous = {name: sys.modules.pop(name, None) for name in EXAMPLE_MODULES}
  sys.path.insert(0, str(EXAMPLE_DIR))
  try:
    yield {name: importlib.import_module(name) for name in EXAMPLE_MODULES}
  finally:
    sys.path.remove(str(EXAMPLE_DIR))
    for name, module in previous.items():
      sys.modules.pop(name, None)
      if module is not None:
        sys.modules[name] = module


@pytest.fixture(scope="module")
def shapes(example, tmp_path_factory):
  """(module, dataset name, data dir) of `shapes` built once for this module."""
  data_dir = str(tmp_path_factory.mktemp("shapes_data"))
  module = example["shapes_dataset"]
  return module, module.prepare_shapes(data_dir), data_dir


def _read(name, split, data_dir, count=None):
  source = tfds.data_source(name, split=split, data_dir=data_dir)
  return source, source.__getitems__(list(range(count or len(source))))


def test_shapes_reads_back_with_counts_dtypes_and_labels(shapes):
  module, name, data_dir = shapes
  assert name == "shapes:1.0.0"
  for split, size in (("train", 12_000), ("test", 2_000)):
    source, records = _read(name, split, data_dir)
    assert len(source) == size
    images = np.stack([r["image"] for r in records])
    labels = np.array([r["label"] for r in records])
    assert images.shape == (size, 16, 16, 1) and images.dtype == np.uint8
    assert labels.min() == 0 and labels.max() == module.NUM_CLASSES - 1
    # Every class is common: no class is missing from a split or drowned by the others.
    assert np.bincount(labels).min() > size / module.NUM_CLASSES / 2
  example = module.to_example(records[0])
  assert example["image"].shape == (16, 16, 1) and example["image"].dtype == np.float32
  assert 0.0 <= example["image"].min() <= example["image"].max() <= 1.0
  assert example["label"].dtype == np.int32 and example["label"].shape == ()
  assert example["mask"].dtype == np.float32 and example["mask"] == 1.0
  # Neither writing nor reading brought in TensorFlow (where it is installed at all).
  assert "tensorflow" not in sys.modules


def test_shapes_builds_are_deterministic_and_reused(shapes, tmp_path):
  module, name, data_dir = shapes
  assert module.prepare_shapes(tmp_path) == name
  for split in ("train", "test"):
    _, (first, *_) = _read(name, split, data_dir, count=1)
    _, (again, *_) = _read(name, split, str(tmp_path), count=1)
    np.testing.assert_array_equal(first["image"], again["image"])
    assert first["label"] == again["label"]
  written = (tmp_path / "shapes" / "1.0.0" / "dataset_info.json").stat().st_mtime_ns
  module.prepare_shapes(tmp_path)
  assert (tmp_path / "shapes" / "1.0.0" / "dataset_info.json").stat().st_mtime_ns == written


def test_shapes_module_imports_under_a_second_name(example):
  # A builder class that registered its name would refuse to be defined twice.
  spec = importlib.util.spec_from_file_location(
    "copied_shapes_dataset", EXAMPLE_DIR / "shapes_dataset.py"
  )
  copy = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(copy)
  assert copy.Shapes.name == example["shapes_dataset"].Shapes.name == "shapes"


def test_shapes_draw_rejects_an_unknown_split(example):
  with pytest.raises(ValueError, match="split='validation'"):
    example["shapes_dataset"].draw("validation")


def _variables(model):
  return jax.tree.leaves(nnx.state(model), is_leaf=lambda x: isinstance(x, nnx.Variable))


@pytest.mark.slow
def test_cnn_holds_only_params_and_batch_stats(example):
  model = example["cnn"].CNN(6, rngs=nnx.Rngs(0))
  assert {type(v) for v in _variables(model)} == {nnx.Param, nnx.BatchStat}
  logits = model(jnp.zeros((4, 16, 16, 1)), rngs=nnx.Rngs(dropout=0))
  assert logits.shape == (4, 6) and logits.dtype == jnp.float32


@pytest.mark.slow
def test_cnn_modes_switch_dropout_and_batch_stats(example):
  model = example["cnn"].CNN(6, dropout_rate=0.5, rngs=nnx.Rngs(0))
  images = jax.random.uniform(jax.random.key(1), (8, 16, 16, 1))

  model.eval()
  stats = jax.tree.map(np.asarray, nnx.state(model, nnx.BatchStat))
  first, second = model(images), model(images, rngs=nnx.Rngs(dropout=1))
  np.testing.assert_array_equal(first, second)
  jax.tree.map(np.testing.assert_array_equal, nnx.state(model, nnx.BatchStat), stats)

  model.train()
  first = model(images, rngs=nnx.Rngs(dropout=1))
  second = model(images, rngs=nnx.Rngs(dropout=2))
  assert not np.allclose(first, second)  # fresh dropout masks
  changed = jax.tree.map(
    lambda new, old: not np.allclose(new, old), nnx.state(model, nnx.BatchStat), stats
  )
  assert all(jax.tree.leaves(changed))


@pytest.mark.parametrize(
  ("kwargs", "message"),
  [
    ({"num_classes": 0}, "num_classes=0"),
    ({"num_classes": 6, "features": ()}, r"features=\(\)"),
    ({"num_classes": 6, "dropout_rate": 1.0}, "dropout_rate=1.0"),
    ({"num_classes": 6, "in_channels": 0}, "in_channels=0"),
  ],
)
def test_cnn_rejects_bad_arguments_by_name(example, kwargs, message):
  with pytest.raises(ValueError, match=message):
    example["cnn"].CNN(**kwargs, rngs=nnx.Rngs(0))


def _arrays(module, name, split, data_dir):
  _, records = _read(name, split, data_dir)
  examples = [module.to_example(r) for r in records]
  return np.stack([e["image"] for e in examples]), np.stack([e["label"] for e in examples])


@pytest.mark.slow
def test_cnn_learns_shapes_with_plain_adam(example, shapes):
  """The data is learnable: a bare adam loop on one device passes 80% on the test split."""
  module, name, data_dir = shapes
  start = time.perf_counter()
  train_images, train_labels = _arrays(module, name, "train", data_dir)
  test_images, test_labels = _arrays(module, name, "test", data_dir)
  model = example["cnn"].CNN(module.NUM_CLASSES, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, images, labels, key):
    def loss_fn(model):
      logits = model(images, rngs=nnx.Rngs(dropout=key))
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  @nnx.jit
  def predict(model, images):
    return jnp.argmax(model(images), axis=-1)

  rng = np.random.default_rng(0)
  # 300 rather than 150 steps: at 150 the test accuracy still swings by a few
  # points from step to step, too close to the bar; the extra steps are cheap.
  steps, batch = 300, 64
  for key in jax.random.split(jax.random.key(0), steps):
    rows = rng.integers(0, len(train_labels), batch)
    loss = train_step(model, optimizer, train_images[rows], train_labels[rows], key)
  model.eval()
  accuracy = float(np.mean(np.asarray(predict(model, test_images)) == test_labels))
  seconds = time.perf_counter() - start
  print(f"shapes: {steps} steps of {batch}, loss {float(loss):.3f}, ", end="")
  print(f"test accuracy {accuracy:.3f}, {seconds:.1f} s")
  assert accuracy > 0.8
