"""`sharded_jit`: the 2020 API, rebuilt on `jax.jit` and `NamedSharding`.

`sharded_jit(fun, in_parts, out_parts)` compiles `fun` once per signature and
runs it split across devices. Specs count pieces per dimension
(`PartitionSpec(2, 1)`), or name mesh axes (`jax.sharding.PartitionSpec`) when
a `mesh` is given; `None` replicates.

Design:
  * The options are checked once (`spmd._jit.arguments`). Counts become
    `NamedSharding`s on one mesh per partition count (the plan,
    `spmd._jit.placement`), and the function becomes one `jax.jit` with those in/out
    shardings, created once. A plain call whose arguments JAX takes as they
    are (`spmd._jit.fast_path` decides before the call) is the `jax.jit` call
    itself: JAX's C++ cache decides when to trace. The trainer's steps take
    this path across processes too: named specs, global arrays in and out.
  * Across processes, each process may pass its own piece (`local_in_parts`):
    pieces become global arrays with JAX's `multihost_utils` primitives and
    outputs come back as pieces (`local_out_parts`); see `spmd._jit.cross_process`.
    Global `jax.Array`s, and tracers of them under `jax.grad`, `jax.vjp` and
    `jax.jit`, pass through without touching the host.
  * Hosts must agree: when a computation spans processes, every new
    signature is compared across them before it runs, and an error at a new
    signature is raised at once, never retried (see `spmd._jit.cross_process`).
  * Partition counts come from the specs, from `num_partitions`, or, when
    everything is replicated, from `with_sharding_constraint` calls found by
    tracing the function once per signature (only in that case).
  * What tracing needs to know (the computation being traced, the pieces this
    process passed in) travels in `contextvars.ContextVar`s, so it follows the
    call that set it and nothing else.

Example:
  >>> import numpy as np
  >>> f = sharded_jit(lambda x: x * 2, in_parts=PartitionSpec(1, 1),
  ...                 out_parts=None)
  >>> f(np.ones((2, 2), np.float32)).tolist()
  [[2.0, 2.0], [2.0, 2.0]]
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from spmd import compile_meeting, multihost
from spmd._jit import cross_process, tracing
from spmd._jit.arguments import Arguments
from spmd._jit.fast_path import FastPath
from spmd._jit.placement import Plan, broadcast_prefix, make_plan, moved
from spmd._jit.tracing import with_sharding_constraint
from spmd.compat import ARRAY_TYPE, sharding_of
from spmd.partition import NamedSpec, PartitionSpec, count_specs

__all__ = ["PartitionSpec", "ShardedJitFunction", "sharded_jit", "with_sharding_constraint"]

log = logging.getLogger(__name__)


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
  name = getattr(fun, "__qualname__", getattr(fun, "__name__", repr(fun)))
  arguments = Arguments.parse(
    name,
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
  impl = ShardedJitFunction(fun, arguments)
  tracing_now = tracing.current.get

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    # A plain call outside another sharded_jit's trace, with arguments JAX
    # takes as they are, is the jax.jit call itself. Keywords, nested calls
    # and arguments to move or convert first take the full path.
    fast = impl.fast
    if fast is not None and not kwargs and tracing_now() is None:
      # The commonest call, one array already on the plan's sharding, is
      # tested here: a call into FastPath costs more than the test itself.
      # `sharding_of` reads what the `sharding` property returns, without its
      # frame (spmd.compat).
      if len(args) == 1 and isinstance(x := args[0], ARRAY_TYPE) and sharding_of(x) is fast.one:
        return fast.jitted(x)
      if fast.admits(args):
        return fast.jitted(*args)
    return impl.call(args, kwargs)

  wrapped.lower = impl.lower
  wrapped.sharded_jit = impl
  return wrapped


class ShardedJitFunction:
  """What a `sharded_jit` function runs: plans, checks and conversions.

  The function `sharded_jit` returns keeps this as its `.sharded_jit`
  attribute; `.lower(*args)` lowers without running. `.fast` is the
  `FastPath` (a `jax.jit` and the test that admits a call to it) that plain
  calls use directly, once the plan allows it.
  """

  def __init__(self, fun: Callable, arguments: Arguments):
    self._fun = fun
    self._args = arguments
    self._name = arguments.name
    # What JAX names the compiled program after (`jit(<this>)`): the traced body takes it.
    self._program_name = getattr(fun, "__name__", "sharded_jit_fun")
    self._plan: Plan | None = None  # when the count is fixed: the one plan
    self._plans: dict[int, Plan] = {}  # when discovered: one per count
    self._signature_counts: dict[Any, int] = {}
    self._sig: inspect.Signature | None = None
    self.fast: FastPath | None = None

  def __repr__(self) -> str:
    a = self._args
    return f"sharded_jit({self._name}, in_parts={a.in_parts!r}, out_parts={a.out_parts!r})"

  # -- calling ---------------------------------------------------------------

  def call(self, args: tuple, kwargs: dict):
    """The full call: checks, planning, conversions. See `sharded_jit`."""
    args, kwargs = self._checked(args, kwargs)
    ctx = tracing.current.get()
    if ctx is not None:
      return self._call_inline(ctx, args, kwargs)
    plan = self._plan_for_call(args, kwargs)
    jitted = self._jitted(plan, kwargs, len(args))
    if plan.cross_process:
      return self._call_cross_process(plan, jitted, args, kwargs)
    return jitted(*self._placed(plan, args), *kwargs.values())

  def lower(self, *args, **kwargs) -> jax.stages.Lowered:
    """Lowers for these arguments without running (ahead-of-time use)."""
    args, kwargs = self._checked(args, kwargs)
    if tracing.current.get() is not None:
      raise ValueError("lower() cannot be called while tracing another sharded_jit")
    plan = self._plan_for_call(args, kwargs)
    jitted = self._jitted(plan, kwargs, len(args))
    if plan.cross_process:
      dyn, kw_values, _ = cross_process.to_global(plan, self._dynamic(args), kwargs, self._name)
      return jitted.lower(*self._with_dynamic(args, dyn), *kw_values)
    return jitted.lower(*args, *kwargs.values())

  def _placed(self, plan: Plan, args: tuple) -> tuple:
    """`args` with committed arrays sharded another way moved, device to device.

    `jax.jit` refuses those rather than moving them; uncommitted arrays and
    host values it places itself.
    """
    leaves, treedef, per_leaf = plan.per_input_leaf(self._dynamic(args))
    placed = [moved(x, leaf.sharding) for x, leaf in zip(leaves, per_leaf)]
    if all(p is x for p, x in zip(placed, leaves)):
      return args
    return self._with_dynamic(args, jax.tree_util.tree_unflatten(treedef, placed))

  def _call_cross_process(self, plan: Plan, jitted: Callable, args: tuple, kwargs: dict):
    try:
      dyn, kw_values, pieces = cross_process.to_global(
        plan, self._dynamic(args), kwargs, self._name
      )
    except ValueError as e:
      cross_process.report_failure(self._name, e)
      raise
    with tracing.setting(tracing.pieces, (self, pieces)):
      out = jitted(*self._with_dynamic(args, dyn), *kw_values)
    return cross_process.to_local(plan, out)

  def _call_inline(self, ctx: tracing.Context, args: tuple, kwargs: dict):
    """Called while tracing another sharded_jit: specs become constraints."""
    if ctx.mesh is None:
      for spec in count_specs((self._args.in_parts, self._args.out_parts)):
        ctx.recorded.append((f"nested {self._name}", spec))
      return self._fun(*args, **kwargs)
    n = self._args.num_partitions
    if n is not None and n != ctx.num_partitions and self._args.mesh is None:
      raise ValueError(
        f"sharded_jit({self._name}) splits {n} ways but is called inside "
        f"sharded_jit({ctx.name}), which has {ctx.num_partitions} partitions"
      )
    mesh, n = self._args.mesh or ctx.mesh, ctx.num_partitions
    dyn = tracing.constrain(self._args.in_parts, self._dynamic(args), mesh, n, "in_parts")
    out = self._fun(*self._with_dynamic(args, dyn), **kwargs)
    return tracing.constrain(self._args.out_parts, out, mesh, n, "out_parts")

  # -- planning --------------------------------------------------------------

  def _plan_for_call(self, args: tuple, kwargs: dict) -> Plan:
    if self._args.num_partitions is not None:
      if self._plan is None:
        self._plan = self._make_plan(self._args.num_partitions)
        if self._plan.plain_calls_go_straight_to_jit:
          self.fast = FastPath(self._jitted(self._plan, {}, 0), self._plan, self._args)
      return self._plan
    # Everything replicated: the count comes from constraints inside `fun`,
    # found by tracing once per signature (shapes, dtypes, static args).
    leaves, treedef = jax.tree_util.tree_flatten((self._dynamic(args), kwargs))
    key = (
      treedef,
      tuple((np.shape(x), str(getattr(x, "dtype", type(x)))) for x in leaves),
      tuple(cross_process.static_key(args[i]) for i in self._args.static_argnums),
    )
    n = self._signature_counts.get(key)
    if n is None:
      n = self._signature_counts[key] = self._discover_num_partitions(args, kwargs)
    if n not in self._plans:
      self._plans[n] = self._make_plan(n)
    return self._plans[n]

  def _make_plan(self, n: int) -> Plan:
    a = self._args
    return make_plan(n, a.in_pairs, a.out_pairs, a.mesh, a.local_num_partitions)

  def _discover_num_partitions(self, args: tuple, kwargs: dict) -> int:
    statics = {i: args[i] for i in self._args.static_argnums}

    def traced(dyn, kw):
      return self._fun(*self._with_dynamic([statics.get(i) for i in range(len(args))], dyn), **kw)

    return tracing.discover_num_partitions(self._name, traced, self._dynamic(args), kwargs)

  def _jitted(self, plan: Plan, kwargs: dict, n_args: int) -> Callable:
    """The plan's `jax.jit` for calls with these keyword-only arguments (built once).

    Keyword-only arguments go last, replicated; calls without them share one.
    """
    key = (tuple(kwargs), n_args) if kwargs else ()
    jitted = plan.jitted.get(key)
    if jitted is not None:
      return jitted
    kwnames = tuple(kwargs)
    in_shardings = plan.shardings(plan.in_leaves)
    if kwnames:
      if not isinstance(in_shardings, tuple):  # one spec for every positional
        in_shardings = (in_shardings,) * (n_args - len(self._args.static_argnums))
      replicated = jax.sharding.NamedSharding(plan.mesh, NamedSpec())
      in_shardings = in_shardings + (replicated,) * len(kwnames)
    jitted = plan.jitted[key] = jax.jit(
      self._traced_body(plan, kwnames),
      in_shardings=in_shardings,
      out_shardings=plan.shardings(plan.out_leaves),
      static_argnums=self._args.static_argnums,
      donate_argnums=self._args.donate_argnums,
    )
    return jitted

  def _traced_body(self, plan: Plan, kwnames: tuple[str, ...]) -> Callable:
    """What `jax.jit` traces: checks, the agreement round, then `fun` in our context."""
    fun, name, n_kw = self._fun, self._name, len(kwnames)

    def body(*all_args):
      args = all_args[: len(all_args) - n_kw]
      kwargs = dict(zip(kwnames, all_args[len(all_args) - n_kw :]))
      self._on_trace(plan, args, kwargs)
      with tracing.setting(tracing.current, tracing.Context(name, plan.mesh, plan.num_partitions)):
        out = fun(*args, **kwargs)
      broadcast_prefix(self._args.out_parts, out, "out_parts")  # a clear error
      return out

    body.__name__ = self._program_name
    body.__qualname__ = name
    return body

  def _on_trace(self, plan: Plan, args: tuple, kwargs: dict) -> None:
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
    owner, pieces = tracing.pieces.get() or (None, None)
    record = cross_process.agreement_record(
      self._name,
      plan.num_partitions,
      repr(self._args.in_parts),
      repr(self._args.out_parts),
      [args[i] for i in self._args.static_argnums],
      kwargs,
      dyn,
      pieces if owner is self else None,
    )
    multihost.check_agreement(f"sharded_jit({self._name})", record)
    compile_meeting.expect(self._program_name)

  # -- arguments -------------------------------------------------------------

  def _checked(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Keyword arguments for positional parameters moved into place, and checked."""
    if kwargs:
      if self._sig is None:
        self._sig = inspect.signature(self._fun)
      bound = self._sig.bind(*args, **kwargs)
      args, kwargs = bound.args, bound.kwargs
    self._args.check(args)
    return args, kwargs

  def _dynamic(self, args: tuple) -> tuple:
    return self._args.dynamic(args)

  def _with_dynamic(self, args, dynamic) -> tuple:
    return self._args.with_dynamic(args, dynamic)
