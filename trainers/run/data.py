"""The run's data: prepared once (together, or process 0 first), then opened by every host for its own rows."""

from __future__ import annotations

import functools
import logging
import pathlib

import jax
import ml_collections
from etils import epath

from spmd import multihost
from spmd import rules as rules_lib
from spmd.errors import UserError
from trainers import paths
from trainers.data.prepare.prepare_group import PrepareGroup
from trainers.data.read import mixture, pipeline
from trainers.step.loss import batch_shardings
from trainers.tasks import Task, check_host_labels

log = logging.getLogger(__name__)


def open_data(config: ml_collections.ConfigDict, task: Task, workdir, mesh, batch_axes):
  """(train batches, eval batches), once the data is prepared.

  A local or mounted `data.dir` and a task that `prepares_together` (the
  LM tasks' `data.sources`): every process prepares its share at once, in
  place (`trainers.data.prepare.source_shards`). Otherwise process 0 prepares first
  and the others then find it prepared.

  A remote `data.dir` (`gs://...`): process 0 prepares the dataset in its
  local cache and uploads it; every host then copies `data.dir` to its own
  local cache (`paths.local_cache`) and reads from there, since ArrayRecord
  reads local files only. A file already there is kept when it is a copy of
  the same version (`paths.copy_tree`).

  Both streams check the task's labels (`Task.label_classes`) in each
  host's rows before placing them: a compiled step cannot name a bad label.
  """
  train, evaluation = _open_streams(config, task, workdir, mesh, batch_axes)
  # With the sequence split over `context`, each device gets only its slice
  # of its rows' sequence features, as the steps take them.
  placement = batch_shardings(task, rules_lib.preset(config.mesh.rules), mesh, batch_axes)
  for stream in (train, evaluation):
    stream.place_features(placement)
  if task.label_classes:
    for stream in (train, evaluation):
      stream.wrap_host_rows(_label_check(task.label_classes, stream.layout.host().rows.start))
  return train, evaluation


def _label_check(label_classes, first_row: int):
  def check(step, rows):
    check_host_labels(step, rows, label_classes, first_row)
    return rows

  return check


def _open_streams(config: ml_collections.ConfigDict, task: Task, workdir, mesh, batch_axes):
  """`open_data`'s (train, eval) streams, before their checks."""
  data_dir = paths.user_path(config.data.dir or paths.user_path(workdir).parent / "data")
  local = data_dir if not paths.is_url(data_dir) else paths.local_cache("data", data_dir)
  staging = None
  timeout_s = float(config.data.get("prepare_timeout_s", 3600.0))
  cache_bytes = int(config.data.get("cache_bytes", 0))
  if cache_bytes < 0:
    raise UserError(f"config.data.cache_bytes={cache_bytes} must be 0 (copy whole) or a size")
  if cache_bytes and local == data_dir:
    log.warning(
      "spmd-train: data.cache_bytes applies to a gs:// data.dir; %s is read in place", data_dir
    )
  if local != data_dir and cache_bytes:
    from trainers.data.records.datasets import Staging  # tfds is imported only when used
    from trainers.data.records.shard_cache import ShardCache

    name = _prepare_on_process_0_first(task, data_dir, local, timeout_s, staged=True)
    folder = paths.local_cache("staged", data_dir) / f"process-{jax.process_index()}"
    cache = ShardCache(folder, cache_bytes)
    staging = Staging(remote=str(data_dir), local=str(local), cache=cache)
  elif task.prepares_together and local == data_dir:
    name = task.prepare_data(str(local), _group(timeout_s))
  else:
    name = _prepare_on_process_0_first(task, data_dir, local, timeout_s)
  data_dir = local
  common = dict(
    global_batch=config.global_batch,
    mesh=mesh,
    batch_axes=batch_axes,
    plan_records=task.plan_records,  # windows per record from the data itself
    features=tuple(task.record_template),  # decode only what the task reads
    shuffle_block=config.data.shuffle_block,
    to_batch=task.to_batch,
    staging=staging,
  )
  if isinstance(name, mixture.DataMixture):  # several sources (config.data.sources)
    return _open_mixture(config, task, name, str(data_dir), common)
  if config.data.get("sources"):
    raise UserError(
      f"config.data.sources is set, but config.task={config.task!r} prepares its own data "
      f"({name!r}); only the LM tasks read data.sources"
    )
  common["examples_per_record"] = task.examples_per_record
  train = pipeline.open_global_batches(
    name,
    config.data.train_split,
    str(data_dir),
    task.to_example,
    seed=config.seed,
    train=True,
    **common,
  )
  evaluation = pipeline.open_global_batches(
    name, config.data.eval_split, str(data_dir), task.to_example, train=False, **common
  )
  return train, evaluation


