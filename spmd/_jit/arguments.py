"""What a `sharded_jit` function was told about its arguments, checked once.

`Arguments.parse` takes `sharded_jit`'s options as the user wrote them,
rejects malformed spec trees and conflicting counts with errors that name
the option, and keeps them in the form the transform uses: each spec paired
with its local spec, static and donated argument numbers as sorted tuples,
and the partition count when the specs, `num_partitions` or the mesh fix it.
Each call's positional arguments are then checked against it and split into
the static ones (compile-time constants) and the dynamic ones (the values
`in_parts` describes).

Example:
  >>> from spmd.partition import PartitionSpec
  >>> a = Arguments.parse("f", (PartitionSpec(2, 1), None), None, static_argnums=1)
  >>> a.num_partitions, a.static_argnums
  (2, (1,))
  >>> a.dynamic(("x", 3, "w"))
  ('x', 'w')
  >>> a.check(("x", 3))
  Traceback (most recent call last):
  ...
  ValueError: in_parts=(PartitionSpec(2, 1), None) has 2 entries but f was called with 1 non-static positional arguments; give one spec per argument, or a single spec for all
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import jax

from spmd._jit.placement import fixed_num_partitions, pair_local
from spmd.partition import NamedSpec, check_spec_tree, infer_num_partitions, is_spec_leaf


@dataclasses.dataclass(frozen=True)
class Arguments:
  """`sharded_jit`'s options about arguments and outputs, checked and normalised."""

  name: str  # the function's name, for error messages
  in_parts: Any
  out_parts: Any
  in_pairs: Any  # in_parts with each spec paired with its local spec (placement.Pair)
  out_pairs: Any
  local_num_partitions: int | None
  static_argnums: tuple[int, ...]
  donate_argnums: tuple[int, ...]
  num_partitions: int | None  # None: discovered from the constraints, per signature
  mesh: jax.sharding.Mesh | None  # the user's mesh, for named specs
  in_len: int | None  # how many dynamic arguments in_parts describes, if it says

  @classmethod
  def parse(
    cls,
    name: str,
    in_parts: Any,
    out_parts: Any,
    num_partitions: int | None = None,
    local_in_parts: Any = None,
    local_out_parts: Any = None,
    local_num_partitions: int | None = None,
    static_argnums: int | Iterable[int] = (),
    donate_argnums: int | Iterable[int] = (),
    mesh: jax.sharding.Mesh | None = None,
  ) -> Arguments:
    """Checks `sharded_jit`'s options (see there) and normalises them."""
    for option, tree in (
      ("in_parts", in_parts),
      ("out_parts", out_parts),
      ("local_in_parts", local_in_parts),
      ("local_out_parts", local_out_parts),
    ):
      check_spec_tree(tree, option)
    if isinstance(in_parts, list):
      in_parts = tuple(in_parts)
    in_pairs = pair_local(in_parts, local_in_parts, "in_parts")
    out_pairs = pair_local(out_parts, local_out_parts, "out_parts")
    local_num_partitions = local_num_partitions or infer_num_partitions(
      local_in_parts=local_in_parts, local_out_parts=local_out_parts
    )
    static = {static_argnums} if isinstance(static_argnums, int) else set(static_argnums)
    donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    fixed = fixed_num_partitions(in_parts, out_parts, num_partitions, mesh)
    named = any(
      isinstance(s, NamedSpec)
      for s in jax.tree_util.tree_leaves(
        (in_parts, out_parts, local_in_parts, local_out_parts), is_leaf=is_spec_leaf
      )
    )
    if named and mesh is None:
      raise ValueError(
        "jax.sharding.PartitionSpec with axis names needs the mesh=... argument of sharded_jit"
      )
    return cls(
      name=name,
      in_parts=in_parts,
      out_parts=out_parts,
      in_pairs=in_pairs,
      out_pairs=out_pairs,
      local_num_partitions=local_num_partitions,
      static_argnums=tuple(sorted(static)),
      donate_argnums=donate,
      num_partitions=fixed,
      mesh=mesh,
      in_len=len(in_parts) if type(in_parts) is tuple else None,
    )

  def check(self, args: tuple) -> None:
    """Clear errors for positional arguments that do not fit static_argnums or in_parts."""
    problem = self.count_problem(len(args))
    if problem is not None:
      raise ValueError(problem)

  def count_problem(self, n: int) -> str | None:
    """Why `n` positional arguments do not fit static_argnums or in_parts; None if they do."""
    if self.static_argnums and self.static_argnums[-1] >= n:
      return (
        f"jitted function has static_argnums={self.static_argnums}"
        f" but was called with only {n} positional "
        f"argument{'s' if n > 1 else ''}. "
        "All static broadcasted arguments must be passed positionally."
      )
    if self.in_len is not None and (n - len(self.static_argnums) != self.in_len):
      return (
        f"in_parts={self.in_parts!r} has {self.in_len} entries but "
        f"{self.name} was called with "
        f"{n - len(self.static_argnums)} non-static positional "
        "arguments; give one spec per argument, or a single spec for all"
      )
    return None

  def dynamic(self, args: tuple) -> tuple:
    """The positional arguments that are not static: the ones in_parts describes."""
    return tuple(a for i, a in enumerate(args) if i not in self.static_argnums)

  def with_dynamic(self, args: tuple, dynamic: Iterable) -> tuple:
    """`args` with its dynamic arguments replaced by `dynamic`, in order."""
    it = iter(dynamic)
    return tuple(a if i in self.static_argnums else next(it) for i, a in enumerate(args))
