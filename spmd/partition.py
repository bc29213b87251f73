"""Partition specs by counts, and how they become `NamedSharding`s.

`PartitionSpec(2, 1)` says "split dimension 0 in two, leave dimension 1 whole",
the way the original `sharded_jit` spelled partitioning. Modern JAX places data
with `NamedSharding(mesh, jax.sharding.PartitionSpec('x', None))`, which names
mesh axes instead of counting pieces. This module translates between the two:
a count spec is resolved onto the axes of a mesh by choosing, for every array
dimension, a group of mesh axes whose sizes multiply to that dimension's count.

Example:
  >>> import numpy as np, jax
  >>> spec = PartitionSpec(2, 1)
  >>> spec, spec.num_partitions
  (PartitionSpec(2, 1), 2)
  >>> assign_axes(PartitionSpec(2, 2), [("a", 2), ("b", 2)])
  P('a', 'b')
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax

NamedSpec = jax.sharding.PartitionSpec


class PartitionSpec(tuple):
  """How many pieces each dimension of an array is split into.

  A tuple subclass, so it is hashable and compares by value, yet JAX's pytree
  utilities treat it as a leaf (only plain tuples and namedtuples are pytree
  nodes), which lets specs sit inside `in_parts` trees next to real tuples.

  Example:
    >>> PartitionSpec(4, 1)
    PartitionSpec(4, 1)
    >>> PartitionSpec(4, 1).num_partitions
    4
    >>> jax.tree_util.tree_leaves([PartitionSpec(2, 1), None],
    ...                           is_leaf=lambda x: x is None)
    [PartitionSpec(2, 1), None]
  """

  def __new__(cls, *counts: int) -> PartitionSpec:
    for count in counts:
      if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"PartitionSpec counts must be positive ints, got {counts=}")
    return tuple.__new__(cls, counts)

  def __repr__(self) -> str:
    return (
      f"PartitionSpec{tuple.__repr__(self)}" if len(self) != 1 else (f"PartitionSpec({self[0]})")
    )

  @property
  def num_partitions(self) -> int:
    """The number of devices this spec splits an array over."""
    return math.prod(self)

  def __getnewargs__(self):  # keeps copy/deepcopy working for a tuple subclass
    return tuple(self)


Spec = PartitionSpec | NamedSpec | None


def is_spec_leaf(x: Any) -> bool:
  """True for what ends a walk through an `in_parts`-style tree."""
  return x is None or isinstance(x, (PartitionSpec, NamedSpec))


def check_spec_tree(tree: Any, name: str) -> None:
  """Raises `TypeError` when `tree` holds anything but specs and containers."""
  for leaf in jax.tree_util.tree_leaves(tree, is_leaf=is_spec_leaf):
    if not is_spec_leaf(leaf):
      raise TypeError(
        f"{name} must hold spmd.PartitionSpec, jax.sharding.PartitionSpec or "
        f"None (replicated) leaves, got {leaf!r} of type {type(leaf).__name__}"
      )


def count_specs(tree: Any) -> list[PartitionSpec]:
  return [
    s for s in jax.tree_util.tree_leaves(tree, is_leaf=is_spec_leaf) if isinstance(s, PartitionSpec)
  ]


def infer_num_partitions(**trees: Any) -> int | None:
  """The one partition count that all count specs in `trees` agree on.

  Returns None when every spec is replicated (the count must then come from
  `num_partitions` or from constraints inside the function).

  Example:
    >>> infer_num_partitions(in_parts=(PartitionSpec(2, 2), None),
    ...                      out_parts=PartitionSpec(4))
    4
  """
  found: dict[int, list[str]] = {}
  for name, tree in trees.items():
    for spec in count_specs(tree):
      found.setdefault(spec.num_partitions, []).append(f"{name}: {spec}")
  if len(found) > 1:
    detail = "; ".join(f"{', '.join(v)} (product {k})" for k, v in sorted(found.items()))
    raise ValueError(
      "All PartitionSpecs of one sharded_jit call must split the same number "
      f"of devices, got {detail}"
    )
  return next(iter(found), None)


def prime_factors(n: int) -> list[int]:
  """Prime factors of `n` in ascending order, with repeats: 12 -> [2, 2, 3]."""
  factors, p = [], 2
  while p * p <= n:
    while n % p == 0:
      factors.append(p)
      n //= p
    p += 1
  if n > 1:
    factors.append(n)
  return factors


def _choose_groups(
  counts: Sequence[int], axes: Sequence[tuple[str, int]]
) -> list[tuple[str, ...]] | None:
  """Disjoint groups of `axes` whose sizes multiply to each of `counts`.

  Prefers earlier axes (so the result is deterministic and, on the default
  mesh, host axes go first). Backtracks across dimensions; meshes have a
  handful of axes, so the search is tiny.
  """

  def groups_for(count, free):
    # All subsets of the free axis indices, in lexicographic order, whose
    # sizes multiply to `count`.
    def walk(start, remaining, chosen):
      if remaining == 1:
        yield tuple(chosen)
        return
      for i in range(start, len(axes)):
        size = axes[i][1]
        if i in free and remaining % size == 0 and size > 1:
          yield from walk(i + 1, remaining // size, [*chosen, i])

    yield from walk(0, count, [])

  def solve(dim, free):
    if dim == len(counts):
      return []
    for group in groups_for(counts[dim], free):
      rest = solve(dim + 1, free - set(group))
      if rest is not None:
        return [group, *rest]
    return None

  free = {i for i, (_, size) in enumerate(axes) if size > 1}
  solution = solve(0, free)
  if solution is None:
    return None
  return [tuple(axes[i][0] for i in group) for group in solution]


def _named(groups: Sequence[tuple[str, ...]]) -> NamedSpec:
  return NamedSpec(*[None if not g else g[0] if len(g) == 1 else g for g in groups])


def assign_axes(
  counts: Sequence[int], axes: Sequence[tuple[str, int]], what: str = "spec"
) -> NamedSpec:
  """Resolves per-dimension counts onto mesh axes given as `(name, size)`.

  Raises `ValueError` naming the spec and the mesh when no grouping exists.
  """
  groups = _choose_groups(counts, axes)
  if groups is None:
    raise ValueError(
      f"{what}={PartitionSpec(*counts)} cannot be laid out on mesh axes "
      f"{dict(axes)}: no disjoint groups of axes multiply to each count"
    )
  return _named(groups)


def assign_axes_with_local(
  counts: Sequence[int],
  local_counts: Sequence[int],
  host_axes: Sequence[tuple[str, int]],
  local_axes: Sequence[tuple[str, int]],
  what: str,
  local_what: str,
) -> NamedSpec:
  """Like `assign_axes`, but honours how each process's piece is split.

  `local_counts[d]` pieces of dimension d live on one process; the other
  `counts[d] // local_counts[d]` factor is spread over processes. Host axes
  come first inside each dimension, so every process holds one contiguous
  block of the global array.
  """
  spec, local_spec = PartitionSpec(*counts), PartitionSpec(*local_counts)
  if len(local_counts) != len(counts):
    raise ValueError(
      f"{local_what}={local_spec} and {what}={spec} have different numbers of dimensions"
    )
  host_counts = []
  for c, lc in zip(counts, local_counts):
    if c % lc:
      raise ValueError(
        f"{local_what}={local_spec} does not divide {what}={spec}"
        f": {lc} local pieces of a dimension split {c} ways"
      )
    host_counts.append(c // lc)
  host_groups = _choose_groups(host_counts, host_axes)
  local_groups = _choose_groups(local_counts, local_axes)
  if host_groups is None or local_groups is None:
    raise ValueError(
      f"{what}={spec} with {local_what}={local_spec} needs "
      f"{math.prod(host_counts)} processes x {math.prod(local_counts)} local "
      f"devices, but the devices are {dict(host_axes)} across processes x "
      f"{dict(local_axes)} per process"
    )
  return _named([h + lg for h, lg in zip(host_groups, local_groups)])


def axis_names(entry: Any) -> tuple[str, ...]:
  """The mesh axis names of one entry of a named spec (None, 'x' or ('x', 'y'))."""
  if entry is None or entry is NamedSpec.UNCONSTRAINED:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def spec_axis_names(spec: NamedSpec) -> list[str]:
  """Every mesh axis name a named spec uses."""
  return [n for entry in spec for n in axis_names(entry)]
