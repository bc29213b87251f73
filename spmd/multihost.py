"""Process-local data to global arrays and back, and cross-host agreement.

Conversions use JAX's own `multihost_utils` primitives, which are linear (so
`jax.grad` flows through them) and reuse device buffers when the local piece
already sits on this process's devices the right way (no host round trip).

Agreement: JAX does not check that processes agree. If two hosts pass local
pieces of different shapes, each builds a different global array and the
compiled program computes wrong numbers, or the hosts wait forever in
mismatched collectives. `check_agreement` compares a small description of the
call (shapes, dtypes, specs, partition count) across all processes through the
distributed runtime's key-value store and a barrier, and raises the same
`AgreementError` on every process when they differ.

Example (one process: nothing to compare, so it returns at once):
  >>> check_agreement("f", {"args": [[4, 8], "float32"]})
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import os
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from spmd import compat
from spmd.partition import axis_names

log = logging.getLogger(__name__)

AGREEMENT_TIMEOUT_ENV = "SPMD_AGREEMENT_TIMEOUT_S"
DEFAULT_AGREEMENT_TIMEOUT_S = 120.0
_KEY_ROOT = "spmd_harness/agree"
ERROR_KEY = "error"  # a record with this key reports a failure on that process
_sequence = itertools.count()
# The last record every process agreed on, per `what`: a process that times
# out alone says what it changed since then.
_agreed: dict[str, Any] = {}


class AgreementError(ValueError):
  """Processes disagree about a cross-process computation.

  `every_host` is True when every process compared the same records and so
  raises this same error (a disagreement), False when some process did not
  arrive (a timeout: the others raise, the missing one is elsewhere).
  """

  def __init__(self, message: str, every_host: bool = False):
    super().__init__(message)
    self.every_host = every_host


def runtime_client():
  """The distributed runtime's key-value client (None in a single process)."""
  return compat.distributed_client()


def agreement_timeout_s() -> float:
  return float(os.environ.get(AGREEMENT_TIMEOUT_ENV, DEFAULT_AGREEMENT_TIMEOUT_S))


def _flatten_record(record: Any, prefix: str = "") -> dict[str, str]:
  if isinstance(record, dict):
    out = {}
    for k, v in record.items():
      out.update(_flatten_record(v, f"{prefix}.{k}" if prefix else str(k)))
    return out
  if isinstance(record, list) and record and isinstance(record[0], dict):
    out = {}
    for i, v in enumerate(record):
      out.update(_flatten_record(v, f"{prefix}[{i}]"))
    return out
  return {prefix: json.dumps(record)}


def describe_disagreement(what: str, records: dict[int, Any]) -> str:
  """A message naming each field the processes disagree on, with values."""
  errors = {p: r[ERROR_KEY] for p, r in records.items() if isinstance(r, dict) and ERROR_KEY in r}
  if errors:
    return f"{what}: failed on another process before running:\n" + "\n".join(
      f"  process {p}: {e}" for p, e in sorted(errors.items())
    )
  flat = {p: _flatten_record(r) for p, r in sorted(records.items())}
  fields = sorted(set().union(*flat.values()))
  lines = [
    f"{what}: processes disagree (checked before running a new signature; nothing was computed):"
  ]
  for field in fields:
    by_value: dict[str, list[int]] = {}
    for p, values in flat.items():
      by_value.setdefault(values.get(field, "<missing>"), []).append(p)
    if len(by_value) > 1:
      shown = "; ".join(f"process {_ranges(ps)}: {v}" for v, ps in by_value.items())
      lines.append(f"  {field}: {shown}")
  return "\n".join(lines)


def _ranges(ps: list[int]) -> str:
  return ",".join(map(str, ps)) if len(ps) <= 4 else f"{ps[0]}..{ps[-1]} ({len(ps)})"


def check_agreement(what: str, record: Any, timeout_s: float | None = None) -> None:
  """Raises `AgreementError` on every process unless all pass equal `record`s.

  Must be called by all processes in the same order (each call is one
  numbered round). A process that does not arrive within `timeout_s` makes
  the others raise, naming it, instead of hanging.
  """
  client = runtime_client()
  if client is None or jax.process_count() == 1:
    return
  seq = next(_sequence)
  me = jax.process_index()
  timeout_s = agreement_timeout_s() if timeout_s is None else timeout_s
  prefix = f"{_KEY_ROOT}/{seq}/"
  client.key_value_set(prefix + str(me), json.dumps(record, sort_keys=True))
  try:
    client.wait_at_barrier(f"{_KEY_ROOT}/barrier/{seq}", int(timeout_s * 1000))
  except Exception as e:  # the runtime raises a bare XlaRuntimeError
    arrived = {int(k.rsplit("/", 1)[-1]) for k, _ in client.key_value_dir_get(prefix)}
    missing = sorted(set(range(jax.process_count())) - arrived)
    raise AgreementError(
      f"{what}: processes {missing} did not reach the agreement check for a new "
      f"signature within {timeout_s:g}s; they are running something else "
      f"(another signature, a cached program, or they died).\n"
      f"{describe_own_change(what, record)}\n({e})"
    ) from None
  records = {int(k.rsplit("/", 1)[-1]): json.loads(v) for k, v in client.key_value_dir_get(prefix)}
  if seq >= 2:  # everyone passed barrier seq-1, so nobody still reads seq-2
    client.key_value_delete(f"{_KEY_ROOT}/{seq - 2}/{me}")
  if any(r != record for r in records.values()):
    raise AgreementError(describe_disagreement(what, records), every_host=True)
  _agreed[what] = record


