"""Hooks: periodic work with its own schedule, seeing a read-only view of the step.

  hook.py      `Hook` (a function and when it runs) and `StepInfo` (what it sees)
  loading.py   the task's hooks and those `config.hooks` names
  builtin.py   the trainer's own: metrics, eval, checkpoints, profile

`from trainers.hooks import Hook, StepInfo` is the public API.
"""

from trainers.hooks.hook import Hook, StepInfo
from trainers.hooks.loading import load_hooks, resolve_hook_specs

__all__ = ["Hook", "StepInfo", "load_hooks", "resolve_hook_specs"]
