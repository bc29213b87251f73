"""One decode step's attention over the KV cache, as a Pallas kernel for a TPU.

`decode_attention(q, keys, values, layer, index, starts)` is what
`trainers.models.decode` computes for one new token a row: each query head
attends to its key/value head's cached slots `starts[b]..index`, scores and
softmax in float32, the weights cast to the compute dtype before they weigh
the values.

Why a kernel: XLA on a TPU v5e copied each layer's keys and values out of
the stacked cache into VMEM and then ran the scores and the weighted sum as
batched matmuls of 3 query rows each (the group of a key/value head), which
cost as much again as the copies; a decode step at batch 32 spent more time
in attention than in all the weight matrices. The kernel reads the layer's
blocks straight from the cache in HBM (the layer index is a scalar prefetched
into the block index, so nothing is sliced out first), pipelines each block
of rows behind the previous one's compute, and multiplies each key/value
head's group of queries, padded to 8 rows, by its keys and values.

The cache must be laid out [layers, batch, kv_heads, max_len, head_dim]
(`decode.CACHE_AXES`): a (row, head) pair's keys are then one contiguous
[max_len, head_dim] matrix, tiled as a TPU tiles any matrix.

Example:
  >>> k = jax.random.normal(jax.random.key(0), (2, 4, 2, 16, 8))  # layers, B, H, S, D
  >>> q = jax.random.normal(jax.random.key(1), (4, 4, 8))          # B, heads, D
  >>> y = decode_attention(q, k, k, 1, 5, jnp.array([0, 2, 0, 1]), interpret=True)
  >>> y.shape
  (4, 4, 8)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

_ROWS = 8  # a group of query heads is padded to one (8, 128) tile of float32
# A grid step's keys and values: small enough that several steps pipeline
# each block's copy behind the previous block's compute, and that two
# buffers of each fit VMEM with room to spare.
_BLOCK_BYTES = 4 * 2**20
_VMEM_LIMIT = 48 * 2**20


def rows_per_block(batch: int, kv_heads: int, max_len: int, head_dim: int, itemsize: int) -> int:
  """Rows of the batch a grid step reads: the most that divide `batch` within `_BLOCK_BYTES`; 0 if none.

  Example:
    >>> rows_per_block(32, 4, 320, 128, 2)
    4
    >>> rows_per_block(3, 8, 8192, 128, 2)
    0
  """
  per_row = 2 * kv_heads * max_len * head_dim * itemsize  # its keys and values
  fits = [r for r in range(1, batch + 1) if batch % r == 0 and r * per_row <= _BLOCK_BYTES]
  return max(fits, default=0)


def supported(q_shape, cache_shape, itemsize: int) -> bool:
  """Whether `decode_attention` takes these shapes: one query a row, blocks that fit VMEM.

  Example:
    >>> supported((32, 1, 12, 128), (16, 32, 4, 320, 128), 2)
    True
    >>> supported((32, 5, 12, 128), (16, 32, 4, 320, 128), 2)
    False
  """
  batch, t, heads, head_dim = q_shape
  _, _, kv_heads, max_len, _ = cache_shape
  group = heads // kv_heads
  return (
    t == 1
    and group <= _ROWS
    and head_dim % 128 == 0
    and max_len % 16 == 0
    and rows_per_block(batch, kv_heads, max_len, head_dim, itemsize) > 0
  )


def _kernel(layer_ref, index_ref, starts_ref, q_ref, k_ref, v_ref, o_ref, *, scale, group):
  # q_ref, o_ref: [rows, kv_heads, 8, head_dim] float32; k_ref, v_ref: [rows, kv_heads, S, head_dim].
  del layer_ref  # only the blocks' index reads it
  rows, kv_heads, _, _ = q_ref.shape
  max_len = k_ref.shape[2]
  first_row = pl.program_id(0) * rows
  index = index_ref[0]
  slots = jax.lax.broadcasted_iota(jnp.int32, (_ROWS, max_len), 1)
  query = jax.lax.broadcasted_iota(jnp.int32, (_ROWS, max_len), 0)

  def row(r, carry):
    live = (slots <= index) & (slots >= starts_ref[first_row + r]) & (query < group)
    for h in range(kv_heads):
      q = q_ref[r, h].astype(k_ref.dtype)  # [8, head_dim]
      k = k_ref[r, h]  # [S, head_dim]
      s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
      s = jnp.where(live, s * scale, jnp.finfo(jnp.float32).min)
      p = jnp.exp(s - jnp.max(s, axis=1, keepdims=True))
      probs = (p / jnp.sum(p, axis=1, keepdims=True)).astype(v_ref.dtype)
      y = jnp.dot(probs, v_ref[r, h], preferred_element_type=jnp.float32)
      o_ref[r, h] = y.astype(o_ref.dtype)
    return carry

  jax.lax.fori_loop(0, rows, row, 0)


@functools.partial(jax.jit, static_argnames=("interpret",))
def decode_attention(
  q: jax.Array,
  keys: jax.Array,
  values: jax.Array,
  layer: jax.Array | int,
  index: jax.Array | int,
  starts: jax.Array,
  *,
  interpret: bool = False,
) -> jax.Array:
  """Each row's one query [B, heads, head_dim] over its cached slots starts[b]..index of `layer`.

  Args:
    q: the new tokens' queries [B, heads, head_dim], in the compute dtype.
    keys, values: the whole cache [layers, B, kv_heads, max_len, head_dim].
    layer: which layer's keys and values.
    index: the slot of the new token (its key is already written there).
    starts: int32 [B], each row's first live slot.
    interpret: run in Pallas interpret mode (any platform; slow).

  Returns:
    [B, heads, head_dim] in q's dtype.
  """
  batch, heads, head_dim = q.shape
  _, _, kv_heads, max_len, _ = keys.shape
  group = heads // kv_heads
  rows = rows_per_block(batch, kv_heads, max_len, head_dim, keys.dtype.itemsize)
  # Each key/value head's group of queries as the first rows of an [8, head_dim] tile.
  grouped = q.reshape(batch, kv_heads, group, head_dim).astype(jnp.float32)
  grouped = jnp.pad(grouped, ((0, 0), (0, 0), (0, _ROWS - group), (0, 0)))
  tile = (rows, kv_heads, _ROWS, head_dim)
  cache_block = (None, rows, kv_heads, max_len, head_dim)
  grid = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=3,
    grid=(batch // rows,),
    in_specs=[
      pl.BlockSpec(tile, lambda i, layer, index, starts: (i, 0, 0, 0)),
      pl.BlockSpec(cache_block, lambda i, layer, index, starts: (layer[0], i, 0, 0, 0)),
      pl.BlockSpec(cache_block, lambda i, layer, index, starts: (layer[0], i, 0, 0, 0)),
    ],
    out_specs=pl.BlockSpec(tile, lambda i, layer, index, starts: (i, 0, 0, 0)),
  )
  out = pl.pallas_call(
    functools.partial(_kernel, scale=head_dim**-0.5, group=group),
    grid_spec=grid,
    out_shape=jax.ShapeDtypeStruct(grouped.shape, jnp.float32),
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=("parallel",), vmem_limit_bytes=_VMEM_LIMIT
    ),
    interpret=interpret,
  )(
    jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)),
    jnp.reshape(jnp.asarray(index, jnp.int32), (1,)),
    starts.astype(jnp.int32),
    grouped,
    keys,
    values,
  )
  return out[:, :, :group].reshape(batch, heads, head_dim).astype(q.dtype)
