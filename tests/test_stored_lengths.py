"""Unpacked LM data keeps its records' lengths beside its index: a host opens it
without reading the records, into the same windows and batches as a scan of them."""

import logging
import os
import pathlib
import re
import shutil

import numpy as np
import pytest
import tensorflow_datasets as tfds
from array_record.python import array_record_module

from spmd.mesh import create_mesh
from tests.configs import train_tiny
from tests.data_fixtures import write_text_files
from tests.test_pretokenized_lm import PretokenizedLm
from trainers.data.prepare import text_corpus
from trainers.data.read import pipeline
from trainers.data.records import datasets, stored_lengths
from trainers.data.records import plan as records
from trainers.tasks import make_task


def corpus_config(source: pathlib.Path):
  config = train_tiny.get_config()
  config.data.name = "text_corpus"
  config.data.source = str(source / "*.txt")
  config.data.pack = False
  config.data.tokenizer = "bytes"
  return config


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """(config, name, data dir) of a text corpus prepared by the LM task, as a run prepares it."""
  root = tmp_path_factory.mktemp("stored_lengths")
  config = corpus_config(write_text_files(root, count=24))
  data_dir = str(root / "data")
  return config, make_task(config).prepare_data(data_dir), data_dir


def open_train(config, name, data_dir):
  """The train split's batches, opened as `trainers.run.data` opens them."""
  task = make_task(config)
  return pipeline.open_global_batches(
    name,
    "train",
    data_dir,
    task.to_example,
    config.global_batch,
    create_mesh("data=-1"),
    seed=3,
    plan_records=task.plan_records,
    features=tuple(task.record_template),
    shuffle_block=5,
    to_batch=task.to_batch,
  )


def version_dir(name, data_dir):
  return datasets.open_source(name, "train", data_dir).info.data_dir


def spoil_records_after_the_first(folder):
  """Rewrites every shard with as many records, all but its first unreadable garbage.

  The reader still opens each shard and finds the count the index promises,
  but decoding any other record fails. A stream reads one record to learn
  what an example looks like; anything more is a read of the payloads.
  """
  for shard in sorted(pathlib.Path(folder).glob("*.array_record-*")):
    reader = array_record_module.ArrayRecordReader(str(shard))
    count, first = reader.num_records(), reader.read(0, 1)[0]
    reader.close()
    writer = array_record_module.ArrayRecordWriter(str(shard), "group_size:1")
    for i in range(count):
      writer.write(first if i == 0 else b"not a record")
    writer.close()


def test_a_prepared_corpus_opens_without_reading_its_records(corpus, tmp_path):
  config, name, data_dir = corpus
  intact = open_train(config, name, data_dir)
  spoiled = shutil.copytree(data_dir, tmp_path / "data")
  folder = version_dir(name, spoiled)
  spoil_records_after_the_first(folder)

  opened = open_train(config, name, str(spoiled))
  assert opened.usage() == intact.usage() and opened.fingerprint == intact.fingerprint
  assert opened.plan == intact.plan
  # The payloads really are unreadable: the first batch reads them.
  with pytest.raises(ValueError, match="could not read record"):
    opened.host_batch(0)
  # Without the kept lengths, opening reads every record (a dataset
  # prepared before they were kept), and so fails here.
  os.remove(stored_lengths.lengths_path(folder, "train", "tokens"))
  with pytest.raises(ValueError, match="could not read record"):
    open_train(config, name, str(spoiled))


def test_preparing_leaves_a_bad_shard_to_the_open_that_every_host_does(corpus, tmp_path, caplog):
  """Process 0 prepares alone while the others wait: an error there would reach no other host."""
  config, name, data_dir = corpus
  spoiled = shutil.copytree(data_dir, tmp_path / "data")
  folder = version_dir(name, spoiled)
  spoil_records_after_the_first(folder)
  os.remove(stored_lengths.lengths_path(folder, "train", "tokens"))
  with caplog.at_level(logging.WARNING, logger=datasets.__name__):
    assert make_task(config).prepare_data(str(spoiled)) == name
  assert f"cannot keep the record lengths of {name.replace(':', '/')}" in caplog.text
  assert not os.path.exists(stored_lengths.lengths_path(folder, "train", "tokens"))
  with pytest.raises(ValueError, match="could not read record"):
    open_train(config, name, str(spoiled))


