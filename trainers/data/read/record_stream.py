"""One split's examples as an endless seeded stream: position -> example, and examples -> rows.

A stream's positions run epoch after epoch; each epoch is a permutation of
the split's examples (`trainers.data.records.record_order`), so position `p` is
example `example_at(p)` on any host without state, and every example comes
exactly once in each epoch. `rows(examples)` reads the records that hold
them (cached: a block's windows come from the same records) and builds the
rows. `GlobalBatches` cuts one stream into global batches;
`trainers.data.read.mixture` draws a batch's rows from several.

Records that hold several examples (windows) are shuffled, that order is cut
into blocks of `shuffle_block` records, and the windows within each block
are permuted: a batch then draws its rows from `shuffle_block` records, each
read and decoded about once per block rather than once per window.

Example:
  >>> import numpy as np
  >>> from trainers.data.read.lm_examples import lm_example
  >>> records = [{"tokens": np.arange(i, i + 5, dtype=np.uint8)} for i in range(4)]
  >>> stream = RecordStream(records, lm_example(seq_len=4), seed=0)
  >>> sorted(stream.example_at(p) for p in range(4)), stream.num_examples
  ([0, 1, 2, 3], 4)
  >>> stream.rows([2])["inputs"].tolist()
  [[2, 3, 4, 5]]
"""

from __future__ import annotations

import collections
import functools
import hashlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from trainers.data.records.plan import Example, RecordPlan
from trainers.data.records.record_order import (
  ShardWindows,
  order_digest,
  record_in_order,
  window_in_block,
)


