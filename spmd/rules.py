"""Logical axis names (what models annotate) to mesh axes (what devices form).

A model says "this weight is (embed, mlp)"; a rule set says "embed goes on
fsdp, mlp on tensor". Changing parallelism is choosing a rule set, not
editing the model. Rules are ordered `(logical, mesh axes)` pairs; a mesh
axis the mesh lacks is skipped (so one preset serves meshes with or without
it), and a mesh axis is used at most once per array (the first dimension that
asks for it gets it).

Every preset maps `length` to the mesh axis `context` (context parallelism):
on a mesh without it, or with it of size 1, the sequence stays whole. The
FSDP presets split the weights' `embed` over `fsdp` and then `context`: the
devices of one sequence hold different slices of the state, not copies
(MaxText's rules, and Megatron's optimizer sharded over data x context).

Every preset maps `experts` to the mesh axis `expert` (expert parallelism),
and `batch` to `data`, `fsdp` and then `expert`: outside the routed layers
the expert devices split the rows like data devices, so none sits idle, and
inside them each device holds its experts' weights alone
(`trainers.models.moe` moves the tokens to them).

Example:
  >>> logical_to_spec(("batch", "length", "embed"), FSDP_TP)  # fsdp taken by batch
  P(('data', 'fsdp', 'expert'), 'context')
  >>> logical_to_spec(("experts", "embed", "mlp"), FSDP_TP)
  P('expert', ('fsdp', 'context'), 'tensor')
  >>> logical_to_spec(("embed", "mlp"), FSDP_TP)
  P(('fsdp', 'context'), 'tensor')
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import jax

from spmd.mesh import CONTEXT_AXIS, EXPERT_AXIS
from spmd.partition import NamedSpec

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]

# Names the models in trainers/models use. Every preset maps all of them, so
# a typo in a model is an error rather than a silently replicated weight.
LOGICAL_AXES = (
  "batch",
  "length",
  "embed",
  "mlp",
  "heads",
  "kv_heads",
  "kv",
  "vocab",
  "layers",
  "norm",
  "classes",
  "positions",
  # The routed experts of a mixture-of-experts layer (`trainers.models.moe`):
  # on the mesh axis `expert` in every preset.
  "experts",
)

# `length` maps to the mesh axis `context` (context parallelism) in every
# preset, so a mesh without it leaves the sequence whole. The batch never takes
# it (`trainers.models.attention` gathers keys and values along it). The FSDP
# presets split `embed` over it after `fsdp`: a weight's rows over every device
# that holds no other copy. An activation [batch, length, embed] never gets it
# on `embed`, since `length` takes it first (a mesh axis is used once per array).
BATCH_AXES = ("data", "fsdp", EXPERT_AXIS)
"""The mesh axes `batch` takes, in order: `expert` last, so rows stay whole on
a mesh without it."""

DATA_PARALLEL: Rules = (
  ("batch", BATCH_AXES),
  ("length", CONTEXT_AXIS),
  ("experts", EXPERT_AXIS),
  *((name, None) for name in LOGICAL_AXES if name not in ("batch", "length", "experts")),
)
"""Pure data parallel: only the batch (and the sequence, over `context`) is split; every
weight is replicated but the routed experts (over `expert`)."""

FSDP: Rules = (
  ("batch", BATCH_AXES),
  ("length", CONTEXT_AXIS),
  ("embed", ("fsdp", CONTEXT_AXIS)),
  ("experts", EXPERT_AXIS),
  ("vocab", None),
  *(
    (name, None)
    for name in (
      "mlp",
      "heads",
      "kv_heads",
      "kv",
      "layers",
      "norm",
      "classes",
      "positions",
    )
  ),
)
"""Fully sharded data parallel: weights split over `fsdp` (and `context`) along `embed`."""

FSDP_TP: Rules = (
  ("batch", BATCH_AXES),
  ("length", CONTEXT_AXIS),
  ("embed", ("fsdp", CONTEXT_AXIS)),
  ("mlp", "tensor"),
  ("heads", "tensor"),
  # Grouped-query attention's key/value heads split like the query heads, so
  # each device holds the K/V heads its query heads read.
  ("kv_heads", "tensor"),
  ("vocab", "tensor"),
  ("experts", EXPERT_AXIS),
  *((name, None) for name in ("kv", "layers", "norm", "classes", "positions")),
)
"""FSDP plus tensor parallel: MLP, heads and vocabulary split over `tensor`."""

PRESETS: dict[str, Rules] = {"dp": DATA_PARALLEL, "fsdp": FSDP, "fsdp_tp": FSDP_TP}


def whole_sequence(rules: Rules) -> Rules:
  """`rules` with `context` on no logical axis: each device holds whole sequences.

  Decoding (a KV cache filled one token at a time) gathers the `context`
  axis this way rather than split its cache; its activations then never
  take `context` on `embed` either, which `length` held in training.

  Example:
    >>> table = dict(whole_sequence(FSDP_TP))
    >>> table["length"], table["embed"]
    (None, ('fsdp',))
  """
  out = []
  for name, axes in rules:
    kept = tuple(a for a in _as_tuple(axes) if a != CONTEXT_AXIS)
    out.append((name, None if not kept else axes if kept == _as_tuple(axes) else kept))
  return tuple(out)


def preset(name: str) -> Rules:
  """A preset rule set by name: `dp`, `fsdp` or `fsdp_tp`."""
  try:
    return PRESETS[name]
  except KeyError:
    raise ValueError(f"unknown rules preset {name!r}; choose one of {sorted(PRESETS)}") from None


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
  return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def logical_to_spec(
  logical: Sequence[str | tuple[str, ...] | None],
  rules: Rules,
  mesh: jax.sharding.Mesh | None = None,
) -> NamedSpec:
  """The named `PartitionSpec` for one array's logical axis names.

  With a mesh, axes it lacks (or of size 1) are dropped. An entry may be a
  tuple of names, for a dimension that merges several (the tokens of
  [batch, length] flattened into one axis): its mesh axes are theirs, in
  order, which lays the merged dimension out as the unmerged ones were.

  Example:
    >>> logical_to_spec(("batch", "length", "mlp"), FSDP_TP)
    P(('data', 'fsdp', 'expert'), 'context', 'tensor')
    >>> logical_to_spec((("batch", "length"), "mlp"), FSDP_TP)
    P(('data', 'fsdp', 'expert', 'context'), 'tensor')
    >>> from spmd.mesh import create_mesh
    >>> logical_to_spec(("batch", "length", "mlp"), FSDP_TP, create_mesh("data=-1,tensor=2"))
    P('data', None, 'tensor')
  """
  table = dict(rules)
  used: set[str] = set()
  entries = []
  for entry in logical:
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    axes = []
    for name in names:
      if name not in table:
        raise ValueError(f"logical axis {name!r} has no rule; rules cover {sorted(table)}")
      axes += [
        a
        for a in _as_tuple(table[name])
        if a not in used and a not in axes and (mesh is None or mesh.shape.get(a, 1) > 1)
      ]
    used.update(axes)
    entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
  while entries and entries[-1] is None:
    entries.pop()
  return NamedSpec(*entries)


def annotation_to_spec(
  names: Sequence[str | tuple[str, ...] | None], rules: Rules, mesh: jax.sharding.Mesh
) -> NamedSpec:
  """The named spec for one array's annotation, whose names are logical or mesh axes.

  A name the rules know is logical and maps through them; otherwise it must
  be one of the mesh's axes (as `flax.nnx.with_partitioning` names them) and
  is used as is. Entries may be tuples of names. Axes of size 1 are dropped
  and a mesh axis is used once per array, as in `logical_to_spec`.

  Example:
    >>> from spmd.mesh import create_mesh
    >>> mesh = create_mesh("data=-1,fsdp=2,tensor=2")
    >>> annotation_to_spec(("embed", "tensor"), FSDP, mesh)
    P('fsdp', 'tensor')
    >>> annotation_to_spec(("rows",), FSDP, mesh)
    Traceback (most recent call last):
    ...
    ValueError: 'rows' is neither a logical axis of the rules (['batch', 'classes', 'embed', 'experts', 'heads', 'kv', 'kv_heads', 'layers', 'length', 'mlp', 'norm', 'positions', 'vocab']) nor a mesh axis (('data', 'fsdp', 'tensor'))
  """
  table = dict(rules)
  used: set[str] = set()
  entries = []
  for entry in names:
    candidates: list[str] = []
    for name in () if entry is None else (entry,) if isinstance(entry, str) else entry:
      if name in table:
        candidates.extend(_as_tuple(table[name]))
      elif name in mesh.axis_names:
        candidates.append(name)
      else:
        raise ValueError(
          f"{name!r} is neither a logical axis of the rules ({sorted(table)}) "
          f"nor a mesh axis ({mesh.axis_names})"
        )
    axes = [a for a in candidates if a not in used and mesh.shape.get(a, 1) > 1]
    used.update(axes)
    entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
  while entries and entries[-1] is None:
    entries.pop()
  return NamedSpec(*entries)


def logical_to_sharding(
  logical_tree: Any, mesh: jax.sharding.Mesh, rules: Rules, shapes: Any = None
) -> Any:
  """A tree of `NamedSharding`s for a tree of logical annotations.

  Args:
    logical_tree: a pytree whose leaves are tuples of logical names (one per
      dimension; None for a dimension no rule splits).
    mesh: the mesh.
    rules: a rule set (see the presets).
    shapes: optionally the same tree of arrays or `ShapeDtypeStruct`s; then
      every split dimension is checked to divide evenly, and a `ValueError`
      names the array's path, shape and mesh axes when it does not.
  """

  def is_leaf(x):
    return isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x)

  specs = jax.tree_util.tree_map(
    lambda names: logical_to_spec(names, rules, mesh), logical_tree, is_leaf=is_leaf
  )
  if shapes is not None:
    spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, NamedSpec))
    shape_leaves = jax.tree_util.tree_flatten_with_path(shapes)[0]
    if len(spec_leaves) != len(shape_leaves):
      raise ValueError(f"{len(spec_leaves)} logical annotations for {len(shape_leaves)} arrays")
    for (path, leaf), spec in zip(shape_leaves, spec_leaves):
      check_divisible(jax.tree_util.keystr(path), tuple(leaf.shape), spec, mesh)
  return jax.tree_util.tree_map(
    lambda spec: jax.sharding.NamedSharding(mesh, spec),
    specs,
    is_leaf=lambda x: isinstance(x, NamedSpec),
  )


def check_divisible(
  name: str, shape: tuple[int, ...], spec: NamedSpec, mesh: jax.sharding.Mesh
) -> None:
  """Raises `ValueError` when a split dimension of `shape` does not divide."""
  if len(spec) > len(shape):
    raise ValueError(f"{name}: {spec} has more entries than {shape=} has dimensions")
  for dim, entry in enumerate(spec):
    parts = math.prod(mesh.shape[a] for a in _as_tuple(entry))
    if shape[dim] % parts:
      raise ValueError(
        f"{name}: dimension {dim} of {shape=} is not divisible by {parts} "
        f"(mesh axes {_as_tuple(entry)} of {dict(mesh.shape)})"
      )


# ---------------------------------------------------------------------------
# Activation sharding: constraints by logical names, active only where a
# trainer says which rules and mesh apply.

_active = threading.local()


@contextlib.contextmanager
def activation_rules(rules: Rules, mesh: jax.sharding.Mesh) -> Iterator[None]:
  """Makes `constrain` pin activations by `rules` on `mesh` while inside.

  A trainer enters it around the code it traces (the loss in the train and
  eval steps), so a model states its activations' layout by logical names
  and never needs to know the mesh; outside it, `constrain` does nothing.
  It holds per thread and only while tracing matters: the constraints end
  up in the compiled program, not in this context.

  Example:
    >>> import jax.numpy as jnp
    >>> from spmd.mesh import create_mesh
    >>> mesh = create_mesh("data=-1,tensor=2")
    >>> with activation_rules(FSDP_TP, mesh):
    ...   y = jax.jit(lambda x: constrain(x * 2, ("batch", "mlp")))(jnp.ones((4, 8)))
    >>> y.sharding.spec
    P('data', 'tensor')
  """
  stack = _active.__dict__.setdefault("stack", [])
  stack.append((tuple(rules), mesh))
  try:
    yield
  finally:
    stack.pop()


def active_rules() -> tuple[Rules, jax.sharding.Mesh] | None:
  """The innermost `activation_rules` of this thread, or None."""
  stack = getattr(_active, "stack", None)
  return stack[-1] if stack else None


def constrain(x: jax.Array, logical: Sequence[str | tuple[str, ...] | None]) -> jax.Array:
  """`x` pinned to the layout its logical axis names map to, or `x` when no rules are active.

  Inside `activation_rules(rules, mesh)` this is
  `jax.lax.with_sharding_constraint` with the spec `logical_to_spec` gives
  (mesh axes of size 1 dropped). Outside it, and inside a `shard_map` that
  makes some mesh axes manual (there each device already holds its own
  rows), it returns `x` unchanged, so a model that constrains its
  activations still runs in a plain process (tests, export, sampling).

  Raises:
    ValueError: `logical` does not name each dimension of `x`, or a split
      dimension does not divide by its mesh axes (naming both).

  Example:
    >>> import jax.numpy as jnp
    >>> constrain(jnp.ones((2, 3)), ("batch", "embed")).shape  # no rules active
    (2, 3)
  """
  active = active_rules()
  if active is None:
    return x
  if len(logical) != x.ndim:
    raise ValueError(f"{tuple(logical)=} must name each dimension of {x.shape=}")
  if jax.sharding.get_abstract_mesh().manual_axes:
    return x
  rules, mesh = active
  spec = logical_to_spec(logical, rules, mesh)
  check_divisible(f"activation {tuple(logical)}", tuple(x.shape), spec, mesh)
  return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, spec))
