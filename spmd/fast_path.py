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

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax._src.array import ArrayImpl

from spmd.arguments import Arguments
from spmd.placement import Leaf, Plan, broadcast_prefix, is_leaf_plan, needs_moving

# Host values that jax.jit places itself (a fully replicated one even across processes).
_HOST_VALUES = (np.ndarray, np.generic, bool, int, float, complex)


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

  The test costs a few attribute reads per argument when the arguments are
  arrays, one per leaf for other pytrees; anything it cannot admit cheaply
  (a wrong argument count, a tree that does not fit `in_parts`) takes the
  full path, which raises the clear error.
  """

  def __init__(self, jitted: Callable, plan: Plan, arguments: Arguments):
    self.jitted = jitted
    self._in_leaves = plan.in_leaves
    self._across = plan.cross_process
    self._arguments = arguments
    # Per number of positional arguments: each one's Leaf or subtree of Leafs,
    # None for a static one; None overall when the count is wrong.
    self._by_count: dict[int, tuple | None] = {}
    self._per_tree: dict[Any, list[jax.sharding.Sharding] | None] = {}

  def admits(self, args: tuple) -> bool:
    """True when `jax.jit` takes these positional arguments as they are."""
    n = len(args)
    expected = self._by_count[n] if n in self._by_count else self._expect(n)
    if expected is None:
      return False
    across = self._across
    for i, (x, leaf) in enumerate(zip(args, expected)):
      if leaf is None:  # static
        continue
      if type(x) is ArrayImpl and type(leaf) is Leaf:
        sharding = leaf.sharding
        if x._committed:
          if x.sharding != sharding and not x.sharding.is_equivalent_to(sharding, x.ndim):
            return False
        elif across and not sharding.is_fully_replicated:
          return False
      elif not self._admits_tree(i, x, leaf):
        return False
    return True

  def _expect(self, n: int) -> tuple | None:
    arguments = self._arguments
    try:
      arguments.check((None,) * n)
    except ValueError:
      expected = None
    else:
      static = arguments.static_argnums
      n_dynamic = n - len(static)
      if is_leaf_plan(self._in_leaves):
        dynamic = [self._in_leaves] * n_dynamic
      elif type(self._in_leaves) is tuple and len(self._in_leaves) == n_dynamic:
        dynamic = list(self._in_leaves)
      else:
        dynamic = None
      expected = None if dynamic is None else arguments.with_dynamic((None,) * n, dynamic)
    self._by_count[n] = expected
    return expected

  def _admits_tree(self, i: int, x: Any, leaves: Any) -> bool:
    """The test for argument `i` leaf by leaf, its shardings cached per tree structure."""
    values, treedef = jax.tree_util.tree_flatten(x)
    key = (i, treedef)
    shardings = self._per_tree.get(key, False)
    if shardings is False:
      try:
        per_leaf = broadcast_prefix(leaves, x, "in_parts", is_leaf=is_leaf_plan)
        shardings = [leaf.sharding for leaf in per_leaf]
      except ValueError:  # not a prefix: the full path raises the clear error
        shardings = None
      self._per_tree[key] = shardings
    if shardings is None:
      return False
    across = self._across
    return all(jit_takes_as_is(v, s, across) for v, s in zip(values, shardings))
