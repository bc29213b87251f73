"""A `sharded_jit` function's plan: its specs resolved onto one mesh.

Once a partition count is known, every spec of `in_parts`/`out_parts` (and
`local_in_parts`/`local_out_parts` across processes) becomes a `Leaf`: the
`NamedSharding` the compiled program uses, and whether the value crosses the
process boundary as this process's piece (`LOCAL`) or as a global array
(`GLOBAL`). The plan holds those leaves, the mesh, and the `jax.jit`s built
for it.

Example:
  >>> import jax
  >>> from spmd.partition import PartitionSpec
  >>> plan = make_plan(1, Pair(PartitionSpec(1, 1), None), Pair(None, None))
  >>> plan.num_partitions, plan.cross_process, plan.in_leaves.mode
  (1, False, 'local')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from spmd import mesh as mesh_lib
from spmd.partition import (
  NamedSpec,
  PartitionSpec,
  Spec,
  assign_axes,
  assign_axes_with_local,
  count_specs,
  infer_num_partitions,
  is_spec_leaf,
  spec_axis_names,
)

# How one flattened input/output crosses the process boundary.
LOCAL = "local"  # the process passes / receives its own piece
GLOBAL = "global"  # a global jax.Array goes in / comes out as it is


@dataclasses.dataclass(frozen=True)
class Leaf:
  """The resolved placement of one spec leaf."""

  sharding: jax.sharding.NamedSharding
  mode: str


def is_leaf_plan(x: Any) -> bool:
  return isinstance(x, Leaf)


@dataclasses.dataclass(frozen=True)
class Pair:
  """A spec and the matching local spec (None when not given)."""

  spec: Spec
  local: Spec


def sharding_for(
  spec: Spec, mesh: jax.sharding.Mesh, num_partitions: int, what: str
) -> jax.sharding.NamedSharding:
  """The `NamedSharding` for one spec on the mesh of a computation."""
  if spec is None:
    return jax.sharding.NamedSharding(mesh, NamedSpec())
  if isinstance(spec, PartitionSpec):
    if spec.num_partitions != num_partitions:
      raise ValueError(
        f"{what}={spec} splits {spec.num_partitions} ways, but the computation "
        f"has {num_partitions} partitions; all specs must have the same product"
      )
    return jax.sharding.NamedSharding(mesh, assign_axes(spec, list(mesh.shape.items()), what))
  missing = [n for n in spec_axis_names(spec) if n not in mesh.shape]
  if missing:
    raise ValueError(
      f"{what}={spec} names axes {missing} that the mesh {dict(mesh.shape)} does not have"
    )
  return jax.sharding.NamedSharding(mesh, spec)


def broadcast_prefix(
  prefix: Any, tree: Any, name: str, is_leaf: Callable[[Any], bool] = is_spec_leaf
) -> list[Any]:
  """One prefix leaf per leaf of `tree`, in `tree`'s flattening order."""
  out: list[Any] = []

  def add(p, subtree):
    out.extend([p] * jax.tree_util.tree_structure(subtree).num_leaves)

  try:
    jax.tree_util.tree_map(add, prefix, tree, is_leaf=is_leaf)
  except ValueError as e:
    raise ValueError(
      f"{name}={prefix!r} is not a tree prefix of the values it describes, "
      f"whose structure is {jax.tree_util.tree_structure(tree)}: {e}"
    ) from None
  return out


def pair_local(parts: Any, local_parts: Any, name: str) -> Any:
  """Pairs each spec of `parts` with its local spec (same structure, or one)."""
  if is_spec_leaf(local_parts):
    return jax.tree_util.tree_map(lambda s: Pair(s, local_parts), parts, is_leaf=is_spec_leaf)

  def pair(spec, local):
    if not is_spec_leaf(local):
      raise ValueError("local spec is a subtree")
    return Pair(spec, local)

  try:
    return jax.tree_util.tree_map(pair, parts, local_parts, is_leaf=is_spec_leaf)
  except ValueError:
    raise ValueError(
      f"local_{name}={local_parts!r} must have the same structure as "
      f"{name}={parts!r}, or be a single spec"
    ) from None


@dataclasses.dataclass
class Plan:
  """Everything decided once a partition count is known."""

  num_partitions: int
  mesh: jax.sharding.Mesh
  cross_process: bool
  in_leaves: Any  # prefix tree of Leaf over the dynamic positional args
  out_leaves: Any  # prefix tree of Leaf over the outputs
  jitted: dict[tuple[str, ...], Callable] = dataclasses.field(default_factory=dict)
  in_cache: dict[Any, list[Leaf]] = dataclasses.field(default_factory=dict)
  out_cache: dict[Any, list[Leaf]] = dataclasses.field(default_factory=dict)

  @property
  def all_global(self) -> bool:
    """True when every input and output crosses processes as a global array."""
    leaves = jax.tree_util.tree_leaves((self.in_leaves, self.out_leaves), is_leaf=is_leaf_plan)
    return all(leaf.mode == GLOBAL for leaf in leaves)

  @property
  def plain_calls_go_straight_to_jit(self) -> bool:
    """Whether a call without keywords may be the `jax.jit` call itself.

    True on this process's devices, and across processes when nothing needs
    converting (global arrays in and out).
    """
    return not self.cross_process or self.all_global

  def shardings(self, leaves: Any) -> Any:
    return jax.tree_util.tree_map(lambda leaf: leaf.sharding, leaves, is_leaf=is_leaf_plan)

  def per_input_leaf(self, dyn: tuple) -> tuple[list, Any, list[Leaf]]:
    """`dyn`'s leaves, its treedef, and the `Leaf` of each (cached per structure)."""
    leaves, treedef = jax.tree_util.tree_flatten(dyn)
    per_leaf = self.in_cache.get(treedef)
    if per_leaf is None:
      per_leaf = self.in_cache[treedef] = broadcast_prefix(
        self.in_leaves, dyn, "in_parts", is_leaf=is_leaf_plan
      )
    return leaves, treedef, per_leaf

  def per_output_leaf(self, out: Any) -> tuple[list, Any, list[Leaf]]:
    """The same for the outputs."""
    leaves, treedef = jax.tree_util.tree_flatten(out)
    per_leaf = self.out_cache.get(treedef)
    if per_leaf is None:
      per_leaf = self.out_cache[treedef] = broadcast_prefix(
        self.out_leaves, out, "out_parts", is_leaf=is_leaf_plan
      )
    return leaves, treedef, per_leaf


