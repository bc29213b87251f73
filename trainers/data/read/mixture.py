"""Global batches drawn from several sources, in proportion to their weights.

A task whose data is several sources (the LM tasks with `config.data.sources`)
returns a `DataMixture` from `prepare_data`: each source's prepared dataset
and weight. `MixtureBatches` then feeds, at step `s`, the global rows
`s * global_batch ...`: each row's source and its place in that source's
stream come from `trainers.data.read.mixture_rows` (arithmetic on the row, the
seed fixed), and each source's stream is its own seeded order epoch after
epoch (`trainers.data.read.record_stream`). So:

  * every global batch holds each source's share of rows to within a row or
    two (weights are shares of rows; packed, every row is a full window);
  * within each source's epoch every example comes exactly once; a source
    that runs out starts its next epoch, whatever the others do (nothing is
    dropped: a mixture has no epoch of its own);
  * the batch of any step is a pure function of (sources, weights, seed,
    step, global batch): the same on any number of hosts, and the position
    saved in a checkpoint (the next step) resumes the mixture exactly.

Eval is one pass over each source's eval split in turn, padded with masked
rows to whole global batches: every held-out example counts once.

Example:
  >>> from spmd.mesh import create_mesh
  >>> from trainers.data.read.lm_examples import lm_example
  >>> from trainers.data.read.record_stream import RecordStream
  >>> def stream(n, first):
  ...   records = [{"tokens": np.full(5, first + i, np.uint8)} for i in range(n)]
  ...   return RecordStream(records, lm_example(4), name=f"s{first}", last_record_last=True)
  >>> batches = MixtureBatches([stream(6, 0), stream(3, 100)], [0.75, 0.25], global_batch=8,
  ...                          mesh=create_mesh("data=-1"))
  >>> sources, _ = batches.row_sources(0)
  >>> sources.tolist().count(0), sources.tolist().count(1)
  (6, 2)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from spmd import layout as layout_lib
from spmd import multihost
from spmd.errors import UserError
from trainers.data.read.mixture_rows import RowMix
from trainers.data.read.pipeline import PADDING_MASK, StepBatches
from trainers.data.read.record_stream import RecordStream
from trainers.data.records.plan import Example, RecordPlan

if TYPE_CHECKING:
  from trainers.data.records.datasets import Staging  # tfds is imported only when used

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MixtureSource:
  """One prepared source of a mixture.

  Attributes:
    label: the source as the user wrote it (`data.sources`' entry, without
      its weight), for logs and the summary.
    datasets: split name -> the TFDS name of that split's prepared data (a
      split without documents has none).
    weight: its weight as given; None: in proportion to its size.
    note: what its preparation reported, for the log (bad rows skipped).
  """

  label: str
  datasets: Mapping[str, str]
  weight: float | None = None
  note: str = ""

  def dataset(self, split: str) -> str | None:
    """The dataset to open for a split spec (`"train"`, `"validation[:50%]"`), None if absent."""
    if "+" in split:
      raise ValueError(
        f"{split=}: a mixture's split is one split, maybe sliced ('validation[:50%]'), since "
        "each of a source's splits is its own dataset"
      )
    return self.datasets.get(split.split("[")[0].strip())


@dataclasses.dataclass(frozen=True)
class DataMixture:
  """`Task.prepare_data`'s answer for several sources: what to train and evaluate on.

  Example:
    >>> source = MixtureSource("a/*.jsonl", {"train": "packed_source/train-64s-0a1b:1.0.0"}, 0.7)
    >>> DataMixture(train=(source,)).train[0].dataset("train[:10%]")
    'packed_source/train-64s-0a1b:1.0.0'
  """

  train: tuple[MixtureSource, ...]
  eval: tuple[MixtureSource, ...] = ()  # empty: the train sources' own eval splits


def source_seed(seed: int, label: str) -> int:
  """Each source's own shuffle seed, from the run's seed and its label.

  >>> source_seed(0, "a/*.jsonl") == source_seed(0, "a/*.jsonl") != source_seed(1, "a/*.jsonl")
  True
  """
  digest = hashlib.sha256(f"{seed}|{label}".encode("utf-8", "surrogateescape")).digest()
  return int.from_bytes(digest[:8], "big") >> 1  # below 2**63, as the streams need


def units_fed(stream: RecordStream, fed: int) -> float:
  """The units (tokens) of a stream's first `fed` positions.

  Exact when every example but the split's last is full
  (`RecordPlan.units_per_example`, packed windows) and the last record
  closes each epoch; otherwise the mean units per example times `fed`.
  """
  plan, n = stream.plan, stream.num_examples
  full = plan.units_per_example
  if full is None or not stream.last_record_last:
    return fed * plan.in_examples / n
  short = n * full - plan.in_examples  # what the last example lacks
  epochs, within = divmod(fed, n)
  last_fed = epochs + (1 if short and stream.fed_last_example(epochs, within) else 0)
  return float(fed * full - short * last_fed)


class MixtureBatches(StepBatches):
  """The global batch of any step, its rows drawn from several `RecordStream`s.

  Args:
    streams: one per source, the same task's examples (equal shapes).
    weights: each source's weight (train); None: in proportion to its examples.
    global_batch, mesh, seed, batch_axes: as `GlobalBatches`'.
    train: True for the weighted mixture; False for one padded pass over
      each source in turn (eval).
    labels: the sources' names, for logs and `sources_fed`.
    name: what the mixture is, for messages and the fingerprint.
  """

  def __init__(
    self,
    streams: Sequence[RecordStream],
    weights: Sequence[float] | None,
    global_batch: int,
    mesh: jax.sharding.Mesh,
    seed: int = 0,
    train: bool = True,
    batch_axes: Sequence[str] | None = None,
    labels: Sequence[str] | None = None,
    name: str = "mixture",
  ):
    if not streams:
      raise ValueError(f"{name} has no sources")
    self.streams = list(streams)
    self.labels = list(labels or [s.name for s in streams])
    self.global_batch, self.seed, self.train, self.name = global_batch, seed, train, name
    self.layout = layout_lib.data_layout(mesh, global_batch, batch_axes)
    empty = [label for label, s in zip(self.labels, self.streams) if s.num_examples == 0]
    if empty:
      raise ValueError(f"{name}: the sources {empty} have no examples")
    specs = {self._spec_text(s) for s in self.streams}
    if len(specs) > 1:
      raise ValueError(f"{name}: the sources' examples differ in shape or dtype: {sorted(specs)}")
    identities = sorted({s.plan.identity for s in self.streams})
    if len(identities) > 1:
      raise ValueError(f"{name}: the sources were made with different tokenizers {identities}")
    self.identity = identities[0]
    self.sizes = np.array([s.num_examples for s in self.streams], np.int64)
    self.num_records = int(self.sizes.sum())
    self._start_rows()
    self._example_spec = self.streams[0].example_spec
    if train:
      given = weights is not None
      weights = list(weights) if given else self.sizes.tolist()
      if len(weights) != len(self.streams):
        raise ValueError(f"{name}: {len(weights)} weights for {len(self.streams)} sources")
      self.weights = np.asarray(weights, np.float64) / np.sum(weights)
      self.mix = RowMix(self.weights, seed)
      # Steps until every source has been through one epoch (information only).
      rows_per_step = self.mix.shares * global_batch
      self.steps_per_epoch = int(np.max(np.ceil(self.sizes / rows_per_step)))
    else:
      self.weights = self.sizes / self.num_records
      self.mix = None
      self._starts = np.concatenate([[0], np.cumsum(self.sizes)])
      self.steps_per_epoch = -(-self.num_records // global_batch)
    parts = [s.fingerprint_text() for s in self.streams]
    pattern = self.mix.digest() if self.mix is not None else "in order"
    self.fingerprint = _digest(["mixture", name, parts, pattern, train])
    self.order = _digest([s.order for s in self.streams] + [pattern])

  @staticmethod
  def _spec_text(stream: RecordStream) -> str:
    return str(sorted((k, v.shape, str(v.dtype)) for k, v in stream.example_spec.items()))

  def row_sources(self, step: int, rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(source, example of that source) of `rows` (default: all) of step `step`; eval padding -1."""
    rows = np.arange(self.global_batch) if rows is None else np.asarray(rows)
    t = step * self.global_batch + rows
    if self.mix is None:
      source = np.searchsorted(self._starts, t, side="right") - 1
      padding = t >= self.num_records
      example = np.where(padding, -1, t - self._starts[np.minimum(source, len(self.sizes) - 1)])
      return np.where(padding, -1, source), example
    source, position = self.mix.locate(t)
    example = np.array(
      [self.streams[s].example_at(int(p)) for s, p in zip(source, position)], np.int64
    )
    return source, example

  def host_batch(self, step: int) -> Example:
    """This host's rows of the global batch at `step`, as numpy arrays."""
    sources, examples = self.row_sources(step, self._rows)
    n = len(self._rows)
    out = {k: np.zeros((n, *v.shape), v.dtype) for k, v in self._example_spec.items()}
    for i in np.unique(sources[sources >= 0]):
      where = sources == i
      rows = self.streams[int(i)].rows([int(e) for e in examples[where]])
      for key, value in rows.items():
        out[key][where] = value
    if not self.train:  # eval padding counts for nothing
      valid = sources >= 0
      mask = out.get("mask", np.ones((n,), PADDING_MASK.dtype))
      out["mask"] = mask * valid.reshape((-1,) + (1,) * (mask.ndim - 1)).astype(mask.dtype)
    return out

  def sources_fed(self, steps: int, unit: str = "units") -> list[dict[str, Any]]:
    """Per source, what the first `steps` steps fed: its weight, rows, epochs, units and share.

    The units (named `unit`: the task's, e.g. "tokens", packed: the real
    ones) are exact for packed windows (`units_fed`); `share` is of the units
    all sources fed. Eval: one whole pass.
    """
    rows = [
      self.mix.rows_of(i, steps * self.global_batch) if self.mix is not None else int(n)
      for i, n in enumerate(self.sizes)
    ]
    units = [units_fed(s, r) for s, r in zip(self.streams, rows)]
    total = sum(units) or 1.0
    return [
      {
        "source": label,
        "weight": float(w),
        "rows": int(r),
        "epochs": r / int(n),
        unit: u,
        "share": u / total,
      }
      for label, w, r, n, u in zip(self.labels, self.weights, rows, self.sizes, units)
    ]

  def usage(self) -> str:
    """Each source: its share of rows, its examples, and (train) how often an epoch comes."""
    parts = []
    for i, (label, stream) in enumerate(zip(self.labels, self.streams)):
      plan = stream.plan
      head = f"{label!r}: {stream.count} records -> {stream.num_examples} {plan.example}"
      if plan.detail:
        head += f" ({plan.detail})"
      if self.mix is not None:
        per_step = self.mix.shares[i] * self.global_batch
        head = (
          f"{head}, {self.mix.shares[i]:.1%} of rows (~{per_step:.1f} a step, an epoch every "
          f"~{stream.num_examples / per_step:.1f} steps)"
        )
      parts.append(head)
    what = "mixture" if self.train else "one pass over"
    line = f"{what} {len(self.streams)} sources: " + "; ".join(parts)
    if not self.train:
      padding = self.steps_per_epoch * self.global_batch - self.num_records
      line += f"; {padding} masked padding rows"
    return line


