"""Weighted mixtures of `config.data.sources` in one process (8 CPU devices): shares per batch
and over 200 steps, each source's windows once per epoch, eval, resume, cache keys, bad rows,
and the BPE's sample. Across real processes: tests/test_mixture_multiprocess.py."""

import collections
import logging
import os
import pathlib
import re

import numpy as np
import pytest

from configs import default
from spmd.errors import UserError
from spmd.mesh import create_mesh
from tests.configs import train_tiny
from tests.data_fixtures import WORDS, source_texts, write_jsonl, write_parquet
from trainers.data.prepare.source_files import SourceError
from trainers.data.prepare.tokenizer import Tokenizer
from trainers.data.read import mixture, pipeline
from trainers.data.read.mixture_rows import RowMix, apportion
from trainers.tasks import make_task

SEQ_LEN = 16
BATCH = 32


def sources_config(root: pathlib.Path, sources: str, **data):
  config = train_tiny.get_config()
  config.data.sources = sources
  config.data.pack = True
  config.data.dir = str(root / "data")
  config.data.validation_percent = 20.0
  config.model.seq_len = SEQ_LEN
  config.global_batch = BATCH
  for key, value in data.items():
    config.data[key] = value
  return config


def write_sources(root: pathlib.Path) -> tuple[str, str]:
  """A JSONL source of three files and a Parquet source, different sizes."""
  a = write_jsonl(root / "a", source_texts(60, seed=1), files=3)
  b = write_parquet(root / "b", source_texts(40, seed=2), files=1)
  return a, b


def open_mixture(config, prepared, train=True, seed=None):
  task = make_task(config)
  return mixture.open_mixture_batches(
    prepared,
    config.data.train_split if train else config.data.eval_split,
    config.data.dir,
    task.to_example,
    BATCH,
    create_mesh("data=-1"),
    seed=config.seed if seed is None else seed,
    train=train,
    features=tuple(task.record_template),
    to_batch=task.to_batch,
    plan_records=task.plan_records,
  )


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
  root = tmp_path_factory.mktemp("sources")
  a, b = write_sources(root)
  config = sources_config(root, f"{a}@0.7,{b}@0.3")
  prepared = make_task(config).prepare_data(config.data.dir)
  return {"root": root, "a": a, "b": b, "config": config, "prepared": prepared}


def test_shares_hold_in_every_batch_and_tokens_over_200_steps(sources):
  batches = open_mixture(sources["config"], sources["prepared"])
  assert batches.labels == [sources["a"], sources["b"]]
  tokens = np.zeros(2)
  for step in range(200):
    rows = batches.host_batch(step)
    which, _ = batches.row_sources(step, batches._rows)
    counts = np.bincount(which, minlength=2)
    assert np.all(np.abs(counts - BATCH * np.array([0.7, 0.3])) <= 1.5), (step, counts)
    real = (rows["segment_ids"] != 0).sum(axis=1)
    tokens += np.bincount(which, weights=real, minlength=2)
    if step % 7 == 0:  # exact mid-epoch too: the padding of each source's last window counted
      assert [f["tokens"] for f in batches.sources_fed(step + 1, "tokens")] == tokens.tolist()
  shares = tokens / tokens.sum()
  assert abs(shares[0] - 0.7) < 0.02 and abs(shares[1] - 0.3) < 0.02, shares
  fed = batches.sources_fed(200, "tokens")
  assert [round(f["weight"], 6) for f in fed] == [0.7, 0.3]
  assert all(f["epochs"] > 1.5 for f in fed), fed  # both sources wrapped into new epochs


