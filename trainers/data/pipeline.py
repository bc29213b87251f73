"""Step-indexed global batches: each host reads exactly its own rows.

The global batch at step `s` is a pure function of (records, seed, step,
global batch size): the same records in the same order whatever the number
of processes. Positions are laid out epoch after epoch, each epoch its own
permutation (grain's `index_shuffle` bijection, see `shuffled_position`),
and records are read by index. A host turns the rows the per-host data
layout gives it (`spmd.layout`, never its own arithmetic) into positions,
reads only those records, and builds the global `jax.Array`.

Policies, written down:
  * train: each epoch's first `steps_per_epoch * global_batch` positions of
    its permutation are used and the remaining `len % global_batch` records
    are skipped that epoch (logged); a different set is skipped each epoch, and
    every used record appears exactly once per epoch across all hosts.
  * eval: one pass in order, padded up to a whole number of global batches;
    padding rows have `mask == 0`, so every example counts exactly once.
  * Every host computes the same step count from the same numbers, so no
    host runs a step the others do not.
  * A record holds a whole number of examples, the same for every record; a
    task's `plan_records` derives it from the data (`lm_windows`: as many
    windows as the longest record holds). What records hold beyond their
    examples is cut; process 0 logs, per split, how much an epoch uses and
    drops and why (`GlobalBatches.usage`).

The iterator's state is just the next step (plus what it must match), so a
run can resume on any number of processes.

Example:
  >>> import numpy as np, jax
  >>> from spmd.mesh import create_mesh
  >>> records = [{"tokens": np.arange(i, i + 5, dtype=np.uint8)} for i in range(10)]
  >>> batches = GlobalBatches(records, lm_example(seq_len=4), global_batch=8,
  ...                         mesh=create_mesh("data=-1"), seed=0)
  >>> batches.steps_per_epoch, batches.positions(0).tolist() == batches.positions(0).tolist()
  (1, True)
  >>> len(set(batches.record_indices(0).tolist()))  # 8 of the 10 records, each once
  8
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from grain.experimental import index_shuffle

from spmd import layout as layout_lib
from spmd import multihost

log = logging.getLogger(__name__)

Example = dict[str, np.ndarray]


def lm_example(seq_len: int) -> Callable[..., Example]:
  """(record, window) -> next-token example: `inputs`, `targets` (int32), `mask`.

  Window `w` of a record is its tokens `[w * (seq_len + 1), (w + 1) * (seq_len + 1))`,
  so long records give several examples (see `GlobalBatches(examples_per_record=...)`).
  A short window is padded with zeros and its padding masked out of the loss.
  """

  to_batch = lm_batch(seq_len)  # one rule for windows, padding and mask

  def to_example(record: dict[str, Any], window: int = 0) -> Example:
    return {k: v[0] for k, v in to_batch([record], np.array([window])).items()}

  return to_example


def lm_batch(seq_len: int) -> Callable[[Sequence[Any], np.ndarray], Example]:
  """(records, windows) -> the rows of `lm_example`, all at once.

  Equal to stacking `lm_example(seq_len)(record, window)` row by row (which
  calls this for one row), at a fraction of the CPU: one token array and one
  mask for the batch, not three small arrays and a dict for every row. The
  input pipeline builds a batch in a background thread, and on a host with
  few cores that CPU comes out of the step's compute threads.

  Example:
    >>> records = [{"tokens": np.arange(10, dtype=np.uint8)}] * 2
    >>> rows = lm_batch(seq_len=4)(records, np.array([0, 1]))
    >>> rows["inputs"].tolist(), rows["mask"].tolist()
    ([[0, 1, 2, 3], [5, 6, 7, 8]], [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
  """

  def to_batch(records: Sequence[Any], windows: np.ndarray) -> Example:
    padded = np.zeros((len(records), seq_len + 1), np.int32)
    lengths = np.zeros(len(records), np.int64)
    for row, (record, window) in enumerate(zip(records, windows)):
      start = int(window) * (seq_len + 1)
      tokens = np.asarray(record["tokens"])[start : start + seq_len + 1]
      padded[row, : len(tokens)] = tokens
      lengths[row] = len(tokens)
    mask = (np.arange(seq_len) < lengths[:, None] - 1).astype(np.float32)
    return {
      "inputs": np.ascontiguousarray(padded[:, :-1]),
      "targets": np.ascontiguousarray(padded[:, 1:]),
      "mask": mask,
    }

  return to_batch


def windows_per_record(record_tokens: int, seq_len: int) -> int:
  """How many `seq_len` examples fit in a record of `record_tokens` tokens."""
  return max(1, record_tokens // (seq_len + 1))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecordPlan:
  """How a split's records become examples, and what an epoch of them uses.

  A task's `plan_records` returns one for the records it is given; the
  pipeline adds what it skips itself (the examples that would not fill a
  global batch) and logs the whole account once, on process 0.

  Attributes:
    examples_per_record: examples each record holds (example `e` is window
      `e % n` of record `e // n`); the same for every record.
    unit: what `total` and `in_examples` count, e.g. "tokens".
    total: units in all the records.
    in_examples: units the examples hold; the other `total - in_examples`
      are cut, for the reason `cut` gives.
    cut: why units are cut, e.g. "past each record's last whole window".
    empty: examples that hold nothing to learn from (rows the task masks).
    example: what one example is, e.g. "windows of 129 tokens".
    detail: more about the examples for the logged line, e.g. "1200
      documents packed, 17 padding tokens in the last window".
    identity: what the examples were made with (e.g. a tokenizer's sha256),
      saved with the data position: a run refuses to resume on data made
      with another (`GlobalBatches.check_resumable`). "" = nothing to check.
    examples: how many examples there are when the last record holds fewer
      than `examples_per_record` (its missing windows do not exist: packed
      windows); None = every record holds them all.

  Example:
    >>> plan = RecordPlan(examples_per_record=1, total=10, in_examples=10)
    >>> plan.unit, plan.example
    ('examples', 'examples')
  """

  examples_per_record: int
  unit: str = "examples"
  total: int
  in_examples: int
  cut: str = ""
  empty: int = 0
  example: str = "examples"
  detail: str = ""
  identity: str = ""
  examples: int | None = None

  def __post_init__(self):
    if not isinstance(self.examples_per_record, int) or self.examples_per_record < 1:
      raise ValueError(f"RecordPlan.examples_per_record={self.examples_per_record!r} must be >= 1")
    if self.examples is not None and self.examples < 1:
      raise ValueError(f"RecordPlan.examples={self.examples!r} must be >= 1 or None")
    if not 0 <= self.in_examples <= self.total:
      raise ValueError(
        f"RecordPlan.in_examples={self.in_examples} must be between 0 and total={self.total}"
      )


_LENGTH_READ_BATCH = 1024  # records per batched read when a feature's length varies


def record_lengths(records: Sequence[Any], feature: str) -> np.ndarray:
  """The length of `feature` (elements) in every record, in record order.

  A feature whose shape the dataset fixes (`records.info.features`, as a
  `RecordSource` has) is not read at all. A variable-length one is read
  once, in order, in batches: the same files give every host the same
  lengths, and the hosts compare what they derive from them (the stream's
  fingerprint) before any step.

  Example:
    >>> record_lengths([{"tokens": np.zeros(3)}, {"tokens": np.zeros(5)}], "tokens").tolist()
    [3, 5]
  """
  info = getattr(records, "info", None)
  spec = info.features[feature] if info is not None and feature in info.features else None
  shape = getattr(spec, "shape", None)
  if shape is not None and all(d is not None and d >= 0 for d in shape):
    return np.full(len(records), int(np.prod(shape)), np.int64)
  getitems = getattr(records, "__getitems__", None)
  lengths = np.zeros(len(records), np.int64)
  for start in range(0, len(records), _LENGTH_READ_BATCH):
    indices = list(range(start, min(start + _LENGTH_READ_BATCH, len(records))))
    batch = getitems(indices) if getitems else [records[i] for i in indices]
    lengths[start : start + len(indices)] = [np.size(r[feature]) for r in batch]
  return lengths


def lm_windows(
  seq_len: int, feature: str = "tokens", record_tokens: int | None = None
) -> Callable[[Sequence[Any]], RecordPlan]:
  """`records -> RecordPlan` for `lm_example`'s windows of `seq_len + 1` tokens.

  Each record gives as many windows as the longest record holds whole
  (`record_tokens` when the records' longest is known, else read from the
  data: `record_lengths`). A shorter record's windows past its end are
  masked out (counted as `empty`), so no token of a longer record is lost;
  what follows a record's last whole window is cut and counted.

  Example:
    >>> records = [{"tokens": np.zeros(20, np.int32)}, {"tokens": np.zeros(7, np.int32)}]
    >>> plan = lm_windows(seq_len=4)(records)  # windows of 5 tokens: 4 per record
    >>> plan.examples_per_record, plan.total, plan.in_examples, plan.empty
    (4, 27, 27, 2)
  """
  window = seq_len + 1

  def plan(records: Sequence[Any]) -> RecordPlan:
    lengths = record_lengths(records, feature)
    longest = record_tokens if record_tokens is not None else int(lengths.max(initial=0))
    per = windows_per_record(longest, seq_len)
    # A window teaches something when it holds a target: two tokens or more.
    learning = np.clip((lengths - 2) // window + 1, 0, per)
    return RecordPlan(
      examples_per_record=per,
      unit="tokens",
      total=int(lengths.sum()),
      in_examples=int(np.minimum(lengths, per * window).sum()),
      cut="past each record's last whole window",
      empty=int(len(lengths) * per - learning.sum()),
      example=f"windows of {window} tokens",
    )

  return plan


@dataclasses.dataclass(frozen=True)
class PipelineState:
  """Where a stream stands; enough to resume it on any number of processes."""

  next_step: int
  seed: int
  global_batch: int
  num_records: int
  fingerprint: str
  order: str = ""  # `order_digest`: the shuffle's first positions, by value
  identity: str = ""  # `RecordPlan.identity`: what the data was made with (a tokenizer)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> PipelineState:
    return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


class GlobalBatches:
  """The global batch of any step, as this host's rows or as a global array.

  Args:
    records: a random-access source (`len()`, `[i]`), e.g. `open_source(...)`.
    to_example: record -> dict of fixed-shape numpy arrays.
    global_batch: rows per step, the same for any number of hosts.
    mesh: the global mesh; the batch is split over its batch axes.
    seed: the shuffle seed (train).
    train: True for shuffled epochs that drop the tail; False for one padded
      pass in order (eval).
    batch_axes: mesh axes that split the batch (default: data axes present).
    name: what the records are, for messages and the state's fingerprint.
    examples_per_record: each record holds this many examples (windows);
      example `e` is window `e % n` of record `e // n`, read as
      `to_example(record, window)`.
    shuffle_block: with several examples per record, how many records a
      block of the shuffle holds (see below).
    to_batch: optional `(records, windows) -> rows`, equal to stacking
      `to_example(record, window)` row by row but cheaper (e.g. `lm_batch`);
      used for every batch without eval padding.
    plan: what the records hold (`RecordPlan`, e.g. from `lm_windows`): its
      `examples_per_record` replaces the argument's, `to_example` is called
      with the window even when there is one, and `usage()` reports in its
      units. None: each record is `examples_per_record` examples.

  With one example per record, each epoch is one uniform permutation of the
  records. With `n` windows per record, a uniform permutation of the windows
  would read a whole record for every example: 32 records read and decoded
  for a batch of 32, each for one window. So each epoch shuffles the
  records, cuts that order into blocks of `shuffle_block` records, and
  permutes the windows within each block; decoded records are kept (an LRU
  cache of `shuffle_block` + `global_batch` records), so each record is read
  about once per block, not once per window. A batch then draws its rows
  from `shuffle_block` records (the role of a shuffle buffer in a streaming
  pipeline), and positions stay a pure function of the step.
  """

  def __init__(
    self,
    records: Sequence[Any],
    to_example: Callable[[Any], Example],
    global_batch: int,
    mesh: jax.sharding.Mesh,
    seed: int = 0,
    train: bool = True,
    batch_axes: Sequence[str] | None = None,
    name: str = "records",
    examples_per_record: int = 1,
    shuffle_block: int = 256,
    to_batch: Callable[[Sequence[Any], np.ndarray], Example] | None = None,
    plan: RecordPlan | None = None,
  ):
    self._windowed = plan is not None or examples_per_record > 1
    if plan is not None:
      examples_per_record = plan.examples_per_record
    if examples_per_record < 1:
      raise ValueError(f"{examples_per_record=} must be at least 1")
    if shuffle_block < 1:
      raise ValueError(f"{shuffle_block=} must be at least 1")
    if not 0 <= seed < 2**63:
      raise ValueError(f"{seed=} must be a non-negative integer below 2**63")
    self.shuffle_block = shuffle_block
    self.examples_per_record = examples_per_record
    self.num_records = len(records) * examples_per_record  # examples, really
    # Windows the last record lacks (packed data): they are never positions.
    self._missing = 0
    if plan is not None and plan.examples is not None:
      self._missing = self.num_records - plan.examples
      if not 0 <= self._missing < examples_per_record:
        raise ValueError(
          f"{name}: RecordPlan.examples={plan.examples} must leave out fewer than one record's "
          f"{examples_per_record} examples of the {len(records)} records' {self.num_records}"
        )
      self.num_records = plan.examples
    self.global_batch = global_batch
    self.seed = seed
    self.train = train
    self.name = name
    self.layout = layout_lib.data_layout(mesh, global_batch, batch_axes)
    if self.num_records == 0:
      raise ValueError(f"{name} has no records")
    if train:
      self.steps_per_epoch = self.num_records // global_batch
      if self.steps_per_epoch == 0:
        raise ValueError(
          f"{name} has {self.num_records} records, fewer than one {global_batch=}; "
          "use a smaller batch or more data"
        )
    else:
      self.steps_per_epoch = -(-self.num_records // global_batch)
    # With windows, the records are shuffled and the windows then within blocks.
    # The record order is read for every row of every step, but a block's rows
    # come from its `shuffle_block` records: most lookups are repeats.
    count = len(records)
    self._record_at = functools.lru_cache(maxsize=2 * shuffle_block + global_batch)(
      functools.partial(_record_in_order, count=count, seed=seed, short_last=self._missing > 0)
    )
    self._cache = _RecordCache(shuffle_block + global_batch) if examples_per_record > 1 else None
    self._records = records
    self._to_example = to_example
    self._to_batch = to_batch
    host = self.layout.host()
    self._rows = np.arange(host.rows.start, host.rows.stop)
    self._example_spec = self._example(records[0], 0)
    self.plan = plan or RecordPlan(
      examples_per_record=examples_per_record,
      total=self.num_records,
      in_examples=self.num_records,
    )
    self.order = order_digest(count, examples_per_record, shuffle_block, seed, self._missing)
    self.fingerprint = hashlib.sha256(
      f"{name}|{self.num_records}|{examples_per_record}|{shuffle_block if examples_per_record > 1 else ''}|{sorted((k, v.shape, str(v.dtype)) for k, v in self._example_spec.items())}".encode()
    ).hexdigest()[:16]

  # -- positions and records ---------------------------------------------------

  def positions(self, step: int, rows: np.ndarray | None = None) -> np.ndarray:
    """Global stream positions of `rows` (default: all) of the batch at `step`."""
    rows = np.arange(self.global_batch) if rows is None else rows
    if not self.train:
      return step * self.global_batch + rows
    epoch, within = divmod(step, self.steps_per_epoch)
    return epoch * self.num_records + within * self.global_batch + rows

  def record_indices(self, step: int, rows: np.ndarray | None = None) -> np.ndarray:
    """Which records the rows of step `step` hold (eval padding: -1)."""
    positions = self.positions(step, rows)
    if not self.train:
      return np.where(positions < self.num_records, positions, -1)
    if self.examples_per_record == 1:
      n = self.num_records
      return np.array([shuffled_position(int(p), n, self.seed) % n for p in positions], np.int64)
    return np.array([self._window_at(int(p)) for p in positions], np.int64)

  def _window_at(self, position: int) -> int:
    """The example (record * n + window) at a train position: blocks of shuffled records."""
    per, block_records, count = self.examples_per_record, self.shuffle_block, len(self._records)
    epoch, within = divmod(position, self.num_records)
    block, j = divmod(within, block_records * per)
    first = block * block_records
    size = min(block_records, count - first) * per
    if first + block_records >= count:  # the last block ends with the last record
      size -= self._missing
    k = index_shuffle(j, size - 1, _seed_of(_WINDOW_ORDER, self.seed, epoch, block), _ROUNDS)
    record = self._record_at(epoch * count + first + k // per)
    return record * per + k % per

  def host_batch(self, step: int) -> Example:
    """This host's rows of the global batch at `step`, as numpy arrays."""
    indices = self.record_indices(step, self._rows)
    valid = indices >= 0
    per = self.examples_per_record
    wanted = [int(i) for i in indices[valid]]
    # One batched read of the distinct records: an ArrayRecord source serves
    # a batch in one call, where reading one by one pays that call per record.
    distinct = sorted({i // per for i in wanted})
    if self._cache is None:
      by_record = dict(zip(distinct, self._read(distinct)))
    else:
      by_record = self._cache.get_or_read(distinct, self._read)
    if self._to_batch is not None and valid.all():
      windows = np.asarray(wanted, np.int64) % per
      return self._to_batch([by_record[i // per] for i in wanted], windows)
    it = iter(self._example(by_record[i // per], i % per) for i in wanted)
    examples = [next(it) if ok else None for ok in valid]
    out = {}
    for key, spec in self._example_spec.items():
      out[key] = np.stack([e[key] if e is not None else np.zeros_like(spec) for e in examples])
    if not self.train:  # eval padding counts for nothing
      mask = out.get("mask", np.ones((len(indices),), np.float32))
      out["mask"] = mask * valid.reshape((-1,) + (1,) * (mask.ndim - 1)).astype(mask.dtype)
    return out

  def usage(self) -> str:
    """What an epoch (eval: the pass) uses of the records and what it drops, and why.

    Example:
      >>> from spmd.mesh import create_mesh
      >>> records = [{"tokens": np.arange(20, dtype=np.int32)}] * 10
      >>> batches = GlobalBatches(records, lm_example(4), 8, create_mesh("data=-1"),
      ...                         plan=lm_windows(4)(records))
      >>> batches.usage()
      '10 records -> 40 windows of 5 tokens; per epoch 200 tokens used, 0 dropped (nothing dropped)'
    """
    plan, examples = self.plan, self.num_records
    per_example = plan.in_examples / examples  # exact when every example holds as much
    head = f"{len(self._records)} records -> {examples} {plan.example}"
    if plan.detail:
      head += f" ({plan.detail})"
    cut = plan.total - plan.in_examples
    why = [f"{cut} {plan.cut}"] if cut else []
    if self.train:
      skipped = examples - self.steps_per_epoch * self.global_batch
      skipped_units = round(skipped * per_example)
      if skipped:
        about = (
          "" if plan.unit == "examples" or skipped_units == skipped * per_example else "about "
        )
        what = "" if plan.unit == "examples" else f"{about}{skipped_units} in "
        why.append(
          f"{what}{skipped} {plan.example.split()[0]} skipped so that each epoch is whole "
          f"global batches of {self.global_batch} (a different set each epoch)"
        )
      line = (
        f"{head}; per epoch {plan.in_examples - skipped_units} {plan.unit} used, "
        f"{cut + skipped_units} dropped ({'; '.join(why) or 'nothing dropped'})"
      )
    else:
      padding = self.steps_per_epoch * self.global_batch - examples
      line = (
        f"{head}; per pass {plan.in_examples} {plan.unit} used, {cut} dropped "
        f"({'; '.join(why) or 'nothing dropped'}), {padding} masked padding rows"
      )
    if plan.empty:
      line += f"; {plan.empty} of the {examples} {plan.example.split()[0]} are empty (masked)"
    return line

  def _read(self, indices: list[int]) -> Sequence[Any]:
    getitems = getattr(self._records, "__getitems__", None)
    return getitems(indices) if getitems else [self._records[i] for i in indices]

  def _example(self, record: Any, window: int) -> Example:
    if not self._windowed:
      return self._to_example(record)
    return self._to_example(record, window)

  def global_batch_arrays(self, step: int) -> dict[str, jax.Array]:
    """The global batch at `step` as `jax.Array`s split over the batch axes.

    Each host checks its own rows' shapes and dtypes every step (free): a
    host whose batch changed shape while the others reuse the compiled step
    would otherwise hang in a collective or compute garbage.
    """
    local = self.host_batch(step)
    for key, value in local.items():
      spec = self._example_spec[key]
      if value.shape != (len(self._rows), *spec.shape) or value.dtype != spec.dtype:
        raise ValueError(
          f"process {jax.process_index()}: batch[{key!r}] at {step=} has local shape "
          f"{value.shape} {value.dtype}, expected {(len(self._rows), *spec.shape)} {spec.dtype}"
        )
    # One call for all arrays: on one process that is one batched device_put.
    global_shapes = {k: (self.global_batch, *v.shape[1:]) for k, v in local.items()}
    return jax.make_array_from_process_local_data(self.layout.sharding, local, global_shapes)

  def expected_host_shapes(self) -> dict[str, tuple[int, ...]]:
    """The shapes every host's rows must have: the trainer checks them each step."""
    return {k: (len(self._rows), *v.shape) for k, v in self._example_spec.items()}

  # -- iteration and state ----------------------------------------------------

  def state(self, next_step: int) -> PipelineState:
    return PipelineState(
      next_step,
      self.seed,
      self.global_batch,
      self.num_records,
      self.fingerprint,
      self.order,
      self.plan.identity,
    )

  def iterator(
    self, start: int | PipelineState = 0, prefetch: int = 2, num_steps: int | None = None
  ) -> BatchIterator:
    """Batches from `start` (a step or a saved state), prefetched to devices."""
    if isinstance(start, PipelineState):
      self.check_resumable(start)
      start = start.next_step
    return BatchIterator(self, start, prefetch, num_steps)

  def check_resumable(self, state: PipelineState) -> None:
    """Raises `ValueError` when `state` belongs to a different stream or order."""
    mine = self.state(state.next_step)
    if state.identity != mine.identity:
      raise ValueError(
        f"cannot resume {self.name}: the saved data position is in data made with "
        f"{state.identity or 'no recorded tokenizer'!r}, and this run's data is made with "
        f"{mine.identity or 'no tokenizer'!r}; its token ids mean other text. Resume with "
        "the tokenizer the run was saved with (data.tokenizer in its config.json; the run "
        "keeps a copy of its tokenizer file in its workdir), or train with the new one in a "
        "new workdir (checkpoint.init_from=<this run's checkpoints> starts from its weights)."
      )
    diffs = {
      f: (getattr(state, f), getattr(mine, f))
      for f in ("seed", "global_batch", "num_records", "fingerprint")
      if getattr(state, f) != getattr(mine, f)
    }
    if diffs:
      raise ValueError(
        f"cannot resume {self.name}: the saved data position belongs to another stream "
        f"(saved, now): {diffs}"
      )
    if self.train and state.order != mine.order:
      raise ValueError(
        f"cannot resume {self.name}: the shuffle order is not the one the saved position "
        f"was taken in (saved order {state.order or 'not recorded'!r}, now {mine.order!r}: "
        "grain's index_shuffle or this harness's seeding changed, or the position predates "
        "order checks). Resumed, this epoch would feed some records twice and others "
        "never; run with the versions that saved it, or start the run again."
      )


def open_global_batches(
  name: str,
  split: str,
  data_dir: str,
  to_example: Callable[[Any], Example],
  global_batch: int,
  mesh: jax.sharding.Mesh,
  seed: int = 0,
  train: bool = True,
  batch_axes: Sequence[str] | None = None,
  examples_per_record: int = 1,
  features: Sequence[str] | None = None,
  shuffle_block: int = 256,
  to_batch: Callable[[Sequence[Any], np.ndarray], Example] | None = None,
  plan_records: Callable[[Sequence[Any]], RecordPlan] | None = None,
) -> GlobalBatches:
  """Opens a prepared TFDS split and its global batches, on every host together.

  `features` names the record features `to_example` reads; only those are
  decoded (None: all of them; see `datasets.open_source`). `plan_records`,
  when given, is called with the opened records and decides how many
  examples each holds (see `RecordPlan`, `lm_windows`).

  Process 0 logs what the split's examples use of it and what they drop
  (`GlobalBatches.usage`), once, before any step.

  All hosts compare what they opened (dataset, size, batch, seed): a host
  with another copy of the data, or one whose open failed (missing or
  corrupt files), makes every host raise the same clear error instead of
  some hosts running on while others stop.
  """
  from trainers.data.datasets import open_source  # tfds is imported only when used

  what = f"input pipeline {name}[{split}]"
  try:
    records = open_source(name, split, data_dir, features)
    plan = plan_records(records) if plan_records is not None else None
    batches = GlobalBatches(
      records,
      to_example,
      global_batch,
      mesh,
      seed=seed,
      train=train,
      batch_axes=batch_axes,
      name=f"{records.name}[{split}]",
      examples_per_record=examples_per_record,
      shuffle_block=shuffle_block,
      to_batch=to_batch,
      plan=plan,
    )
  except (OSError, ValueError) as e:
    multihost.check_agreement(what, {multihost.ERROR_KEY: f"{type(e).__name__}: {e}"})
    raise
  multihost.check_agreement(
    what,
    {
      "dataset": batches.name,
      "records": batches.num_records,
      "fingerprint": batches.fingerprint,
      "global_batch": global_batch,
      "seed": seed,
      "train": train,
      "usage": batches.usage(),
    },
  )
  if jax.process_index() == 0:
    log.warning("spmd-train: data: %s split: %s", split, batches.usage())
  return batches


# Rounds of grain's `index_shuffle` bijection per permutation (as its `MapDataset.shuffle`).
_ROUNDS = 4
ORDER_DIGEST_POSITIONS = 64  # first positions of each permutation in `order_digest`
_RECORD_ORDER, _WINDOW_ORDER = 0, 1  # which permutation a seed is for


def order_digest(
  num_records: int, examples_per_record: int, shuffle_block: int, seed: int, missing: int = 0
) -> str:
  """A hash of the first positions of both permutations, for the run's seed.

  Saved with the data position and compared on resume: if grain's
  `index_shuffle` or our seeding ever orders the stream differently, a
  resumed run refuses to start instead of silently feeding another order.
  Both bijections are covered: the records', and the windows' within a block.

  Example:
    >>> order_digest(10, 1, 256, seed=0) == order_digest(10, 1, 256, seed=0)
    True
    >>> order_digest(10, 1, 256, seed=0) == order_digest(10, 1, 256, seed=1)
    False
  """
  first = min(num_records, ORDER_DIGEST_POSITIONS)
  records = [_record_in_order(p, num_records, seed, missing > 0) for p in range(first)]
  windows: list[int] = []
  if examples_per_record > 1:
    size = min(shuffle_block, num_records) * examples_per_record
    if shuffle_block >= num_records:
      size -= missing
    block_seed = _seed_of(_WINDOW_ORDER, seed, 0, 0)
    windows = [
      index_shuffle(j, size - 1, block_seed, _ROUNDS)
      for j in range(min(size, ORDER_DIGEST_POSITIONS))
    ]
  return hashlib.sha256(json.dumps([records, windows]).encode()).hexdigest()[:16]


def shuffled_position(position: int, length: int, seed: int) -> int:
  """Position `position` of a stream of permutations of `range(length)`, one per epoch.

  Each epoch is grain's `index_shuffle` bijection, seeded from (`seed`,
  epoch) by our own rule, so the order does not change with grain's private
  seed derivation (`MapDataset.seed(...).shuffle()` derives its seeds in a
  way grain documents as not stable). It is also a quarter of the cost per
  element of indexing a shuffled `MapDataset` (5 vs 20 µs here), which the
  input pipeline pays for every row of every step.

  Example:
    >>> sorted(shuffled_position(p, 5, seed=0) for p in range(5))
    [0, 1, 2, 3, 4]
    >>> sorted(shuffled_position(p, 5, seed=0) for p in range(5, 10))  # epoch 1
    [5, 6, 7, 8, 9]
  """
  epoch, within = divmod(position, length)
  seed = _seed_of(_RECORD_ORDER, seed, epoch)
  return epoch * length + index_shuffle(within, length - 1, seed, _ROUNDS)


def _record_in_order(position: int, count: int, seed: int, short_last: bool) -> int:
  """The record at `position` of the record order, epoch after epoch.

  Each epoch is a permutation of the `count` records. With `short_last`
  (the last record holds fewer examples than the others) it is a permutation
  of the others followed by that record, so that only an epoch's last block
  of the window shuffle is short and positions stay arithmetic.

  Example:
    >>> [_record_in_order(p, 4, seed=0, short_last=True) for p in range(4)][-1]
    3
  """
  if not short_last or count == 1:
    return shuffled_position(position, count, seed) % count
  epoch, within = divmod(position, count)
  if within == count - 1:
    return count - 1
  return shuffled_position(epoch * (count - 1) + within, count - 1, seed) % (count - 1)


@functools.lru_cache(maxsize=16)  # a batch spans at most two epochs, two blocks
def _seed_of(*key: int) -> int:
  """The 32-bit seed of one permutation, e.g. `(_WINDOW_ORDER, seed, epoch, block)`."""
  return int(np.random.SeedSequence(key).generate_state(1)[0])


class _RecordCache:
  """The last `capacity` records read, by index; safe to share between threads."""

  def __init__(self, capacity: int):
    self.capacity = capacity
    self._records: collections.OrderedDict[int, Any] = collections.OrderedDict()
    self._lock = threading.Lock()

  def get_or_read(
    self, indices: list[int], read: Callable[[list[int]], Sequence[Any]]
  ) -> dict[int, Any]:
    with self._lock:
      found = {i: self._records[i] for i in indices if i in self._records}
      for i in found:
        self._records.move_to_end(i)
    missing = [i for i in indices if i not in found]
    if missing:  # one batched read, outside the lock
      found.update(zip(missing, read(missing)))
      with self._lock:
        for i in missing:
          self._records[i] = found[i]
        while len(self._records) > self.capacity:
          self._records.popitem(last=False)
    return found


class BatchIterator(Iterator[tuple[int, dict[str, jax.Array]]]):
  """Yields `(step, global batch)`; a background thread reads ahead.

  The thread prepares up to `prefetch` steps (read records, build host rows,
  copy them to this host's devices) while the accelerator runs the current
  one. Errors in the thread are raised by `next()`.
  """

  def __init__(self, batches: GlobalBatches, start: int, prefetch: int, num_steps: int | None):
    if prefetch < 0:
      raise ValueError(f"{prefetch=} must be >= 0")
    self._batches = batches
    self._next = start
    self._stop_at = None if num_steps is None else start + num_steps
    self._prefetch = prefetch
    self._queue: queue.Queue = queue.Queue(maxsize=max(prefetch, 1))
    self._halt = threading.Event()
    self._thread = None
    if prefetch:
      self._thread = threading.Thread(
        target=self._fill, args=(start,), daemon=True, name="spmd-input-prefetch"
      )
      self._thread.start()

  def _fill(self, step: int) -> None:
    while not self._halt.is_set() and (self._stop_at is None or step < self._stop_at):
      try:
        item = (step, self._batches.global_batch_arrays(step), None)
      except Exception as e:  # handed to the consumer, which raises it
        item = (step, None, e)
      while not self._halt.is_set():
        try:
          self._queue.put(item, timeout=0.1)
          break
        except queue.Full:
          continue
      if item[2] is not None:
        return
      step += 1

  def __next__(self) -> tuple[int, dict[str, jax.Array]]:
    if self._stop_at is not None and self._next >= self._stop_at:
      raise StopIteration
    if self._thread is None:
      step, batch = self._next, self._batches.global_batch_arrays(self._next)
    else:
      step, batch, error = self._queue.get()
      if error is not None:
        raise error
    self._next = step + 1
    return step, batch

  def state(self) -> PipelineState:
    """The position to save: the next step this iterator would yield."""
    return self._batches.state(self._next)

  def close(self) -> None:
    self._halt.set()
    if self._thread is not None:
      self._thread.join(timeout=5)

  def __del__(self):
    self._halt.set()
