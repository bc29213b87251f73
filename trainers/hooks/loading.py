"""Hooks from the config: `config.hooks` specs resolved and their factories called.

A spec is "package.module:function" or "file.py:function" beside the config
file (as `config.task`'s); each `function(config)` returns a `Hook`, a
`Wrapper`, or a list of them. Their settings may live in
`config.hook_settings`, a section the trainer leaves to them (as
`config.model` is the task's).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ml_collections

from trainers.hooks.hook import Hook, StepInfo
from trainers.hooks.wrapper import Wrapper
from trainers.tasks import load_task_factory, resolve_task_spec


def _as_hooks(made: Any, spec: str) -> list[Hook | Wrapper]:
  hooks = [made] if isinstance(made, Hook | Wrapper) else list(made or ())
  for hook in hooks:
    if not isinstance(hook, Hook | Wrapper):
      raise TypeError(
        f"config.hooks: {spec} returned {hook!r}, not a trainers.hooks.Hook or Wrapper"
      )
  return hooks


def resolve_hook_specs(specs: Sequence[str], config_dir: str | Path | None) -> tuple[str, ...]:
  """`config.hooks` with file specs made absolute (as `config.task`'s are)."""
  return tuple(resolve_task_spec(spec, config_dir) for spec in specs)


def load_hooks(
  config: ml_collections.ConfigDict, task_hooks: Sequence[Hook | Wrapper] = ()
) -> list[Hook | Wrapper]:
  """The task's hooks and wrappers, then those `config.hooks` names, each factory called with `config`.

  Example:
    >>> from configs import default
    >>> config = default.get_config()
    >>> config.hooks = ("trainers.hooks.loading:example_hooks",)
    >>> load_hooks(config)
    [Hook(log_step, every=100, at=[], metrics=True)]
  """
  hooks = _as_hooks(list(task_hooks), "Task.hooks")
  for spec in config.get("hooks", ()):
    hooks += _as_hooks(load_task_factory(spec)(config), spec)
  return hooks


def example_hooks(config: ml_collections.ConfigDict) -> Hook:
  """A `config.hooks` factory: the loss at info level every 100 steps (for the docs)."""

  def log_step(info: StepInfo) -> None:
    logging.info("step %d: loss %.4f", info.step, info.metrics["loss"])

  return Hook(log_step, every=100, metrics=True)
