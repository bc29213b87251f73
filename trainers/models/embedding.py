"""Embedding lookups laid out by the active rules, so no mesh makes XLA copy whole activations.

`lookup(table, ids)` is `table[ids]`, with ids outside the table's rows
giving zeros. Under `spmd.rules.activation_rules` (the train and eval
steps) it runs as a `shard_map` whose layout follows the rules:

  - the table's feature columns, split FSDP-style (`embed` on `fsdp`), are
    all-gathered first, as XLA gathers every other FSDP weight before its
    matmul; the gradient comes back reduce-scattered over the same axes;
  - the table's rows, split over `tensor` (`vocab` under `fsdp_tp`), are
    Megatron's vocabulary-parallel lookup: each device looks up the ids
    that fall in its rows, zeros elsewhere, and one all-reduce over those
    axes adds the pieces (exactly: one term is nonzero);
  - each device looks up only its own rows of the batch, so the output, and
    the gradient's scatter-add into the table, stay split like the batch;
  - a lookup in a narrower dtype than float32 (`dtype=bf16` under the
    precision policy) gathers the table in that dtype, but its gradient is
    summed across devices in float32 (a custom VJP: the lookup's transpose
    at float32) and returned in the table's dtype: a float32 table's gradient
    is never rounded, a bf16 table's once.

Why not leave the gather to XLA: with the batch split over `(data, fsdp)`
and the table's columns over `fsdp`, a gather's output would want `fsdp`
twice (the batch's and the columns'); XLA's SPMD partitioner cannot reach
either layout cheaply and replicates the whole `[batch, length, d_model]`
activation ("Involuntary full rematerialization"), forward and backward.
Why not a one-hot matmul, which partitions like any matmul: it costs
`4 * vocab * d_model` FLOPs per token, a few percent of Llama-3-8B's step at
a 128k vocabulary, for a lookup that needs none; and its gradient still
falls back on some meshes. The `shard_map` costs no FLOPs and its
collectives are the ones FSDP pays for every other weight.

Outside any rules (a model called in a plain process) and inside a
`shard_map` that already made the mesh axes manual, it is a plain gather.

Example:
  >>> import jax.numpy as jnp
  >>> table = jnp.arange(8.0).reshape(4, 2)
  >>> lookup(table, jnp.array([[2, 0, 9, -1]])).tolist()
  [[[4.0, 5.0], [0.0, 1.0], [0.0, 0.0], [0.0, 0.0]]]
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from spmd import rules as rules_lib

IDS_AXES = ("batch", "length")


def _mesh_axes(entry) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _dividing(shape: Sequence[int], spec: PartitionSpec, mesh) -> list:
  """`spec`'s entries, None where the entry's mesh axes do not divide that dimension."""
  entries = []
  for size, entry in zip(shape, spec):
    devices = 1
    for axis in _mesh_axes(entry):
      devices *= mesh.shape[axis]
    entries.append(entry if size % devices == 0 else None)
  return entries


def _local_lookup(table: jax.Array, ids: jax.Array, dtype=None) -> jax.Array:
  """`table[ids]` in `dtype` (the table's if None), zeros for ids outside [0, rows).

  Negative ids are out of range, not wrapped. The rows are read as float32
  (at least) and the result cast to `dtype`: the gradient, a scatter-add
  over every occurrence of each id, accumulates in float32 and is rounded
  to the table's dtype at most once, as a matmul's would be. Summed in
  bf16, a frequent token's gradient would lose most of its bits.
  """
  rows = table.shape[0]
  dtype = table.dtype if dtype is None else dtype
  ids = jnp.where(ids < 0, rows, ids)  # `rows` is out of range: zeros, like ids >= rows
  wide = table.astype(jnp.promote_types(dtype, jnp.float32))
  return jnp.take(wide, ids, axis=0, mode="fill", fill_value=0).astype(dtype)


def lookup(
  table: jax.Array,
  ids: jax.Array,
  table_axes: Sequence[str] = ("vocab", "embed"),
  ids_axes: Sequence[str] = IDS_AXES,
  dtype=None,
) -> jax.Array:
  """`table[ids]`: rows of `table` [rows, features] for integer `ids` [...], zeros out of range.

  Args:
    table: the embedding table, [rows, features].
    ids: integer ids, e.g. tokens [batch, length].
    table_axes: the table's logical axis names (rows, features), as its
      parameter is annotated; they say how the rules split it.
    ids_axes: the ids' logical axis names, one per dimension.
    dtype: the rows' dtype, the table's if None; the table is gathered in
      it, and its gradient comes back in the table's own dtype.

  Returns:
    [*ids.shape, features] in `dtype`, split like the ids (the features
    whole) when rules are active.
  """
  dtype = jnp.dtype(table.dtype if dtype is None else dtype)
  if len(table_axes) != 2 or table.ndim != 2:
    raise ValueError(f"{table.shape=} and {tuple(table_axes)=} must be [rows, features]")
  if len(ids_axes) != ids.ndim:
    raise ValueError(f"{tuple(ids_axes)=} must name each dimension of {ids.shape=}")
  active = rules_lib.active_rules()
  if active is None or jax.sharding.get_abstract_mesh().manual_axes:
    return _local_lookup(table, ids, dtype)
  rules, mesh = active
  table_spec = rules_lib.logical_to_spec(table_axes, rules, mesh)
  ids_spec = rules_lib.logical_to_spec(ids_axes, rules, mesh)
  rules_lib.check_divisible(f"embedding table {tuple(table_axes)}", table.shape, table_spec, mesh)
  if _dividing(ids.shape, ids_spec, mesh) != list(ids_spec):
    # Ids the rules' axes do not divide (a micro-batch of fewer rows than
    # the batch axes have devices) cannot be split as the rules say; XLA
    # lays such an array out as it can, so the lookup is left to it.
    return _local_lookup(table, ids, dtype)
  if not any(table_spec) and not any(ids_spec):
    return _local_lookup(table, ids, dtype)  # nothing split (one device, or dp on a data=1 mesh)
  entries = (*table_spec, None, None)
  row_axes, column_axes = _mesh_axes(entries[0]), _mesh_axes(entries[1])
  ids_mesh_axes = {a for entry in ids_spec for a in _mesh_axes(entry)}
  # Rows split over an axis that also splits the ids: each device holds other
  # ids and other rows, so the rows are gathered rather than looked up in place.
  gather_rows = bool(set(row_axes) & ids_mesh_axes)

  def local(table_shard, ids_shard):
    if column_axes:
      table_shard = jax.lax.all_gather(table_shard, column_axes, axis=1, tiled=True)
    if gather_rows:
      table_shard = jax.lax.all_gather(table_shard, row_axes, axis=0, tiled=True)
    if not row_axes or gather_rows:
      return _local_lookup(table_shard, ids_shard)
    rows = table_shard.shape[0]
    first = jax.lax.axis_index(row_axes) * rows
    shifted = ids_shard - first
    # Ids of other devices' rows look up zeros here (`rows` is out of range).
    shifted = jnp.where((shifted >= 0) & (shifted < rows), shifted, rows)
    return jax.lax.psum(_local_lookup(table_shard, shifted), row_axes)

  out_spec = PartitionSpec(*ids_spec, *([None] * (ids.ndim + 1 - len(ids_spec))))
  laid_out = jax.shard_map(local, mesh=mesh, in_specs=(table_spec, ids_spec), out_specs=out_spec)
  if jnp.finfo(table.dtype).bits >= 32 and jnp.finfo(dtype).bits >= 32:
    return laid_out(table.astype(dtype), ids)
  return _reduced_in_float32(laid_out, tuple(table.shape), dtype, table, ids)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _reduced_in_float32(
  laid_out: Callable, shape: tuple[int, ...], dtype, table: jax.Array, ids: jax.Array
) -> jax.Array:
  """`laid_out(table.astype(dtype), ids)`, whose gradient crosses devices in float32.

  The lookup's transpose sums each device's scatter-add across devices (a
  reduce-scatter over the gathered columns, a sum over the batch axes that
  hold the table whole): in bf16 that sum would round at every step of the
  reduction. The forward pass gathers in `dtype` (its all-gather moves
  bf16); the backward pass is the same lookup's transpose at float32, and
  the gradient is returned in the table's dtype. A float32 table (the
  built-in models under the policy) takes it as it is: no rounding follows
  the sum, so no compiler can move one ahead of it (XLA:TPU moves a
  rounding to bf16 ahead of an all-reduce). A bf16 table's is rounded once.
  """
  return laid_out(table.astype(dtype), ids)


def _reduced_fwd(laid_out, shape, dtype, table, ids):
  return laid_out(table.astype(dtype), ids), (jnp.zeros((0,), table.dtype), ids)


def _reduced_bwd(laid_out, shape, dtype, residuals, cotangent):
  marker, ids = residuals
  wide = jax.ShapeDtypeStruct(shape, jnp.float32)
  (d_table,) = jax.linear_transpose(lambda t: laid_out(t, ids), wide)(cotangent.astype(jnp.float32))
  return d_table.astype(marker.dtype), None


_reduced_in_float32.defvjp(_reduced_fwd, _reduced_bwd)
