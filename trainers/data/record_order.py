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

import functools
import hashlib
import json

import numpy as np
from grain.experimental import index_shuffle

# Rounds of grain's `index_shuffle` bijection per permutation (as its `MapDataset.shuffle`).
_ROUNDS = 4
ORDER_DIGEST_POSITIONS = 64  # first positions of each permutation in `order_digest`
_RECORD_ORDER, _WINDOW_ORDER = 0, 1  # which permutation a seed is for


def order_digest(
  num_records: int,
  examples_per_record: int,
  shuffle_block: int,
  seed: int,
  missing: int = 0,
  short_last: bool | None = None,
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
  records = [record_in_order(p, num_records, seed, last) for p in range(first)]
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


def record_in_order(position: int, count: int, seed: int, short_last: bool) -> int:
  """The record at `position` of the record order, epoch after epoch.

  Each epoch is a permutation of the `count` records. With `short_last`
  (the last record holds fewer examples than the others) it is a permutation
  of the others followed by that record, so that only an epoch's last block
  of the window shuffle is short and positions stay arithmetic.

  Example:
    >>> [record_in_order(p, 4, seed=0, short_last=True) for p in range(4)][-1]
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


def window_in_block(j: int, size: int, seed: int, epoch: int, block: int) -> int:
  """Position `j` of the window permutation of one shuffle block of `size` examples.

  Example:
    >>> sorted(window_in_block(j, 6, seed=0, epoch=0, block=0) for j in range(6))
    [0, 1, 2, 3, 4, 5]
  """
  return index_shuffle(j, size - 1, _seed_of(_WINDOW_ORDER, seed, epoch, block), _ROUNDS)
