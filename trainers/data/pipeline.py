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
  >>> from trainers.data.lm_examples import lm_example
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
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from spmd import layout as layout_lib
from spmd import multihost
from trainers.data.record_order import (
  order_digest,
  record_in_order,
  shuffled_position,
  window_in_block,
)
from trainers.data.records import Example, RecordPlan

log = logging.getLogger(__name__)
# One row's mask in eval batches of examples that have none: padding rows get 0.
_PADDING_MASK = np.ones((), np.float32)


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
      functools.partial(record_in_order, count=count, seed=seed, short_last=self._missing > 0)
    )
    self._cache = _RecordCache(shuffle_block + global_batch) if examples_per_record > 1 else None
    self._records = records
    self._to_example = to_example
    self._to_batch = to_batch
    host = self.layout.host()
    self._rows = np.arange(host.rows.start, host.rows.stop)
    self._example_spec = self._example(records[0], 0)
    self._host_rows: list[Callable[[int, Example], Example]] = []  # `wrap_host_rows`
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
    k = window_in_block(j, size, self.seed, epoch, block)
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
      mask = out.get("mask", np.ones((len(indices),), _PADDING_MASK.dtype))
      out["mask"] = mask * valid.reshape((-1,) + (1,) * (mask.ndim - 1)).astype(mask.dtype)
    return out

  def usage(self) -> str:
    """What an epoch (eval: the pass) uses of the records and what it drops, and why.

    Example:
      >>> from spmd.mesh import create_mesh
      >>> from trainers.data.lm_examples import lm_example, lm_windows
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

  def wrap_host_rows(self, wrap: Callable[[int, Example], Example]) -> None:
    """From now on, this host's rows of each step pass through `wrap(step, rows)` before placement.

    After the wrappers added before it; the shape check of `global_batch_arrays`
    sees what they return (`trainers.hooks.Wrapper.host_rows`).
    """
    self._host_rows.append(wrap)

  def global_batch_arrays(self, step: int) -> dict[str, jax.Array]:
    """The global batch at `step` as `jax.Array`s split over the batch axes.

    Each host checks its own rows' shapes and dtypes every step (free): a
    host whose batch changed shape while the others reuse the compiled step
    would otherwise hang in a collective or compute garbage.
    """
    local = self.host_batch(step)
    for wrap in self._host_rows:
      local = wrap(step, local)
    for key, value in local.items():
      spec = self._example_spec.get(key)
      if spec is None:  # the mask of eval padding, for examples without one (`host_batch`)
        spec = _PADDING_MASK
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
