"""Step-indexed global batches in one process (8 CPU devices)."""

import collections
import dataclasses

import numpy as np
import pytest

from spmd.mesh import create_mesh
from tests.data_fixtures import SEQ_LEN, build_corpus
from trainers.data.read import lm_examples, pipeline
from trainers.data.records import record_order
from trainers.data.records.datasets import open_source
from trainers.data.records.plan import RecordPlan


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  return build_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def records(corpus):
  name, data_dir = corpus
  return open_source(name, "train", data_dir)


def make(records, global_batch=16, seed=3, train=True, mesh="data=-1", **options):
  return pipeline.GlobalBatches(
    records,
    lm_examples.lm_example(SEQ_LEN),
    global_batch,
    create_mesh(mesh),
    seed=seed,
    train=train,
    **options,
  )


def test_every_record_once_per_epoch_and_epochs_differ(records):
  b = make(records)
  n, spe = len(records), b.steps_per_epoch
  assert spe == n // 16
  for epoch in range(3):
    seen = np.concatenate([b.record_indices(s) for s in range(epoch * spe, (epoch + 1) * spe)])
    assert len(seen) == spe * 16 and len(set(seen.tolist())) == len(seen)
    assert set(seen.tolist()) <= set(range(n))
  first = b.record_indices(0)
  assert not np.array_equal(first, b.record_indices(spe))  # reshuffled next epoch
  assert np.array_equal(first, make(records).record_indices(0))  # deterministic
  assert not np.array_equal(first, make(records, seed=4).record_indices(0))


def test_host_batch_holds_exactly_those_records(records):
  b = make(records)
  batch = b.host_batch(5)
  to_example = lm_examples.lm_example(SEQ_LEN)
  for row, index in enumerate(b.record_indices(5)):
    expected = to_example(records[int(index)])
    for key in ("inputs", "targets", "mask"):
      np.testing.assert_array_equal(batch[key][row], expected[key])
  assert batch["inputs"].shape == (16, SEQ_LEN) and batch["inputs"].dtype == np.int32
  assert b.expected_host_shapes() == {
    "inputs": (16, SEQ_LEN),
    "targets": (16, SEQ_LEN),
    "mask": (16, SEQ_LEN),
  }


def test_lm_example_shifts_and_masks_short_records():
  ex = lm_examples.lm_example(4)({"tokens": np.array([10, 11, 12], np.uint8)})
  assert ex["inputs"].tolist() == [10, 11, 12, 0] and ex["targets"].tolist() == [11, 12, 0, 0]
  assert ex["mask"].tolist() == [1, 1, 0, 0]


@pytest.mark.parametrize("seq_len", [3, 4, 7])
def test_lm_batch_equals_lm_example_row_by_row(seq_len):
  # Full windows, a short last window and windows past the end (all masked).
  lengths = [0, 1, 2, seq_len, seq_len + 1, seq_len + 2, 3 * (seq_len + 1) - 1]
  records = [{"tokens": np.arange(n, dtype=np.uint8) + 7} for n in lengths]
  rows = [(r, w) for r in records for w in range(3)]
  batch = lm_examples.lm_batch(seq_len)([r for r, _ in rows], np.array([w for _, w in rows]))
  to_example = lm_examples.lm_example(seq_len)
  for key in ("inputs", "targets", "mask"):
    expected = np.stack([to_example(r, w)[key] for r, w in rows])
    assert batch[key].dtype == expected.dtype and batch[key].flags.c_contiguous
    np.testing.assert_array_equal(batch[key], expected, err_msg=key)


class CountingToBatch:
  def __init__(self, to_batch):
    self.to_batch, self.calls = to_batch, 0

  def __call__(self, records, windows):
    self.calls += 1
    return self.to_batch(records, windows)


