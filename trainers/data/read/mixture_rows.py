"""Which source each row of a weighted mixture comes from, and its place in that source's stream.

Rows are laid out in blocks of `MIX_BLOCK` rows. Each source has a fixed
number of slots per block, its weight's share rounded (largest remainder,
at least one slot each), so over every whole block the shares are exact, to
1/`MIX_BLOCK`. Within the block the slots are interleaved as evenly as the
counts allow: source `i`'s `n`-th slot sits at the ideal time
`(n + 1/2) / count_i`, and the block is the slots in the order of their
times. Any run of rows then holds each source's share to within a row or
two, a global batch included, not only on average. The seed shifts where
row 0 enters the pattern, and each source has its own seeded order.

Row `t`'s source and its position in that source's stream (how many rows
the source fed before it) are arithmetic on `t`, so a host computes any
row of any step without state, on any number of hosts, and a resumed run
continues the mixture exactly.

Example:
  >>> mix = RowMix([0.7, 0.3], seed=0)
  >>> sources, positions = mix.locate(np.arange(10))
  >>> sources.tolist().count(0), sources.tolist().count(1)
  (7, 3)
  >>> positions[sources == 1].tolist()  # each source's rows are its stream's next positions
  [0, 1, 2]
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import numpy as np

MIX_BLOCK = 1 << 14  # rows per block: shares exact to 1/16384 over every block
_MIXTURE_ORDER = 2  # the seed's use, distinct from record_order's records (0) and windows (1)


def apportion(shares: Sequence[float], total: int) -> np.ndarray:
  """`total` slots split in proportion to `shares`: largest remainder, at least one each.

  >>> apportion([0.7, 0.3], 10).tolist(), apportion([0.999, 0.001], 100).tolist()
  ([7, 3], [99, 1])
  """
  shares = np.asarray(shares, np.float64)
  if len(shares) > total:
    raise ValueError(f"{len(shares)} sources cannot share {total} slots")
  ideal = shares / shares.sum() * total
  counts = np.floor(ideal).astype(np.int64)
  # Ties by source order, so every host rounds alike.
  order = np.lexsort((np.arange(len(shares)), -(ideal - counts)))
  counts[order[: total - counts.sum()]] += 1
  while (counts == 0).any():  # a tiny weight still gets its slot, taken from the largest
    counts[np.argmax(counts)] -= 1
    counts[np.argmin(counts)] += 1
  return counts


class RowMix:
  """The sources of a mixture's rows: block counts, the block's pattern, the seed's shift.

  Attributes:
    counts: slots per block of each source (they sum to `block`).
    shares: `counts / block`, the shares the mixture feeds exactly over a block.
  """

  def __init__(self, weights: Sequence[float], seed: int = 0, block: int = MIX_BLOCK):
    weights = [float(w) for w in weights]
    if not weights or not all(w > 0 and np.isfinite(w) for w in weights):
      raise ValueError(f"mixture weights={weights} must be positive numbers")
    self.block = block
    self.counts = apportion(weights, block)
    self.shares = self.counts / block
    labels = np.repeat(np.arange(len(weights)), self.counts)
    slot = np.concatenate([np.arange(c) for c in self.counts])
    # (n + 1/2) / count as floats: correctly rounded quotients of small
    # integers, so equal times are equal floats and ties go by source.
    times = (slot + 0.5) / self.counts[labels]
    self.labels = labels[np.lexsort((labels, times))].astype(np.int32)
    # prefix[i, j]: slots of source i among the block's first j.
    prefix = np.zeros((len(weights), block + 1), np.int64)
    for i in range(len(weights)):
      prefix[i, 1:] = np.cumsum(self.labels == i)
    self._prefix = prefix
    state = np.random.SeedSequence((_MIXTURE_ORDER, seed)).generate_state(2)
    self.offset = int((int(state[0]) << 32 | int(state[1])) % block)

  def _fed_before(self, source: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Slots of `source` in the pattern's first `x` slots (pattern repeated block after block)."""
    blocks, within = np.divmod(x, self.block)
    return blocks * self.counts[source] + self._prefix[source, within]

  def locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(source, position in its stream) of each global row `rows` (step * global_batch + row)."""
    x = self.offset + np.asarray(rows, np.int64)
    source = self.labels[x % self.block].astype(np.int64)
    start = self._prefix[source, self.offset]
    return source, self._fed_before(source, x) - start

  def rows_of(self, source: int, rows: int) -> int:
    """How many of the first `rows` global rows come from `source`."""
    src = np.asarray([source])
    fed = self._fed_before(src, np.asarray([self.offset + rows])) - self._prefix[src, self.offset]
    return int(fed[0])

  def digest(self) -> str:
    """A hash of the pattern (counts, shift, the first slots), for the saved position's checks."""
    head = self.labels[: min(self.block, 64)].tolist()
    return hashlib.sha256(
      json.dumps([self.counts.tolist(), self.offset, head]).encode()
    ).hexdigest()[:16]
