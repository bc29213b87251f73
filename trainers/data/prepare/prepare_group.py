"""The processes that prepare data together: which one this is, how many, and how they wait.

Data preparation runs before any device computation, so the group waits
through a barrier of the distributed runtime (`spmd.multihost.barrier`),
handed in by the trainer; this package imports nothing of JAX's. A
preparation that runs alone uses `ALONE`.

Example:
  >>> ALONE.index, ALONE.count, ALONE.owns(3)
  (0, 1, True)
  >>> group = PrepareGroup(index=1, count=2, barrier=lambda name: None)
  >>> [piece for piece in range(5) if group.owns(piece)]
  [1, 3]
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any


def _computed_here(name: str, compute: Callable[[], Any]) -> Any:
  del name  # one process: its own answer is the group's
  return compute()


@dataclasses.dataclass(frozen=True)
class PrepareGroup:
  """This process's place in the group that prepares a dataset.

  Attributes:
    index: this process, from 0; process 0 publishes what the group built.
    count: the processes in the group.
    barrier: `name -> None`, returns once every process of the group has
      called it with `name`.
    agree: `(name, compute) -> value`: `compute()`'s JSON value as process 0
      computed it, on every process (`spmd.multihost.from_process_0`), for
      what the hosts must not see differently (the files of a source).
  """

  index: int
  count: int
  barrier: Callable[[str], None]
  agree: Callable[[str, Callable[[], Any]], Any] = _computed_here
  _calls: itertools.count = dataclasses.field(default_factory=itertools.count, compare=False)

  def __post_init__(self):
    if not 0 <= self.index < self.count:
      raise ValueError(f"PrepareGroup: index={self.index} must be in [0, count={self.count})")

  @property
  def chief(self) -> bool:
    """Whether this process publishes (process 0)."""
    return self.index == 0

  def owns(self, piece: int) -> bool:
    """Whether piece number `piece` (a shard, say) is this process's to write: round robin."""
    return piece % self.count == self.index

  def wait(self, what: str) -> None:
    """Waits for the whole group; every process makes the same calls in the same order.

    The name gets a call number, so one name can be waited at more than once.
    """
    self.barrier(f"{what}/{next(self._calls)}")


ALONE = PrepareGroup(index=0, count=1, barrier=lambda name: None)