@pytest.mark.parametrize("train", [True, False])
def test_to_batch_gives_the_same_batches_and_eval_padding_uses_rows(records, train):
  per, seq_len = 2, SEQ_LEN // 2 - 1
  to_batch = CountingToBatch(lm_examples.lm_batch(seq_len))

  def build(**kwargs):
    return pipeline.GlobalBatches(
      records, lm_examples.lm_example(seq_len), 24, create_mesh("data=-1"),
      train=train, examples_per_record=per, **kwargs,
    )  # fmt: skip

  fast, rows = build(to_batch=to_batch), build()
  steps = range(fast.steps_per_epoch)
  for step in steps:
    a, b = fast.host_batch(step), rows.host_batch(step)
    for key in b:
      np.testing.assert_array_equal(a[key], b[key], err_msg=f"{key} at {step=}")
  padded = 0 if train else sum(int((fast.record_indices(s) < 0).any()) for s in steps)
  assert not train or padded == 0
  assert to_batch.calls == len(steps) - padded, "to_batch builds every batch without padding"
  assert train or padded == 1  # the eval pass ends in a padded batch, built row by row


def test_eval_pads_with_a_mask_and_counts_every_example_once(records):
  b = make(records, global_batch=24, train=False)
  n = len(records)
  assert b.steps_per_epoch == -(-n // 24)
  counts = collections.Counter()
  for step in range(b.steps_per_epoch):
    idx = b.record_indices(step)
    mask = b.host_batch(step)["mask"]
    for i, m in zip(idx, mask):
      if i >= 0:
        counts[int(i)] += 1
      else:
        assert not m.any()  # padding counts for nothing
  assert counts == collections.Counter(range(n))


def test_global_arrays_are_split_over_the_batch_axes(records):
  b = make(records, mesh="data=-1,tensor=2")
  arrays = b.global_batch_arrays(0)
  assert arrays["inputs"].shape == (16, SEQ_LEN)
  assert arrays["inputs"].sharding == b.layout.sharding
  np.testing.assert_array_equal(np.asarray(arrays["inputs"]), b.host_batch(0)["inputs"])


def test_prefetching_iterator_matches_and_resumes(records):
  b = make(records)
  plain = [(s, np.asarray(x["inputs"])) for s, x in b.iterator(0, prefetch=0, num_steps=6)]
  it = b.iterator(0, prefetch=3)
  fetched = [next(it) for _ in range(3)]
  state = it.state()
  it.close()
  assert state.next_step == 3
  resumed = list(b.iterator(pipeline.PipelineState.from_dict(state.to_dict()), num_steps=3))
  got = [(s, np.asarray(x["inputs"])) for s, x in fetched + resumed]
  assert [s for s, _ in got] == [s for s, _ in plain]
  for (_, a), (_, c) in zip(got, plain):
    np.testing.assert_array_equal(a, c)
  with pytest.raises(ValueError, match="another stream .*'seed': \\(3, 4\\)"):
    make(records, seed=4).iterator(state)


def test_errors_in_the_prefetch_thread_reach_the_caller(records):
  class Broken(list):
    def __getitems__(self, indices):
      raise OSError("disk went away")

  b = pipeline.GlobalBatches(
    Broken(records[i] for i in range(40)),
    lm_examples.lm_example(SEQ_LEN),
    16,
    create_mesh("data=-1"),
  )
  with pytest.raises(OSError, match="disk went away"):
    next(b.iterator(0, prefetch=2))


def test_bad_sizes_are_clear_errors(records):
  with pytest.raises(
    ValueError, match="global_batch=12 is not divisible by the data-parallel size 8"
  ):
    make(records, global_batch=12)
  with pytest.raises(ValueError, match="fewer than one global_batch=4096"):
    make(records, global_batch=4096)


def test_bad_seed_is_a_clear_error(records):
  with pytest.raises(ValueError, match="seed=-1 must be a non-negative integer"):
    make(records, seed=-1)


def test_shuffled_positions_are_a_fixed_permutation_per_epoch():
  for length, seed in [(1, 0), (10, 3), (1000, 2**40)]:
    for epoch in range(3):
      got = [
        record_order.shuffled_position(epoch * length + i, length, seed) for i in range(length)
      ]
      assert sorted(got) == list(range(epoch * length, (epoch + 1) * length))
  epoch0 = [record_order.shuffled_position(i, 1000, 0) for i in range(1000)]
  epoch1 = [record_order.shuffled_position(1000 + i, 1000, 0) - 1000 for i in range(1000)]
  seed1 = [record_order.shuffled_position(i, 1000, 1) for i in range(1000)]
  assert epoch0 != epoch1 and epoch0 != seed1 and epoch1 != seed1
  # Pinned: this project's own record of the order. A user's resume does not
  # depend on it: the saved position carries the order's digest by value
  # (`record_order.order_digest`). If this fails, grain's index_shuffle or our
  # seeding changed; positions saved before refuse to resume, as they must.
  assert [record_order.shuffled_position(p, 10, 3) for p in range(12)] == PINNED_ORDER


PINNED_ORDER = [3, 7, 8, 4, 0, 5, 9, 1, 6, 2, 12, 11]


@pytest.mark.parametrize("which", ["records", "windows"])
def test_a_position_saved_under_another_bijection_does_not_resume(records, monkeypatch, which):
  """A grain whose index_shuffle changed would reorder a resumed run: it refuses instead."""
  saved = make(records, examples_per_record=4, shuffle_block=2).state(5)
  original = record_order.index_shuffle

  def changed(index, max_index, seed, rounds):
    # Another bijection: the same permutation, reversed, for one of the two uses.
    window_seed = seed == record_order._seed_of(record_order._WINDOW_ORDER, 3, 0, 0)
    if (which == "windows") == window_seed:
      return max_index - original(index, max_index, seed, rounds)
    return original(index, max_index, seed, rounds)

  monkeypatch.setattr(record_order, "index_shuffle", changed)
  now = make(records, examples_per_record=4, shuffle_block=2)
  assert now.state(5).fingerprint == saved.fingerprint  # only the order tells them apart
  with pytest.raises(ValueError, match="the shuffle order is not the one the saved position"):
    now.check_resumable(saved)
  monkeypatch.setattr(record_order, "index_shuffle", original)
  make(records, examples_per_record=4, shuffle_block=2).check_resumable(saved)  # unchanged: fine


def test_missing_data_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="not prepared in data_dir="):
    pipeline.open_global_batches(
      "text_corpus",
      "train",
      str(tmp_path),
      lm_examples.lm_example(SEQ_LEN),
      16,
      create_mesh("data=-1"),
    )


