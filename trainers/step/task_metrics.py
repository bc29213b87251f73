"""A task's metrics: the names the trainer keeps for itself, and the loss's own, found up front.

`Task.loss` returns `metric_sums`, a dict of name -> scalar sum. The trainer
reports each by its name: `<name>` in the train metrics (`metrics.jsonl`,
TensorBoard, the progress bar) and `eval_<name>` in the evals (the same
files, the run's summary, the JSON of `spmd-train --mode=eval`). Those
records also hold what the trainer writes itself, so a task metric of the
same name would silently replace it: `RESERVED_METRICS` lists them, in this
one place, and `check_names` refuses them.

`loss_metric_names` evaluates the loss abstractly (shapes only, nothing
computed) on the task's own example shapes, so a bad name or a metric that
is not a scalar is an error at startup, before data preparation and before
any step.

Example:
  >>> check_names({"mae": 0.0, "within_tenth": 0.0}, unit="examples")
  >>> check_names({"perplexity": 0.0}, unit="examples")  # doctest: +ELLIPSIS
  Traceback (most recent call last):
  ...
  spmd.errors.UserError: the task's loss returns the metric 'perplexity': the trainer writes metrics of...
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any

import jax
import numpy as np
from flax import nnx

from spmd import rules as rules_lib
from spmd.errors import UserError
from trainers.step.state import StateSetup, build_model
from trainers.tasks import Task

# Means the eval writes itself (`trainers.run.evaluate.evaluate_batches`), as `eval_<name>`.
TRAINER_EVAL_METRICS = ("loss", "perplexity", "weight")

RESERVED_METRICS: tuple[str, ...] = (
  # The train step's own metrics (trainers/step/train_step.py).
  "loss",
  "grad_norm",
  "learning_rate",
  "finite",
  "bad_steps",
  "weight",
  "units",
  # Added to every fetched row (trainers/run/loop.py, trainers/reporting/throughput.py; the
  # rate `<unit>_per_s` too, see `reserved_names`) and to every JSONL record
  # (trainers/reporting/metrics.py).
  "step",
  "step_time_s",
  "mfu",
  "hfu",
  "time",
  # The eval step's sums (trainers/step/eval_step.py), and the eval's own means
  # `eval_loss`, `eval_perplexity`, `eval_weight` (`TRAINER_EVAL_METRICS`).
  "loss_sum",
  "perplexity",
  # The record of `spmd-train --mode=eval` (trainers/run/evaluate.py): `eval_<name>`.
  "batches",
  "batches_in_split",
  "split",
)
"""Names a task's metric may not take: the trainer writes records of these names itself.

Besides these, `<unit>_per_s` (the task's throughput) and any name starting
with `eval_` (the prefix of every eval metric) are reserved.
"""

EVAL_PREFIX = "eval_"


def reserved_names(unit: str) -> tuple[str, ...]:
  """`RESERVED_METRICS` and the task's throughput key, `<unit>_per_s`.

  Example:
    >>> reserved_names("images")[-1]
    'images_per_s'
  """
  return (*RESERVED_METRICS, f"{unit}_per_s")


def check_names(metric_sums: Mapping[str, Any], unit: str) -> None:
  """Raises naming any metric of the task's loss that the trainer's own records would clash with.

  `unit` is `Task.unit` (its throughput, `<unit>_per_s`, is in every row).
  """
  if not isinstance(metric_sums, Mapping):
    raise TypeError(
      "the task's loss must return (loss_sum, weight, metric_sums) with metric_sums a dict "
      f"of name -> scalar sum ({{}} for none); got {type(metric_sums).__name__}"
    )
  not_text = [name for name in metric_sums if not isinstance(name, str) or not name]
  if not_text:
    raise TypeError(f"the task's loss returns metric names {not_text!r}; names must be strings")
  reserved = reserved_names(unit)
  clash = [n for n in metric_sums if n in reserved or n.startswith(EVAL_PREFIX)]
  if clash:
    which = ", ".join(repr(n) for n in clash)
    one = len(clash) == 1
    raise UserError(
      f"the task's loss returns the metric{'' if one else 's'} {which}: the trainer writes "
      f"metrics of {'that name' if one else 'those names'} itself, which "
      f"{'it' if one else 'they'} would overwrite; rename {'it' if one else 'them'} in the "
      "loss's metric_sums. Reserved: "
      f"{', '.join(reserved)}, and any name starting with {EVAL_PREFIX!r}"
    )


def eval_metrics_of_task(evaluation: Mapping[str, Any]) -> dict[str, Any]:
  """The task's own metrics (`eval_<name>`) in an eval's results, in their order.

  Example:
    >>> eval_metrics_of_task({"eval_loss": 1.0, "eval_perplexity": 2.7, "eval_mae": 0.3,
    ...                       "eval_weight": 64.0})
    {'eval_mae': 0.3}
  """
  own = {EVAL_PREFIX + name for name in TRAINER_EVAL_METRICS}
  return {k: v for k, v in evaluation.items() if k.startswith(EVAL_PREFIX) and k not in own}


@dataclasses.dataclass(frozen=True)
class MetricNames:
  """The names of the metrics the task's loss returns, in train and in eval mode."""

  train: tuple[str, ...]
  eval: tuple[str, ...]


def loss_metric_names(setup: StateSetup, task: Task, global_batch: int) -> MetricNames:
  """The loss's metric names in train and eval mode, checked; from shapes alone, before any data.

  Evaluates `Task.loss` abstractly (`jax.eval_shape`: traced, not compiled or
  run) on the model of `setup` and a batch of `global_batch` examples shaped
  as `Task.example_shapes()` says. Raises naming a reserved name
  (`check_names`) or a metric that is not one number.
  """
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), setup.abstract["params"])
  model_state = setup.abstract.get("model_state")
  if model_state is not None:
    model_state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), model_state)
  batch = {
    k: jax.ShapeDtypeStruct((global_batch, *shape), dtype)
    for k, (shape, dtype) in task.example_shapes().items()
  }
  found = {}
  for train in (True, False):
    if not train and "mask" not in batch:  # eval batches always carry one (their padding)
      batch = dict(batch, mask=jax.ShapeDtypeStruct((global_batch,), np.float32))
    sums = _abstract_metric_sums(setup, task, train, params, model_state, batch, key)
    check_names(sums, task.unit)
    not_scalar = {k: v.shape for k, v in sums.items() if int(np.prod(v.shape)) != 1}
    if not_scalar:
      raise UserError(
        f"the task's loss ({'train' if train else 'eval'} mode) returns metrics that are not "
        f"one number each: {not_scalar}; return each metric's sum over the batch"
      )
    found[train] = tuple(sums)
  return MetricNames(train=found[True], eval=found[False])


def _abstract_metric_sums(setup, task: Task, train: bool, params, model_state, batch, key):
  """The shapes of the loss's `metric_sums`, as the train or eval step would call it."""

  def metric_sums(params, model_state, batch, key):
    model = build_model(setup, params, model_state, key)
    if train:
      model.train()
    else:
      model.eval()
    active = rules_lib.activation_rules(setup.rules, setup.mesh) if setup.mesh else nullcontext()
    with active:
      result = task.loss(model, batch, nnx.Rngs(key), train)
    if not isinstance(result, tuple) or len(result) != 3:
      raise TypeError(
        "the task's loss must return (loss_sum, weight, metric_sums); got "
        f"{type(result).__name__}{f' of {len(result)}' if isinstance(result, tuple) else ''}"
      )
    check_names(result[2], task.unit)  # before jax reads it as a tree
    return dict(result[2])

  return jax.eval_shape(metric_sums, params, model_state, batch, key)
