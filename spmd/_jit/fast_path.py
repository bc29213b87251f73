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

from spmd._jit.arguments import Arguments
from spmd._jit.placement import Plan, is_leaf_plan, needs_moving
from spmd.compat import ARRAY_TYPE, sharding_of

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
  admitted at once. Other arguments are tested leaf by leaf against the
  shardings the plan resolved for their tree structure. A structure the plan
  has not resolved yet (a first call, a wrong argument count, a tree that
  does not fit `in_parts`) takes the full path, which resolves it or raises
  the clear error.
  """

  def __init__(self, jitted: Callable, plan: Plan, arguments: Arguments):
    self.jitted = jitted
    self._plan = plan
    self._arguments = arguments
    # Per number of positional arguments: each one's sharding when in_parts
    # gives the whole argument one (otherwise _UNKNOWN), None for a static
    # one; False when the count does not fit static_argnums and in_parts.
    self._by_count: dict[int, tuple | bool] = {}
    # The sharding of a call's one argument, when it may have one and no
    # static arguments; otherwise an object no array's sharding is.
    one = self._expect(1)
    self.one = one[0] if one and one[0] is not None else _UNKNOWN

  def admits(self, args: tuple) -> bool:
    """True when `jax.jit` takes these positional arguments as they are."""
    expected = self._by_count.get(len(args))
    if expected is None:
      expected = self._expect(len(args))
    if expected is False:
      return False
    for x, want in zip(args, expected):
      if want is not None and not (isinstance(x, ARRAY_TYPE) and sharding_of(x) is want):
        return self._admits_leaf_by_leaf(args)
    return True

  def _admits_leaf_by_leaf(self, args: tuple) -> bool:
    leaves, treedef = jax.tree_util.tree_flatten(self._arguments.dynamic(args))
    per_leaf = self._plan.in_cache.get(treedef)  # filled by the full path
    if per_leaf is None:
      return False
    across = self._plan.cross_process
    for x, leaf in zip(leaves, per_leaf):
      sharding = leaf.sharding
      if isinstance(x, ARRAY_TYPE) and ((s := sharding_of(x)) is sharding or s == sharding):
        continue  # already on exactly the sharding the program takes
      if not jit_takes_as_is(x, sharding, across):
        return False
    return True

  def _expect(self, n: int) -> tuple | bool:
    arguments, in_leaves = self._arguments, self._plan.in_leaves
    n_dynamic = n - len(arguments.static_argnums)
    if arguments.count_problem(n) is not None:
      expected = False
    else:
      # in_parts is one spec for every argument, or one entry per argument;
      # any other tree is left to the leaf-by-leaf test.
      if is_leaf_plan(in_leaves):
        dynamic = [in_leaves] * n_dynamic
      elif type(in_leaves) is tuple and len(in_leaves) == n_dynamic:
        dynamic = list(in_leaves)
      else:
        dynamic = [None] * n_dynamic
      wants = [e.sharding if is_leaf_plan(e) else _UNKNOWN for e in dynamic]
      expected = arguments.with_dynamic((None,) * n, wants)
    self._by_count[n] = expected
    return expected
