"""`sharded_jit`: the 2020 API, rebuilt on `jax.jit` and `NamedSharding`.

`sharded_jit(fun, in_parts, out_parts)` compiles `fun` once per signature and
runs it split across devices. Specs count pieces per dimension
(`PartitionSpec(2, 1)`), or name mesh axes (`jax.sharding.PartitionSpec`) when
a `mesh` is given; `None` replicates.

Design:
  * Counts become `NamedSharding`s on one mesh per partition count (see
    `spmd.mesh`), and the function becomes one `jax.jit` with those in/out
    shardings, created once. A call on one process's devices is the `jax.jit`
    call itself plus one Python frame: JAX's C++ cache decides when to trace.
  * Across processes, each process passes its own piece (`local_in_parts`):
    pieces become global arrays with JAX's `multihost_utils` primitives and
    outputs come back as pieces (`local_out_parts`). Global `jax.Array`s, and
    tracers of them under `jax.grad`, `jax.vjp` and `jax.jit`, pass through
    without touching the host.
  * Hosts must agree. The function handed to `jax.jit` runs only when JAX
    traces, i.e. on the first call of each new signature; when the
    computation spans processes it first compares (local shapes, global
    shapes, dtypes, specs, partition count, static arguments) across all
    processes through the distributed runtime's key-value store and a
    barrier, and every process raises the same `AgreementError` on a mismatch.
    Calls that hit the compiled-program cache pay nothing. An error at a new
    signature is raised at once, never retried (a retry would trace again:
    another agreement round, and the function's trace-time side effects twice).
    Limit: a host that changes its signature while the others reuse a cached
    program cannot be caught here without a per-call collective; it times out
    in the check (`SPMD_AGREEMENT_TIMEOUT_S`) instead of hanging forever,
    naming what it changed since the last signature all agreed on, and the
    others, waiting for it in the program's collectives, are ended by JAX's
    distributed runtime when it exits. Callers that know the expected local
    shape (the trainer) check it locally every step.
  * Partition counts come from the specs, from `num_partitions`, or, when
    everything is replicated, from `with_sharding_constraint` calls found by
    tracing the function once per signature (only in that case).

Example:
  >>> import numpy as np
  >>> f = sharded_jit(lambda x: x * 2, in_parts=PartitionSpec(1, 1),
  ...                 out_parts=None)
  >>> f(np.ones((2, 2), np.float32)).tolist()
  [[2.0, 2.0], [2.0, 2.0]]
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from spmd import mesh as mesh_lib
from spmd import multihost
from spmd.partition import (
  NamedSpec,
  PartitionSpec,
  Spec,
  assign_axes,
  assign_axes_with_local,
  check_spec_tree,
  infer_num_partitions,
  is_spec_leaf,
  spec_axis_names,
)

log = logging.getLogger(__name__)

# Set on an exception raised while JAX traced a sharded_jit function. Calling
# again would only trace again: the user's trace-time side effects would run
# twice and, across processes, every host would wait a second agreement round.
_RAISED_IN_TRACE = "_sharded_jit_raised_in_trace"


def _raised_in_trace(e: BaseException) -> bool:
  return getattr(e, _RAISED_IN_TRACE, False)


# How each flattened input/output crosses the process boundary.
_LOCAL = "local"  # the process passes / receives its own piece
_GLOBAL = "global"  # a global jax.Array goes in / comes out as it is


@dataclasses.dataclass(frozen=True)
class _Leaf:
  """The resolved placement of one spec leaf."""

  sharding: jax.sharding.NamedSharding
  mode: str


def _is_leaf_plan(x: Any) -> bool:
  return isinstance(x, _Leaf)


@dataclasses.dataclass(frozen=True)
class _Pair:
  """A spec and the matching local spec (None when not given)."""

  spec: Spec
  local: Spec


# ---------------------------------------------------------------------------
# The context active while a sharded_jit function is being traced.


@dataclasses.dataclass
class _Context:
  name: str
  mesh: jax.sharding.Mesh | None  # None while discovering the count
  num_partitions: int | None
  recorded: list[tuple[str, PartitionSpec]] = dataclasses.field(default_factory=list)


_state = threading.local()
# How many sharded_jit traces are in progress in any thread. The fast call
# path reads only this (one global load); when it is non-zero the full path
# looks at this thread's own stack.
_tracing_depth = [0]


def _current() -> _Context | None:
  stack = getattr(_state, "stack", None)
  return stack[-1] if stack else None


class _pushed:
  def __init__(self, ctx: _Context):
    self.ctx = ctx

  def __enter__(self):
    if not hasattr(_state, "stack"):
      _state.stack = []
    _state.stack.append(self.ctx)
    _tracing_depth[0] += 1

  def __exit__(self, *exc):
    _tracing_depth[0] -= 1
    _state.stack.pop()


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


def with_sharding_constraint(x: Any, partitions: Spec) -> Any:
  """Identity that pins how `x` is split, inside a `sharded_jit` function.

  `partitions` is a count spec whose product matches the enclosing
  computation, a named spec when `sharded_jit` was given a mesh, or None to
  replicate. Under `jax.grad` the cotangent is constrained the same way.

  Example:
    >>> import numpy as np
    >>> def f(x):
    ...   return with_sharding_constraint(x + 1, PartitionSpec(1, 1)) * 2
    >>> sharded_jit(f, in_parts=None, out_parts=None)(np.zeros((2, 2))).tolist()
    [[2.0, 2.0], [2.0, 2.0]]
  """
  ctx = _current()
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


# ---------------------------------------------------------------------------
# Prefix trees.


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


def _pair_local(parts: Any, local_parts: Any, name: str) -> Any:
  """Pairs each spec of `parts` with its local spec (same structure, or one)."""
  if is_spec_leaf(local_parts):
    return jax.tree_util.tree_map(lambda s: _Pair(s, local_parts), parts, is_leaf=is_spec_leaf)

  def pair(spec, local):
    if not is_spec_leaf(local):
      raise ValueError("local spec is a subtree")
    return _Pair(spec, local)

  try:
    return jax.tree_util.tree_map(pair, parts, local_parts, is_leaf=is_spec_leaf)
  except ValueError:
    raise ValueError(
      f"local_{name}={local_parts!r} must have the same structure as "
      f"{name}={parts!r}, or be a single spec"
    ) from None


# ---------------------------------------------------------------------------
# The plan: everything decided once a partition count is known.


@dataclasses.dataclass
class _Plan:
  num_partitions: int
  mesh: jax.sharding.Mesh
  cross_process: bool
  in_leaves: Any  # prefix tree of _Leaf over the dynamic positional args
  out_leaves: Any  # prefix tree of _Leaf over the outputs
  jitted: dict[tuple[str, ...], Callable] = dataclasses.field(default_factory=dict)
  in_cache: dict[Any, list[_Leaf]] = dataclasses.field(default_factory=dict)
  out_cache: dict[Any, list[_Leaf]] = dataclasses.field(default_factory=dict)

  @property
  def all_global(self) -> bool:
    """True when every input and output crosses processes as a global array."""
    leaves = jax.tree_util.tree_leaves((self.in_leaves, self.out_leaves), is_leaf=_is_leaf_plan)
    return all(leaf.mode == _GLOBAL for leaf in leaves)


class ShardedJitFunction:
  """What a `sharded_jit` function runs: plans, checks and conversions.

  The function `sharded_jit` returns keeps this as its `.sharded_jit`
  attribute; `.lower(*args)` lowers without running.
  """

  def __init__(
    self,
    fun,
    in_parts,
    out_parts,
    num_partitions,
    local_in_parts,
    local_out_parts,
    local_num_partitions,
    static_argnums,
    donate_argnums,
    mesh,
  ):
    for name, tree in (
      ("in_parts", in_parts),
      ("out_parts", out_parts),
      ("local_in_parts", local_in_parts),
      ("local_out_parts", local_out_parts),
    ):
      check_spec_tree(tree, name)
    if isinstance(in_parts, list):
      in_parts = tuple(in_parts)
    self._fun = fun
    self._name = getattr(fun, "__qualname__", getattr(fun, "__name__", repr(fun)))
    self._in_parts, self._out_parts = in_parts, out_parts
    self._in_pairs = _pair_local(in_parts, local_in_parts, "in_parts")
    self._out_pairs = _pair_local(out_parts, local_out_parts, "out_parts")
    self._local_num_partitions = local_num_partitions or infer_num_partitions(
      local_in_parts=local_in_parts, local_out_parts=local_out_parts
    )
    self._static_argnums = tuple(
      sorted({static_argnums} if isinstance(static_argnums, int) else set(static_argnums))
    )
    self._donate_argnums = (
      (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    )
    self._user_mesh = mesh
    self._num_partitions = infer_num_partitions(in_parts=in_parts, out_parts=out_parts)
    for name, value in (
      ("num_partitions", num_partitions),
      ("mesh size", None if mesh is None else mesh.size),
    ):
      if value is not None and self._num_partitions not in (None, value):
        raise ValueError(
          f"{name}={value} conflicts with in_parts={in_parts!r} "
          f"and out_parts={out_parts!r}, whose specs split "
          f"{self._num_partitions} ways"
        )
      if value is not None:
        self._num_partitions = value
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
    self._in_len = len(in_parts) if type(in_parts) is tuple else None
    self._plans: dict[int, _Plan] = {}
    self._plan: _Plan | None = None
    self._signature_counts: dict[Any, int] = {}
    self._stash = threading.local()
    self._sig: inspect.Signature | None = None
    self.fast: Callable | None = None  # the jax.jit that plain calls may use directly

  def __repr__(self) -> str:
    return f"sharded_jit({self._name}, in_parts={self._in_parts!r}, out_parts={self._out_parts!r})"

  # -- calling ---------------------------------------------------------------

  def call(self, args: tuple, kwargs: dict):
    """The full call: checks, planning, conversions. See `sharded_jit`."""
    jitted, args, kwargs, plan = self._prepare(args, kwargs)
    if jitted is None:
      return self._call_inline(_current(), args, kwargs)
    if not plan.cross_process:
      try:
        return jitted(*args, *kwargs.values())
      except ValueError as e:
        if _raised_in_trace(e):
          raise
        resharded = self._reshard_committed(plan, args)
        if resharded is None:
          raise
        return jitted(*resharded, *kwargs.values())
    return self._call_cross_process(plan, jitted, args, kwargs)

  def lower(self, *args, **kwargs) -> jax.stages.Lowered:
    """Lowers for these arguments without running (ahead-of-time use)."""
    jitted, args, kwargs, plan = self._prepare(args, kwargs)
    if jitted is None:
      raise ValueError("lower() cannot be called while tracing another sharded_jit")
    if plan.cross_process:
      args, kw_values, _ = self._to_global_args(plan, args, kwargs)
      return jitted.lower(*args, *kw_values)
    return jitted.lower(*args, *kwargs.values())

  def _prepare(self, args, kwargs):
    """Validated (jitted, args, kwargs, plan); jitted is None when nested."""
    if kwargs:
      args, kwargs = self._bind(args, kwargs)
    self._check_arguments(args)
    if _current() is not None:
      return None, args, kwargs, None
    plan = self._plan or self._plan_for_call(args, kwargs)
    key = (tuple(kwargs), len(args)) if kwargs else ()
    jitted = plan.jitted.get(key) or self._jit(plan, key)
    if not key and plan is self._plan and (not plan.cross_process or plan.all_global):
      # Later plain calls go straight to jax.jit: on this process's devices
      # always; across processes when nothing needs converting (global arrays
      # in and out). Anything else fails inside jax.jit and is redone on the
      # full path, which explains it.
      self.fast = jitted
    return jitted, args, kwargs, plan

  def _check_arguments(self, args: tuple) -> None:
    """Clear errors for positional arguments that do not fit static_argnums or in_parts.

    Also run when JAX traces, so that a malformed call on the fast path
    fails with these messages rather than with one from calling the function.
    """
    if self._static_argnums and self._static_argnums[-1] >= len(args):
      raise ValueError(
        f"jitted function has static_argnums={self._static_argnums}"
        f" but was called with only {len(args)} positional "
        f"argument{'s' if len(args) > 1 else ''}. "
        "All static broadcasted arguments must be passed positionally."
      )
    if self._in_len is not None and (len(args) - len(self._static_argnums) != self._in_len):
      raise ValueError(
        f"in_parts={self._in_parts!r} has {self._in_len} entries but "
        f"{self._name} was called with "
        f"{len(args) - len(self._static_argnums)} non-static positional "
        "arguments; give one spec per argument, or a single spec for all"
      )

  def _bind(self, args, kwargs):
    """Keyword arguments for positional parameters move to their position."""
    bound = self._signature().bind(*args, **kwargs)
    return bound.args, bound.kwargs

  def _signature(self) -> inspect.Signature:
    if self._sig is None:
      self._sig = inspect.signature(self._fun)
    return self._sig

  def _dynamic(self, args) -> tuple:
    return tuple(a for i, a in enumerate(args) if i not in self._static_argnums)

  def _with_dynamic(self, args, dynamic) -> tuple:
    it = iter(dynamic)
    return tuple(a if i in self._static_argnums else next(it) for i, a in enumerate(args))

  def _in_leaves(self, plan: _Plan, dyn: tuple):
    leaves, treedef = jax.tree_util.tree_flatten(dyn)
    per_leaf = plan.in_cache.get(treedef)
    if per_leaf is None:
      per_leaf = plan.in_cache[treedef] = broadcast_prefix(
        plan.in_leaves, dyn, "in_parts", is_leaf=_is_leaf_plan
      )
    return leaves, treedef, per_leaf

  def _reshard_committed(self, plan: _Plan, args) -> tuple | None:
    """Args with committed arrays moved to the expected sharding, if any."""
    leaves, treedef, per_leaf = self._in_leaves(plan, self._dynamic(args))
    moved = False
    for i, (x, leaf) in enumerate(zip(leaves, per_leaf)):
      if isinstance(x, jax.Array) and not x.sharding.is_equivalent_to(leaf.sharding, x.ndim):
        leaves[i] = jax.device_put(x, leaf.sharding)
        moved = True
    if not moved:
      return None
    return self._with_dynamic(args, jax.tree_util.tree_unflatten(treedef, leaves))

  def _call_cross_process(self, plan: _Plan, jitted, args, kwargs):
    try:
      call_args, kw_values, leaves = self._to_global_args(plan, args, kwargs)
    except ValueError as e:
      # Tell the other processes, which are about to check this new signature
      # together, so that they fail with this reason instead of timing out.
      multihost.check_agreement(
        f"sharded_jit({self._name})", {multihost.ERROR_KEY: f"{type(e).__name__}: {e}"}
      )
      raise
    self._stash.local_leaves = leaves
    try:
      out = jitted(*call_args, *kw_values)
    finally:
      self._stash.local_leaves = None
    out_leaves, out_treedef = jax.tree_util.tree_flatten(out)
    out_per_leaf = plan.out_cache.get(out_treedef)
    if out_per_leaf is None:
      out_per_leaf = plan.out_cache[out_treedef] = broadcast_prefix(
        plan.out_leaves, out, "out_parts", is_leaf=_is_leaf_plan
      )
    return jax.tree_util.tree_unflatten(
      out_treedef,
      [
        multihost.global_to_local(y, leaf.sharding) if leaf.mode == _LOCAL else y
        for y, leaf in zip(out_leaves, out_per_leaf)
      ],
    )

  def _to_global_args(self, plan: _Plan, args, kwargs):
    """Each process's pieces as global arrays, and the local leaves."""
    dyn = self._dynamic(args)
    leaves, treedef, per_leaf = self._in_leaves(plan, dyn)
    paths = None
    converted = []
    for i, (x, leaf) in enumerate(zip(leaves, per_leaf)):
      concrete = multihost.concrete_value(x)
      if multihost.is_global_value(x) or (leaf.mode == _GLOBAL and concrete is None):
        # A global array, or a tracer of one (jax.grad, jax.vjp, jax.jit), goes
        # to the inner jax.jit as it is: its in_shardings constrain a traced
        # value, and a concrete one on other devices moves device to device.
        # An argument without local_in_parts can only be global, so a tracer
        # with no concrete value to say otherwise (jax.jit) is taken as global.
        if concrete is not None and not concrete.sharding.is_equivalent_to(leaf.sharding, x.ndim):
          x = jax.device_put(x, leaf.sharding)
      elif isinstance(x, jax.ShapeDtypeStruct):  # lower() for planning: global shapes
        x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=leaf.sharding)
      elif leaf.mode == _GLOBAL:
        paths = paths or _paths(dyn)
        traced = "" if concrete is x else f" tracing a {type(concrete).__name__}"
        raise ValueError(
          f"argument {paths[i]} of {self._name} is split across processes "
          f"({leaf.sharding.spec}) but has no local_in_parts spec, so it must "
          f"be a global jax.Array; got {type(x).__name__}{traced} of shape "
          f"{np.shape(x)}. Pass local_in_parts to hand in this process's piece"
        )
      else:
        paths = paths or _paths(dyn)
        x = multihost.local_to_global(x, leaf.sharding, f"argument {paths[i]}")
      converted.append(x)
    replicated = jax.sharding.NamedSharding(plan.mesh, NamedSpec())
    kw_values = [
      jax.tree_util.tree_map(
        functools.partial(_replicated_to_global, sharding=replicated, name=k), v
      )
      for k, v in kwargs.items()
    ]
    call_args = self._with_dynamic(args, jax.tree_util.tree_unflatten(treedef, converted))
    return call_args, kw_values, leaves

  def _call_inline(self, ctx: _Context, args, kwargs):
    """Called while tracing another sharded_jit: specs become constraints."""
    if ctx.mesh is None:
      for _, spec in self._all_count_specs():
        ctx.recorded.append((f"nested {self._name}", spec))
      return self._fun(*args, **kwargs)
    n = self._num_partitions
    if n is not None and n != ctx.num_partitions and self._user_mesh is None:
      raise ValueError(
        f"sharded_jit({self._name}) splits {n} ways but is called inside "
        f"sharded_jit({ctx.name}), which has {ctx.num_partitions} partitions"
      )
    mesh = self._user_mesh or ctx.mesh

    def constrain(parts, values, what):
      def one(spec, sub):
        sharding = sharding_for(spec, mesh, ctx.num_partitions, what)
        return jax.tree_util.tree_map(lambda v: jax.lax.with_sharding_constraint(v, sharding), sub)

      broadcast_prefix(parts, values, what)  # a clear error if not a prefix
      return jax.tree_util.tree_map(one, parts, values, is_leaf=is_spec_leaf)

    dyn = constrain(self._in_parts, self._dynamic(args), "in_parts")
    out = self._fun(*self._with_dynamic(args, dyn), **kwargs)
    return constrain(self._out_parts, out, "out_parts")

  def _all_count_specs(self):
    for name, tree in (("in_parts", self._in_parts), ("out_parts", self._out_parts)):
      for s in jax.tree_util.tree_leaves(tree, is_leaf=is_spec_leaf):
        if isinstance(s, PartitionSpec):
          yield name, s

  # -- planning --------------------------------------------------------------

  def _plan_for_call(self, args, kwargs) -> _Plan:
    if self._num_partitions is not None:
      self._plan = self._make_plan(self._num_partitions)
      return self._plan
    # Everything replicated: the count comes from constraints inside `fun`,
    # found by tracing once per signature (shapes, dtypes, static args).
    dyn = self._dynamic(args)
    leaves, treedef = jax.tree_util.tree_flatten((dyn, kwargs))
    key = (
      treedef,
      tuple(_aval_key(x) for x in leaves),
      tuple(_static_key(args[i]) for i in self._static_argnums),
    )
    n = self._signature_counts.get(key)
    if n is None:
      n = self._signature_counts[key] = self._discover_num_partitions(args, kwargs)
    if n not in self._plans:
      self._plans[n] = self._make_plan(n)
    return self._plans[n]

  def _discover_num_partitions(self, args, kwargs) -> int:
    ctx = _Context(self._name, None, None)
    statics = {i: args[i] for i in self._static_argnums}

    def traced(dyn, kw):
      return self._fun(*self._with_dynamic([statics.get(i) for i in range(len(args))], dyn), **kw)

    with _pushed(ctx):
      jax.eval_shape(traced, self._dynamic(args), kwargs)
    counts = {}
    for what, spec in ctx.recorded:
      counts.setdefault(spec.num_partitions, []).append(f"{what} {spec}")
    if len(counts) > 1:
      raise ValueError(
        f"sharded_jit({self._name}): constraints disagree on the partition count: {counts}"
      )
    return next(iter(counts), 1)

  def _make_plan(self, n: int) -> _Plan:
    if self._user_mesh is not None:
      mesh = self._user_mesh
    else:
      mesh = mesh_lib.partition_mesh(mesh_lib.devices_for_partitions(n))
    processes = {d.process_index for d in mesh.devices.flat}
    cross = len(processes) > 1
    if cross:
      self._check_local_count(mesh)
    host_axes, local_axes = mesh_lib.split_axes(mesh)

    def resolve(pair, what):
      spec, local = pair.spec, pair.local
      local_what = f"local_{what}"
      if not cross:
        if local is not None and local != spec:
          raise ValueError(
            f"{local_what}={local!r} differs from {what}={spec!r}, but the "
            f"computation runs on this process's devices only ({n} "
            f"partitions); local and global pieces are the same here"
          )
        return _Leaf(sharding_for(spec, mesh, n, what), _LOCAL)
      if spec is None:
        return _Leaf(sharding_for(None, mesh, n, what), _LOCAL)
      if isinstance(local, PartitionSpec) and isinstance(spec, PartitionSpec):
        if spec.num_partitions != n:
          sharding_for(spec, mesh, n, what)  # raises the product error
        named = assign_axes_with_local(spec, local, host_axes, local_axes, what, local_what)
        return _Leaf(jax.sharding.NamedSharding(mesh, named), _LOCAL)
      if local is not None and local != spec:
        raise ValueError(
          f"{local_what}={local!r} must be a count spec for {what}={spec!r} or the same named spec"
        )
      return _Leaf(sharding_for(spec, mesh, n, what), _GLOBAL if local is None else _LOCAL)

    def resolve_tree(pairs, what):
      return jax.tree_util.tree_map(lambda p: resolve(p, what), pairs)

    return _Plan(
      n,
      mesh,
      cross,
      resolve_tree(self._in_pairs, "in_parts"),
      resolve_tree(self._out_pairs, "out_parts"),
    )

  def _check_local_count(self, mesh: jax.sharding.Mesh) -> None:
    local = jax.local_device_count()
    local_n = self._local_num_partitions
    if (
      local_n is None
      and not any(True for _ in self._all_count_specs())
      and (self._user_mesh is None)
    ):
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

  def _jit(self, plan: _Plan, key: tuple) -> Callable:
    """The `jax.jit` for a plan; keyword-only arguments go last, replicated.

    `key` is () for calls without keyword-only arguments, else their names
    and the number of positional arguments.
    """
    kwnames, n_args = key or ((), 0)
    replicated = jax.sharding.NamedSharding(plan.mesh, NamedSpec())
    in_shardings = jax.tree_util.tree_map(
      lambda leaf: leaf.sharding, plan.in_leaves, is_leaf=_is_leaf_plan
    )
    out_shardings = jax.tree_util.tree_map(
      lambda leaf: leaf.sharding, plan.out_leaves, is_leaf=_is_leaf_plan
    )
    fun, name, n_kw = self._fun, self._name, len(kwnames)

    def body(*all_args):
      try:
        args = all_args[: len(all_args) - n_kw]
        kwargs = dict(zip(kwnames, all_args[len(all_args) - n_kw :]))
        self._check_arguments(args)
        self._on_trace(plan, args, kwargs)
        with _pushed(_Context(name, plan.mesh, plan.num_partitions)):
          out = fun(*args, **kwargs)
        broadcast_prefix(self._out_parts, out, "out_parts")  # a clear error
        return out
      except Exception as e:
        with contextlib.suppress(AttributeError, TypeError):  # some types take no attributes
          setattr(e, _RAISED_IN_TRACE, True)
        raise

    body.__name__ = getattr(fun, "__name__", "sharded_jit_fun")
    body.__qualname__ = name
    if n_kw:
      if not isinstance(in_shardings, tuple):  # one spec for every positional
        in_shardings = (in_shardings,) * (n_args - len(self._static_argnums))
      in_shardings = in_shardings + (replicated,) * n_kw
    jitted = jax.jit(
      body,
      in_shardings=in_shardings,
      out_shardings=out_shardings,
      static_argnums=self._static_argnums,
      donate_argnums=self._donate_argnums,
    )
    plan.jitted[key] = jitted
    return jitted

  def _on_trace(self, plan: _Plan, args, kwargs) -> None:
    """Runs when JAX traces a new signature: log, and check hosts agree."""
    dyn = self._dynamic(args)
    avals = [f"{x.dtype}{list(x.shape)}" for x in jax.tree_util.tree_leaves((dyn, kwargs))]
    level = logging.WARNING if jax.config.jax_log_compiles else logging.DEBUG
    log.log(
      level,
      "sharded_jit: compiling %s for %d devices with args %s",
      self._name,
      plan.num_partitions,
      avals,
    )
    if not plan.cross_process:
      return
    local = getattr(self._stash, "local_leaves", None)
    paths = _paths(dyn)
    leaves = jax.tree_util.tree_leaves(dyn)
    record = {
      "function": self._name,
      "num_partitions": plan.num_partitions,
      "in_parts": repr(self._in_parts),
      "out_parts": repr(self._out_parts),
      "static_args": [_static_key(args[i]) for i in self._static_argnums],
      "keyword_args": sorted(kwargs),
      "args": [
        {
          "path": p,
          "local_shape": list(np.shape(lx)) if local is not None else None,
          "local_dtype": str(getattr(lx, "dtype", type(lx).__name__))
          if local is not None
          else None,
          "global_shape": list(x.shape),
          "dtype": str(x.dtype),
        }
        for p, x, lx in zip(paths, leaves, local or leaves)
      ],
    }
    multihost.check_agreement(f"sharded_jit({self._name})", record)


