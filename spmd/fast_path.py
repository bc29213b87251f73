"""When a plain `sharded_jit` call can be the `jax.jit` call itself.

A `jax.jit` with `in_shardings` places host values and uncommitted arrays
itself, but refuses two kinds of argument rather than moving them (see
`_resolve_in_shardings` in `jax/_src/pjit.py`): a committed array sharded
another way (other devices, another split, another memory kind), and,
when the computation spans processes, a numpy value where the sharding is
not fully replicated. `sharded_jit`'s full path moves the first kind device
to device and converts or explains the second. `FastPath.admits` decides
before the call, from each argument's type, sharding and committedness,
whether JAX takes the arguments as they are; only then does the call go
straight to `jax.jit`, so no refusal is ever caught and retried.

Example (the 8 CPU devices the tests configure):
  >>> import jax, numpy as np
  >>> mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
  >>> rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
  >>> jit_takes_as_is(np.ones(2), rows, across_processes=False)
  True
  >>> jit_takes_as_is(jax.device_put(np.ones(2), rows), rows, across_processes=False)
  True
  >>> elsewhere = jax.device_put(np.ones(2), jax.devices()[5])
  >>> jit_takes_as_is(elsewhere, rows, across_processes=False)
  False
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax._src.array import ArrayImpl

from spmd.arguments import Arguments
from spmd.placement import Plan, broadcast_prefix, is_leaf_plan, needs_moving

# Host values that jax.jit places itself (a fully replicated one even across processes).
_HOST_VALUES = (np.ndarray, np.generic, bool, int, float, complex)
# Not yet known; also a "sharding" that no array has.
_UNKNOWN = object()


def jit_takes_as_is(x: Any, sharding: jax.sharding.Sharding, across_processes: bool) -> bool:
  """Whether `jax.jit` with this in-sharding takes `x` without refusing it.

  A tracer is judged by the concrete value it carries (under `jax.grad` JAX
  checks that value); one without (under `jax.jit` or `jax.vmap`) is
  constrained, never refused. Across processes only global arrays, tracers of
  them, and host values for a fully replicated sharding go straight in;
  anything else goes to the full path, which converts it or says why not.
  """
  if needs_moving(x, sharding):
    return False
  if not across_processes:
    return True
  concrete = x.to_concrete_value() if isinstance(x, jax.core.Tracer) else x
  if concrete is None:
    return True
  if isinstance(concrete, jax.Array):
    return concrete.committed or sharding.is_fully_replicated
  return isinstance(concrete, _HOST_VALUES) and sharding.is_fully_replicated


class FastPath:
  """A plan's `jax.jit` for plain calls, and the test that admits a call to it.

  The test is on every plain call, so its common case is one identity check
  per argument: an array whose sharding is the very object the plan holds
  (every output of the plan's programs, and anything placed with it) is
  admitted at once. Other arrays are compared by value, other pytrees leaf
  by leaf; anything it cannot admit cheaply (a wrong argument count, a tree
  that does not fit `in_parts`) takes the full path, which raises the clear
  error.
  """

  def __init__(self, jitted: Callable, plan: Plan, arguments: Arguments):
    self.jitted = jitted
    self._in_leaves = plan.in_leaves
    self._across = plan.cross_process
    self._arguments = arguments
    # Per number of positional arguments: for each one, the sharding of the
    # whole argument, a _Subtree of Leafs, or None for a static one; False
    # when the count is wrong.
    self._by_count: dict[int, tuple | bool] = {}
    self._per_tree: dict[Any, list[jax.sharding.Sharding] | None] = {}
    # The sharding of a call's one argument, when it may have one and no
    # static arguments; otherwise an object no array's sharding is.
    one = self._expect(1)
    self.one = one[0] if one and isinstance(one[0], jax.sharding.Sharding) else _UNKNOWN

  def admits(self, args: tuple) -> bool:
    """True when `jax.jit` takes these positional arguments as they are."""
    expected = self._by_count.get(len(args))
    if expected is None:
      expected = self._expect(len(args))
    if expected is False:
      return False
    for x, want in zip(args, expected):
      if want is None or (type(x) is ArrayImpl and x._sharding is want):
        continue
      if not self._admits_one(x, want):
        return False
    return True

  def _admits_one(self, x: Any, want: Any) -> bool:
    if type(want) is _Subtree:
      return self._admits_tree(x, want, want.leaves)
    if type(x) is ArrayImpl:
      if x._committed:
        return x.sharding == want or x.sharding.is_equivalent_to(want, x.ndim)
      return not self._across or want.is_fully_replicated
    return self._admits_tree(x, want, want)

  def _expect(self, n: int) -> tuple | bool:
    arguments = self._arguments
    try:
      arguments.check((None,) * n)
    except ValueError:
      expected = False
    else:
      n_dynamic = n - len(arguments.static_argnums)
      if is_leaf_plan(self._in_leaves):
        dynamic = [self._in_leaves] * n_dynamic
      elif type(self._in_leaves) is tuple and len(self._in_leaves) == n_dynamic:
        dynamic = list(self._in_leaves)
      else:
        dynamic = None
      if dynamic is None:
        expected = False
      else:
        wants = [e.sharding if is_leaf_plan(e) else _Subtree(e) for e in dynamic]
        expected = arguments.with_dynamic((None,) * n, wants)
    self._by_count[n] = expected
    return expected

  def _admits_tree(self, x: Any, want: Any, prefix: Any) -> bool:
    """The test for `x` leaf by leaf, its shardings cached per tree structure.

    `prefix` is one sharding for the whole argument, or a tree of Leafs;
    `want` (held for the FastPath's life) names it in the cache.
    """
    values, treedef = jax.tree_util.tree_flatten(x)
    key = (id(want), treedef)
    shardings = self._per_tree.get(key, _UNKNOWN)
    if shardings is _UNKNOWN:
      try:
        per_leaf = broadcast_prefix(prefix, x, "in_parts", is_leaf=is_leaf_plan)
        shardings = [p.sharding if is_leaf_plan(p) else p for p in per_leaf]
      except ValueError:  # not a prefix: the full path raises the clear error
        shardings = None
      self._per_tree[key] = shardings
    if shardings is None:
      return False
    across = self._across
    return all(jit_takes_as_is(v, s, across) for v, s in zip(values, shardings))


@dataclasses.dataclass(frozen=True)
class _Subtree:
  """An argument whose parts in_parts splits differently: a tree of Leafs."""

  leaves: Any
