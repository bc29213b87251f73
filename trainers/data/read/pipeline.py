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
  >>> from trainers.data.read.lm_examples import lm_example
  >>> records = [{"tokens": np.arange(i, i + 5, dtype=np.uint8)} for i in range(10)]
  >>> batches = GlobalBatches(records, lm_example(seq_len=4), global_batch=8,
  ...                         mesh=create_mesh("data=-1"), seed=0)
  >>> batches.steps_per_epoch, batches.positions(0).tolist() == batches.positions(0).tolist()
  (1, True)
  >>> len(set(batches.record_indices(0).tolist()))  # 8 of the 10 records, each once
  8
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from spmd import layout as layout_lib
from spmd import multihost
from trainers.data.read.record_stream import RecordStream
from trainers.data.records.plan import Example, RecordPlan

if TYPE_CHECKING:
  from trainers.data.records.datasets import Staging  # tfds is imported only when used

log = logging.getLogger(__name__)
# One row's mask in eval batches of examples that have none: padding rows get 0.
PADDING_MASK = np.ones((), np.float32)


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


class StepBatches:
  """What a step-indexed stream of global batches is, whatever draws its rows.

  A subclass sets `layout`, `global_batch`, `seed`, `train`, `name`,
  `num_records`, `steps_per_epoch`, `fingerprint`, `order`, `identity` and
  `_example_spec`, and builds this host's rows in `host_batch(step)`; the
  rest (placement, the per-step shape check, prefetching, the saved
  position and its checks) is this class's. `GlobalBatches` is one split's
  stream; `trainers.data.read.mixture.MixtureBatches` draws rows from several.
  """

  layout: layout_lib.DataLayout
  global_batch: int
  seed: int
  train: bool
  name: str
  num_records: int
  steps_per_epoch: int
  fingerprint: str
  order: str
  identity: str
  _example_spec: Example

  def _start_rows(self) -> None:
    host = self.layout.host()
    self._rows = np.arange(host.rows.start, host.rows.stop)
    self._host_rows: list[Callable[[int, Example], Example]] = []  # `wrap_host_rows`
    self._placement: dict[str, jax.sharding.Sharding] = {}  # `place_features`

  def host_batch(self, step: int) -> Example:
    """This host's rows of the global batch at `step`, as numpy arrays."""
    raise NotImplementedError

  def usage(self) -> str:
    """What an epoch (eval: the pass) uses of the data and what it drops, and why."""
    raise NotImplementedError

  def sources_fed(self, steps: int, unit: str = "units") -> list[dict[str, Any]] | None:
    """What each source fed in `steps` steps (a mixture's `data_sources`); None: one source."""
    del steps, unit
    return None

  def wrap_host_rows(self, wrap: Callable[[int, Example], Example]) -> None:
    """From now on, this host's rows of each step pass through `wrap(step, rows)` before placement.

    After the wrappers added before it; the shape check of `global_batch_arrays`
    sees what they return (`trainers.hooks.Wrapper.host_rows`).
    """
    self._host_rows.append(wrap)

  def place_features(self, shardings: dict[str, jax.sharding.Sharding]) -> None:
    """Places the features named in `shardings` by them, the rest by `layout.sharding`.

    For the sequence features when the mesh splits the sequence over
    `context` (`trainers.step.loss.batch_shardings`): this host still reads
    its rows whole, and each of its devices gets only its slice of them.
    """
    self._placement = dict(shardings)

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
        spec = PADDING_MASK
      if value.shape != (len(self._rows), *spec.shape) or value.dtype != spec.dtype:
        raise ValueError(
          f"process {jax.process_index()}: batch[{key!r}] at {step=} has local shape "
          f"{value.shape} {value.dtype}, expected {(len(self._rows), *spec.shape)} {spec.dtype}"
        )
    # One call for all arrays: on one process that is one batched device_put.
    global_shapes = {k: (self.global_batch, *v.shape[1:]) for k, v in local.items()}
    shardings = {k: self._placement.get(k, self.layout.sharding) for k in local}
    return jax.make_array_from_process_local_data(shardings, local, global_shapes)

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
      self.identity,
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


