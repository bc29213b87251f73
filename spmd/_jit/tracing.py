"""What a `sharded_jit` function sees while JAX traces it.

The computation being traced is held in a `contextvars.ContextVar`, so it
follows the call that set it and nothing else. `with_sharding_constraint`
reads it to pin a value's sharding on that computation's mesh; a
`sharded_jit` called inside becomes constraints (`constrain`) instead of a
call; and when every spec is replicated, tracing once with no mesh records
the constraints' counts (`discover_num_partitions`).

Example:
  >>> import numpy as np
  >>> from spmd import PartitionSpec, sharded_jit
  >>> def f(x):
  ...   return with_sharding_constraint(x + 1, PartitionSpec(1, 1)) * 2
  >>> sharded_jit(f, in_parts=None, out_parts=None)(np.zeros((2, 2))).tolist()
  [[2.0, 2.0], [2.0, 2.0]]
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from spmd._jit.placement import broadcast_prefix, sharding_for
from spmd.partition import PartitionSpec, check_spec_tree, is_spec_leaf


@dataclasses.dataclass
class Context:
  """The sharded_jit computation being traced."""

  name: str
  mesh: jax.sharding.Mesh | None  # None while discovering the count
  num_partitions: int | None
  recorded: list[tuple[str, PartitionSpec]] = dataclasses.field(default_factory=list)


# Set while a sharded_jit function is traced.
current: contextvars.ContextVar[Context | None] = contextvars.ContextVar(
  "sharded_jit_tracing", default=None
)
# Set around a cross-process call that converted this process's pieces: the
# agreement check at trace time compares their shapes, which the traced
# global values no longer show. Holds (the ShardedJitFunction, its leaves).
pieces: contextvars.ContextVar[tuple[Any, list] | None] = contextvars.ContextVar(
  "sharded_jit_pieces", default=None
)


@contextlib.contextmanager
def setting(var: contextvars.ContextVar, value: Any):
  """`var` is `value` inside the block, and what it was after it."""
  token = var.set(value)
  try:
    yield
  finally:
    var.reset(token)


def with_sharding_constraint(x: Any, partitions: Any) -> Any:
  """Identity that pins how `x` is split, inside a `sharded_jit` function.

  `partitions` is a count spec whose product matches the enclosing
  computation, a named spec when `sharded_jit` was given a mesh, or None to
  replicate. Under `jax.grad` the cotangent is constrained the same way.

  Example:
    >>> import numpy as np
    >>> from spmd import PartitionSpec, sharded_jit
    >>> def f(x):
    ...   return with_sharding_constraint(x + 1, PartitionSpec(1, 1)) * 2
    >>> sharded_jit(f, in_parts=None, out_parts=None)(np.zeros((2, 2))).tolist()
    [[2.0, 2.0], [2.0, 2.0]]
  """
  ctx = current.get()
  if ctx is None:
    raise NotImplementedError(
      "with_sharding_constraint() should only be called inside sharded_jit()"
    )
  check_spec_tree(partitions, "with_sharding_constraint partitions")
  if ctx.mesh is None:  # discovering the partition count: just record
    if isinstance(partitions, PartitionSpec):
      ctx.recorded.append(("with_sharding_constraint", partitions))
    return x
  sharding = sharding_for(
    partitions, ctx.mesh, ctx.num_partitions, "with_sharding_constraint partitions"
  )
  return jax.tree_util.tree_map(lambda leaf: jax.lax.with_sharding_constraint(leaf, sharding), x)


def constrain(
  parts: Any, values: Any, mesh: jax.sharding.Mesh, num_partitions: int, what: str
) -> Any:
  """`values` pinned to the shardings of the spec tree `parts` (a prefix of them)."""

  def one(spec, sub):
    sharding = sharding_for(spec, mesh, num_partitions, what)
    return jax.tree_util.tree_map(lambda v: jax.lax.with_sharding_constraint(v, sharding), sub)

  broadcast_prefix(parts, values, what)  # a clear error if not a prefix
  return jax.tree_util.tree_map(one, parts, values, is_leaf=is_spec_leaf)


def discover_num_partitions(name: str, traced: Callable, *args: Any) -> int:
  """The one count that the constraints inside `traced(*args)` agree on (1 if none)."""
  ctx = Context(name, None, None)
  with setting(current, ctx):
    jax.eval_shape(traced, *args)
  counts = {}
  for what, spec in ctx.recorded:
    counts.setdefault(spec.num_partitions, []).append(f"{what} {spec}")
  if len(counts) > 1:
    raise ValueError(f"sharded_jit({name}): constraints disagree on the partition count: {counts}")
  return next(iter(counts), 1)
