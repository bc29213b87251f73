"""Next-token examples from token records: windows of `seq_len + 1` tokens.

A record of tokens gives one example per window; `lm_example` builds one
row, `lm_batch` the rows of a batch at once, and `lm_windows` tells the
pipeline how many windows each record holds (`RecordPlan`).

Example:
  >>> import numpy as np
  >>> lm_example(seq_len=4)({"tokens": np.arange(10, dtype=np.uint8)}, 1)["inputs"].tolist()
  [5, 6, 7, 8]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from trainers.data.records.plan import Example, RecordPlan, record_lengths


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
