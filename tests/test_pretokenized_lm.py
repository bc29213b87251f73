"""A pre-tokenized LM dataset (int32 ids, vocab 1000): every window of its long
records is used, the run logs what it uses and drops, and a run on it samples ids."""

import collections
import json
import logging
from typing import ClassVar

import numpy as np
import pytest
import tensorflow_datasets as tfds

from spmd.mesh import create_mesh
from tests.configs import train_tiny
from tests.session_settings import compilation_cache_dir
from trainers.data.prepare import text_corpus
from trainers.data.read import pipeline
from trainers.data.records.datasets import open_source
from trainers.run.train import train_and_evaluate
from trainers.tasks import make_task

VOCAB = 1000
RECORD_TOKENS = 1000
# Varied records: a long one, short ones, one of exactly a window, one a token past it.
VARIED_LENGTHS = (1000, 10, 200, 64, 65, 1, 333, 999)


class PretokenizedLm(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Token ids written by a tokenizer elsewhere: `tokens` int32, fixed or varied length."""

  VERSION = tfds.core.Version("1.0.0")
  BUILDER_CONFIGS: ClassVar[list[tfds.core.BuilderConfig]] = [
    tfds.core.BuilderConfig(name="fixed", description=f"{RECORD_TOKENS} tokens a record"),
    tfds.core.BuilderConfig(name="varied", description="records of varied lengths"),
  ]
  code_path = None  # See TextCorpus.code_path: tfds 4.9.10 needs it set.

  def __init__(self, **kwargs):
    kwargs.setdefault("file_format", "array_record")
    super().__init__(**kwargs)

  def _info(self):
    length = RECORD_TOKENS if self.builder_config.name == "fixed" else None
    tokens = tfds.features.Tensor(shape=(length,), dtype=np.int32)
    return tfds.core.DatasetInfo(
      builder=self, features=tfds.features.FeaturesDict({"tokens": tokens})
    )

  def _split_generators(self, dl_manager):
    return {
      "train": self._generate_examples(40, seed=0),
      "validation": self._generate_examples(8, seed=1),
    }

  def _generate_examples(self, count, seed):
    rng = np.random.default_rng(seed)
    for i in range(count):
      n = RECORD_TOKENS if self.builder_config.name == "fixed" else VARIED_LENGTHS[i % 8]
      yield i, {"tokens": rng.integers(0, VOCAB, n, dtype=np.int32)}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("pretokenized")
  for config in ("fixed", "varied"):
    PretokenizedLm(data_dir=str(root), config=config).download_and_prepare(
      download_config=text_corpus.DOWNLOAD_CONFIG
    )
  return str(root)


def lm_config(data_dir, config="fixed", seq_len=63):
  config_ = train_tiny.get_config()
  config_.data.name = f"pretokenized_lm/{config}:1.0.0"
  config_.data.dir = data_dir
  config_.model.vocab_size = VOCAB
  config_.model.seq_len = seq_len
  return config_


def open_train(data_dir, config, global_batch, caplog, split="train"):
  """The task's batches, opened as the trainer opens them, and the line logged."""
  task = make_task(config)
  with caplog.at_level(logging.WARNING, logger=pipeline.__name__):
    caplog.clear()
    batches = pipeline.open_global_batches(
      task.prepare_data(data_dir),
      split,
      data_dir,
      task.to_example,
      global_batch,
      create_mesh("data=-1"),
      seed=5,
      train=split == "train",
      examples_per_record=task.examples_per_record,
      plan_records=task.plan_records,
      features=tuple(task.record_template),
      shuffle_block=7,
      to_batch=task.to_batch,
    )
  # The split's line; preparing may log another (the record lengths it kept).
  (line,) = [r.getMessage() for r in caplog.records if " split: " in r.getMessage()]
  return batches, line


def windows_of(tokens, window):
  """Every window of `tokens` that holds a target (two tokens or more)."""
  chunks = [tuple(tokens[s : s + window].tolist()) for s in range(0, len(tokens), window)]
  return [c for c in chunks if len(c) >= 2]


def windows_in(batch):
  """The tokens each row of an LM batch holds: its unmasked inputs and their last target."""
  out = []
  for inputs, targets, mask in zip(batch["inputs"], batch["targets"], batch["mask"]):
    n = int(mask.sum())
    if n:
      out.append((*inputs[:n].tolist(), int(targets[n - 1])))
  return out


def test_long_records_give_every_window_once_per_epoch(data_dir, caplog):
  records = open_source("pretokenized_lm/fixed", "train", data_dir)
  batches, line = open_train(data_dir, lm_config(data_dir), 24, caplog)
  # 1000 tokens a record are 15 windows of 64 (seq_len 63 + 1), not one.
  assert batches.examples_per_record == 15 and batches.num_records == 40 * 15
  assert batches.steps_per_epoch == 25  # 600 windows, 24 a batch: none skipped
  expected = collections.Counter(
    w for i in range(len(records)) for w in windows_of(records[i]["tokens"][:960], 64)
  )
  for epoch in range(2):
    steps = range(epoch * 25, (epoch + 1) * 25)
    got = collections.Counter(w for s in steps for w in windows_in(batches.host_batch(s)))
    assert got == expected, f"{epoch=}: every whole window of every record exactly once"
  assert line == (
    "spmd-train: data: train split: 40 records -> 600 windows of 64 tokens; per epoch "
    "38400 tokens used, 1600 dropped (1600 past each record's last whole window)"
  )


def test_the_log_counts_windows_skipped_for_whole_batches(data_dir, caplog):
  batches, line = open_train(data_dir, lm_config(data_dir), 16, caplog)
  assert batches.steps_per_epoch == 37  # 600 // 16: 8 windows wait for the next epoch
  assert line == (
    "spmd-train: data: train split: 40 records -> 600 windows of 64 tokens; per epoch "
    "37888 tokens used, 2112 dropped (1600 past each record's last whole window; 512 in "
    "8 windows skipped so that each epoch is whole global batches of 16 (a different set "
    "each epoch))"
  )
  _, line = open_train(data_dir, lm_config(data_dir), 16, caplog, split="validation")
  assert line == (
    "spmd-train: data: validation split: 8 records -> 120 windows of 64 tokens; per pass "
    "7680 tokens used, 320 dropped (320 past each record's last whole window), "
    "8 masked padding rows"
  )


def test_varied_records_keep_every_token_of_the_longest_and_mask_the_rest(data_dir, caplog):
  records = open_source("pretokenized_lm/varied", "train", data_dir)
  batches, line = open_train(data_dir, lm_config(data_dir, "varied"), 8, caplog)
  assert batches.examples_per_record == 1000 // 64  # the longest record's whole windows
  expected = collections.Counter(
    w for i in range(len(records)) for w in windows_of(records[i]["tokens"][: 15 * 64], 64)
  )
  steps = range(batches.steps_per_epoch)
  got = collections.Counter(w for s in steps for w in windows_in(batches.host_batch(s)))
  assert got == expected  # 600 is a multiple of 8: nothing skipped
  total = 5 * sum(VARIED_LENGTHS)
  cut = 5 * (1000 - 960 + 999 - 960)  # past the 15th window of the two longest
  learning = 5 * sum(min(15, max(0, (n - 2) // 64 + 1)) for n in VARIED_LENGTHS)
  assert line == (
    f"spmd-train: data: train split: 40 records -> 600 windows of 64 tokens; per epoch "
    f"{total - cut} tokens used, {cut} dropped ({cut} past each record's last whole window); "
    f"{600 - learning} of the 600 windows are empty (masked)"
  )


@pytest.mark.slow
def test_a_vocabulary_of_1000_trains_samples_ids_and_ends_cleanly(data_dir, tmp_path):
  config = lm_config(data_dir, seq_len=16)
  config.compilation_cache_dir = compilation_cache_dir()
  config.train.steps, config.eval_every, config.checkpoint.every = 4, 0, 0
  config.sample_tokens = 8  # train_tiny's runs end without a sample
  config.loss_curve = True  # and without a loss curve
  summary = train_and_evaluate(config, str(tmp_path / "run"))
  assert summary["steps"] == 4 and np.isfinite(summary["eval_loss"])
  written = json.loads((tmp_path / "run" / "summary.json").read_text())
  assert written["steps"] == 4 and (tmp_path / "run" / "loss.png").exists()
  report = summary["report"]
  assert report.startswith("sample (greedy, prompt 'def ', token ids: vocab_size=1000"), report
  ids = json.loads(report.splitlines()[1])  # the ids, not bytes decoded from them
  assert ids[:4] == list(b"def ") and len(ids) == 4 + 8
  assert all(0 <= i < VOCAB for i in ids)