def _group(timeout_s: float) -> PrepareGroup:
  """Every process of the job, waiting through the distributed runtime (no device computation)."""
  return PrepareGroup(
    index=jax.process_index(),
    count=jax.process_count(),
    barrier=lambda name: _wait(name, timeout_s),
    agree=lambda name, compute: multihost.from_process_0(f"data/{name}", compute),
  )


def _wait(name: str, timeout_s: float, what: str | None = None) -> None:
  """The barrier `data/<name>`; its expiry is a `UserError` naming the step and the setting.

  `what` names what the processes were preparing; by default `name` does,
  without its call number (`PrepareGroup.wait`'s names:
  `packed_source/<config>/1.0.0/tokenized/3`).
  """
  try:
    multihost.barrier(f"data/{name}", timeout_s=timeout_s)
  except Exception as e:  # the runtime raises a bare JaxRuntimeError
    if "DEADLINE_EXCEEDED" not in str(e):
      raise
    if what is None:
      what = repr(name.rsplit("/", 1)[0] if name.rsplit("/", 1)[-1].isdigit() else name)
    raise UserError(
      f"data: the processes did not all finish preparing {what} within "
      f"data.prepare_timeout_s={timeout_s:g} s: a process that failed says why in its own "
      "log; if they are still at work (a large corpus), raise data.prepare_timeout_s"
    ) from None


def _prepare_on_process_0_first(
  task: Task, data_dir: epath.Path, local, timeout_s: float, staged: bool = False
):
  """The task's data prepared by process 0 (and uploaded to a remote `data.dir`), then found.

  A remote `data.dir` is copied to each host's `local` cache; `staged`: its
  metadata only (everything but the shards), which is what opening it
  needs, the shards being staged on demand (`ShardCache`), and process 0
  removes the shards it prepared once they are uploaded.
  """
  exclude = _is_shard if staged else None
  prepare = task.prepare_data
  if task.prepares_together:  # it lists sources: every process takes process 0's listing
    prepare = functools.partial(task.prepare_data, group=_listed_by_process_0())
  # Process 0 builds; the others wait, then find it built (no race on files).
  if jax.process_index() == 0:
    if local != data_dir and data_dir.exists():
      paths.copy_tree(data_dir, epath.Path(local), exclude=exclude)
    name = prepare(str(local))
    shards = []
    if staged:
      shards = [p for p in pathlib.Path(local).rglob("*") if _is_shard(p.name) and p.is_file()]
    if local != data_dir and (shards or not staged):  # staged: only what was prepared here
      uploaded = paths.copy_tree(epath.Path(local), data_dir)
      log.warning(
        "spmd-train: data prepared in %s; %d files uploaded to %s", local, uploaded, data_dir
      )
    for path in shards:  # the bucket is where they are read from
      path.unlink()
  _wait("prepared_by_process_0", timeout_s, f"the task's data (process 0 prepares it in {local})")
  if jax.process_index() != 0:
    if local != data_dir:
      paths.copy_tree(data_dir, epath.Path(local), exclude=exclude)
    name = prepare(str(local))
  return name


def _listed_by_process_0() -> PrepareGroup:
  """A group of one that prepares alone but lists the sources as process 0 did.

  Process 0 prepares first; the others, once it is done, find its datasets.
  They must look for the datasets of its listing: a file that landed in
  the meantime would name other datasets, which a process would prepare
  alone, and the hosts would read different data.
  """
  return PrepareGroup(
    index=0,
    count=1,
    barrier=lambda name: None,
    agree=lambda name, compute: multihost.from_process_0(f"data/{name}", compute),
  )


def _is_shard(name: str) -> bool:
  """A dataset's ArrayRecord shard (TFDS's `NAME-SPLIT.array_record-0000k-of-0000n`)."""
  return ".array_record-" in name


def _open_mixture(config, task: Task, prepared: mixture.DataMixture, data_dir: str, common: dict):
  """(train, eval) batches of a mixture: the weighted sources, then each source's eval split."""
  train = mixture.open_mixture_batches(
    prepared,
    config.data.train_split,
    data_dir,
    task.to_example,
    seed=config.seed,
    train=True,
    steps=config.train.steps,
    unit=task.unit,
    **common,
  )
  evaluation = mixture.open_mixture_batches(
    prepared, config.data.eval_split, data_dir, task.to_example, train=False, **common
  )
  return train, evaluation
