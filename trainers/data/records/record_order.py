"""The order of a step-indexed stream: seeded permutations, epoch after epoch.

Records are ordered by grain's `index_shuffle` bijection, one permutation per
epoch; the windows of a block of records by another. Both are seeded by our
own rule from (seed, epoch, block), so any host computes any position
without state, and `order_digest` lets a resumed run check it would see the
same order.

Example:
  >>> [shuffled_position(p, 3, seed=0) // 3 for p in range(6)]  # epoch after epoch
  [0, 0, 0, 1, 1, 1]
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import sys

import numpy as np

# grain's `index_shuffle` is one compiled function, but `grain.experimental` imports
# the whole of grain first (its datasets, multiprocessing and monitoring), in every
# process of every run. Its extension module is loaded on its own, under its own
# name, so a later `import grain` finds it and uses the same module; where grain
# lays its files out otherwise, the public import.
_INDEX_SHUFFLE = "grain._src.python.experimental.index_shuffle.python.index_shuffle_module"


def _grain_index_shuffle():
  if _INDEX_SHUFFLE in sys.modules:
    return sys.modules[_INDEX_SHUFFLE].index_shuffle
  grain = importlib.util.find_spec("grain")  # finds the package without importing it
  folder = os.path.join(os.path.dirname(grain.origin), *_INDEX_SHUFFLE.split(".")[1:-1])
  suffix = next(
    (
      s
      for s in importlib.machinery.EXTENSION_SUFFIXES
      if os.path.exists(os.path.join(folder, "index_shuffle_module" + s))
    ),
    None,
  )
  if suffix is None:
    from grain.experimental import index_shuffle as public

    return public
  path = os.path.join(folder, "index_shuffle_module" + suffix)
  loader = importlib.machinery.ExtensionFileLoader(_INDEX_SHUFFLE, path)
  module = importlib.util.module_from_spec(
    importlib.util.spec_from_file_location(_INDEX_SHUFFLE, path, loader=loader)
  )
  loader.exec_module(module)
  sys.modules[_INDEX_SHUFFLE] = module
  return module.index_shuffle


index_shuffle = _grain_index_shuffle()

# Rounds of grain's `index_shuffle` bijection per permutation (as its `MapDataset.shuffle`).
_ROUNDS = 4
ORDER_DIGEST_POSITIONS = 64  # first positions of each permutation in `order_digest`
_RECORD_ORDER, _WINDOW_ORDER = 0, 1  # which permutation a seed is for
_SHARD_ORDER, _WITHIN_SHARDS = 2, 3  # the shard-window order's two permutations


@dataclasses.dataclass(frozen=True)
class ShardWindows:
  """A record order that reads a few shards at a time: for shards staged into a bounded cache.

  Each epoch permutes the shards, cuts that order into windows of `window`
  shards, and permutes the records within each window: consecutive
  positions stay within one window's shards (two at a block's edge), where
  one permutation of all records touches every shard in every batch. Still a
  pure function of (seed, position, sizes, window): the same on any process
  count. `sizes`: each shard's record count, in the split's file order.
  """

  sizes: tuple[int, ...]
  window: int

  def __post_init__(self):
    if self.window < 1 or not self.sizes or min(self.sizes) < 0:
      raise ValueError(f"ShardWindows needs shards and a window of at least 1: {self}")

  @functools.cached_property
  def firsts(self) -> list[int]:
    """Each shard's first record index."""
    return np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(int).tolist()

  @functools.cached_property
  def _plans(self) -> dict:
    return {}

  def epoch_plan(self, count: int, seed: int, epoch: int, short_last: bool):
    """(positions before the short last record, each window's shard starts, shards, first positions).

    Computed once an epoch and kept (a batch spans two epochs at most): the
    lookup of a position is then two bisections and a bijection, never a
    pass over the shards.
    """
    key = (count, seed, epoch, short_last)
    plan = self._plans.get(key)  # threads may share it: one get, one set
    if plan is None:
      if sum(self.sizes) != count:
        raise ValueError(f"ShardWindows.sizes sum to {sum(self.sizes)}, not the {count} records")
      sizes = list(self.sizes)
      if short_last and count > 1:  # the last record (its shard's last) closes each epoch
        sizes[max(i for i, size in enumerate(sizes) if size > 0)] -= 1
      plan = (sum(sizes), *_epoch_windows(sizes, self.window, seed, epoch))
      if len(self._plans) >= 4:
        self._plans.clear()
      self._plans[key] = plan
    return plan


def order_digest(
  num_records: int,
  examples_per_record: int,
  shuffle_block: int,
  seed: int,
  missing: int = 0,
  short_last: bool | None = None,
  shard_windows: ShardWindows | None = None,
) -> str:
  """A hash of the first positions of both permutations, for the run's seed.

  Saved with the data position and compared on resume: if grain's
  `index_shuffle` or our seeding ever orders the stream differently, a
  resumed run refuses to start instead of silently feeding another order.
  Both bijections are covered: the records', and the windows' within a block.
  `short_last` (default: `missing > 0`) is `record_in_order`'s.

  Example:
    >>> order_digest(10, 1, 256, seed=0) == order_digest(10, 1, 256, seed=0)
    True
    >>> order_digest(10, 1, 256, seed=0) == order_digest(10, 1, 256, seed=1)
    False
  """
  first = min(num_records, ORDER_DIGEST_POSITIONS)
  last = missing > 0 if short_last is None else short_last
  records = [record_in_order(p, num_records, seed, last, shard_windows) for p in range(first)]
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
  shown: list = [records, windows]
  if shard_windows is not None:  # a different order: never the digest of the plain one
    shown.append(["shard-windows-v1", shard_windows.window, list(shard_windows.sizes)])
  return hashlib.sha256(json.dumps(shown).encode()).hexdigest()[:16]


