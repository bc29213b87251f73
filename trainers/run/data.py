"""The run's data: prepared once (process 0 first), then opened by every host for its own rows."""

from __future__ import annotations

import logging

import jax
import ml_collections
from etils import epath

from spmd import multihost
from trainers import paths
from trainers.data import pipeline
from trainers.tasks import Task

log = logging.getLogger(__name__)


def open_data(config: ml_collections.ConfigDict, task: Task, workdir, mesh, batch_axes):
  """(train batches, eval batches); process 0 prepares the data first.

  A remote `data.dir` (`gs://...`): process 0 prepares the dataset in its
  local cache and uploads it; every host then copies `data.dir` to its own
  local cache (`paths.local_cache`) and reads from there, since ArrayRecord
  reads local files only. A file already there is kept when it is a copy of
  the same version (`paths.copy_tree`).
  """
  data_dir = paths.user_path(config.data.dir or paths.user_path(workdir).parent / "data")
  local = data_dir if not paths.is_url(data_dir) else paths.local_cache("data", data_dir)
  # Process 0 builds; the others wait, then find it built (no race on files).
  if jax.process_index() == 0:
    if local != data_dir and data_dir.exists():
      paths.copy_tree(data_dir, epath.Path(local))
    name = task.prepare_data(str(local))
    if local != data_dir:
      uploaded = paths.copy_tree(epath.Path(local), data_dir)
      log.warning(
        "spmd-train: data prepared in %s; %d files uploaded to %s", local, uploaded, data_dir
      )
  multihost.barrier("data_prepared", timeout_s=3600)
  if jax.process_index() != 0:
    if local != data_dir:
      paths.copy_tree(data_dir, epath.Path(local))
    name = task.prepare_data(str(local))
  data_dir = local
  common = dict(
    global_batch=config.global_batch,
    mesh=mesh,
    batch_axes=batch_axes,
    examples_per_record=task.examples_per_record,
    plan_records=task.plan_records,  # windows per record from the data itself
    features=tuple(task.record_template),  # decode only what the task reads
    shuffle_block=config.data.shuffle_block,
    to_batch=task.to_batch,
  )
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