class GlobalBatches(StepBatches):
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
  pipeline), and positions stay a pure function of the step
  (`trainers.data.read.record_stream`).
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
    self._stream = stream = RecordStream(
      records,
      to_example,
      seed=seed,
      name=name,
      examples_per_record=examples_per_record,
      shuffle_block=shuffle_block,
      to_batch=to_batch,
      plan=plan,
      cache_rows=global_batch,
      # Shards staged into a bounded cache are read a window at a time (the
      # train order; an eval pass reads them in order anyway).
      shard_windows=getattr(records, "shard_windows", None) if train else None,
    )
    self.shuffle_block = shuffle_block
    self.examples_per_record = stream.examples_per_record
    self.num_records = stream.num_examples  # examples, really
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
    self._records = records
    self._start_rows()
    self._example_spec = stream.example_spec
    self.plan = stream.plan
    self.identity = self.plan.identity
    self.order = stream.order
    self.fingerprint = stream.fingerprint()

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
    return self._stream.examples_at(positions)

  def host_batch(self, step: int) -> Example:
    """This host's rows of the global batch at `step`, as numpy arrays."""
    indices = self.record_indices(step, self._rows)
    valid = indices >= 0
    per = self.examples_per_record
    wanted = [int(i) for i in indices[valid]]
    by_record = self._stream.records_of(wanted)
    if valid.all():
      return self._stream.rows(wanted, by_record)
    it = iter(self._stream.example(by_record[i // per], i % per) for i in wanted)
    examples = [next(it) if ok else None for ok in valid]
    out = {}
    for key, spec in self._example_spec.items():
      out[key] = np.stack([e[key] if e is not None else np.zeros_like(spec) for e in examples])
    if not self.train:  # eval padding counts for nothing
      mask = out.get("mask", np.ones((len(indices),), PADDING_MASK.dtype))
      out["mask"] = mask * valid.reshape((-1,) + (1,) * (mask.ndim - 1)).astype(mask.dtype)
    return out

  def usage(self) -> str:
    """What an epoch (eval: the pass) uses of the records and what it drops, and why.

    Example:
      >>> from spmd.mesh import create_mesh
      >>> from trainers.data.read.lm_examples import lm_example, lm_windows
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
  staging: Staging | None = None,
) -> GlobalBatches:
  """Opens a prepared TFDS split and its global batches, on every host together.

  `features` names the record features `to_example` reads; only those are
  decoded (None: all of them; see `datasets.open_source`). `plan_records`,
  when given, is called with the opened records and decides how many
  examples each holds (see `RecordPlan`, `lm_windows`). `staging`: the
  shards are remote, read through a bounded cache (`datasets.Staging`).

  Process 0 logs what the split's examples use of it and what they drop
  (`GlobalBatches.usage`), once, before any step.

  All hosts compare what they opened (dataset, size, batch, seed): a host
  with another copy of the data, or one whose open failed (missing or
  corrupt files), makes every host raise the same clear error instead of
  some hosts running on while others stop.
  """
  from trainers.data.records.datasets import open_source  # tfds is imported only when used

  what = f"input pipeline {name}[{split}]"
  try:
    records = open_source(name, split, data_dir, features, staging)
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


class BatchIterator(Iterator[tuple[int, dict[str, jax.Array]]]):
  """Yields `(step, global batch)`; a background thread reads ahead.

  The thread prepares up to `prefetch` steps (read records, build host rows,
  copy them to this host's devices) while the accelerator runs the current
  one. Errors in the thread are raised by `next()`.
  """

  def __init__(self, batches: StepBatches, start: int, prefetch: int, num_steps: int | None):
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
