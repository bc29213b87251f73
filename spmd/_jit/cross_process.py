"""A `sharded_jit` call across processes: pieces in, pieces out, one agreement record.

Each process passes its own piece of an argument that has a local spec;
`to_global` turns those pieces into global arrays (and lets global arrays,
and tracers of them, through untouched), `to_local` turns outputs with a
local spec back into this process's piece, and `agreement_record` describes
a new signature so that `multihost.check_agreement` can compare it across
processes before anything runs.

Hosts must agree. The function `sharded_jit` hands to `jax.jit` runs
only when JAX traces, i.e. on the first call of each new signature; when the
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

Example (one process: the record of a call, as every process would send it):
  >>> import numpy as np
  >>> record = agreement_record("f", 2, "P(2)", "None", [], {}, (np.zeros((4, 3)),), None)
  >>> record["args"][0]["path"], record["args"][0]["global_shape"]
  ('args[0]', [4, 3])
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from spmd import multihost
from spmd._jit.placement import GLOBAL, LOCAL, Plan
from spmd.partition import NamedSpec


def to_global(plan: Plan, dyn: tuple, kwargs: dict, name: str) -> tuple[tuple, list, list]:
  """`(dyn, keyword values)` as global arrays, and this process's own leaves of `dyn`.

  Keyword-only arguments are replicated: every process passes the whole value.
  """
  leaves, treedef, per_leaf = plan.per_input_leaf(dyn)
  paths = None
  converted = []
  for i, (x, leaf) in enumerate(zip(leaves, per_leaf)):
    concrete = multihost.concrete_value(x)
    if multihost.is_global_value(x) or (leaf.mode == GLOBAL and concrete is None):
      # A global array, or a tracer of one (jax.grad, jax.vjp, jax.jit), goes
      # to the inner jax.jit as it is: its in_shardings constrain a traced
      # value, and a concrete one on other devices moves device to device.
      # An argument without local_in_parts can only be global, so a tracer
      # with no concrete value to say otherwise (jax.jit) is taken as global.
      if concrete is not None and not concrete.sharding.is_equivalent_to(leaf.sharding, x.ndim):
        x = jax.device_put(x, leaf.sharding)
    elif isinstance(x, jax.ShapeDtypeStruct):  # lower() for planning: global shapes
      x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=leaf.sharding)
    elif leaf.mode == GLOBAL:
      paths = paths or _paths(dyn)
      traced = "" if concrete is x else f" tracing a {type(concrete).__name__}"
      raise ValueError(
        f"argument {paths[i]} of {name} is split across processes "
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
    jax.tree_util.tree_map(functools.partial(_replicated_to_global, sharding=replicated, name=k), v)
    for k, v in kwargs.items()
  ]
  return jax.tree_util.tree_unflatten(treedef, converted), kw_values, leaves


def to_local(plan: Plan, out: Any) -> Any:
  """Outputs with a local spec as this process's piece; the others as they are."""
  leaves, treedef, per_leaf = plan.per_output_leaf(out)
  return jax.tree_util.tree_unflatten(
    treedef,
    [
      multihost.global_to_local(y, leaf.sharding) if leaf.mode == LOCAL else y
      for y, leaf in zip(leaves, per_leaf)
    ],
  )


def report_failure(name: str, e: Exception) -> None:
  """Tells the other processes, about to check a new signature together, why this one failed.

  They then fail with this reason instead of timing out in the check.
  """
  multihost.check_agreement(
    f"sharded_jit({name})", {multihost.ERROR_KEY: f"{type(e).__name__}: {e}"}
  )


def agreement_record(
  name: str,
  num_partitions: int,
  in_parts: str,
  out_parts: str,
  static_args: list,
  kwargs: dict,
  dyn: tuple,
  local_leaves: list | None,
) -> dict:
  """What every process must agree on before it runs a new signature.

  `dyn` holds the global values the program sees (tracers at trace time);
  `local_leaves` the pieces this process passed in, when it passed pieces.
  """
  leaves = jax.tree_util.tree_leaves(dyn)
  local = local_leaves
  # Without pieces (global arrays in), the local fields are None on every process.
  return {
    "function": name,
    "num_partitions": num_partitions,
    "in_parts": in_parts,
    "out_parts": out_parts,
    "static_args": [static_key(a) for a in static_args],
    "keyword_args": sorted(kwargs),
    "args": [
      {
        "path": p,
        "local_shape": list(np.shape(lx)) if local is not None else None,
        "local_dtype": str(getattr(lx, "dtype", type(lx).__name__)) if local is not None else None,
        "global_shape": list(x.shape),
        "dtype": str(x.dtype),
      }
      for p, x, lx in zip(_paths(dyn), leaves, local or leaves)
    ],
  }


def static_key(v: Any) -> Any:
  """A description of a static argument that is equal on every process."""
  if v is None or isinstance(v, (bool, int, float, str)):
    return v
  if isinstance(v, (tuple, list)):
    return [static_key(x) for x in v]
  return type(v).__qualname__


def _replicated_to_global(v: Any, sharding, name: str) -> jax.Array:
  return multihost.local_to_global(v, sharding, f"argument {name}")


def _paths(tree: Any) -> list[str]:
  return [
    f"args{jax.tree_util.keystr(p)}" for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
  ]