def _digest(value: Any) -> str:
  return hashlib.sha256(json.dumps(value, default=str).encode()).hexdigest()[:16]


def _epochs_line(batches: MixtureBatches, steps: int) -> str:
  """Each source's share of units (tokens) and its epochs over `steps` steps, for the log."""
  fed = batches.sources_fed(steps)
  return "; ".join(f"{f['source']!r} {f['share']:.1%}, {f['epochs']:.2f} epochs" for f in fed)


def open_mixture_batches(
  mixture: DataMixture,
  split: str,
  data_dir: str,
  to_example: Callable[[Any], Example],
  global_batch: int,
  mesh: jax.sharding.Mesh,
  seed: int = 0,
  train: bool = True,
  batch_axes: Sequence[str] | None = None,
  features: Sequence[str] | None = None,
  shuffle_block: int = 256,
  to_batch: Callable[[Sequence[Any], np.ndarray], Example] | None = None,
  plan_records: Callable[[Sequence[Any]], RecordPlan] | None = None,
  steps: int | None = None,
  unit: str = "units",
  staging: Staging | None = None,
) -> MixtureBatches:
  """Opens each source's prepared split and their mixture, on every host together.

  Eval opens the eval sources (the train sources when there are none) that
  have the split; a source whose eval split holds nothing is left out, and
  none at all is an error. Process 0 logs the mixture once (each source's
  share of rows and examples, and, given `steps`, each source's share of
  `unit` and its epochs over the run). All hosts compare what they opened,
  as `open_global_batches`, so one host's bad copy stops every host.
  `staging`: the shards are remote, read through a bounded cache
  (`datasets.Staging`), which the sources share.
  """
  from trainers.data.records.datasets import open_source  # tfds is imported only when used

  sources = mixture.train if train or not mixture.eval else mixture.eval
  what = f"input pipeline mixture[{split}]"
  try:
    kept = [s for s in sources if s.dataset(split) is not None]
    left_out = [s.label for s in sources if s.dataset(split) is None]
    if not kept:
      raise UserError(
        f"no source of the mixture has documents in the split {split!r}: "
        f"{', '.join(repr(label) for label in left_out)} have only "
        f"{sorted({x for s in sources for x in s.datasets})}; with data.sources, raise "
        "data.validation_percent so that the sources hold out documents, or name the "
        "eval data in data.eval_sources"
      )
    streams = []
    if staging is not None:  # every source reads its windows at once: each its share
      staging = dataclasses.replace(staging, share=len(kept))
    for source in kept:
      records = open_source(source.dataset(split), split, data_dir, features, staging)
      streams.append(
        RecordStream(
          records,
          to_example,
          seed=source_seed(seed, source.label),
          name=f"{source.label}[{split}]",
          shuffle_block=shuffle_block,
          to_batch=to_batch,
          plan=plan_records(records) if plan_records is not None else None,
          cache_rows=global_batch,
          last_record_last=True,
          shard_windows=records.shard_windows,
        )
      )
    weights = [s.weight for s in kept]
    batches = MixtureBatches(
      streams,
      None if None in weights else weights,
      global_batch,
      mesh,
      seed=seed,
      train=train,
      batch_axes=batch_axes,
      labels=[s.label for s in kept],
      name=f"mixture[{split}]",
    )
  except (OSError, ValueError) as e:
    multihost.check_agreement(what, {multihost.ERROR_KEY: f"{type(e).__name__}: {e}"})
    raise
  multihost.check_agreement(
    what,
    {
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
    for source in kept:
      if source.note:
        log.warning("spmd-train: data: %r: %s", source.label, source.note)
    if left_out:
      log.warning(
        "spmd-train: data: %s split: %s hold nothing in it and are left out", split, left_out
      )
    if train and steps:
      log.warning(
        "spmd-train: data: over the run's %d steps, each source's share of %s and its epochs: %s",
        steps,
        unit,
        _epochs_line(batches, steps),
      )
  return batches
