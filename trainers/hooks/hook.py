"""Hooks: periodic work, registered with its schedule, seeing a read-only view of the step.

A hook is a function of a `StepInfo`, wrapped in a `Hook` that says when it
runs: every N steps (and after the last), at given steps, or both. The
built-in metrics, eval, checkpoint and profile work are hooks of the same
kind (`trainers.run.loop`); yours come from the task (`Task.hooks`) or the config
(`config.hooks`, specs like `config.task`'s: "package.module:function" or
"file.py:function" beside the config file, each `function(config)` returning
a `Hook` or a list of them).

Every process runs every hook at the same steps, so a hook may run
collectives (an eval, a save, a global norm). Nothing forces a host sync:
`info.metrics` is fetched from the devices only for a hook that asks
(`metrics=True`), together with the pending metrics of the steps before it;
otherwise it is None. Reading device values (`jax.device_get`) is the
hook's own choice, and costs a sync when it runs.

Example, a hook logging the parameters' global norm every 50 steps:

  >>> import logging, optax
  >>> def param_norm(info: StepInfo) -> None:
  ...   norm = jax.device_get(optax.global_norm(info.state["params"]))
  ...   logging.info("step %d: parameter norm %.3f", info.step, norm)
  >>> hook = Hook(param_norm, every=50)
  >>> [s for s in range(1, 121) if hook.due(s, total_steps=120)]
  [50, 100, 120]
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import jax


class ReadOnlyRows(Sequence):
  """A read-only view of the fetched metric rows (no copy per step): `StepInfo.history`."""

  def __init__(self, rows: list[dict]):
    self._rows = rows

  def __getitem__(self, i):
    got = self._rows[i]
    if isinstance(i, slice):
      return tuple(types.MappingProxyType(r) for r in got)
    return types.MappingProxyType(got)

  def __len__(self) -> int:
    return len(self._rows)

  def __iter__(self) -> Iterator[Mapping[str, float]]:
    return (types.MappingProxyType(r) for r in self._rows)


@dataclasses.dataclass(frozen=True)
class StepInfo:
  """What a hook sees: the step just finished, read-only.

  Attributes:
    step: steps completed (1 after the first).
    total_steps: the step the run ends at.
    state: the train state, a read-only mapping of global device arrays:
      "params", "opt_state", "step", "updates", "bad_steps", and "model_state" for
      models with other variables.
    mesh: the run's mesh.
    workdir: the run's directory (an `etils.epath.Path`; may be `gs://`).
    metrics: this step's metrics (loss, grad_norm, learning_rate, the task's,
      throughput) for a hook registered with `metrics=True`; else None.
    history: every metrics row fetched so far, oldest first; each row has
      its "step".
    model: `() -> nnx.Module`, the model with these parameters (built on
      call, in eval mode).
  """

  step: int
  total_steps: int
  state: Mapping[str, Any]
  mesh: jax.sharding.Mesh
  workdir: Any
  metrics: Mapping[str, float] | None
  history: Sequence[Mapping[str, float]]
  model: Callable[[], Any]


class Hook:
  """`fn(info)` after each step where `due` holds, on every process.

  Args:
    fn: `StepInfo -> None`.
    every: run every this many steps, and after the last step (0 = never).
    at: steps to run at as well (e.g. where a profile starts and stops).
    metrics: fetch the metrics for `info.metrics` (one host sync when due).
    end: optional `(info, ok) -> None | Mapping`, called once after the loop,
      on every process; `ok` is False after an error (then other hosts may be
      gone, so it must not run collectives). A preemption is ok. The mapping
      it returns, if any, joins the run's summary (`summary.json` and the
      printed table): entries of your own, under names the summary does not
      already use.
    name: for logs and errors (default: `fn`'s name).

  Example:
    >>> Hook(print, every=10, at=(3,)).due(3, total_steps=100)
    True
  """

  def __init__(
    self,
    fn: Callable[[StepInfo], None],
    *,
    every: int = 0,
    at: Collection[int] = (),
    metrics: bool = False,
    end: Callable[[StepInfo, bool], Mapping[str, Any] | None] | None = None,
    name: str = "",
  ):
    if not callable(fn):
      raise TypeError(f"Hook fn={fn!r} is not callable")
    if not isinstance(every, int) or every < 0:
      raise ValueError(f"Hook {name or fn!r}: every={every!r} must be an int >= 0")
    self.fn, self.every, self.at = fn, every, frozenset(int(s) for s in at)
    self.metrics, self.end = bool(metrics), end
    self.name = name or getattr(fn, "__name__", type(fn).__name__)

  def due(self, step: int, total_steps: int) -> bool:
    """Whether the hook runs after `step`."""
    if step in self.at:
      return True
    return self.every > 0 and (step % self.every == 0 or step == total_steps)

  def __repr__(self) -> str:
    return f"Hook({self.name}, every={self.every}, at={sorted(self.at)}, metrics={self.metrics})"
