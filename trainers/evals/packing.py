"""Many short scored sequences packed into rows of the model's window, each its own segment.

A sequence of n tokens is read as n - 1 inputs with n - 1 targets; its last
`scored` targets are what an eval sums. Sequences are placed longest first,
each into the first row with room (first-fit decreasing), as segments
numbered from 1 in their row, their positions counting from 0: a model that
takes `segment_ids` and `positions` (the packed-data path of the Llama and
transformer tasks) attends only within each segment, so each sequence's
log-probabilities are those it has alone, and a row holds as many as fit
instead of one sequence and padding. Rows are added to a multiple of
`row_multiple` (the forward pass's batch), the added ones all padding
(segment 0, scored nowhere).

Example:
  >>> rows = pack([np.array([5, 6, 7, 8]), np.array([1, 2, 3])], [2, 1], row_len=8, row_multiple=2)
  >>> rows.inputs.tolist()[0], rows.segment_ids.tolist()[0], rows.positions.tolist()[0]
  ([5, 6, 7, 1, 2, 0, 0, 0], [1, 1, 1, 2, 2, 0, 0, 0], [0, 1, 2, 0, 1, 0, 0, 0])
  >>> rows.spans.tolist(), rows.tokens, rows.inputs.shape
  ([[0, 1, 3], [0, 4, 5]], 5, (2, 8))
  >>> sums_of(rows, np.arange(16, dtype=np.float32).reshape(2, 8)).tolist()
  [3.0, 4.0]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Rows:
  """Packed rows, int32 [rows, row_len] each, and where each sequence's scored targets are.

  Attributes:
    inputs, targets, segment_ids, positions: the model's inputs and each slot's target.
    spans: int [sequences, 3]: (row, start, end) of each sequence's scored
      targets, in the order the sequences were given.
    tokens: the rows' real inputs (every sequence's n - 1), padding left out.
  """

  inputs: np.ndarray
  targets: np.ndarray
  segment_ids: np.ndarray
  positions: np.ndarray
  spans: np.ndarray
  tokens: int

  def batches(self, rows: int) -> list[dict[str, np.ndarray]]:
    """The rows in batches of `rows` (their count is a multiple of it), as the model's features."""
    return [
      {
        "inputs": self.inputs[i : i + rows],
        "targets": self.targets[i : i + rows],
        "segment_ids": self.segment_ids[i : i + rows],
        "positions": self.positions[i : i + rows],
      }
      for i in range(0, len(self.inputs), rows)
    ]


def pack(
  sequences: Sequence[np.ndarray], scored: Sequence[int], row_len: int, row_multiple: int = 1
) -> Rows:
  """`sequences` (int ids, 2 to row_len + 1 each) in rows of `row_len`; see the module docstring.

  Raises:
    ValueError: a sequence is too short or too long, or scores more targets than it has.
  """
  lengths = np.array([len(s) - 1 for s in sequences], np.int64)
  for i, (n, k) in enumerate(zip(lengths, scored)):
    if not 1 <= n <= row_len or not 1 <= k <= n:
      raise ValueError(
        f"sequence {i}: {n + 1} tokens scoring {k}; a row reads 1 to {row_len} inputs "
        "and scores 1 to all of its targets"
      )
  free = np.zeros(len(sequences), np.int64)  # each row's room (at most one row a sequence)
  used = 0
  placed = np.zeros((len(sequences), 3), np.int64)  # (row, start, segment)
  for i in np.argsort(-lengths, kind="stable"):
    fits = np.flatnonzero(free[:used] >= lengths[i])
    row = int(fits[0]) if len(fits) else used
    if row == used:
      free[row], used = row_len, used + 1
    start = row_len - free[row]
    placed[i] = row, start, 0
    free[row] -= lengths[i]
  total = max(row_multiple, -(-used // row_multiple) * row_multiple)
  shape = (total, row_len)
  inputs, targets = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
  segment_ids, positions = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
  spans = np.zeros((len(sequences), 3), np.int64)
  # Segments numbered by their place in the row, left to right.
  order = np.lexsort((placed[:, 1], placed[:, 0]))
  segment, last_row = 0, -1
  for i in order:
    row, start, _ = placed[i]
    segment = segment + 1 if row == last_row else 1
    last_row = row
    n, ids = lengths[i], np.asarray(sequences[i], np.int32)
    end = start + n
    inputs[row, start:end], targets[row, start:end] = ids[:-1], ids[1:]
    segment_ids[row, start:end] = segment
    positions[row, start:end] = np.arange(n)
    spans[i] = row, end - scored[i], end
  return Rows(inputs, targets, segment_ids, positions, spans, int(lengths.sum()))


def sums_of(rows: Rows, values: np.ndarray) -> np.ndarray:
  """Each sequence's sum of `values` [rows, row_len] over its scored targets, in float64."""
  totals = np.concatenate(
    [np.zeros((len(values), 1)), np.cumsum(values.astype(np.float64), axis=1)], axis=1
  )
  row, start, end = rows.spans.T
  return totals[row, end] - totals[row, start]