def _replicated_to_global(v: Any, sharding, name: str) -> jax.Array:
  return multihost.local_to_global(v, sharding, f"argument {name}")


def _paths(tree: Any) -> list[str]:
  return [
    f"args{jax.tree_util.keystr(p)}" for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
  ]


def _aval_key(x: Any) -> tuple:
  return (np.shape(x), str(getattr(x, "dtype", type(x))))


def _static_key(v: Any) -> Any:
  """A description of a static argument that is equal on every process."""
  if v is None or isinstance(v, (bool, int, float, str)):
    return v
  if isinstance(v, (tuple, list)):
    return [_static_key(x) for x in v]
  return type(v).__qualname__


def sharded_jit(
  fun: Callable,
  in_parts: Any,
  out_parts: Any,
  num_partitions: int | None = None,
  local_in_parts: Any = None,
  local_out_parts: Any = None,
  local_num_partitions: int | None = None,
  static_argnums: int | Iterable[int] = (),
  donate_argnums: int | Iterable[int] = (),
  mesh: jax.sharding.Mesh | None = None,
) -> Callable:
  """Like `jax.jit`, but splits `fun`'s inputs, outputs and work across devices.

  Args:
    fun: the function to compile.
    in_parts: how each positional argument is split: a `PartitionSpec` of
      per-dimension counts, None to replicate, a named
      `jax.sharding.PartitionSpec` (with `mesh`), or a tuple/tree of those that
      is a prefix of the arguments. All count specs of one call must multiply
      to the same number of partitions.
    out_parts: the same for the outputs.
    num_partitions: the partition count, when the specs don't say it (for
      example everything replicated, to keep data on the same devices as a
      neighbouring sharded call).
    local_in_parts: across processes: how this process's own piece of each
      argument is split over its devices. Each process then passes only its
      piece; the global shape is local shape x parts / local parts per
      dimension. Without it, split arguments must be global `jax.Array`s.
    local_out_parts: the same for outputs: with it, outputs come back as this
      process's piece; without it, split outputs come back as global arrays.
      Replicated outputs always come back whole.
    local_num_partitions: the number of local devices, for cross-process calls
      whose specs are all replicated.
    static_argnums: positional arguments that are compile-time constants.
    donate_argnums: positional arguments whose buffers may be reused.
    mesh: a `jax.sharding.Mesh` for named specs; its devices are used.

  Returns:
    A function with `fun`'s signature (keyword arguments welcome) that runs
    on the first `num_partitions` local devices, or on every device of every
    process when that is the count. Its `.lower(*args)` lowers ahead of time.

  Example:
    >>> import numpy as np
    >>> f = sharded_jit(lambda a, b: a @ b, in_parts=(PartitionSpec(1, 1), None),
    ...                 out_parts=PartitionSpec(1, 1))
    >>> f(np.eye(2), np.ones((2, 2))).tolist()
    [[1.0, 1.0], [1.0, 1.0]]
  """
  impl = ShardedJitFunction(
    fun,
    in_parts,
    out_parts,
    num_partitions,
    local_in_parts,
    local_out_parts,
    local_num_partitions,
    static_argnums,
    donate_argnums,
    mesh,
  )
  depth = _tracing_depth

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    # Fast path: after the first call, a plain call on this process's devices
    # is the jax.jit call itself. Anything unusual (keywords, a trace in
    # progress, an error to explain) takes the full path.
    fast = impl.fast
    if fast is None or kwargs or depth[0]:
      return impl.call(args, kwargs)
    try:
      return fast(*args)
    except multihost.AgreementError:
      raise  # every process raised it in the same round; another would wait again
    except (TypeError, ValueError) as e:
      if _raised_in_trace(e):
        raise  # from the user's function or our checks: the full path would trace again
      # Otherwise JAX refused the arguments before tracing: redo it on the
      # full path, which raises our own errors.
    return impl.call(args, kwargs)

  wrapped.lower = impl.lower
  wrapped.sharded_jit = impl
  return wrapped