def test_kept_lengths_give_the_windows_and_batches_a_scan_gives(corpus, tmp_path, caplog):
  config, name, data_dir = corpus
  kept = open_train(config, name, data_dir)
  old = shutil.copytree(data_dir, tmp_path / "data")  # as prepared before lengths were kept
  folder = version_dir(name, old)
  for split in ("train", "validation"):
    os.remove(stored_lengths.lengths_path(folder, split, "tokens"))
  with caplog.at_level(logging.WARNING, logger=records.__name__):
    scanned = open_train(config, name, str(old))
  assert "keeps no lengths of its 'tokens' records" in caplog.text
  assert scanned.plan == kept.plan and scanned.fingerprint == kept.fingerprint
  assert scanned.plan.empty > 0  # records of varied length: short ones have empty windows
  for step in (0, 1, kept.steps_per_epoch + 2):
    a, b = kept.host_batch(step), scanned.host_batch(step)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), step
  # Preparing again keeps them (what the run does on process 0 first).
  with caplog.at_level(logging.WARNING, logger=datasets.__name__):
    assert make_task(config).prepare_data(str(old)) == name
  assert "kept the 'tokens' lengths" in caplog.text
  for split in ("train", "validation"):
    got = np.load(stored_lengths.lengths_path(folder, split, "tokens"))
    want = np.load(stored_lengths.lengths_path(version_dir(name, data_dir), split, "tokens"))
    assert np.array_equal(got, want), split


def test_a_dataset_built_elsewhere_gets_its_lengths_when_prepared(tmp_path):
  """A TFDS dataset built by `tfds build` (no lengths), read in slices and unions of splits."""
  data_dir = str(tmp_path)
  PretokenizedLm(data_dir=data_dir, config="varied").download_and_prepare(
    download_config=text_corpus.DOWNLOAD_CONFIG
  )
  name = "pretokenized_lm/varied:1.0.0"
  assert datasets.open_source(name, "train", data_dir).stored_lengths("tokens") is None
  config = train_tiny.get_config()
  config.data.name, config.data.dir, config.model.vocab_size = name, data_dir, 1000
  assert make_task(config).prepare_data(data_dir) == name
  for split in ("train", "validation", "train[5:17]+validation", "validation+train[:10%]"):
    source = datasets.open_source(name, split, data_dir, ["tokens"])
    scan = [np.size(source[i]["tokens"]) for i in range(len(source))]
    assert source.stored_lengths("tokens").tolist() == scan, split


def test_a_bad_lengths_file_is_named(corpus, tmp_path):
  config, name, data_dir = corpus
  copy = shutil.copytree(data_dir, tmp_path / "data")
  path = stored_lengths.lengths_path(version_dir(name, copy), "train", "tokens")
  stored_lengths.write_lengths(os.path.dirname(path), "train", "tokens", [5, 7, 9])
  with pytest.raises(
    ValueError, match=rf"{re.escape(path)} hold 3 lengths for a split of \d+ records"
  ):
    open_train(config, name, str(copy))
  np.save(path, np.array([[1, 2]]))
  with pytest.raises(
    ValueError, match=rf"{re.escape(path)} hold int64\[1, 2\], not one integer per record"
  ):
    open_train(config, name, str(copy))
  np.save(path, np.array([{"a": 1}], dtype=object), allow_pickle=True)
  with pytest.raises(ValueError, match=rf"{re.escape(path)} cannot be read"):
    open_train(config, name, str(copy))


def test_only_a_feature_of_varied_length_needs_lengths():
  def tokens(shape):
    return tfds.features.FeaturesDict({"tokens": tfds.features.Tensor(shape=shape, dtype=np.int32)})

  assert stored_lengths.has_variable_length(tokens((None,)), "tokens")
  assert not stored_lengths.has_variable_length(tokens((8,)), "tokens")
  assert not stored_lengths.has_variable_length(tokens((None,)), "missing")