class RecordStream:
  """A split's examples in a seeded order, epoch after epoch, read by position.

  Args:
    records: a random-access source (`len()`, `[i]`, maybe `__getitems__`).
    to_example: record -> example (`record, window -> example` with windows).
    seed: the shuffle seed, below 2**63.
    name: what the records are, for messages and the fingerprint.
    examples_per_record: each record holds this many examples; example `e`
      is window `e % n` of record `e // n`.
    shuffle_block: records per block of the window shuffle.
    to_batch: optional `(records, windows) -> rows`, equal to stacking
      `to_example` but cheaper.
    plan: what the records hold (`RecordPlan`); its `examples_per_record`
      replaces the argument's, and its `examples` the count when the last
      record holds fewer.
    cache_rows: rows a batch may need beyond a block's records (the global
      batch), for the sizes of the caches.
    last_record_last: the last record closes every epoch (`record_in_order`'s
      `short_last`); None = when it holds fewer examples than the others.
    shard_windows: order the records a window of shards at a time
      (`record_order.ShardWindows`: shards staged into a bounded cache); None:
      one permutation of all the records an epoch.
  """

  def __init__(
    self,
    records: Sequence[Any],
    to_example: Callable[..., Example],
    *,
    seed: int = 0,
    name: str = "records",
    examples_per_record: int = 1,
    shuffle_block: int = 256,
    to_batch: Callable[[Sequence[Any], np.ndarray], Example] | None = None,
    plan: RecordPlan | None = None,
    cache_rows: int = 0,
    last_record_last: bool | None = None,
    shard_windows: ShardWindows | None = None,
  ):
    self.windowed = plan is not None or examples_per_record > 1
    if plan is not None:
      examples_per_record = plan.examples_per_record
    if examples_per_record < 1:
      raise ValueError(f"{examples_per_record=} must be at least 1")
    if shuffle_block < 1:
      raise ValueError(f"{shuffle_block=} must be at least 1")
    if not 0 <= seed < 2**63:
      raise ValueError(f"{seed=} must be a non-negative integer below 2**63")
    self.name, self.seed, self.shuffle_block = name, seed, shuffle_block
    self.examples_per_record = examples_per_record
    self.count = len(records)
    self.num_examples = self.count * examples_per_record
    # Windows the last record lacks (packed data): they are never positions.
    self.missing = 0
    if plan is not None and plan.examples is not None:
      self.missing = self.num_examples - plan.examples
      if not 0 <= self.missing < examples_per_record:
        raise ValueError(
          f"{name}: RecordPlan.examples={plan.examples} must leave out fewer than one record's "
          f"{examples_per_record} examples of the {self.count} records' {self.num_examples}"
        )
      self.num_examples = plan.examples
    self.last_record_last = self.missing > 0 if last_record_last is None else last_record_last
    self.plan = plan or RecordPlan(
      examples_per_record=examples_per_record,
      total=self.num_examples,
      in_examples=self.num_examples,
    )
    self._records, self._to_example, self._to_batch = records, to_example, to_batch
    # The record order is read for every row of every step, but a block's rows
    # come from its `shuffle_block` records: most lookups are repeats.
    self._record_at = functools.lru_cache(maxsize=2 * shuffle_block + cache_rows)(
      functools.partial(
        record_in_order,
        count=self.count,
        seed=seed,
        short_last=self.last_record_last,
        shard_windows=shard_windows,
      )
    )
    self._cache = _RecordCache(shuffle_block + cache_rows) if examples_per_record > 1 else None
    self.example_spec = self.example(records[0], 0) if self.count else {}
    self.shard_windows = shard_windows
    self.order = order_digest(
      self.count,
      examples_per_record,
      shuffle_block,
      seed,
      self.missing,
      self.last_record_last,
      shard_windows,
    )

  def fingerprint_text(self) -> str:
    """What the stream is (name, size, windows, block, example shapes), for fingerprints."""
    block = self.shuffle_block if self.examples_per_record > 1 else ""
    spec = sorted((k, v.shape, str(v.dtype)) for k, v in self.example_spec.items())
    return f"{self.name}|{self.num_examples}|{self.examples_per_record}|{block}|{spec}"

  def fingerprint(self) -> str:
    return hashlib.sha256(self.fingerprint_text().encode()).hexdigest()[:16]

  # -- positions ---------------------------------------------------------------

  def example_at(self, position: int) -> int:
    """The example at stream `position`: epoch `position // num_examples`, each a permutation."""
    if self.examples_per_record == 1:
      return self._record_at(position)
    return self._window_at(position)

  def examples_at(self, positions: np.ndarray) -> np.ndarray:
    return np.array([self.example_at(int(p)) for p in positions], np.int64)

  def _window_at(self, position: int) -> int:
    """The example (record * n + window) at a position: blocks of shuffled records."""
    per, block_records, count = self.examples_per_record, self.shuffle_block, self.count
    epoch, within = divmod(position, self.num_examples)
    block, j = divmod(within, block_records * per)
    first = block * block_records
    size = min(block_records, count - first) * per
    if first + block_records >= count:  # the last block ends with the last record
      size -= self.missing
    k = window_in_block(j, size, self.seed, epoch, block)
    record = self._record_at(epoch * count + first + k // per)
    return record * per + k % per

  def fed_last_example(self, epoch: int, within: int) -> bool:
    """Whether the first `within` positions of `epoch` hold the last example (a packed split's
    padded one).

    Needs `last_record_last`: the last record is then in the epoch's last
    block, so only the positions of that block before `within` are looked at.
    """
    if not self.last_record_last:
      raise ValueError(f"{self.name}: the last example's place needs last_record_last=True")
    n, per = self.num_examples, self.examples_per_record
    if per == 1:
      return within >= n
    first = (self.count - 1) // self.shuffle_block * self.shuffle_block * per
    return any(self._window_at(epoch * n + j) == n - 1 for j in range(first, min(within, n)))

  # -- reading -----------------------------------------------------------------

  def records_of(self, examples: Sequence[int]) -> dict[int, Any]:
    """The records holding `examples`, by record index: one batched read of the missing ones."""
    per = self.examples_per_record
    # An ArrayRecord source serves a batch in one call, where reading one by
    # one pays that call per record.
    distinct = sorted({int(e) // per for e in examples})
    if self._cache is None:
      return dict(zip(distinct, self._read(distinct)))
    return self._cache.get_or_read(distinct, self._read)

  def rows(self, examples: Sequence[int], by_record: dict[int, Any] | None = None) -> Example:
    """The rows of `examples`, in order (`to_batch` when the stream has one)."""
    by_record = self.records_of(examples) if by_record is None else by_record
    per = self.examples_per_record
    if self._to_batch is not None:
      windows = np.asarray(examples, np.int64) % per
      return self._to_batch([by_record[int(e) // per] for e in examples], windows)
    built = [self.example(by_record[int(e) // per], int(e) % per) for e in examples]
    return {k: np.stack([b[k] for b in built]) for k in self.example_spec}

  def example(self, record: Any, window: int) -> Example:
    if not self.windowed:
      return self._to_example(record)
    return self._to_example(record, window)

  def _read(self, indices: list[int]) -> Sequence[Any]:
    getitems = getattr(self._records, "__getitems__", None)
    return getitems(indices) if getitems else [self._records[i] for i in indices]


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
