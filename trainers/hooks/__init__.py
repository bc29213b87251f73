"""Hooks: periodic work with its own schedule, seeing a read-only view of the step.

  hook.py      `Hook` (a function and when it runs) and `StepInfo` (what it sees)
  wrapper.py   `Wrapper`: your code around this process's rows, the batches, the train step
  loading.py   the task's hooks and those `config.hooks` names
  builtin.py   the trainer's own: metrics, eval, checkpoints, profile

`from trainers.hooks import Hook, StepInfo, Wrapper` is the public API.
"""

from trainers.hooks.hook import Hook, StepInfo
from trainers.hooks.loading import load_hooks, resolve_hook_specs
from trainers.hooks.wrapper import StepContext, Wrapper

__all__ = ["Hook", "StepContext", "StepInfo", "Wrapper", "load_hooks", "resolve_hook_specs"]