def make_plan(
  n: int,
  in_pairs: Any,
  out_pairs: Any,
  mesh: jax.sharding.Mesh | None = None,
  local_num_partitions: int | None = None,
) -> Plan:
  """The plan for `n` partitions, on `mesh` or on the devices `spmd.mesh` picks for `n`."""
  user_mesh = mesh
  if mesh is None:
    mesh = mesh_lib.partition_mesh(mesh_lib.devices_for_partitions(n))
  cross = len({d.process_index for d in mesh.devices.flat}) > 1
  if cross:
    _check_local_count(local_num_partitions, (in_pairs, out_pairs), user_mesh is not None)
  host_axes, local_axes = mesh_lib.split_axes(mesh)
  # Equal shardings are one object, so that a program's outputs carry the very
  # sharding its inputs expect, and the fast path can admit them by identity.
  interned: dict[jax.sharding.NamedSharding, jax.sharding.NamedSharding] = {}

  def resolve(pair, what):
    leaf = resolve_one(pair, what)
    return Leaf(interned.setdefault(leaf.sharding, leaf.sharding), leaf.mode)

  def resolve_one(pair, what):
    spec, local = pair.spec, pair.local
    local_what = f"local_{what}"
    if not cross:
      if local is not None and local != spec:
        raise ValueError(
          f"{local_what}={local!r} differs from {what}={spec!r}, but the "
          f"computation runs on this process's devices only ({n} "
          f"partitions); local and global pieces are the same here"
        )
      return Leaf(sharding_for(spec, mesh, n, what), LOCAL)
    if spec is None:
      return Leaf(sharding_for(None, mesh, n, what), LOCAL)
    if isinstance(local, PartitionSpec) and isinstance(spec, PartitionSpec):
      if spec.num_partitions != n:
        sharding_for(spec, mesh, n, what)  # raises the product error
      named = assign_axes_with_local(spec, local, host_axes, local_axes, what, local_what)
      return Leaf(jax.sharding.NamedSharding(mesh, named), LOCAL)
    if local is not None and local != spec:
      raise ValueError(
        f"{local_what}={local!r} must be a count spec for {what}={spec!r} or the same named spec"
      )
    return Leaf(sharding_for(spec, mesh, n, what), GLOBAL if local is None else LOCAL)

  def resolve_tree(pairs, what):
    return jax.tree_util.tree_map(lambda p: resolve(p, what), pairs)

  return Plan(
    n, mesh, cross, resolve_tree(in_pairs, "in_parts"), resolve_tree(out_pairs, "out_parts")
  )


def _check_local_count(local_n: int | None, pairs: Any, user_mesh: bool) -> None:
  """A cross-process computation uses every local device, and must know how many."""
  local = jax.local_device_count()
  specs = [p.spec for p in jax.tree_util.tree_leaves(pairs)]
  if local_n is None and not count_specs(specs) and not user_mesh:
    raise ValueError(
      "Specify 'local_num_partitions' when using cross-process sharded_jit "
      "and all inputs and outputs are replicated."
    )
  if local_n is not None and local_n > local:
    raise ValueError(
      f"sharded_jit computation requires {local_n} local devices, "
      f"but only {local} local devices are available."
    )
  if local_n is not None and local_n < local:
    raise ValueError(
      f"sharded_jit across processes uses every local device: "
      f"local_num_partitions={local_n} but this process has {local} devices"
    )


def fixed_num_partitions(in_parts, out_parts, num_partitions, mesh) -> int | None:
  """The count the specs, `num_partitions` or the mesh fix; None if discovered."""
  n = infer_num_partitions(in_parts=in_parts, out_parts=out_parts)
  for name, value in (
    ("num_partitions", num_partitions),
    ("mesh size", None if mesh is None else mesh.size),
  ):
    if value is not None and n not in (None, value):
      raise ValueError(
        f"{name}={value} conflicts with in_parts={in_parts!r} "
        f"and out_parts={out_parts!r}, whose specs split {n} ways"
      )
    if value is not None:
      n = value
  return n


def needs_moving(x: Any, sharding: jax.sharding.Sharding) -> bool:
  """Whether `x` is (or, under `jax.grad`, traces) a committed array sharded otherwise.

  `jax.jit` refuses such an argument rather than moving it; uncommitted
  arrays and host values it places itself.
  """
  concrete = x.to_concrete_value() if isinstance(x, jax.core.Tracer) else x
  return (
    isinstance(concrete, jax.Array)
    and not isinstance(concrete, jax.core.Tracer)
    and concrete.committed
    and not concrete.sharding.is_equivalent_to(sharding, concrete.ndim)
  )


def moved(x: Any, sharding: jax.sharding.NamedSharding) -> Any:
  """`x` on `sharding` if it is (or traces) a committed array sharded otherwise."""
  return jax.device_put(x, sharding) if needs_moving(x, sharding) else x