def shuffled_position(position: int, length: int, seed: int) -> int:
  """Position `position` of a stream of permutations of `range(length)`, one per epoch.

  Each epoch is grain's `index_shuffle` bijection, seeded from (`seed`,
  epoch) by our own rule, so the order does not change with grain's private
  seed derivation (`MapDataset.seed(...).shuffle()` derives its seeds in a
  way grain documents as not stable). It also skips a shuffled
  `MapDataset`'s per-element indexing machinery, a cost the input pipeline
  would pay for every row of every step.

  Example:
    >>> sorted(shuffled_position(p, 5, seed=0) for p in range(5))
    [0, 1, 2, 3, 4]
    >>> sorted(shuffled_position(p, 5, seed=0) for p in range(5, 10))  # epoch 1
    [5, 6, 7, 8, 9]
  """
  epoch, within = divmod(position, length)
  seed = _seed_of(_RECORD_ORDER, seed, epoch)
  return epoch * length + index_shuffle(within, length - 1, seed, _ROUNDS)


def record_in_order(
  position: int,
  count: int,
  seed: int,
  short_last: bool,
  shard_windows: ShardWindows | None = None,
) -> int:
  """The record at `position` of the record order, epoch after epoch.

  Each epoch is a permutation of the `count` records. With `short_last`
  (the last record holds fewer examples than the others) it is a permutation
  of the others followed by that record, so that only an epoch's last block
  of the window shuffle is short and positions stay arithmetic. With
  `shard_windows`, the permutation is that order's (`ShardWindows`).

  Example:
    >>> [record_in_order(p, 4, seed=0, short_last=True) for p in range(4)][-1]
    3
    >>> windows = ShardWindows(sizes=(3, 3, 3, 3), window=2)
    >>> order = [record_in_order(p, 12, 0, False, windows) for p in range(12)]
    >>> sorted(order) == list(range(12)), len({r // 3 for r in order[:6]})
    (True, 2)
  """
  if shard_windows is not None:
    return _in_shard_windows(position, count, seed, short_last, shard_windows)
  if not short_last or count == 1:
    return shuffled_position(position, count, seed) % count
  epoch, within = divmod(position, count)
  if within == count - 1:
    return count - 1
  return shuffled_position(epoch * (count - 1) + within, count - 1, seed) % (count - 1)


def _in_shard_windows(position: int, count: int, seed: int, short_last: bool, w: ShardWindows):
  epoch, within = divmod(position, count)
  length, starts, shards, windows = w.epoch_plan(count, seed, epoch, short_last)
  if within >= length:  # the short last record, after the others
    return count - 1
  k = bisect.bisect_right(windows, within) - 1  # the window
  offset, size = within - windows[k], windows[k + 1] - windows[k]
  if size > 1:
    offset = index_shuffle(offset, size - 1, _seed_of(_WITHIN_SHARDS, seed, epoch, k), _ROUNDS)
  j = bisect.bisect_right(starts[k], offset) - 1  # the shard within the window
  shard = shards[k][j]
  return w.firsts[shard] + offset - starts[k][j]


def _epoch_windows(sizes: list[int], window: int, seed: int, epoch: int):
  """One epoch's windows: each one's shard starts, shards, and the windows' first positions."""
  n = len(sizes)
  order = (
    [0]
    if n == 1
    else [index_shuffle(i, n - 1, _seed_of(_SHARD_ORDER, seed, epoch), _ROUNDS) for i in range(n)]
  )
  starts, shards, windows = [], [], [0]
  for first in range(0, n, window):
    group = order[first : first + window]
    offsets = np.concatenate([[0], np.cumsum([sizes[s] for s in group])]).tolist()
    starts.append(offsets[:-1])
    shards.append(group)
    windows.append(windows[-1] + offsets[-1])
  return starts, shards, windows


@functools.lru_cache(maxsize=16)  # a batch spans at most two epochs, two blocks
def _seed_of(*key: int) -> int:
  """The 32-bit seed of one permutation, e.g. `(_WINDOW_ORDER, seed, epoch, block)`."""
  return int(np.random.SeedSequence(key).generate_state(1)[0])


def window_in_block(j: int, size: int, seed: int, epoch: int, block: int) -> int:
  """Position `j` of the window permutation of one shuffle block of `size` examples.

  Example:
    >>> sorted(window_in_block(j, 6, seed=0, epoch=0, block=0) for j in range(6))
    [0, 1, 2, 3, 4, 5]
  """
  return index_shuffle(j, size - 1, _seed_of(_WINDOW_ORDER, seed, epoch, block), _ROUNDS)
