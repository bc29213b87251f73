"""`spmd-train --mode=eval`: evaluate a saved checkpoint, on any number of hosts.

  spmd-train --mode=eval --workdir=W                    # the latest committed step
  spmd-train --mode=eval --workdir=W --step=200         # a named step
  spmd-train --mode=eval --workdir=W --checkpoint=OTHER/checkpoints[/200]
  spmd-train --mode=eval --workdir=W --eval_batches=0   # the whole eval split
  spmd-train --mode=eval --workdir=W --config=W/code/config.py [--config.x=...]

Without `--config` the run's own resolved config (`W/config.json`) is used
(see `trainers.checkpoints.saved_run`). The parameters (and model state) alone are
restored, into the current mesh's shardings: the checkpoint may come from
any mesh and process count, and no optimizer state is read. The eval split
is read once, in order, each example exactly once (the last batch padded
with masked rows), over `config.eval_batches` batches (0: all of them), with
the same eval step as training: for the same step and batches the metrics
equal the run's own eval.

Process 0 writes the metrics to `W/eval/step_<N>.json` (the training run's
`metrics.jsonl` is not touched) and prints them: `eval_loss`,
`eval_perplexity`, `eval_weight`, each metric of the task's loss as
`eval_<its name>`, and each of `config.evals` as `evals/<name>/<metric>`
(`trainers/evals`; a generation eval's completions go to
`W/evals/<name>/step_<N>.jsonl`). Failures are reported as a training run's are: every
process stops, naming the one that failed.

Example (one process; `W` a finished run of a task whose loss returns `mae`):
  >>> evaluate_run("W", step=200)  # doctest: +SKIP
  {'step': 200, 'eval_loss': 0.19, 'eval_perplexity': 1.21, 'eval_mae': 0.41, ...}
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from etils import epath

import spmd
from spmd import multihost
from trainers import paths
from trainers.checkpoints import saved_run
from trainers.data.read import pipeline
from trainers.evals.encoding import run_encoder
from trainers.evals.runner import PREFIX as EVALS_PREFIX
from trainers.evals.runner import EvalRunner
from trainers.run.data import open_data
from trainers.run.startup import config_hash
from trainers.run.watchdog import ProgressWatchdog
from trainers.step import task_metrics
from trainers.step.eval_step import eval_inputs, make_eval_step
from trainers.step.mesh import build_mesh
from trainers.step.state import make_state
from trainers.tasks import make_task

log = logging.getLogger(__name__)
EVAL_DIR = "eval"


def evaluate_batches(eval_step, batches: pipeline.GlobalBatches, state, max_batches: int) -> dict:
  """Exact means over the eval batches: the task's sums, divided by their total weight.

  `eval_loss`, `eval_perplexity` and `eval_weight` are the trainer's own
  (`task_metrics.TRAINER_EVAL_METRICS`); each metric of the task's loss is
  `eval_<its name>`, whatever the names (none at all included).
  """
  steps = batches.steps_per_epoch if max_batches <= 0 else min(max_batches, batches.steps_per_epoch)
  inputs = eval_inputs(state)
  sums = [eval_step(inputs, batch) for _, batch in batches.iterator(0, prefetch=1, num_steps=steps)]
  totals = jax.device_get(sums)  # one transfer for the whole eval
  added = {k: sum(float(t[k]) for t in totals) for k in totals[0]}
  weight = max(added.pop("weight"), 1e-9)
  loss = added.pop("loss_sum") / weight
  out = {"eval_loss": loss, "eval_perplexity": float(np.exp(min(loss, 50.0)))}
  out.update({f"eval_{k}": v / weight for k, v in added.items()})
  out["eval_weight"] = weight
  return out


def eval_file(workdir: str | epath.Path, step: int) -> epath.Path:
  """Where an eval-only run of `step` writes its metrics."""
  return paths.user_path(workdir) / EVAL_DIR / f"step_{step}.json"


def evaluate_run(
  workdir: str,
  config: ml_collections.ConfigDict | None = None,
  *,
  step: int | None = None,
  checkpoint: str = "",
  eval_batches: int | None = None,
) -> dict[str, Any]:
  """Evaluates one checkpoint of a run; returns the metrics (every process).

  Args:
    workdir: the run's workdir: its `config.json`, `checkpoints/` and where
      `eval/step_<N>.json` is written.
    config: a resolved config (`trainers.config.resolve`); None reads the
      run's own `config.json`.
    step: the checkpoint step; None: the latest committed one.
    checkpoint: another checkpoint location (a workdir, an orbax checkpoint
      directory or one step's directory) instead of `<workdir>/checkpoints`.
    eval_batches: batches to evaluate, replacing `config.eval_batches`
      (0: the whole eval split).

  Raises:
    FileNotFoundError: no config, no checkpoint, or no such step (the
      message names the directory and the committed steps).
    CheckpointError: the step is unfinished, damaged, or of another model.
  """
  if eval_batches is not None and eval_batches < 0:
    raise ValueError(f"--eval_batches={eval_batches} must be >= 0 (0: the whole eval split)")
  spmd.initialize()
  workdir_path = paths.user_path(workdir)
  if config is None:
    config = saved_run.saved_config(workdir_path, "or pass the run's config file with --config")
  if eval_batches is not None:
    config = ml_collections.ConfigDict(config.to_dict())  # the caller's stays as it was
    config.eval_batches = eval_batches
  # From the start, as in training: a process waiting for its peers hears of
  # a peer's failure at once; restore and compilation count as the first step.
  watchdog = ProgressWatchdog(config.train.step_timeout_s, config.train.first_step_timeout_s)
  try:
    return _evaluate_run(config, workdir_path, step, checkpoint, watchdog)
  finally:
    watchdog.close()


def _evaluate_run(
  config: ml_collections.ConfigDict,
  workdir: epath.Path,
  step: int | None,
  checkpoint: str,
  watchdog: ProgressWatchdog,
) -> dict[str, Any]:
  started = time.perf_counter()
  chief = jax.process_index() == 0
  cache_dir = str(
    paths.user_path(
      config.get("compilation_cache_dir", "")
      or os.environ.get("JAX_COMPILATION_CACHE_DIR", "")
      or workdir.parent / ".jax_cache"
    )
  )
  jax.config.update("jax_compilation_cache_dir", cache_dir)

  ref = saved_run.find_checkpoint(workdir, checkpoint, step)
  mesh, batch_axes = build_mesh(config)
  task = make_task(config)
  setup = make_state(task.model, config, mesh, batch_axes, task.optimizer)
  task_metrics.loss_metric_names(setup, task, config.global_batch)  # before any data
  evals = EvalRunner.build(config, setup, task, batch_axes)  # config.evals, its files read
  with watchdog.phase("data preparation", 0, "none"):
    _, batches = open_data(config, task, workdir, mesh, batch_axes)
  if evals is not None:
    evals.prepare(run_encoder(config, str(workdir)))
  # Every host reads the same step of the same checkpoint with the same config:
  # a step committed while the hosts listed the directory must not split them.
  multihost.check_agreement(
    "spmd-train --mode=eval start",
    {
      "config": config_hash(config),
      "checkpoint": str(ref.directory),
      "step": ref.step,
      "data": batches.fingerprint,
    },
  )
  weights = saved_run.restore_run_weights(ref, setup, config)  # a LoRA run's with its base
  eval_step = make_eval_step(setup, task, mesh, batch_axes)
  with watchdog.phase("an eval", config.eval_timeout_s, "eval_timeout_s"):
    metrics = evaluate_batches(eval_step, batches, weights, config.eval_batches)
    if evals is not None:
      metrics.update(evals(weights, ref.step, str(workdir)))
  evaluated = (
    batches.steps_per_epoch
    if config.eval_batches <= 0
    else min(config.eval_batches, batches.steps_per_epoch)
  )
  record = {
    "step": ref.step,
    **metrics,
    "checkpoint": str(ref.path),
    "eval_split": config.data.eval_split,
    "eval_batches": evaluated,
    "eval_batches_in_split": batches.steps_per_epoch,
    "global_batch": config.global_batch,
    "processes": jax.process_count(),
    "devices": jax.device_count(),
    "time": time.time(),
    "wall_time_s": time.perf_counter() - started,
  }
  if chief:
    path = eval_file(workdir, ref.step)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(format_eval(record, path), flush=True)
  return record


def format_eval(record: dict[str, Any], path: epath.Path | str) -> str:
  """The printed table of an eval-only run.

  Example:
    >>> print(format_eval({"step": 3, "eval_loss": 1.5, "eval_batches": 2,
    ...                    "eval_batches_in_split": 4, "checkpoint": "/c/3"}, "/w/eval/step_3.json"))
    eval of checkpoint step 3
      eval_loss             : 1.5
      batches               : 2 of 4 in the split
      checkpoint            : /c/3
      written to            : /w/eval/step_3.json
  """
  rows = [f"eval of checkpoint step {record['step']}"]
  for key, value in record.items():
    if key.startswith((f"{EVALS_PREFIX}/", "eval_")) and key not in (
      "eval_batches",
      "eval_batches_in_split",
      "eval_split",
    ):
      rows.append(f"  {key:<22}: {value:.6g}")
  rows.append(
    f"  {'batches':<22}: {record['eval_batches']} of {record['eval_batches_in_split']} in the split"
  )
  rows.append(f"  {'checkpoint':<22}: {record['checkpoint']}")
  rows.append(f"  {'written to':<22}: {path}")
  return "\n".join(rows)
