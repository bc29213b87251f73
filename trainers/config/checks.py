"""The run's config, checked once, up front: keys, types, values, and the task's section.

`resolve(config, config_file)` is what `spmd-train` and `spmd-plan` call on
the config they loaded, before any data preparation or restore:

  1. every key set in the config file (or by an override) must exist in the
     defaults (`trainers/config/defaults.py`) with a value of the same type; a
     misspelt key is an error naming it and the nearest valid key. The
     task's own section, `config.model`, is the task's to check,
     `config.hook_settings` the hook factories', and `config.evals`
     `trainers.evals.specs`' (each entry's keys, and its file read whole);
  2. keys the file leaves out take their default;
  3. `config.task` and `config.hooks` are resolved: a file relative to the
     config file's folder, as an absolute path;
  4. the values the trainer reads are checked, and the task and the hooks
     are built once from the config, which checks their sections.

Example:
  >>> from configs import mlp
  >>> config = mlp.get_config()
  >>> config.train.warmup_step = 10  # misspelt in a config file
  >>> resolve(config)
  Traceback (most recent call last):
  ...
  ValueError: config.train.warmup_step is not a setting (did you mean 'config.train.warmup_steps'?)
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_collections
from flax import nnx

from spmd import rules
from trainers.config import defaults
from trainers.data.prepare import tokenizer
from trainers.evals.items import read_items
from trainers.evals.specs import eval_specs
from trainers.hooks import load_hooks, resolve_hook_specs
from trainers.models import lora
from trainers.reporting import tracking
from trainers.step import optim
from trainers.step.mesh import check_axes
from trainers.step.precision import PRECISIONS
from trainers.step.state import UNANNOTATED_RULES
from trainers.tasks import make_task, resolve_task_spec

TASK_SECTION = "model"  # the task's own section: keys and values are the task's to check
HOOK_SECTION = "hook_settings"  # the hook factories' own section, theirs to check
EVALS_SECTION = "evals"  # named entries, checked by trainers/evals/specs.py
OWN_SECTIONS = (TASK_SECTION, HOOK_SECTION, EVALS_SECTION)


def _flat(config: Mapping, prefix: str = "config") -> dict[str, Any]:
  out = {}
  for key, value in config.items():
    path = f"{prefix}.{key}"
    if isinstance(value, Mapping | ml_collections.ConfigDict) and key not in OWN_SECTIONS:
      out.update(_flat(value, path))
    else:
      out[path] = value
  return out


def _same_type(value: Any, default: Any) -> bool:
  if default is None or value is None:
    return True
  if isinstance(default, bool):
    return isinstance(value, bool)
  if isinstance(default, int):
    return isinstance(value, int) and not isinstance(value, bool)
  if isinstance(default, float):
    return isinstance(value, int | float) and not isinstance(value, bool)
  if isinstance(default, list | tuple):
    return isinstance(value, list | tuple)
  return isinstance(value, type(default))


def check_keys(config: ml_collections.ConfigDict, reference: ml_collections.ConfigDict) -> None:
  """Raises `ValueError` for a key `reference` lacks or a value of another type."""
  known = _flat(reference)
  for path, value in _flat(config).items():
    if path not in known:
      near = difflib.get_close_matches(path, list(known), n=1, cutoff=0.6)
      hint = f" (did you mean {near[0]!r}?)" if near else ""
      raise ValueError(f"{path} is not a setting{hint}")
    if not _same_type(value, known[path]):
      raise ValueError(
        f"{path}={value!r} is a {type(value).__name__}; the setting takes a "
        f"{type(known[path]).__name__} (default {known[path]!r})"
      )


def _merged(config: ml_collections.ConfigDict, reference: ml_collections.ConfigDict):
  """`reference` with every value `config` sets; the task's and the hooks' sections are taken whole."""
  out = ml_collections.ConfigDict(reference.to_dict())
  for key, value in config.items():
    if key in OWN_SECTIONS:
      out[key] = ml_collections.ConfigDict(
        value.to_dict() if hasattr(value, "to_dict") else dict(value)
      )
    elif isinstance(value, Mapping | ml_collections.ConfigDict):
      out[key] = _merged(value, reference[key])
    else:
      out[key] = value
  return out


def _positive(config: ml_collections.ConfigDict, *paths: str) -> None:
  for path in paths:
    value = config
    for part in path.split("."):
      value = value[part]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{path}={value!r} must be a positive integer")


def _one_of(value: Any, name: str, choices: tuple) -> None:
  if value not in choices:
    raise ValueError(f"{name}={value!r} must be one of {choices}")


def check_values(config: ml_collections.ConfigDict) -> None:
  """Raises `ValueError` naming the first value the trainer cannot run with."""
  _positive(config, "global_batch", "train.steps", "train.micro_batches", "log_every")
  if config.global_batch % config.train.micro_batches:
    raise ValueError(
      f"global_batch={config.global_batch} is not divisible by "
      f"train.micro_batches={config.train.micro_batches}"
    )
  rules.preset(config.mesh.rules)
  check_axes(config)
  _one_of(config.mesh.unannotated, "mesh.unannotated", UNANNOTATED_RULES)
  _one_of(config.train.flat_grad_reduce, "train.flat_grad_reduce", ("auto", "on", "off"))
  _one_of(config.train.nonfinite_guard, "train.nonfinite_guard", ("auto", "branch", "select"))
  _one_of(config.train.precision, "train.precision", PRECISIONS)
  _one_of(config.train.optimizer, "train.optimizer", optim.OPTIMIZERS)
  _one_of(config.train.schedule, "train.schedule", optim.SCHEDULES)
  tokenizer.check_spec(config.data.tokenizer)
  tracking.check_settings(config.wandb)
  for pattern in config.train.weight_decay_exclude:
    try:
      re.compile(pattern)
    except (re.error, TypeError) as e:
      raise ValueError(f"train.weight_decay_exclude: {pattern!r} is not a regex: {e}") from None
  for name in (
    "train.warmup_steps",
    "train.weight_decay",
    "train.momentum",
    "train.grad_clip_norm",
    "eval_every",
    "eval_batches",
    "data.prefetch",
    "eval_timeout_s",
    "checkpoint.save_timeout_s",
  ):
    value = config
    for part in name.split("."):
      value = value[part]
    if value < 0:
      raise ValueError(f"{name}={value!r} must be >= 0")
  if not config.data.prepare_timeout_s > 0:
    raise ValueError(f"data.prepare_timeout_s={config.data.prepare_timeout_s!r} must be > 0")
  if config.checkpoint.every < 0 or config.checkpoint.keep < 1:
    raise ValueError(
      f"checkpoint.every={config.checkpoint.every} must be >= 0 and "
      f"checkpoint.keep={config.checkpoint.keep} >= 1"
    )
  for spec in eval_specs(config.evals):
    read_items(spec)  # every row, now: a bad one fails before data preparation
  settings = lora.settings_from_config(config.lora)  # rank, alpha, dropout, the patterns
  if config.lora.init_from and (settings is None or not config.checkpoint.init_from):
    raise ValueError(
      f"lora.init_from={config.lora.init_from!r} starts adapters on the base weights they were "
      "trained on: set lora.targets, lora.rank and lora.alpha as the folder has them, and "
      "checkpoint.init_from to the base model's folder"
    )


def check_lora_targets(config: ml_collections.ConfigDict) -> None:
  """Raises `ValueError` for a `config.lora` the model cannot take, naming the setting.

  A `lora.targets` pattern that matches no parameter of the model, or
  `lora.dropout` > 0 on a model that takes its adapters merged into its
  weights (`lora.check_dropout`).

  On the model's shapes only (`nnx.eval_shape`): nothing is initialised.
  """
  settings = lora.settings_from_config(config.lora)
  if settings is not None:
    task = make_task(config)
    model = nnx.eval_shape(lambda: task.model(nnx.Rngs(0)))
    lora.find_adapters(model, settings)
    lora.check_dropout(settings, model)


def resolve(
  config: ml_collections.ConfigDict, config_file: str | Path | None = None
) -> ml_collections.ConfigDict:
  """The complete, checked config, with `config.task` resolved (see the module docstring)."""
  reference = defaults.get_config()
  check_keys(config, reference)
  resolved = _merged(config, reference)
  folder = Path(config_file).resolve().parent if config_file else None
  resolved.task = resolve_task_spec(resolved.task, folder)
  resolved.hooks = resolve_hook_specs(resolved.hooks, folder)
  check_values(resolved)
  load_hooks(resolved, make_task(resolved).hooks)  # the task checks its own section
  check_lora_targets(resolved)
  return resolved