def test_each_source_feeds_each_window_once_per_epoch(sources):
  batches = open_mixture(sources["config"], sources["prepared"])
  fed = collections.defaultdict(list)
  for step in range(200):
    which, examples = batches.row_sources(step)
    for s, e in zip(which, examples):
      fed[int(s)].append(int(e))
  for s, stream in enumerate(batches.streams):
    n, got = stream.num_examples, fed[s]
    epochs = [got[e * n : (e + 1) * n] for e in range(len(got) // n)]
    assert len(epochs) >= 2
    for epoch in epochs:
      assert sorted(epoch) == list(range(n)), f"source {s}: not each window once"
    assert epochs[0] != epochs[1], "each epoch its own order"


def test_the_mixture_is_a_pure_function_of_seed_and_step(sources):
  one = open_mixture(sources["config"], sources["prepared"])
  two = open_mixture(sources["config"], sources["prepared"])
  for step in (0, 37, 199):
    assert [x.tolist() for x in one.row_sources(step)] == [
      x.tolist() for x in two.row_sources(step)
    ]
  other = open_mixture(sources["config"], sources["prepared"], seed=5)
  assert [x.tolist() for x in other.row_sources(3)] != [x.tolist() for x in one.row_sources(3)]
  assert other.fingerprint != one.fingerprint


def test_row_mix_arithmetic():
  assert apportion([1, 1, 1], 10).tolist() == [4, 3, 3]
  mix = RowMix([0.5, 0.3, 0.2, 1e-6], seed=3)
  assert mix.counts.sum() == mix.block and mix.counts[-1] == 1  # a tiny weight keeps a slot
  which, position = mix.locate(np.arange(3 * mix.block + 17))
  for s in range(4):
    assert position[which == s].tolist() == list(range(int((which == s).sum())))
    assert mix.rows_of(s, len(which)) == int((which == s).sum())
  later, _ = mix.locate(np.arange(1000, 1100))
  assert later.tolist() == which[1000:1100].tolist()  # any row, on its own
  with pytest.raises(ValueError, match="must be positive"):
    RowMix([1.0, 0.0])


def test_eval_is_one_pass_over_every_held_out_window(sources):
  batches = open_mixture(sources["config"], sources["prepared"], train=False)
  seen = collections.Counter()
  for step in range(batches.steps_per_epoch):
    which, examples = batches.row_sources(step)
    mask = batches.host_batch(step)["mask"]
    for s, e, m in zip(which, examples, mask):
      if s < 0:
        assert not m.any()  # padding counts for nothing
      else:
        seen[(int(s), int(e))] += 1
  expected = {(s, e) for s, st in enumerate(batches.streams) for e in range(st.num_examples)}
  assert set(seen) == expected and set(seen.values()) == {1}


def test_a_saved_position_resumes_and_another_mixture_refuses(sources, tmp_path):
  batches = open_mixture(sources["config"], sources["prepared"])
  state = pipeline.PipelineState.from_dict(batches.state(5).to_dict())
  (step, batch), *_ = list(batches.iterator(state, prefetch=0, num_steps=1))
  assert step == 5 and np.array_equal(np.asarray(batch["inputs"]), batches.host_batch(5)["inputs"])
  reweighted = sources_config(sources["root"], f"{sources['a']}@0.5,{sources['b']}@0.5")
  other = open_mixture(reweighted, make_task(reweighted).prepare_data(reweighted.data.dir))
  with pytest.raises(ValueError, match="belongs to another stream"):
    other.iterator(state)


def built(config) -> list[str]:
  return sorted(os.listdir(pathlib.Path(config.data.dir) / "packed_source"))


def test_prepared_sources_are_keyed_by_files_tokenizer_and_packing(tmp_path):
  a, b = write_sources(tmp_path)
  config = sources_config(tmp_path, f"{a},{b}")
  first = make_task(config).prepare_data(config.data.dir)
  folders = built(config)
  assert first.train[0].weight is None  # no weights: in proportion to size
  assert make_task(config).prepare_data(config.data.dir) == first and built(config) == folders
  part = tmp_path / "a" / "part-1.jsonl"
  os.utime(part, ns=(part.stat().st_atime_ns, part.stat().st_mtime_ns + 10**9))
  touched = make_task(config).prepare_data(config.data.dir)
  assert touched.train[0] != first.train[0] and touched.train[1] == first.train[1]
  longer = sources_config(tmp_path, f"{a},{b}")
  longer.model.seq_len = 2 * SEQ_LEN
  assert make_task(longer).prepare_data(config.data.dir).train[1] != first.train[1]


def test_bad_rows_skipped_are_logged_with_where_and_a_lower_limit_refuses(tmp_path, caplog):
  texts = source_texts(30, seed=3)
  good = write_jsonl(tmp_path / "a", texts, files=1)
  bad = tmp_path / "a" / "part-0.jsonl"
  lines = bad.read_text().splitlines()
  lines[4], lines[9] = '{"body": "no text"}', '{"text": 12}'
  bad.write_text("\n".join(lines) + "\n")
  held = write_jsonl(tmp_path / "held", source_texts(12, seed=9), files=1)
  config = sources_config(tmp_path, good, validation_percent=0.0, eval_sources=held)
  with pytest.raises(SourceError, match=r"part-0.jsonl line 5: has no 'text' field"):
    make_task(config).prepare_data(config.data.dir)
  config.data.skip_bad_rows = 2
  prepared = make_task(config).prepare_data(config.data.dir)
  with caplog.at_level(logging.WARNING, logger=mixture.__name__):
    open_mixture(config, prepared)
  (note,) = [r.getMessage() for r in caplog.records if "bad rows skipped" in r.getMessage()]
  assert "2 bad rows skipped" in note and f"{bad} line 5" in note and f"{bad} line 10" in note
  config.data.skip_bad_rows = 1  # the data prepared above skipped 2
  with pytest.raises(SourceError, match=r"line 10: 'text' is a number.*skipped 2 bad rows"):
    make_task(config).prepare_data(config.data.dir)


def test_eval_sources_replace_the_held_out_documents(tmp_path):
  a, b = write_sources(tmp_path)
  held = write_jsonl(tmp_path / "held", source_texts(12, seed=9), files=1)
  config = sources_config(tmp_path, f"{a}@1,{b}@1", eval_sources=held)
  prepared = make_task(config).prepare_data(config.data.dir)
  assert [set(s.datasets) for s in prepared.train] == [{"train"}, {"train"}]
  evaluation = open_mixture(config, prepared, train=False)
  assert evaluation.labels == [held]
  no_eval = sources_config(tmp_path, f"{a}@1,{b}@1", validation_percent=0.0)
  with pytest.raises(ValueError, match="no source of the mixture has documents in the split"):
    open_mixture(no_eval, make_task(no_eval).prepare_data(no_eval.data.dir), train=False)


def test_a_trained_bpe_learns_from_every_source(tmp_path):
  other_words = tuple(w[::-1] + "q" for w in WORDS)  # words the first source never has
  a = write_jsonl(tmp_path / "a", source_texts(40, seed=1), files=2)
  b = write_parquet(tmp_path / "b", source_texts(40, seed=2, words=other_words))
  config = sources_config(tmp_path, f"{a}@0.9,{b}@0.1", tokenizer="bpe")
  config.model.vocab_size = 400
  task = make_task(config)
  task.prepare_data(config.data.dir)
  (path,) = (pathlib.Path(config.data.dir) / "tokenizers").glob("bpe-400-sources-*/tokenizer.json")
  tokenizer = Tokenizer(path)
  for word in ("program", other_words[-1]):  # one of each source
    assert len(tokenizer.encode(" " + word)) <= 2, (word, tokenizer.encode(" " + word))


def test_a_file_in_both_the_train_and_the_eval_sources_is_refused_naming_it(tmp_path):
  """A user holds one file out for eval by naming it in data.eval_sources, but the train glob
  still takes it in: evaluated on what it trains on, the eval loss would mean nothing."""
  a = write_jsonl(tmp_path / "a", source_texts(60, seed=1), files=3)
  held = tmp_path / "a" / "part-2.jsonl"
  config = sources_config(tmp_path, a, validation_percent=0.0, eval_sources=str(held))
  said = f"{held} is in data.sources ('{a}') and in data.eval_sources ('{held}')"
  with pytest.raises(SourceError, match=re.escape(said)):
    make_task(config).prepare_data(config.data.dir)
  assert not (tmp_path / "data" / "packed_source").exists()  # refused before any packing


def test_sources_that_hold_no_documents_out_are_a_user_error_naming_each(tmp_path):
  """Two small sources at the default validation_percent: the hash holds out none of their
  documents, so the eval has nothing to read. One line (exit 2, not a traceback that
  --max-restarts retries) naming each source and the settings that fix it."""
  a = write_jsonl(tmp_path / "a", source_texts(6, seed=1), files=1)
  b = write_jsonl(tmp_path / "b", source_texts(4, seed=2), files=1)
  config = sources_config(tmp_path, f"{a}@1,{b}@1")
  config.data.validation_percent = default.get_config().data.validation_percent
  prepared = make_task(config).prepare_data(config.data.dir)
  with pytest.raises(UserError) as raised:
    open_mixture(config, prepared, train=False)
  message = str(raised.value)
  assert a in message and b in message and "\n" not in message, message
  assert "data.validation_percent" in message and "data.eval_sources" in message, message
