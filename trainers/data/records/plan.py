"""What a split's records hold: the `RecordPlan` account and record lengths.

Example:
  >>> RecordPlan(examples_per_record=2, unit="tokens", total=10, in_examples=8).examples_per_record
  2
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

Example = dict[str, np.ndarray]


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
    units_per_example: the units of a full example, when every example but
      the split's last is full (packed windows: `seq_len` tokens); a
      mixture then counts each source's units exactly. None = not so.

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
  units_per_example: int | None = None

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
  `RecordSource` has) is not read at all, nor is one whose lengths were kept
  when the dataset was prepared (`records.stored_lengths(feature)`, see
  `trainers.data.records.stored_lengths`). Otherwise every record is read once, in
  order, in batches: the same files give every host the same lengths, and
  the hosts compare what they derive from them (the stream's fingerprint)
  before any step.

  Example:
    >>> record_lengths([{"tokens": np.zeros(3)}, {"tokens": np.zeros(5)}], "tokens").tolist()
    [3, 5]
  """
  info = getattr(records, "info", None)
  spec = info.features[feature] if info is not None and feature in info.features else None
  shape = getattr(spec, "shape", None)
  if shape is not None and all(d is not None and d >= 0 for d in shape):
    return np.full(len(records), int(np.prod(shape)), np.int64)
  stored = getattr(records, "stored_lengths", None)
  if stored is not None:
    kept = stored(feature)
    if kept is not None:
      return kept
    log.warning(
      "spmd-train: data: %r keeps no lengths of its %r records (prepared before they were "
      "kept, or not by this harness); reading all %d records for them",
      records,
      feature,
      len(records),
    )
  getitems = getattr(records, "__getitems__", None)
  lengths = np.zeros(len(records), np.int64)
  for start in range(0, len(records), _LENGTH_READ_BATCH):
    indices = list(range(start, min(start + _LENGTH_READ_BATCH, len(records))))
    batch = getitems(indices) if getitems else [records[i] for i in indices]
    lengths[start : start + len(indices)] = [np.size(r[feature]) for r in batch]
  return lengths