def describe_own_change(what: str, record: Any) -> str:
  """What this process's `record` changed since the last one all processes agreed on.

  The others' records are not there when they did not come, so this is the
  best a process waiting alone can say: the fields it changed, with values.
  """
  if isinstance(record, dict) and ERROR_KEY in record:
    return f"This process failed before running: {record[ERROR_KEY]}"
  now = _flatten_record(record)
  if what not in _agreed:
    return "This process calls with (no earlier call was agreed on):\n" + "\n".join(
      f"  {field}: {value}" for field, value in now.items()
    )
  before = _flatten_record(_agreed[what])
  changed = [
    f"  {field}: {before.get(field, '<missing>')} -> {now.get(field, '<missing>')}"
    for field in sorted(set(before) | set(now))
    if before.get(field) != now.get(field)
  ]
  if not changed:
    return "This process calls with the signature all processes last agreed on."
  return "Changed on this process since the last call all processes agreed on:\n" + "\n".join(
    changed
  )


def local_to_global(x: Any, sharding: jax.sharding.NamedSharding, name: str) -> jax.Array:
  """This process's piece `x` of an array sharded as `sharding`.

  A global `jax.Array` (not fully addressable), or a tracer of one
  (`is_global_value`), passes through untouched; numpy or process-local arrays
  become one global array.
  """
  if is_global_value(x):
    return x
  shape = np.shape(x)
  pieces = local_pieces(sharding, len(shape), name)
  if any(s % p for s, p in zip(shape, pieces)):
    raise ValueError(
      f"{name}: local {shape=} is not divisible by the local "
      f"parts={tuple(pieces)} this process splits it into"
    )
  if not isinstance(x, jax.core.Tracer):  # eager: no gradient to define, skip tracing
    return multihost_utils.host_local_array_to_global_array(x, sharding.mesh, sharding.spec)
  return _to_global(x, sharding)


def is_global_array(x: Any) -> bool:
  """True for a concrete `jax.Array` that spans other processes' devices."""
  return (
    isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and not x.is_fully_addressable
  )


def concrete_value(x: Any) -> Any:
  """`x`, or for a tracer the concrete value it stands for, or None if it has none.

  Under `jax.grad` and `jax.vjp` of concrete arguments a tracer carries its
  primal value; under `jax.jit` (and `jax.vmap`) it has none.
  """
  return x.to_concrete_value() if isinstance(x, jax.core.Tracer) else x


def is_global_value(x: Any) -> bool:
  """True for a global `jax.Array` or a tracer of one.

  A tracer with a concrete value is judged by that value. One without (under
  `jax.jit`) is global when its type carries a mesh with more devices than this
  process has, which only values placed across processes do; any other stays
  what it was taken for before tracing: this process's piece.
  """
  if not isinstance(x, jax.core.Tracer):
    return is_global_array(x)
  concrete = x.to_concrete_value()
  if concrete is not None:
    return is_global_array(concrete)
  mesh = getattr(getattr(getattr(x, "aval", None), "sharding", None), "mesh", None)
  return getattr(mesh, "size", 0) > jax.local_device_count()


def global_to_local(x: jax.Array, sharding: jax.sharding.NamedSharding) -> jax.Array:
  """This process's piece of global `x`, as an array on its own devices."""
  if not isinstance(x, jax.core.Tracer):
    # A concrete array (every output of a cross-process call): called
    # eagerly, the custom_vjp would trace it anew on every call, a cost paid
    # per array per step; JAX's own conversion needs no trace, and nothing
    # differentiates through a concrete value.
    return multihost_utils.global_array_to_host_local_array(x, sharding.mesh, sharding.spec)
  return _to_local(x, sharding)


# JAX's conversion primitives transpose to themselves, which is wrong for
# gradients (the transpose of "global to local" is "local to global", and the
# shapes differ), so the gradients are defined here.


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _to_global(x, sharding):
  return multihost_utils.host_local_array_to_global_array(x, sharding.mesh, sharding.spec)


def _to_global_fwd(x, sharding):
  return _to_global(x, sharding), None


def _to_global_bwd(sharding, _, ct):
  # Each process gets its block of the one global cotangent; a replicated
  # input gets the whole of it (the gradient of the one global function).
  return (multihost_utils.global_array_to_host_local_array(ct, sharding.mesh, sharding.spec),)


_to_global.defvjp(_to_global_fwd, _to_global_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _to_local(x, sharding):
  return multihost_utils.global_array_to_host_local_array(x, sharding.mesh, sharding.spec)


def _to_local_fwd(x, sharding):
  return _to_local(x, sharding), None


def _to_local_bwd(sharding, _, ct):
  # The local cotangents are the pieces of one global cotangent, just as the
  # outputs were pieces of one global output. Where processes hold replicas,
  # their cotangents must agree (as for replicated inputs); this holds when
  # every process computes the same loss from the same replicated values.
  return (_to_global(ct, sharding),)


_to_local.defvjp(_to_local_fwd, _to_local_bwd)


def local_pieces(sharding: jax.sharding.NamedSharding, ndim: int, name: str) -> tuple[int, ...]:
  """How many pieces each dimension of this process's block is split into."""
  if len(sharding.spec) > ndim:
    raise ValueError(f"{name}: spec {sharding.spec} has more dimensions than the array's {ndim}")
  spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
  local_shape = sharding.mesh.local_mesh.shape
  return tuple(math.prod(local_shape[n] for n in axis_names(e)) for e in spec)


def barrier(name: str, timeout_s: float | None = None) -> None:
  """Waits until every process reaches `name` (a no-op for one process).

  Uses the distributed runtime's barrier, not a device collective, so it
  works before any computation and never compiles anything.
  """
  client = runtime_client()
  if client is None or jax.process_count() == 1:
    return
  timeout_s = agreement_timeout_s() if timeout_s is None else timeout_s
  client.wait_at_barrier(f"spmd_harness/barrier/{name}", int(timeout_s * 1000))