def test_windows_split_long_records_into_examples(records):
  per = 2  # records hold SEQ_LEN + 1 tokens, so window 1 is empty (all masked)
  b = pipeline.GlobalBatches(
    records,
    lm_examples.lm_example(SEQ_LEN // 2 - 1),
    16,
    create_mesh("data=-1"),
    examples_per_record=per,
  )
  assert b.num_records == per * len(records)
  seen = np.concatenate([b.record_indices(s) for s in range(b.steps_per_epoch)])
  assert len(set(seen.tolist())) == len(seen)
  batch = b.host_batch(0)
  to_example = lm_examples.lm_example(SEQ_LEN // 2 - 1)
  for row, e in enumerate(b.record_indices(0)):
    expected = to_example(records[int(e) // per], int(e) % per)
    np.testing.assert_array_equal(batch["targets"][row], expected["targets"])


class CountingRecords:
  """A record list that counts how many records were read, one or a batch at a time."""

  def __init__(self, n: int, length: int):
    self._records = [{"tokens": np.full(length, i % 250, np.uint8)} for i in range(n)]
    self.reads = 0

  def __len__(self):
    return len(self._records)

  def __getitem__(self, i):
    self.reads += 1
    return self._records[i]

  def __getitems__(self, indices):
    self.reads += len(indices)
    return [self._records[i] for i in indices]


@pytest.mark.slow
@pytest.mark.parametrize("block", [1, 7, 1000])
def test_windows_shuffle_in_blocks_every_window_once_each_record_read_once_per_epoch(block):
  per, seq_len, n = 5, 7, 48  # 48 records of 5 windows; blocks of 7: the last one short
  source = CountingRecords(n, per * (seq_len + 1))
  mesh = create_mesh("data=-1,fsdp=1,tensor=1")

  def build():
    example = lm_examples.lm_example(seq_len)
    return pipeline.GlobalBatches(
      source, example, 8, mesh, seed=1, examples_per_record=per, shuffle_block=block
    )

  b = build()
  assert b.num_records == n * per and b.steps_per_epoch == n * per // 8
  epochs = []
  for epoch in range(2):
    source.reads = 0
    steps = range(epoch * b.steps_per_epoch, (epoch + 1) * b.steps_per_epoch)
    seen = np.concatenate([b.record_indices(s) for s in steps])
    assert sorted(seen.tolist()) == list(range(n * per)), "every window once per epoch"
    for s in steps:
      batch = b.host_batch(s)
      for row, e in enumerate(b.record_indices(s)):  # the rows hold those windows
        expected = lm_examples.lm_example(seq_len)(source._records[int(e) // per], int(e) % per)
        np.testing.assert_array_equal(batch["targets"][row], expected["targets"])
    # Each record read once an epoch at most (fewer when still cached from the last).
    assert source.reads <= n and (epoch or source.reads == n), f"{source.reads} reads, {n} records"
    if 8 <= block * per < n * per:  # a batch's rows come from two consecutive blocks at most
      order = [record_order.shuffled_position(epoch * n + i, n, seed=1) % n for i in range(n)]
      block_of = {r: i // block for i, r in enumerate(order)}
      for s in steps:
        blocks = {block_of[int(e) // per] for e in b.record_indices(s)}
        assert max(blocks) - min(blocks) <= 1, blocks
    epochs.append(seen)
  assert not np.array_equal(epochs[0], epochs[1]), "each epoch its own order"
  assert np.array_equal(build().record_indices(3), b.record_indices(3)), "a pure function of step"


@pytest.mark.parametrize("block", [1, 7, 1000])
def test_a_short_last_record_gives_only_its_windows_each_once_per_epoch(block):
  """Packed data: the last record holds 2 of 5 windows; the other 3 are never rows."""
  per, seq_len, n, examples = 5, 7, 48, 47 * 5 + 2
  source = CountingRecords(n, per * (seq_len + 1))
  plan = RecordPlan(examples_per_record=per, examples=examples, total=1, in_examples=1)
  b = pipeline.GlobalBatches(
    source,
    lm_examples.lm_example(seq_len),
    8,
    create_mesh("data=-1"),
    seed=1,
    shuffle_block=block,
    plan=plan,
  )
  assert b.num_records == examples and b.steps_per_epoch == examples // 8
  skipped = examples % 8
  for epoch in range(3):
    steps = range(epoch * b.steps_per_epoch, (epoch + 1) * b.steps_per_epoch)
    seen = np.concatenate([b.record_indices(s) for s in steps]).tolist()
    assert len(seen) == len(set(seen)) == examples - skipped, "each window once per epoch"
    assert set(seen) <= set(range(examples)), "never a window the last record lacks"
  with pytest.raises(ValueError, match=r"RecordPlan.examples=235 must leave out fewer"):
    pipeline.GlobalBatches(
      source,
      lm_examples.lm_example(seq_len),
      8,
      create_mesh("data=-1"),
      plan=dataclasses.replace(plan, examples=n * per - per),
    )


def test_the_record_order_shuffles_with_grains_own_index_shuffle():
  # record_order loads grain's compiled bijection without importing all of grain;
  # it must be grain's function itself, as `grain.experimental` exports it.
  from grain import experimental

  assert record_order.index_shuffle is experimental.index_shuffle
  order = [record_order.index_shuffle(i, 9, 7, 4) for i in range(10)]
  assert sorted(order) == list(range(10))
