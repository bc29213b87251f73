"""Packed LM data: every token of every document once per epoch, segment rules, a user's
pre-tokenized dataset packed, resume refused on another tokenizer, and the same global
batches (and resume) on 1, 2 and 4 processes."""

import json
import logging
import pathlib
import shutil

import numpy as np
import pytest

from spmd.mesh import create_mesh
from tests.configs import train_tiny
from tests.data_fixtures import write_text_files, write_training_text
from tests.multiprocess import assert_ok, run_worker
from tests.test_pretokenized_lm import VOCAB, PretokenizedLm
from trainers.data.prepare import packed, text_corpus
from trainers.data.prepare.tokenizer import Tokenizer, read_text
from trainers.data.read import lm_examples, pipeline
from trainers.data.records.datasets import open_source
from trainers.data.records.plan import RecordPlan
from trainers.tasks import make_task

SEQ_LEN = 16
GLOBAL_BATCH = 8
RUN_WINDOWS = 4  # windows a record holds here: several records, the last one short


@pytest.fixture(autouse=True)
def short_runs(monkeypatch):
  """Records of RUN_WINDOWS windows, so that every test crosses records."""
  monkeypatch.setattr(packed, "RECORD_TOKENS", RUN_WINDOWS * SEQ_LEN)


def all_windows(records):
  """Every window of every record, in stream order, through the task's batch builder."""
  plan = packed.packed_plan(SEQ_LEN)(records)
  k = np.arange(plan.examples)
  rows = packed.packed_batch(SEQ_LEN)([records[int(r)] for r in k // RUN_WINDOWS], k % RUN_WINDOWS)
  return plan.examples, rows


def packed_config(root, tokenizer="bpe", vocab_size=300):
  config = train_tiny.get_config()
  config.data.source = str(root / "src" / "*.txt")
  config.data.dir = str(root / "data")
  config.data.tokenizer = tokenizer
  config.data.pack = True
  config.model.vocab_size = vocab_size
  config.model.seq_len = SEQ_LEN
  return config


def open_packed(config, caplog, split="train"):
  """The task's prepared data and batches, opened as the trainer opens them; the line logged."""
  task = make_task(config)
  name = task.prepare_data(config.data.dir)
  with caplog.at_level(logging.WARNING, logger=pipeline.__name__):
    caplog.clear()
    batches = pipeline.open_global_batches(
      name,
      split,
      config.data.dir,
      task.to_example,
      GLOBAL_BATCH,
      create_mesh("data=-1"),
      seed=config.seed,
      train=split == "train",
      plan_records=task.plan_records,
      features=tuple(task.record_template),
      to_batch=task.to_batch,
    )
  (line,) = [r.getMessage() for r in caplog.records if "spmd-train: data:" in r.getMessage()]
  return task, name, batches, line


def expected_rows(stream, starts, seq_len, k):
  """Window k's rows, from the whole stream and its documents' starts, one token at a time."""
  doc_of = np.searchsorted(starts, np.arange(len(stream)), side="right") - 1
  row = {key: [] for key in ("inputs", "targets", "segment_ids", "positions", "mask")}
  first = k * seq_len
  for i in range(seq_len):
    t = first + i
    real = t < len(stream)
    doc = doc_of[t] if real else -1
    row["inputs"].append(int(stream[t]) if real else 0)
    row["targets"].append(int(stream[t + 1]) if t + 1 < len(stream) else 0)
    row["segment_ids"].append(int(doc - doc_of[first] + 1) if real else 0)
    row["positions"].append(int(t - max(first, starts[doc])) if real else 0)
    row["mask"].append(float(t + 1 < len(stream) and doc_of[t + 1] == doc))
  return row


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  root = tmp_path_factory.mktemp("packed")
  write_text_files(root, count=30)
  return root


def test_every_token_of_every_document_once_per_epoch_in_order(corpus, caplog):
  config = packed_config(corpus)
  _, name, batches, line = open_packed(config, caplog)
  records = open_source(name, "train", config.data.dir)
  # The documents, tokenized, framed and ordered as the split was built.
  files = text_corpus.split_files(
    text_corpus.corpus_files(config.data.source, exclude=config.data.dir),
    config.data.validation_percent,
  )["train"]
  tok = Tokenizer(_tokenizer_file(config))
  docs = [np.array([1, *tok.encode(read_text(f.path)), 2]) for f in files]
  order = packed.document_order(len(docs), config.seed)
  stream = np.concatenate([docs[i] for i in order])
  starts = np.cumsum([0] + [len(docs[i]) for i in order[:-1]])
  windows = batches.num_records
  assert windows == -(-len(stream) // SEQ_LEN)  # every token an input once: ceil(L / S)
  assert len(records) == -(-windows // RUN_WINDOWS) and windows % RUN_WINDOWS  # the last short

  # One epoch through the pipeline: each fed window once, the skipped ones counted.
  fed = {}
  for step in range(batches.steps_per_epoch):
    rows = batches.host_batch(step)
    for r, index in enumerate(batches.record_indices(step, batches._rows)):
      assert int(index) not in fed
      fed[int(index)] = {k: v[r].tolist() for k, v in rows.items()}
  skipped = windows - len(fed)
  assert skipped == windows % GLOBAL_BATCH and len(fed) > 50
  for k, row in fed.items():
    assert row == expected_rows(stream, starts, SEQ_LEN, k), f"window {k}"
  # The fed windows plus the skipped ones hold the stream, in order, each token once.
  _, every = all_windows(records)
  rebuilt = every["inputs"][every["segment_ids"] != 0]
  assert rebuilt.tolist() == stream.tolist()
  assert every["mask"].sum() == len(stream) - len(docs)  # each document's last token, no target
  padding = windows * SEQ_LEN - len(stream)
  assert line.startswith(
    f"spmd-train: data: train split: {len(records)} records -> {windows} windows of {SEQ_LEN + 1} "
    f"tokens ({len(docs)} documents packed, {padding} padding tokens in the last window); "
    f"per epoch "
  )
  assert f"in {skipped} windows skipped so that each epoch is whole global batches" in line


def _tokenizer_file(config):
  """The run's BPE, as the task cached it in the data dir."""
  from trainers.data.prepare.tokenizer import CACHE_DIR

  (found,) = sorted((pathlib.Path(config.data.dir) / CACHE_DIR).glob("bpe-*/tokenizer.json"))
  return found


def test_a_pretokenized_dataset_packs_every_token(tmp_path, caplog):
  PretokenizedLm(data_dir=str(tmp_path), config="varied").download_and_prepare(
    download_config=text_corpus.DOWNLOAD_CONFIG
  )
  config = packed_config(tmp_path, tokenizer="bytes", vocab_size=VOCAB)
  config.data.name = "pretokenized_lm/varied:1.0.0"
  config.data.dir = str(tmp_path)
  _, name, _, line = open_packed(config, caplog)
  source = open_source("pretokenized_lm/varied:1.0.0", "train", tmp_path)
  docs = [source[i]["tokens"] for i in range(len(source))]
  order = packed.document_order(len(docs), config.seed)
  stream = np.concatenate([docs[i] for i in order])  # ids as they are: no tokenizer, no frame
  records = open_source(name, "train", tmp_path)
  windows, every = all_windows(records)
  assert every["inputs"][every["segment_ids"] != 0].tolist() == stream.tolist()
  skipped = windows % GLOBAL_BATCH
  # Nothing dropped but the windows that do not fill the last global batch.
  assert "past each record" not in line and "(40 documents packed," in line
  assert line.endswith(
    f"in {skipped} windows skipped so that each epoch is whole global batches of "
    f"{GLOBAL_BATCH} (a different set each epoch))"
  )


def test_resume_on_data_of_another_tokenizer_is_refused():
  records = [{"tokens": np.arange(5, dtype=np.int32)}] * 8
  mesh = create_mesh("data=-1")

  def batches(identity):
    plan = RecordPlan(examples_per_record=1, total=8, in_examples=8, identity=identity)
    return pipeline.GlobalBatches(records, lm_examples.lm_example(4), 8, mesh, plan=plan)

  saved = batches("tokenizer sha256:aaa").state(3)
  with pytest.raises(ValueError) as error:
    batches("tokenizer sha256:bbb").check_resumable(saved)
  message = str(error.value)
  assert "'tokenizer sha256:aaa'" in message and "'tokenizer sha256:bbb'" in message
  assert "checkpoint.init_from" in message and "delete" not in message.lower()
  batches("tokenizer sha256:aaa").check_resumable(saved)  # the same one resumes


@pytest.mark.slow
def test_train_on_bpe_then_resume_with_another_tokenizer_is_refused(tmp_path):
  from trainers.run.train import train_and_evaluate

  source = write_training_text(tmp_path)
  config = packed_config(tmp_path)
  config.data.source = source
  config.train.steps = 4
  config.checkpoint.every = 2
  config.eval_every = 4
  config.sample_tokens = 8  # the sample's text goes through the run's tokenizer
  workdir = tmp_path / "run"
  summary = train_and_evaluate(config, str(workdir))
  assert summary["steps"] == 4 and 0.9 < summary["real_token_share"] <= 1.0
  assert "text through the tokenizer" in summary["report"]
  kept = workdir / "tokenizer.json"
  assert kept.read_bytes() == _tokenizer_file(config).read_bytes()

  # Tokenizer B: another BPE file of the same size (trained on other text).
  from trainers.data.prepare.tokenizer import train_bpe

  other = train_bpe(["completely different text " * 50], 300, tmp_path / "b" / "tokenizer.json")
  config.data.tokenizer = str(other)
  config.train.steps = 6
  with pytest.raises(ValueError, match=r"cannot resume .*made with 'tokenizer sha256:"):
    train_and_evaluate(config, str(workdir))


def _build_for_workers(root):
  config = packed_config(root)
  task = make_task(config)
  return task.prepare_data(config.data.dir), config.data.dir


@pytest.fixture(scope="module")
def packed_data(corpus):
  with pytest.MonkeyPatch.context() as patch:  # the module fixture outlives short_runs
    patch.setattr(packed, "RECORD_TOKENS", RUN_WINDOWS * SEQ_LEN)
    return _build_for_workers(corpus)


def run(mode, data, out_dir, num_processes, *opts):
  name, data_dir = data
  out_dir.mkdir(parents=True, exist_ok=True)
  return run_worker(
    "data_worker",
    mode,
    name,
    data_dir,
    str(out_dir),
    f"seq_len={SEQ_LEN}",
    "global_batch=16",
    "packed=tokenizer-a",
    *opts,
    num_processes=num_processes,
    devices_per_process=2,
  )


def load(path):
  with open(path) as f:
    return json.load(f)


@pytest.mark.multiprocess
def test_packed_batches_identical_on_1_2_4_processes_and_resume_elsewhere(packed_data, tmp_path):
  hashes = {}
  for n in (1, 2, 4):
    save = ("save_at=5",) if n == 2 else ()  # the 2-process stream also saves its position
    assert_ok(run("stream", packed_data, tmp_path / f"n{n}", n, "steps=12", *save))
    hashes[n] = load(tmp_path / f"n{n}" / "hashes.json")
  assert hashes[1] == hashes[2] == hashes[4] and len(hashes[1]) == 12
  per_host = [load(tmp_path / "n4" / f"indices_p{p}.json") for p in range(4)]
  spe = per_host[0]["steps_per_epoch"]
  assert spe < 12  # across an epoch boundary
  fed = [i for h in per_host for s in range(spe) for i in h["indices"][str(s)]]
  assert len(fed) == len(set(fed)) == spe * 16

  # Saved by the 2-process stream after 5 steps, resumed on 4: the same stream continues.
  (tmp_path / "resume").mkdir()
  shutil.copy(tmp_path / "n2" / "state.json", tmp_path / "resume" / "state.json")
  state = load(tmp_path / "resume" / "state.json")
  assert state["next_step"] == 5 and state["identity"] == "tokenizer-a"
  assert_ok(run("resume", packed_data, tmp_path / "resume", 4, "steps=7"))
  got = load(tmp_path / "resume" / "resumed.json")
  assert got == {str(s): hashes[1][str(s)] for s in range(5, 12)}
